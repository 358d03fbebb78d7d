"""Shared GPU leases for other GPU services (training jobs, image servers): take, renew, release, list.

The same budget the supervisors lease from (see shared_leases.py). A service takes before it allocates:

    from supervisor.fleet.leases_client import take_lease, renew_lease, release_lease

    lease = await take_lease("redis://gpu-redis:6379/0", gpu=0, mib=8000, owner="trainer", ttl_s=60)
    ...                                  # renew_lease(url, lease.id, ttl_s=60) at least every ttl_s/3
    await release_lease("redis://gpu-redis:6379/0", lease_id=lease.id)

or, renewing in the background until the block ends:

    async with held_lease(url, gpu=0, mib=8000, owner="trainer") as lease:
        ...

`take_lease` waits until the lease fits (recording a *want* with its priority meanwhile, which the
supervisors see and, if their `external_priority` allows, evict idle models for), or raises LeaseTimeout.
A lease not renewed expires after its TTL, so a crashed holder never leaks memory; `held_lease` raises
LeaseLost in its block when its lease expired and others took the room. Scripts without an
event loop use the `_sync` twins. Redis errors (`redis.exceptions.RedisError`) are raised as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from supervisor.fleet.redis_link import connect
from supervisor.fleet.shared_leases import GpuBudget, LeaseLost, SharedLease, SharedLeases, gpu_key, new_id

DEFAULT_TTL_S = 300.0
_POLL_S = 0.5


__all__ = [
    "LeaseError",
    "LeaseLost",
    "LeaseTimeout",
    "held_lease",
    "list_leases",
    "list_leases_sync",
    "release_lease",
    "release_lease_sync",
    "renew_lease",
    "renew_lease_sync",
    "take_lease",
    "take_lease_sync",
]


class LeaseError(Exception):
    """The lease cannot be had or found (an unknown GPU, a lease that expired)."""


class LeaseTimeout(LeaseError):
    """The lease did not fit before the timeout."""


def _gpu(gpu: int | str, gpu_host: str | None) -> str:
    """A GPU index on `gpu_host` (default this machine), or a full `<host>:<index>` key as it is."""
    return gpu if isinstance(gpu, str) and ":" in gpu else gpu_key(gpu_host or socket.gethostname(), int(gpu))


@contextlib.asynccontextmanager
async def _leases(redis_url: str) -> AsyncIterator[SharedLeases]:
    client: Redis = connect(redis_url)
    try:
        yield SharedLeases(client)
    finally:
        await client.aclose()


async def take_lease(
    redis_url: str,
    gpu: int | str,
    mib: int,
    owner: str,
    ttl_s: float = DEFAULT_TTL_S,
    priority: int = 0,
    gpu_host: str | None = None,
    timeout_s: float | None = None,
    capacity_mib: int | None = None,
) -> SharedLease:
    """Wait until `mib` fit on the GPU, then hold them for `ttl_s` (renew to keep them).

    `gpu` is an index on `gpu_host` (default this machine's host name) or a `<host>:<index>` key. A GPU
    no supervisor registered needs `capacity_mib`. Raises LeaseTimeout after `timeout_s` (None: wait
    for ever) and LeaseError for an unregistered GPU or more MiB than its capacity. Cancelled, it
    withdraws its want at once.
    """
    key = _gpu(gpu, gpu_host)
    want, lease_id = new_id("want"), new_id()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    async with _leases(redis_url) as leases:
        try:
            while True:
                # The want lives a little longer than one poll, so it vanishes soon after we stop asking.
                result = await leases.take(
                    key, mib, owner, ttl_s, priority, "external", capacity_mib, lease_id, want, _POLL_S * 4
                )
                if result.lease is not None:
                    return result.lease
                if result.outcome == "unregistered":
                    raise LeaseError(
                        f"GPU {key} is not registered by any supervisor; pass its capacity to lease it anyway"
                    )
                if result.outcome == "never_fits":
                    raise LeaseError(
                        f"{mib} MiB can never fit on GPU {key}: its capacity is {result.free_mib} MiB"
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    await leases.withdraw_want(key, want)
                    raise LeaseTimeout(f"{mib} MiB did not fit on GPU {key} ({result.free_mib} MiB free)")
                await asyncio.sleep(_POLL_S)
        except asyncio.CancelledError:  # the caller gave up waiting (a signal, its own timeout)
            with contextlib.suppress(RedisError, OSError):
                await leases.withdraw_want(key, want)
                # Redis may have granted it as the wait was called off: the caller will never know it.
                await leases.release(key, lease_id)
            raise


async def renew_lease(redis_url: str, lease_id: str, ttl_s: float = DEFAULT_TTL_S) -> SharedLease:
    """Hold the lease `ttl_s` more from now; LeaseError if it already expired or was released."""
    async with _leases(redis_url) as leases:
        lease = await leases.renew(lease_id, ttl_s)
    if lease is None:
        raise LeaseError(f"lease {lease_id} is gone (expired or released)")
    return lease


async def release_lease(
    redis_url: str,
    lease_id: str | None = None,
    gpu: int | str | None = None,
    owner: str | None = None,
    gpu_host: str | None = None,
) -> list[SharedLease]:
    """Release one lease by id, or every lease of `owner` (on `gpu`, or on every shared GPU)."""
    async with _leases(redis_url) as leases:
        key = None if gpu is None else _gpu(gpu, gpu_host)
        return await leases.release(key, lease_id, owner)


async def list_leases(
    redis_url: str, gpu: int | str | None = None, gpu_host: str | None = None
) -> list[GpuBudget]:
    """Every shared GPU's capacity, live leases and waiting wants (or only `gpu`'s)."""
    async with _leases(redis_url) as leases:
        keys = [_gpu(gpu, gpu_host)] if gpu is not None else await leases.gpus()
        return [await leases.budget(key) for key in keys]


@contextlib.asynccontextmanager
async def held_lease(
    redis_url: str, gpu: int | str, mib: int, owner: str, ttl_s: float = 30.0, **take: Any
) -> AsyncIterator[SharedLease]:
    """Take a lease, renew it every ttl_s/3 while the block runs, release it at the end.

    A lease that could not be renewed in time and whose room others hold now (Redis restarted empty,
    or the holder was paused past its TTL) is lost: the block is cancelled and LeaseLost raised from
    it, since the memory the holder uses is no longer accounted for.
    """
    lease = await take_lease(redis_url, gpu, mib, owner, ttl_s, **take)
    holder = asyncio.current_task()
    lost: LeaseLost | None = None

    async def renew() -> None:
        nonlocal lost
        async with _leases(redis_url) as leases:
            while True:
                await asyncio.sleep(ttl_s / 3)
                try:
                    await leases.renew(lease.id, ttl_s, restore=lease)
                except LeaseLost as exc:
                    lost = exc
                    if holder is not None:
                        holder.cancel()
                    return
                except (RedisError, OSError):  # Redis away for a moment: the next round tries again
                    pass

    renewing = asyncio.ensure_future(renew())
    try:
        yield lease
    except asyncio.CancelledError:
        if lost is None or holder is None:
            raise
        holder.uncancel()  # our cancel, not the caller's: it ends as LeaseLost
        raise LeaseLost(
            f"lease {lease.id} ({mib} MiB on {lease.gpu}) was lost: others hold its room"
        ) from None
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        with contextlib.suppress(Exception):  # if Redis is away the lease expires on its own
            await release_lease(redis_url, lease_id=lease.id)


def take_lease_sync(redis_url: str, gpu: int | str, mib: int, owner: str, **options: Any) -> SharedLease:
    """take_lease() for code without an event loop."""
    return asyncio.run(take_lease(redis_url, gpu, mib, owner, **options))


def renew_lease_sync(redis_url: str, lease_id: str, ttl_s: float = DEFAULT_TTL_S) -> SharedLease:
    return asyncio.run(renew_lease(redis_url, lease_id, ttl_s))


def release_lease_sync(redis_url: str, **which: Any) -> list[SharedLease]:
    return asyncio.run(release_lease(redis_url, **which))


def list_leases_sync(redis_url: str, **which: Any) -> list[GpuBudget]:
    return asyncio.run(list_leases(redis_url, **which))
