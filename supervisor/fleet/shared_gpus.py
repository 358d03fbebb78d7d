"""The scheduler's side of shared GPUs: what others hold there, our own leases in Redis, and external wants.

The scheduler stays the only writer of leases; it calls this adapter at three points:

- planning (`others_mib`): the MiB that leases in Redis not held by this daemon take on each shared
  GPU, subtracted from what the local lease map says is free. None while Redis is unreachable: the
  scheduler then places nothing new on a shared GPU (other services may be using it), while models
  already loaded keep serving and non-shared GPUs work as before.
- taking (`take`): after a plan, the atomic take in Redis for the plan's shared GPUs; refused means
  someone took the room since the snapshot, and the scheduler plans again. A plan with no shared GPU
  returns at once, without an await, so local leasing keeps "no await between plan and take".
- releasing (`release`, `rename`): when the child's tree is gone (the scheduler's existing release
  point), or when NVML says its memory is still held (`leaked:` keeps the Redis lease too).

While a lease is held it is renewed every TTL/3 (and put back if Redis lost it in a restart: we still
hold that memory). Pending external requests (`wants`) of priority >= `external_priority` make the
scheduler unload idle models of lower priority on that GPU (`evict`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

import structlog

from supervisor.fleet.redis_link import FleetDataError, FleetUnavailable, RedisLink
from supervisor.fleet.shared_leases import LeaseLost, SharedLease, SharedLeases, gpu_key
from supervisor.gpus import Gpu

log = structlog.get_logger("fleet.shared_gpus")

# evict(gpu index, MiB still missing, the want's priority, its owner) -> slot keys it started to unload
Evict = Callable[[int, int, int, str], list[str]]
# lost(slot key, why): a holder whose shared lease went to others must give its memory up
Lost = Callable[[str, str], None]
_WANTS_POLL_S = 1.0
_CLOSE_WAIT_S = 3.0


class SharedGpus:
    def __init__(
        self,
        link: RedisLink,
        gpus: Collection[Gpu],
        shared: Collection[int],
        gpu_host: str,
        margin_mib: int,
        node_id: str,
        ttl_s: float,
        external_priority: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.link = link
        self.leases = SharedLeases(link.client)
        self.totals = {g.index: g.total_mib for g in gpus if g.index in shared}
        self.keys = {index: gpu_key(gpu_host, index) for index in self.totals}  # GPU index -> Redis name
        self.margin_mib = margin_mib
        self.node_id = node_id
        self.ttl_s = ttl_s
        self.external_priority = external_priority
        self.held: dict[str, list[SharedLease]] = {}  # local lease holder (slot key) -> its Redis leases
        self._evict: Evict | None = None
        self._lost: Lost | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # releases under way
        self._loops: list[asyncio.Task[None]] = []  # renewing, watching wants
        self._said_unavailable = False

    def is_shared(self, gpu: int) -> bool:
        return gpu in self.keys

    def capacity_mib(self, gpu: int) -> int:
        return max(0, self.totals[gpu] - self.margin_mib)

    async def start(self, evict: Evict, lost: Lost) -> None:
        """Register our shared GPUs' budgets and start renewing and watching wants."""
        self._evict = evict
        self._lost = lost
        self.link.on_rejoin(self._rejoin)
        with contextlib.suppress(FleetUnavailable):
            await self._register()
        self._loops = [
            asyncio.ensure_future(self._renew_forever()),
            asyncio.ensure_future(self._watch_wants()),
        ]

    async def close(self) -> None:
        """Stop renewing, and let the releases the scheduler's shutdown started finish (briefly: if Redis is
        away, the TTL ends them)."""
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=_CLOSE_WAIT_S)

    # --- planning and taking ----------------------------------------------------------------------------

    async def others_mib(self) -> dict[int, int] | None:
        """Per shared GPU: MiB leased in Redis by anyone but this daemon; None when Redis is unreachable."""
        if not self.keys:
            return {}
        if not self.link.healthy:
            self._unavailable()
            return None
        ours = {lease.id for leases in self.held.values() for lease in leases}
        try:
            others = {}
            for index, key in self.keys.items():
                budget = await self.link.call(self.leases.budget(key))
                others[index] = sum(x.mib for x in budget.leases if x.id not in ours)
        except FleetUnavailable as exc:
            self._unavailable(exc)
            return None
        self._said_unavailable = False
        return others

    async def take(self, holder: str, mib_by_gpu: Mapping[int, int], priority: int) -> bool:
        """Lease the plan's shared GPUs in Redis, all or nothing; True at once when it has none.

        False when Redis refused (the room went meanwhile) or cannot be reached.
        """
        wanted = {gpu: mib for gpu, mib in sorted(mib_by_gpu.items()) if gpu in self.keys}
        if not wanted:
            return True  # no await: the caller's local take follows its plan directly
        taken: list[SharedLease] = []
        try:
            for gpu, mib in wanted.items():
                result = await self.link.call(
                    self.leases.take(
                        self.keys[gpu],
                        mib,
                        f"{self.node_id}/{holder}",
                        self.ttl_s,
                        priority,
                        "supervisor",
                        self.capacity_mib(gpu),  # if Redis lost the registration in a restart
                    )
                )
                if result.lease is None:
                    log.info(
                        "shared_lease_refused",
                        holder=holder,
                        gpu=self.keys[gpu],
                        mib=mib,
                        free_mib=result.free_mib,
                    )
                    self._drop(taken)
                    return False
                taken.append(result.lease)
        except FleetUnavailable as exc:
            self._unavailable(exc)
            self._drop(taken)
            return False
        self.held[holder] = taken
        log.info("shared_lease_taken", holder=holder, leases={x.gpu: x.mib for x in taken})
        return True

    def release(self, holder: str) -> None:
        """Give back the holder's Redis leases (in the background; if Redis is away they expire)."""
        self._drop(self.held.pop(holder, []))

    def rename(self, holder: str, new_holder: str) -> None:
        """The memory stays held under another local holder (a `leaked:` lease): keep its Redis leases."""
        if holder in self.held:
            self.held[new_holder] = self.held.pop(holder)

    def _drop(self, leases: list[SharedLease]) -> None:
        if leases:
            self._background(self._release(leases))

    async def _release(self, leases: list[SharedLease]) -> None:
        for lease in leases:
            with contextlib.suppress(FleetUnavailable):
                await self.link.call(self.leases.release(lease.gpu, lease.id))

    def _unavailable(self, exc: FleetUnavailable | None = None) -> None:
        if not self._said_unavailable:
            self._said_unavailable = True
            # Its own error (`fleet_redis_error`) says what Redis answered: bad data, not an outage.
            answered = isinstance(exc, FleetDataError)
            why = "Redis answered with an error" if answered else "Redis cannot be reached"
            log.warning(
                "shared_gpus_unavailable",
                gpus=sorted(self.keys.values()),
                reason=f"{why}: nothing new is leased on shared GPUs (other services may be using them); "
                "loaded models keep serving",
            )

    # --- keeping leases alive -----------------------------------------------------------------------

    async def _register(self) -> None:
        for index, key in self.keys.items():
            await self.link.call(self.leases.register(key, self.totals[index], self.margin_mib, self.node_id))

    async def _renew_all(self) -> None:
        """Renew every held lease (putting back one Redis lost). A holder released while the round is
        on its way (its model stopped) is renewed no further, and a lease of it that a renewal already
        in flight put back is given back again: else it held its room, for nobody, for a whole TTL."""
        for _, leases in list(self.held.items()):
            renewed = []
            for lease in leases:
                if self._holder_of(leases) is None:
                    break  # released: its leases are given back, none is renewed again
                try:
                    fresh = await self.link.call(self.leases.renew(lease.id, self.ttl_s, restore=lease))
                except LeaseLost:
                    holder = self._holder_of(leases)
                    if holder is not None:
                        # Renewed too late (this process was paused past its TTL) and others took the
                        # room: its model must give the memory up, or two holders use it.
                        log.error("shared_lease_lost", holder=holder, gpu=lease.gpu, mib=lease.mib)
                        self.held.pop(holder, None)
                        if self._lost is not None:
                            self._lost(holder, f"its lease on shared GPU {lease.gpu} went to others")
                    break
                if self._holder_of(leases) is None:  # released while this renewal was on its way
                    self._drop([fresh or lease])
                    break
                renewed.append(fresh or lease)
            else:
                if (holder := self._holder_of(leases)) is not None:
                    self.held[holder] = renewed

    def _holder_of(self, leases: list[SharedLease]) -> str | None:
        """Who holds this very list of leases now (a rename moves it to another holder), if anyone."""
        return next((holder for holder, held in self.held.items() if held is leases), None)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            if self.link.healthy:
                with contextlib.suppress(FleetUnavailable):
                    await self._renew_all()

    async def _rejoin(self) -> None:
        """Redis is back (maybe empty): register the GPUs again and put our leases back at once."""
        await self._register()
        await self._renew_all()
        self._said_unavailable = False

    async def _watch_wants(self) -> None:
        """External requests waiting for room, of priority >= external_priority: unload idle models of
        lower priority on that GPU, through the scheduler's own unload path."""
        while True:
            await asyncio.sleep(_WANTS_POLL_S)
            floor = self.external_priority()
            if floor is None or not self.link.healthy or self._evict is None:
                continue
            for index, key in self.keys.items():
                try:
                    budget = await self.link.call(self.leases.budget(key))
                except FleetUnavailable:
                    break
                capacity = (
                    budget.capacity_mib if budget.capacity_mib is not None else self.capacity_mib(index)
                )
                free = capacity - budget.leased_mib
                for want in budget.wants:  # most urgent first
                    if want.priority < floor or want.mib <= free or want.mib > capacity:
                        continue
                    self._evict(index, want.mib - free, want.priority, want.owner)
                    break  # one want at a time per GPU: the next round sees what that freed

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("background_task_failed", task="shared_gpus", error=repr(exc), exc_info=exc)
