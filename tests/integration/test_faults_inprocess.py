"""Issue 12, inside the scheduler: faults injected into an in-process Scheduler with a real llama-server
child (a stop that raises, an error after the lease is taken, a drain abandoned by a second signal)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import structlog

from supervisor import errors
from supervisor.manifests import load_directory
from supervisor.slots import SlotState
from tests.integration.conftest import MakeScheduler
from workers import sockets
from workers.base import Endpoint
from workers.process import ChildProcess


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _internal_errors(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] in ("background_task_failed", "handler_error")]


@pytest.mark.parametrize("stops_first", [True, False], ids=["after-stopping", "before-stopping"])
async def test_a_stop_that_raises_still_ends_unloaded_with_the_tree_gone_then_the_lease_released(
    make_scheduler: MakeScheduler, monkeypatch: pytest.MonkeyPatch, stops_first: bool
) -> None:
    scheduler = await make_scheduler()
    stop = ChildProcess.stop

    async def failing_stop(self: ChildProcess, grace_s: float) -> None:
        if stops_first:
            await stop(self, grace_s)
        raise OSError("cannot unlink the pid file")  # or psutil, or NVML: something raised

    monkeypatch.setattr(ChildProcess, "stop", failing_stop)
    ticket = await scheduler.acquire("demo")
    pid = ticket.process.pid
    socket = ticket.endpoint.socket
    assert socket is not None
    assert socket.exists()
    ticket.release()
    slot = scheduler.slots["demo"]
    released_while_alive = []

    def unloaded() -> bool:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        if alive and scheduler.leases.get(slot.key) is None:
            released_while_alive.append(pid)
        return slot.state == SlotState.UNLOADED

    with structlog.testing.capture_logs() as logs:
        scheduler.unload("demo")
        await _until(unloaded)
    assert not released_while_alive
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert scheduler.leases.get(slot.key) is None
    assert [e["event"] for e in logs if e["event"] == "child_stop_failed"] == ["child_stop_failed"]
    assert not _internal_errors(logs)
    assert not socket.exists()  # killed another way, the child still leaves nothing behind
    monkeypatch.setattr(ChildProcess, "stop", stop)
    ticket = await scheduler.acquire("demo")  # not stuck STOPPING: the next request starts it again
    assert ticket.process.pid != pid
    ticket.release()


async def test_an_unexpected_error_after_the_lease_leaves_the_slot_failed_with_nothing_held(
    make_scheduler: MakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = await make_scheduler()

    def broken_endpoint() -> Endpoint:
        raise RuntimeError("no socket for you")

    monkeypatch.setattr(sockets, "new_endpoint", broken_endpoint)
    with structlog.testing.capture_logs() as logs, pytest.raises(errors.SupervisorError) as raised:
        await scheduler.acquire("demo")
    assert raised.value.code == "model_failed"
    assert "internal error" in raised.value.message
    slot = scheduler.slots["demo"]
    assert slot.state == SlotState.FAILED
    assert scheduler.leases.holders() == []
    assert "load_error" in [e["event"] for e in logs]
    assert not _internal_errors(logs)


async def test_abandon_drain_makes_shutdown_stop_the_children_without_waiting(
    make_scheduler: MakeScheduler,
) -> None:
    scheduler = await make_scheduler(drain_timeout_s=600)
    ticket = await scheduler.acquire("demo")  # a request in flight that will not end by itself
    shutdown = asyncio.create_task(scheduler.shutdown())
    await asyncio.sleep(0)
    assert not scheduler.accepting  # at the very start, before any wait
    with pytest.raises(errors.SupervisorError, match="shutting down"):
        await scheduler.acquire("demo")
    assert not shutdown.done()  # draining
    scheduler.abandon_drain()
    await asyncio.wait_for(shutdown, 60)
    assert ticket.process.exited.done()
    assert scheduler.slots["demo"].state == SlotState.UNLOADED
    assert scheduler.leases.holders() == []
    ticket.release()  # late, as a request cut off by the stop would: harmless


async def test_shutdown_hands_no_place_to_queued_requests(make_scheduler: MakeScheduler) -> None:
    scheduler = await make_scheduler(drain_timeout_s=600)
    slot = scheduler.slots["demo"]
    first = await scheduler.acquire("demo")
    others = [await scheduler.acquire("demo") for _ in range(slot.manifest.inflight_limit() - 1)]
    queued = asyncio.create_task(scheduler.acquire("demo"))
    await _until(lambda: len(slot.admission) == 1)
    shutdown = asyncio.create_task(scheduler.shutdown())
    with pytest.raises(errors.SupervisorError, match="shutting down"):
        await queued  # answered at once, while the requests in flight still run
    for ticket in (first, *others):
        ticket.release()  # each ends; none hands its place on
    await asyncio.wait_for(shutdown, 60)
    assert slot.inflight == 0


async def test_a_queued_request_waits_without_spinning_while_a_dead_child_is_not_yet_seen(
    make_scheduler: MakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued request that looks again in the moment between its child's exit and the watcher marking
    the slot FAILED must wait, not loop: a loop with no await would starve the watcher (and /health) for
    ever. The watcher is held back here to make that moment long (reading the dead child's last words
    takes 0.5 s); the chaos run found it by chance."""
    scheduler = await make_scheduler()
    slot = scheduler.slots["demo"]
    final_tail = ChildProcess.final_tail

    async def slow_final_tail(process: ChildProcess, lines: int = 20) -> list[str]:
        await asyncio.sleep(0.5)
        return await final_tail(process, lines)

    monkeypatch.setattr(ChildProcess, "final_tail", slow_final_tail)
    held = [await scheduler.acquire("demo") for _ in range(slot.manifest.inflight_limit())]
    queued = asyncio.create_task(scheduler.acquire("demo"))
    await _until(lambda: len(slot.admission) == 1)
    pid = held[0].process.pid
    os.kill(pid, signal.SIGKILL)
    await _until(lambda: held[0].process.returncode is not None)
    assert slot.state == SlotState.READY  # the watcher has not looked yet
    slot.admission.wake_all()  # the queued request looks again now
    await asyncio.sleep(0.1)  # returns only if the event loop is not spinning
    assert not queued.done()
    for ticket in held:
        ticket.release()
    ticket = await asyncio.wait_for(queued, 60)  # served by the child started again after the crash
    assert ticket.process.pid != pid
    ticket.release()


async def test_a_child_that_crashes_while_draining_for_a_reload_is_started_again_once(
    make_scheduler: MakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that changes a model's launch drains its child and restarts it on next use. If the child
    crashes during that drain, the next request starts it with the new launch, once: not a child that is
    drained and started again at once for the reload it already follows."""
    scheduler = await make_scheduler()
    slot = scheduler.slots["demo"]
    ticket = await scheduler.acquire("demo")  # in flight, and not ended by the crash below
    first = ticket.process.pid
    spawned: list[int] = []
    spawn = ChildProcess.spawn

    async def counted_spawn(*args: Any, **kwargs: Any) -> ChildProcess:
        child = await spawn(*args, **kwargs)
        spawned.append(child.pid)
        return child

    monkeypatch.setattr(ChildProcess, "spawn", counted_spawn)
    manifest = tmp_path / "manifests" / "demo.yaml"
    manifest.write_text(manifest.read_text().replace("ctx_size: 2048", "ctx_size: 1024"))
    assert "ctx_size: 1024" in manifest.read_text()
    scheduler.reload(load_directory(tmp_path / "manifests"), scheduler.settings)
    await _until(lambda: slot.state == SlotState.DRAINING)
    os.kill(first, signal.SIGKILL)
    await _until(lambda: slot.state == SlotState.FAILED)
    ticket.release()

    ticket = await scheduler.acquire("demo")  # started again, with the new launch
    assert spawned == [ticket.process.pid]
    ticket.release()
    ticket = await scheduler.acquire("demo")
    assert spawned == [ticket.process.pid]
    ticket.release()
