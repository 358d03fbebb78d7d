"""CPU sets as settings and manifests write them (supervisor/cpus.py)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import cpus
from supervisor.config import ConfigError, load_settings
from supervisor.manifests import ManifestLoadError, load_directory


@pytest.mark.parametrize(
    ("given_value", "expected"),
    [
        ("0", (0,)),
        (3, (3,)),
        ("0-3,8", (0, 1, 2, 3, 8)),
        (" 2 - 3 , 1 ", (1, 2, 3)),
        ([4, "0-1", 1], (0, 1, 4)),
        ((7,), (7,)),
    ],
)
def test_a_cpu_list_is_read_as_linux_writes_one(given_value: object, expected: tuple[int, ...]) -> None:
    assert cpus.parse_cpu_list(given_value) == expected


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("", "not a CPU number or range"),
        ("one", "not a CPU number or range"),
        ("1,,2", "not a CPU number or range"),
        ("3-1", "goes down"),
        (-1, "start at 0"),
        (True, "numbers"),
        ([], "at least one CPU"),
        ({"cpu": 1}, "numbers"),
        ("0-99999999", "beyond any machine's"),
        ("\u0663", "not a CPU number"),  # an Arabic-Indic three: a digit to str.isdigit, not a CPU
        ("\u00b2", "not a CPU number"),  # a superscript two
    ],
)
def test_a_bad_cpu_list_says_what_is_wrong(bad: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        cpus.parse_cpu_list(bad)


@given(st.sets(st.integers(min_value=0, max_value=300), min_size=1))
def test_a_set_written_as_linux_writes_it_reads_back_the_same(chosen: set[int]) -> None:
    assert cpus.parse_cpu_list(cpus.cpu_list_text(chosen)) == tuple(sorted(chosen))


def test_the_setting_takes_a_cpu_the_daemon_may_use() -> None:
    first = min(os.sched_getaffinity(0))
    assert load_settings(None, environ={"LLM_SUPERVISOR_CPUS": str(first)}).cpus == (first,)
    assert load_settings(None, environ={}).cpus is None


def test_a_setting_naming_a_cpu_the_daemon_may_not_use_is_refused_with_where_it_came_from() -> None:
    first, absent = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={"LLM_SUPERVISOR_CPUS": f"{first}-{absent}"})
    assert "$LLM_SUPERVISOR_CPUS" in str(info.value)
    assert f"CPU {absent} is not among those this process may use" in str(info.value)
    with pytest.raises(ConfigError, match=f"CPUs {absent}-{absent + 1} are not among"):
        load_settings(None, environ={"LLM_SUPERVISOR_CPUS": f"{absent}-{absent + 1}"})


def test_a_manifest_naming_a_cpu_the_host_lacks_is_refused_with_its_file_and_line(tmp_path: Path) -> None:
    absent = max(os.sched_getaffinity(0)) + 1
    path = tmp_path / "m.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            name: m
            engine: llama-server
            model: /m.gguf
            cpus: "{absent}"
            """
        )
    )
    with pytest.raises(ManifestLoadError) as info:
        load_directory(tmp_path)
    [error] = info.value.errors
    assert (error.file, error.line, error.field) == (path, 4, "cpus")
    assert f"CPU {absent} is not among those this process may use" in str(error)


def test_an_engine_runs_where_its_manifest_says_else_where_the_daemon_started() -> None:
    first = min(os.sched_getaffinity(0))
    assert cpus.for_engine((first,), daemon_pinned=False) == frozenset({first})
    assert cpus.for_engine((first,), daemon_pinned=True) == frozenset({first})
    # Not pinned: the child is left the daemon's CPUs. Pinned: it gets those the daemon started with.
    assert cpus.for_engine(None, daemon_pinned=False) is None
    assert cpus.for_engine(None, daemon_pinned=True) == frozenset(os.sched_getaffinity(0))
