"""The scheduler's shared-GPU adapter against a real redis-server: two daemons' adapters and an external
holder racing for one GPU never exceed it; Redis away means nothing new is placed there."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from supervisor.fleet.leases_client import LeaseTimeout, release_lease, take_lease
from supervisor.fleet.redis_link import RedisLink
from supervisor.fleet.shared_gpus import SharedGpus
from supervisor.fleet.shared_leases import SharedLeases, gpu_key
from supervisor.gpus import Gpu
from tests.fleet.conftest import RedisServer

CAPACITY = 1000


def adapter(url: str, node: str) -> SharedGpus:
    gpus = [Gpu(0, CAPACITY, "simulated GPU", None, True)]
    return SharedGpus(RedisLink(url, CollectorRegistry()), gpus, {0}, "box", 0, node, ttl_s=30)


async def test_two_daemons_and_an_external_holder_never_exceed_a_shared_gpu(
    redis_server: RedisServer,
) -> None:
    a, b = adapter(redis_server.url, "node-a"), adapter(redis_server.url, "node-b")
    for side in (a, b):
        await side.start(lambda *_: [], lambda *_: None)
    checker = SharedLeases(a.link.client)
    rng = random.Random(7)
    try:
        for round_ in range(25):
            sizes = [rng.choice((200, 300, 450)) for _ in range(4)]

            async def external(mib: int, round_: int = round_) -> bool:
                try:
                    lease = await take_lease(
                        redis_server.url, "box:0", mib, f"ext{round_}", ttl_s=30, timeout_s=0
                    )
                except LeaseTimeout:
                    return False
                await release_lease(redis_server.url, lease_id=lease.id)
                return True

            results = await asyncio.gather(
                a.take(f"m{round_}a#1", {0: sizes[0]}, 0),
                b.take(f"m{round_}b#1", {0: sizes[1]}, 0),
                a.take(f"m{round_}c#1", {0: sizes[2]}, 0),
                external(sizes[3]),
            )
            budget = await checker.budget(gpu_key("box", 0))
            assert budget.leased_mib <= CAPACITY
            won = [size for size, ok in zip(sizes[:3], results[:3], strict=True) if ok]
            assert budget.leased_mib == sum(won)
            for holder in (f"m{round_}a#1", f"m{round_}c#1"):
                a.release(holder)
            b.release(f"m{round_}b#1")
            await asyncio.sleep(0.05)  # releases run in the background
            await _until(lambda: _empty(checker))
    finally:
        for side in (a, b):
            await side.close()
            await side.link.close()


async def _empty(checker: SharedLeases) -> bool:
    return (await checker.budget(gpu_key("box", 0))).leases == []


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(100):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_others_leases_count_and_redis_away_places_nothing_new(redis_server: RedisServer) -> None:
    a = adapter(redis_server.url, "node-a")
    await a.link.start()
    await a.start(lambda *_: [], lambda *_: None)
    try:
        assert await a.take("mine#1", {0: 300}, 0)
        await take_lease(redis_server.url, "box:0", 250, "trainer", ttl_s=30)
        assert await a.others_mib() == {0: 250}  # ours is in the local lease map already
        assert await a.take("nonshared#1", {1: 999}, 0)  # no shared GPU in the plan: nothing to do
        redis_server.kill()
        assert await a.others_mib() is None
        assert not await a.take("late#1", {0: 10}, 0)
        assert not a.link.healthy
        redis_server.start()  # empty: our lease must come back, the external one is gone
        for _ in range(200):
            if a.link.healthy:
                break
            await asyncio.sleep(0.05)
        assert a.link.healthy
        budget = await SharedLeases(a.link.client).budget("box:0")
        assert [(x.owner, x.mib) for x in budget.leases] == [("node-a/mine#1", 300)]
        assert budget.capacity_mib == CAPACITY
    finally:
        await a.close()
        await a.link.close()


async def test_a_want_of_high_enough_priority_asks_the_scheduler_to_evict(redis_server: RedisServer) -> None:
    a = adapter(redis_server.url, "node-a")
    a.external_priority = lambda: 5
    asked: list[tuple[int, int, int, str]] = []
    evicted = asyncio.Event()

    def evict(gpu: int, need: int, priority: int, owner: str) -> list[str]:
        asked.append((gpu, need, priority, owner))
        a.release("model#1")  # what the scheduler's unload ends with
        evicted.set()
        return ["model#1"]

    await a.link.start()
    await a.start(evict, lambda holder, why: None)
    try:
        assert await a.take("model#1", {0: 800}, 0)
        low = asyncio.ensure_future(
            take_lease(redis_server.url, "box:0", 500, "batch", ttl_s=30, priority=1, timeout_s=2)
        )
        await asyncio.sleep(1.5)
        assert asked == []  # priority 1 < external_priority 5: nobody is evicted for it
        assert isinstance((await asyncio.gather(low, return_exceptions=True))[0], LeaseTimeout)
        lease = await take_lease(
            redis_server.url, "box:0", 500, "trainer", ttl_s=30, priority=9, timeout_s=10
        )
        assert asked == [(0, 300, 9, "trainer")]
        assert lease.mib == 500
    finally:
        await a.close()
        await a.link.close()


async def test_a_lease_released_while_a_renewal_round_runs_is_not_put_back(redis_server: RedisServer) -> None:
    """The renewal round worked on a copy of the held leases: a model stopped (its lease released) while
    an earlier lease's renewal was on its way got its lease renewed, put back in Redis, after the release,
    held by nobody for a whole TTL (a review helper). Here the release happens inside that await."""
    side = adapter(redis_server.url, "node-a")
    await side.start(lambda *_: [], lambda *_: None)
    checker = SharedLeases(side.link.client)
    try:
        assert await side.take("m1#0", {0: 100}, 0)
        assert await side.take("m2#0", {0: 200}, 0)
        first = side.held["m1#0"][0]
        renew = side.leases.renew

        async def renew_while_m2_stops(lease_id: str, ttl_s: float, restore: Any = None) -> Any:
            if lease_id == first.id:
                side.release("m2#0")  # m2's child stops while m1's renewal is on the wire
                await asyncio.sleep(0.2)  # the release reaches Redis first
            return await renew(lease_id, ttl_s, restore=restore)

        side.leases.renew = renew_while_m2_stops  # type: ignore[method-assign]
        await side._renew_all()
        await asyncio.sleep(0.2)
        budget = await checker.budget(gpu_key("box", 0))
        assert "m2#0" not in side.held
        assert [(lease.owner, lease.mib) for lease in budget.leases] == [("node-a/m1#0", 100)]
    finally:
        await side.close()
        await side.link.close()
