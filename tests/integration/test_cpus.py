"""CPU affinity with a real daemon and real llama-server children: the daemon's threads on its `cpus`,
an engine on its manifest's, and an engine with none on the CPUs the daemon was started with."""

from __future__ import annotations

import os

import psutil
import pytest

from supervisor.cpus import cpu_list_text
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import argv_of

STARTED_WITH = frozenset(os.sched_getaffinity(0))

pytestmark = pytest.mark.skipif(len(STARTED_WITH) < 2, reason="needs two CPUs to tell the sets apart")


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU set of each of a process's threads (they can differ: the set is per thread)."""
    return {frozenset(os.sched_getaffinity(thread.id)) for thread in psutil.Process(pid).threads()}


def engine_serving(children: list[psutil.Process], alias: str) -> psutil.Process:
    [engine] = [c for c in children if alias in argv_of(c)]
    return engine


async def test_the_daemon_and_each_engine_run_on_their_own_cpus(make_daemon: MakeDaemon) -> None:
    first, last = min(STARTED_WITH), max(STARTED_WITH)
    daemon = await make_daemon(
        models={"placed": {"cpus": [last]}, "anywhere": {}},
        config={"cpus": str(first)},
    )
    assert await daemon.chat("placed")
    assert await daemon.chat("anywhere")

    assert daemon.proc is not None
    assert thread_cpus(daemon.proc.pid) == {frozenset({first})}
    children = daemon.children()
    assert thread_cpus(engine_serving(children, "placed").pid) == {frozenset({last})}
    # Not the daemon's own CPU: pinning the daemon leaves its engines the CPUs it was started with.
    assert thread_cpus(engine_serving(children, "anywhere").pid) == {STARTED_WITH}
    assert daemon.events("cpus_pinned")[0]["cpus"] == str(first)
    started = {event["model"]: event["cpus"] for event in daemon.events("child_started")}
    assert started == {"placed": str(last), "anywhere": cpu_list_text(STARTED_WITH)}


async def test_an_unpinned_daemon_leaves_engines_without_cpus_alone(make_daemon: MakeDaemon) -> None:
    last = max(STARTED_WITH)
    daemon = await make_daemon(models={"placed": {"cpus": f"{last}"}, "anywhere": {}})
    assert await daemon.chat("placed")
    assert await daemon.chat("anywhere")

    assert daemon.proc is not None
    assert thread_cpus(daemon.proc.pid) == {STARTED_WITH}
    children = daemon.children()
    assert thread_cpus(engine_serving(children, "placed").pid) == {frozenset({last})}
    assert thread_cpus(engine_serving(children, "anywhere").pid) == {STARTED_WITH}
    assert not daemon.events("cpus_pinned")
