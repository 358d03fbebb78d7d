"""CPU affinity: the CPUs the daemon's own threads run on (`cpus` in the settings) and those each engine's
processes may use (`cpus` in its manifest).

Why: the daemon is one event loop that every request and every streamed chunk goes through, and it shares
the host's cores with the engines (llama.cpp's compute threads spin while they work; vLLM's EngineCore
polls). Sharing a core means sharing its caches: on a two-core machine the daemon's CPU per whole
request fell by a fifth to a half once it had a core of its own (README, Performance, "own core"). A
CPU set is what nginx (`worker_cpu_affinity`), systemd (`CPUAffinity=`) and Docker (`--cpuset-cpus`) let
an operator give; here the daemon's and its engines' can differ, which a unit file's cannot.

CPUs are written as Linux writes them (`taskset -c`, cgroups' cpuset): "0-3,8", or a list of numbers.
An engine whose manifest names none runs on the CPUs the daemon was started with, not on the daemon's own
set: pinning the daemon must not squeeze its engines onto its core.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from functools import cache
from typing import Annotated, Any

import structlog
from pydantic import BeforeValidator, WithJsonSchema

log = structlog.get_logger("cpus")

_MAX_CPU = 1 << 16  # beyond any machine's CPU numbers: "0-999999999" is a typo, not a set to build


def parse_cpu_list(value: Any) -> tuple[int, ...]:
    """CPU numbers from "0-3,8", a number, or a list of numbers (or of such strings), sorted, distinct.
    ValueError says what is wrong."""
    if isinstance(value, bool):  # YAML's `yes`: an int to Python, not a CPU
        raise ValueError("a CPU list is numbers, e.g. 0-3,8 or [0, 1]")
    if isinstance(value, int):
        items: Iterable[Any] = (value,)
    elif isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, list | tuple):
        items = value
    else:
        raise ValueError("a CPU list is numbers, e.g. 0-3,8 or [0, 1]")
    found: set[int] = set()
    for item in items:
        found |= _cpu_range(item)
    if not found:
        raise ValueError("a CPU list names at least one CPU")
    return tuple(sorted(found))


def _cpu_range(item: Any) -> set[int]:
    if isinstance(item, int) and not isinstance(item, bool):
        first = last = item
    elif isinstance(item, str):
        text = item.strip()
        low, dash, high = text.partition("-")
        if not _number(low) or (dash and not _number(high)):
            raise ValueError(f"{text!r} is not a CPU number or range (e.g. 3 or 0-3)")
        first, last = int(low), int(high) if dash else int(low)
    else:
        raise ValueError(f"{item!r} is not a CPU number or range (e.g. 3 or 0-3)")
    if first < 0:
        raise ValueError(f"CPU numbers start at 0, not {first}")
    if last < first:
        raise ValueError(f"{first}-{last} is not a CPU range: it goes down")
    if last >= _MAX_CPU:
        raise ValueError(f"CPU {last} is beyond any machine's")
    return set(range(first, last + 1))


def _number(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes other scripts' digits and superscripts."""
    stripped = text.strip()
    return stripped.isascii() and stripped.isdecimal()


def cpu_list_text(cpus: Iterable[int]) -> str:
    """As Linux writes a set (/proc's Cpus_allowed_list): "0-3,8"."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start = prev = None
    for cpu in [*ordered, None]:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(runs)


def supported() -> bool:
    """Linux only: pinning every thread reads /proc/self/task, and a child's set is given between fork
    and exec by the Linux-only part of workers/process.py."""
    return sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")


@cache
def available() -> frozenset[int]:
    """The CPUs this process was started with: read once, before the daemon pins itself (`pin_daemon`),
    so that engines with no `cpus` of their own keep them, and every later check of a CPU list is against
    them. A CPU that goes offline later still counts (an engine started on it alone then fails to start,
    saying so). On a system without CPU affinity, none."""
    if not supported():
        return frozenset()
    return frozenset(os.sched_getaffinity(0))


def check_available(cpus: Iterable[int]) -> None:
    """ValueError when `cpus` names a CPU this process may not use (absent, offline, or outside the
    cpuset it was started in). In the daemon that is the CPUs it was started with; `llm-supervisor
    check` checks against its own, which a shell or a CI runner may not share with the daemon."""
    if not supported():
        raise ValueError(f"CPU affinity is not supported on {sys.platform}")
    missing = set(cpus) - available()
    if missing:
        named = cpu_list_text(missing)
        raise ValueError(
            f"{'CPUs' if len(missing) > 1 else 'CPU'} {named} {'are' if len(missing) > 1 else 'is'} not "
            f"among those this process may use ({cpu_list_text(available())})"
        )


def _checked(value: Any) -> tuple[int, ...]:
    cpus = parse_cpu_list(value)
    check_available(cpus)
    return cpus


# A setting's or a manifest's CPU set: "0-3,8", a number or a list, each CPU one this process may use (so a
# manifest naming another host's CPUs is refused with its file and line, not at its first load).
CpuList = Annotated[
    tuple[int, ...],
    BeforeValidator(_checked),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$"},
                {"type": "integer", "minimum": 0},
                {
                    "type": "array",
                    "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]},
                    "minItems": 1,
                },
            ],
            "description": 'CPUs as Linux lists them: "0-3,8", a number, or a list of numbers',
        }
    ),
]


def pin_daemon(cpus: Iterable[int]) -> None:
    """Every thread of this process, and those it starts later, on `cpus`."""
    chosen = set(cpus)
    available()  # read before it changes (the settings' validation has read it already)
    pin_threads(chosen)
    log.info("cpus_pinned", cpus=cpu_list_text(chosen), engines_default=cpu_list_text(available()))


def pin_threads(cpus: Iterable[int]) -> None:
    """Every thread of this process on `cpus`: sched_setaffinity(0) would move only the calling one."""
    chosen = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), chosen)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def for_engine(manifest_cpus: Iterable[int] | None, daemon_pinned: bool) -> frozenset[int] | None:
    """The CPUs an engine is started on: its manifest's, else the start-up set when the daemon pinned
    itself away from it (its `cpus` setting); None to leave the child the daemon's (nothing pinned)."""
    if manifest_cpus is not None:
        return frozenset(manifest_cpus)
    return available() if daemon_pinned else None
