"""Signals at awkward moments: during start-up, and a second one during the shutdown drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import psutil
import pytest

from supervisor.scheduler import Scheduler
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually


async def _stubborn_orphan(daemon: Daemon) -> psutil.Process:
    """A recorded child of a 'previous run' that ignores SIGTERM: reaping it holds start-up for
    stop_grace_s, a window in which the daemon is started but not listening."""
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", "trap '' TERM; exec sleep 120", start_new_session=True
    )
    orphan = psutil.Process(proc.pid)
    children = daemon.state_dir / "children"
    children.mkdir(parents=True, exist_ok=True)
    record = {"pid": proc.pid, "create_time": orphan.create_time(), "model": "old", "argv": ["sleep"]}
    (children / f"{proc.pid}.json").write_text(json.dumps(record))
    return orphan


async def test_sigterm_during_start_up_exits_0_with_nothing_left(make_daemon: MakeDaemon) -> None:
    # A pinned model starts loading during start-up too: the shutdown must stop it as well.
    daemon = await make_daemon(models={"demo": {"pinned": True}}, config={"stop_grace_s": 3}, start=False)
    orphan = await _stubborn_orphan(daemon)
    try:
        await daemon.start(wait=False)
        await eventually(lambda: bool(daemon.events("starting")), 30, "the daemon's first log line")
        daemon.signal(signal.SIGTERM)  # before it listens: reaping the orphan takes stop_grace_s
        assert await daemon.wait_exit() == 0
    finally:
        if orphan.is_running():
            orphan.kill()
    assert not daemon.events("listening")
    (started,) = daemon.events("shutdown_started")
    assert started["during"] == "start-up"
    assert daemon.events("shutdown_complete")
    assert [e["pid"] for e in daemon.events("orphan_reaped")] == [orphan.pid]
    assert daemon.children() == []
    assert not list((daemon.state_dir / "children").glob("*.json"))


async def test_sigint_during_start_up_exits_0_too(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"stop_grace_s": 3}, start=False)
    orphan = await _stubborn_orphan(daemon)
    try:
        await daemon.start(wait=False)
        await eventually(lambda: bool(daemon.events("starting")), 30, "the daemon's first log line")
        daemon.signal(signal.SIGINT)
        assert await daemon.wait_exit() == 0
    finally:
        if orphan.is_running():
            orphan.kill()
    assert not daemon.events("listening")
    assert daemon.children() == []


@pytest.mark.skipif(
    not hasattr(Scheduler, "abandon_drain"),
    reason="Scheduler.abandon_drain (the scheduler's part) not there yet",
)
async def test_a_second_sigterm_cuts_the_drain_short(make_daemon: MakeDaemon) -> None:
    # A drain that would last two minutes: the only stream in flight is stuck in a stopped engine.
    daemon = await make_daemon(config={"drain_timeout_s": 120})
    stream = await daemon.start_stream("demo", max_tokens=1500)
    (engine,) = daemon.children()
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        daemon.signal(signal.SIGTERM)
        await eventually(lambda: bool(daemon.events("shutdown_draining")), what="the drain to begin")
        daemon.signal(signal.SIGTERM)
        assert await daemon.wait_exit(timeout_s=60) == 0  # a deadline far below drain_timeout_s
    finally:
        with contextlib.suppress(Exception):  # cut by the shutdown: how it ends is not the point here
            await stream.close()
    assert len(daemon.events("second_stop_signal", signal="SIGTERM")) == 1
    assert len(daemon.events("drain_abandoned")) == 1
    assert daemon.children() == []
    assert not list((daemon.state_dir / "children").glob("*.json"))


async def test_a_crash_in_native_code_leaves_the_python_stacks_in_the_log(make_daemon: MakeDaemon) -> None:
    """A segfault (in the compiled request path, uvloop or httptools) once ended a daemon in the test
    suite with nothing but an exit status of -11. faulthandler now writes every thread's stack first."""
    daemon = await make_daemon(models={})  # no engine: nothing is left behind by the crash
    daemon.expect_exit = {-signal.SIGSEGV}
    daemon.signal(signal.SIGSEGV)
    assert await daemon.wait_exit() == -signal.SIGSEGV
    log = daemon.log_path.read_text(errors="replace")
    assert "Fatal Python error: Segmentation fault" in log
    assert 'File "' in log  # a stack, not just the line
