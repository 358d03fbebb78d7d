"""AdmissionQueue: who gets a busy model's next free place."""

from __future__ import annotations

import asyncio

from supervisor.admission import AdmissionQueue


async def test_higher_priority_goes_first_then_arrival_order() -> None:
    queue = AdmissionQueue()
    low, first, second, urgent = queue.push(0), queue.push(1), queue.push(1), queue.push(5)
    order = []
    for _ in range(4):
        assert queue.admit_next()
        order += [f for f in (low, first, second, urgent) if f.done() and f not in order]
    assert order == [urgent, first, second, low]
    assert not queue.admit_next()
    assert len(queue) == 0


async def test_a_waiter_that_gives_up_leaves_at_once_and_is_skipped() -> None:
    queue = AdmissionQueue()
    gone, stays = queue.push(9), queue.push(0)
    queue.forget(gone)
    assert gone.cancelled()
    assert len(queue) == 1
    assert queue.admit_next()
    assert stays.result() is True


async def test_a_waiter_cancelled_with_its_task_is_not_handed_the_place() -> None:
    queue = AdmissionQueue()
    turn = queue.push(0)
    later = queue.push(0)
    waiter = asyncio.ensure_future(turn)
    await asyncio.sleep(0)
    waiter.cancel()  # the client went away; its clean-up has not run yet
    await asyncio.sleep(0)
    assert queue.admit_next()
    assert later.result() is True


async def test_wake_all_tells_every_waiter_to_look_again() -> None:
    queue = AdmissionQueue()
    waiters = [queue.push(p) for p in (0, 3, 1)]
    queue.wake_all()
    assert [w.result() for w in waiters] == [False, False, False]
    assert len(queue) == 0
    assert not queue.admit_next()


async def test_waiters_that_give_up_leave_nothing_behind_under_sustained_overload() -> None:
    queue = AdmissionQueue()
    stays = queue.push(0)
    for _ in range(1000):  # each waiter times out before a place comes free
        queue.forget(queue.push(5))
    assert len(queue) == 1
    assert len(queue._heap) == 1  # the entries of those who left went with them
    assert queue.admit_next()
    assert stays.result() is True


async def test_forgetting_from_the_middle_keeps_the_order() -> None:
    queue = AdmissionQueue()
    waiters = {p: queue.push(p) for p in (3, 9, 1, 7, 5)}
    queue.forget(waiters[7])
    order = []
    while queue.admit_next():
        order += [p for p, f in waiters.items() if f.done() and not f.cancelled() and p not in order]
    assert order == [9, 5, 3, 1]


async def test_waiters_told_to_look_again_keep_their_places_when_they_queue_again() -> None:
    """A reload that changed only a model's description woke every waiter, and each queued again last:
    served in the order 5, 2, 4, 6, 1, 7, 3, 0, the first (the nearest to its deadline) last."""
    queue = AdmissionQueue()
    woken: list[int] = []

    async def wait(n: int, turn: asyncio.Future[bool]) -> None:
        await turn
        woken.append(n)

    order = (5, 2, 4, 6, 1, 7, 3, 0)  # pushed in this order, having arrived in 0..7
    tasks = [asyncio.ensure_future(wait(n, queue.push(0, arrived=float(n)))) for n in order]
    await asyncio.sleep(0)
    queue.wake_all()
    await asyncio.gather(*tasks)
    assert woken == list(range(8))  # best first: a place free at once goes to the first in line
    again = {n: queue.push(0, arrived=float(n)) for n in (5, 2, 4, 6, 1, 7, 3, 0)}
    served = []
    while queue.admit_next():
        served += [n for n, f in again.items() if f.done() and n not in served]
    assert served == list(range(8))
