"""The daemon's one connection to Redis, and whether the fleet is reachable right now.

Redis is an optional helper, never a dependency of serving: a failed call marks the link down (logged
once, `fleet_degraded`, and the `llm_supervisor_fleet_degraded` gauge), a background task pings with
back-off until Redis answers again (`fleet_rejoined`), and callers look at `healthy` before they rely on
it. An error Redis answers with (bad data in it) is no outage: the link stays up, the error is logged
once (`fleet_redis_error`) and that call raises FleetDataError. `call()` raises only FleetUnavailable
(or that subclass), which the fleet's own code catches; nothing that serves a request ever sees a
Redis exception.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from prometheus_client import CollectorRegistry, Gauge
from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.retry import Retry

log = structlog.get_logger("fleet")
T = TypeVar("T")

_TIMEOUT_S = 2.0  # one Redis round trip; a longer silence counts as Redis being unreachable
_BACKOFF_FIRST_S = 0.25
_BACKOFF_MAX_S = 5.0


class FleetUnavailable(Exception):
    """Redis could not be reached (or answered with an error); the caller goes on as a single host."""


class FleetDataError(FleetUnavailable):
    """Redis answered this call with an error (a value of the wrong type, a script that failed on what
    it read): the link is up, only this call has no result. Not an outage: marking the link down for it
    made the node leave and rejoin the fleet every second."""


def connect(url: str) -> Redis:
    """A client with short timeouts and no retries of its own: the link decides when to try again."""
    return Redis.from_url(
        url,
        socket_timeout=_TIMEOUT_S,
        socket_connect_timeout=_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


class RedisLink:
    """Owns the client; tracks health; rejoin callbacks run when Redis answers again after an outage."""

    def __init__(self, url: str, registry: CollectorRegistry | None = None) -> None:
        self.client = connect(url)
        self.healthy = True  # until a call says otherwise; start() checks at once
        self._wake = asyncio.Event()
        self._on_rejoin: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._last_error: str | None = None  # the last error Redis answered with, logged once
        self.degraded = Gauge(
            "llm_supervisor_fleet_degraded",
            "1 while Redis (the fleet's shared state) cannot be reached and this node serves as a single "
            "host; 0 otherwise.",
            registry=registry,
        )

    def on_rejoin(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._on_rejoin.append(callback)

    async def start(self) -> None:
        """Check Redis once (a failure is logged, not raised) and start watching it."""
        with contextlib.suppress(FleetUnavailable):
            await self.call(self.client.ping())
        self._task = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.client.aclose()

    async def call(self, operation: Awaitable[T]) -> T:
        """Await a Redis operation; any Redis or network failure marks the link down and raises
        FleetUnavailable. Does not wait for an outage to end."""
        try:
            result = await operation
        except ResponseError as exc:
            if isinstance(exc, ReadOnlyError):  # a replica after a failover: no use until it is a primary
                self.mark_down(exc)
                raise FleetUnavailable(str(exc)) from None
            if str(exc) != self._last_error:  # once until it changes: a poll would repeat it every second
                self._last_error = str(exc)
                log.error("fleet_redis_error", error=str(exc))
            raise FleetDataError(str(exc)) from None
        except (RedisError, OSError, TimeoutError) as exc:
            self.mark_down(exc)
            raise FleetUnavailable(str(exc) or type(exc).__name__) from None
        return result

    def mark_down(self, exc: BaseException) -> None:
        if self.healthy:
            self.healthy = False
            self.degraded.set(1)
            log.warning(
                "fleet_degraded",
                error=str(exc) or type(exc).__name__,
                effect="serving as a single host: local models keep serving, nothing new on shared GPUs",
            )
            self._wake.set()

    async def _watch(self) -> None:
        """While Redis is down, ping with back-off; when it answers, run the rejoin callbacks."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            delay = _BACKOFF_FIRST_S
            while not self.healthy:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                try:
                    # Connections pooled before the outage point at a server that is gone: the first
                    # call on one would fail and count as a second outage.
                    await self.client.connection_pool.disconnect()
                    await self.client.ping()
                except (RedisError, OSError, TimeoutError):
                    continue
                self.healthy = True
                self.degraded.set(0)
                log.info("fleet_rejoined")
                for callback in self._on_rejoin:
                    try:
                        await callback()
                    except FleetUnavailable:
                        pass  # down again: the next failure has marked it and woken us
                    except Exception as exc:  # a bug in a callback must not end the watch
                        log.error("fleet_rejoin_failed", error=repr(exc), exc_info=exc)
