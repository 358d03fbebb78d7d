"""bench/instructions.py --steps: it reads callgrind_annotate's report by the C names mypyc gives the
compiled functions. The tests do not run valgrind, so a renamed function would only drop its step from
the table: these hold every step to a function that exists, and the report's lines to what is read."""

from __future__ import annotations

import importlib
import re

import pytest

from bench.instructions import _GENERATOR, _REPORT_LINE, STEPS, steps_table

# An async method's body, as mypyc names it: "{method}_{Class}_gen" (a function's: "{function}_gen").
_METHOD_GENERATOR = re.compile(r"(\w+?)_([A-Z]\w*)_gen$")


def _resolve(function: str) -> object:
    """The Python object a step's C name stands for: module parts, then class and function."""
    parts = function.removesuffix(_GENERATOR).split("___")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module("supervisor." + ".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        names = parts[split:]
        if names and (method := _METHOD_GENERATOR.match(names[-1])) is not None:
            names[-1:] = [method.group(2), method.group(1)]
        elif names and names[-1].endswith("_gen"):
            names[-1] = names[-1].removesuffix("_gen")
        for name in names:
            target = getattr(target, name)
        return target
    raise AssertionError(f"no module of the package in {function}")


@pytest.mark.parametrize(("label", "function"), STEPS)
def test_every_step_names_a_function_of_the_request_path(label: str, function: str) -> None:
    assert callable(_resolve(function)), label


def test_a_report_line_gives_its_count_and_function() -> None:
    line = "50,115 ( 4.26%)  ???:CPyPy_supervisor___proxy___count [/work/supervisor/x.so]"
    match = _REPORT_LINE.match(line)
    assert match is not None
    assert (match.group(1), match.group(2)) == ("50,115", "CPyPy_supervisor___proxy___count")
    source = "243,951 (100.0%)  /project/uvloop/loop.c:__pyx_f_6uvloop_4loop_4Loop__run [/x/loop.so]"
    match = _REPORT_LINE.match(source)
    assert match is not None
    assert match.group(2) == "__pyx_f_6uvloop_4loop_4Loop__run"


def test_the_table_shows_each_step_either_tree_ran_per_request() -> None:
    first, second = STEPS[0][0], STEPS[1][0]
    table = steps_table("plain", 100, {first: 20_000}, {first: 10_000, second: 500})
    rows = table.splitlines()
    assert any(row.startswith(first) and row.split()[-3:] == ["200", "100", "0.500"] for row in rows)
    assert any(row.startswith(second) and row.split()[-2:] == ["0", "5"] for row in rows)
    assert not any(row.startswith(STEPS[2][0]) for row in rows)  # run by neither
