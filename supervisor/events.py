"""The event bus: what changed in the daemon, for dashboards that follow GET /v1/admin/events.

Publishing never blocks and never raises into its caller (the scheduler, a slot, a pull). Every subscriber
has a bounded queue; one that falls behind until its queue is full is dropped: its stream ends and the
daemon goes on as if it had never been there. Text in events is scrubbed of secrets once, at publish.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from supervisor import secrets

log = structlog.get_logger("events")

QUEUE_SIZE = 1000  # events a subscriber may fall behind by before it is dropped


@dataclass(frozen=True)
class Event:
    type: str  # slot_transition, eviction, load, crash, reload, pull, queue
    data: dict[str, Any]


class Subscription:
    """One follower's queue; iterate it for events. Iteration ends when the bus drops or closes it."""

    def __init__(self, bus: EventBus, size: int) -> None:
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(size)
        self.dropped = False
        self._bus = bus

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        event = await self.queue.get()
        if event is None:
            raise StopAsyncIteration
        return event

    def close(self) -> None:
        self._bus.unsubscribe(self)

    def end(self) -> None:
        """Wake the reader with the end of the stream, discarding what it has not read (never blocks)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class EventBus:
    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self.queue_size = queue_size
        self._subscribers: set[Subscription] = set()
        self._last_sent: dict[str, float] = {}  # throttle key -> loop time of its last event
        self._pending: dict[str, Event] = {}  # throttle key -> the latest event held back
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        """A new follower; events published from now on reach it. Close it when done."""
        subscription = Subscription(self, self.queue_size)
        if self._closed:
            subscription.end()
        else:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def publish(self, type: str, **data: Any) -> None:
        """Hand the event to every subscriber now; never blocks, never raises."""
        if not self._subscribers:
            return  # nobody to tell: a later subscriber starts from a snapshot
        try:
            self._deliver(Event(type, _scrubbed(data)))
        except Exception as exc:  # a dashboard's feed must never break a load or a transition
            log.error("event_publish_failed", type=type, error=repr(exc), exc_info=exc)

    def publish_throttled(
        self, type: str, key: str, interval_s: float, force: bool = False, **data: Any
    ) -> None:
        """At most one event per `key` per `interval_s`; one held back is replaced by newer ones and sent
        when the interval ends, so the latest state always arrives. `force` sends at once (a new status).

        With nobody subscribed nothing is built (queue counts change twice per queued request); what was
        held back is dropped, since a later subscriber starts from a snapshot and must not get it after.
        """
        if not self._subscribers:
            self._pending.pop(key, None)
            return
        try:
            loop = asyncio.get_running_loop()
            now = loop.time()
            event = Event(type, _scrubbed(data))
            if force or (key not in self._timers and now - self._last_sent.get(key, -math.inf) >= interval_s):
                if (timer := self._timers.pop(key, None)) is not None:
                    timer.cancel()
                self._pending.pop(key, None)
                self._last_sent[key] = now
                self._deliver(event)
                return
            self._pending[key] = event
            if key not in self._timers:
                delay = interval_s - (now - self._last_sent.get(key, now))
                self._timers[key] = loop.call_later(max(0.0, delay), self._flush, key)
        except Exception as exc:
            log.error("event_publish_failed", type=type, error=repr(exc), exc_info=exc)

    def _flush(self, key: str) -> None:
        self._timers.pop(key, None)
        event = self._pending.pop(key, None)
        if event is not None:
            self._last_sent[key] = asyncio.get_running_loop().time()
            self._deliver(event)

    def _deliver(self, event: Event) -> None:
        for subscription in list(self._subscribers):
            try:
                subscription.queue.put_nowait(event)
            except asyncio.QueueFull:
                # A reader this far behind would only fall further behind: it reconnects for a snapshot.
                self._subscribers.discard(subscription)
                subscription.dropped = True
                subscription.end()
                log.warning("events_subscriber_dropped", queue_size=self.queue_size, event_type=event.type)

    def close(self) -> None:
        """End every subscriber's stream (at shutdown, so open event streams do not hold it up)."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._pending.clear()
        for subscription in list(self._subscribers):
            subscription.end()
        self._subscribers.clear()


def _scrubbed(data: dict[str, Any]) -> dict[str, Any]:
    """The event's fields with secrets masked and the time it happened (epoch seconds)."""
    scrubbed: dict[str, Any] = secrets.shown(data, sees_internals=True)
    return {**scrubbed, "at": round(time.time(), 3)}


def vram_source(source: str) -> str:
    """An estimate's source as answers name it: `weights` for what supervisor.estimates calls artifacts."""
    return "weights" if source == "artifacts" else source
