"""Scheduling cases that need the scheduler itself at hand (tickets held and released by the test), in
process, with real llama-server children: a request served by whichever replica comes up first, and a
busy model that makes way for a more urgent load only when its own queue holds nothing more urgent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog.testing

from tests.integration.conftest import MakeScheduler


async def _until(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_request_waiting_for_a_model_is_served_by_its_replica_that_came_up(
    make_scheduler: MakeScheduler,
) -> None:
    """Two GPUs; "other" (busy) holds GPU 0; "demo" has `replicas: 2`, room for one of them on GPU 1.
    A first request for demo waits on replica 0, which has no room, while replica 1 comes up. It kept
    waiting on replica 0's load, whose next look for room evicted replica 1 (its own sibling, idle) to
    take GPU 1: a child killed and another started for nothing. It is now served by replica 1, and no
    replica is a victim for its sibling."""
    scheduler = await make_scheduler(
        {
            "other": {"vram_mib": 700, "parallel": 1},
            "demo": {"vram_mib": 700, "parallel": 1, "replicas": 2},
        },
        gpus=[{"index": 0, "total_mib": 1024}, {"index": 1, "total_mib": 1024}],
    )
    busy = await scheduler.acquire("other")  # held: "other" stays busy on GPU 0
    assert scheduler.leases.get(busy.slot.key).mib_by_gpu == {0: 700}  # type: ignore[union-attr]
    with structlog.testing.capture_logs() as logs:
        try:
            ticket = await asyncio.wait_for(scheduler.acquire("demo"), 20)
        finally:
            busy.release()
        ticket.release()
    stopped = [
        e
        for e in logs
        if e.get("event") == "slot_transition" and e.get("replica") == 1 and e.get("to") == "draining"
    ]
    assert not stopped, f"replica 1 was evicted for its own sibling replica 0: {stopped}"
    assert ticket.slot.replica == 1, "served by replica 0, loaded after replica 1 was evicted"


async def test_a_busy_model_whose_queue_holds_a_more_urgent_request_does_not_yield_to_a_load(
    make_scheduler: MakeScheduler,
) -> None:
    """One GPU holds one of "low" (priority 0, one request at a time) and "high" (priority 5). low is
    busy, and a request of priority 9 (x_priority) waits in its queue for the next turn. A request for
    high then waits for low's room. Judged by its manifest's priority alone, low made way for high's
    load: its place did not go to the priority-9 request, it was evicted for high, and the most urgent
    request waited for it to load again. Its queue counts, as a load's waiters do."""
    scheduler = await make_scheduler(
        {
            "low": {"vram_mib": 700, "parallel": 1, "max_inflight": 1, "priority": 0},
            "high": {"vram_mib": 700, "priority": 5},
        },
        gpus=[{"index": 0, "total_mib": 1024}],
    )
    first = await scheduler.acquire("low")
    pid = first.process.pid
    urgent = asyncio.create_task(scheduler.acquire("low", priority=9))
    await _until(lambda: len(scheduler.slots["low"].admission) == 1, what="the urgent request to queue")

    async def ask_high() -> None:
        (await scheduler.acquire("high")).release()

    high = asyncio.create_task(ask_high())
    await _until(lambda: "high" in str(list(scheduler._placing)), what="high's load to wait for room")
    await asyncio.sleep(0.3)  # its first look for room is done
    first.release()
    ticket = await asyncio.wait_for(urgent, 10)
    ticket.release()
    await asyncio.wait_for(high, 15)  # served too, after the urgent request
    assert ticket.process.pid == pid, "low was evicted under its queued priority-9 request, then reloaded"
