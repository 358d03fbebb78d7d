"""The event bus: bounded per subscriber, never raising into its publisher, secrets scrubbed."""

from __future__ import annotations

import asyncio

from supervisor import secrets
from supervisor.events import Event, EventBus


def _drain(queue: asyncio.Queue[Event | None]) -> list[Event | None]:
    items: list[Event | None] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_a_slow_subscriber_is_dropped_and_the_others_keep_getting_events() -> None:
    bus = EventBus(queue_size=3)
    slow = bus.subscribe()
    fast = bus.subscribe()
    received = []
    for n in range(10):
        bus.publish("queue", model="demo", queued=n)  # never blocks, whoever is behind
        received.append(await anext(fast))
    assert [e.data["queued"] for e in received] == list(range(10))
    assert slow.dropped
    assert not fast.dropped
    assert [e async for e in slow] == []  # its stream ends: it reconnects for a new snapshot
    assert len(bus) == 1


async def test_publish_never_raises_into_the_publisher() -> None:
    bus = EventBus()
    subscription = bus.subscribe()
    bus.publish("load", model="demo", odd=object())  # not JSON, not a problem for the publisher
    bus.publish("load", model="demo", vram_mib=512)
    events = [e for e in _drain(subscription.queue) if e is not None]
    assert [e.data.get("vram_mib") for e in events][-1] == 512


async def test_events_carry_scrubbed_text_and_a_time() -> None:
    secrets.remember("sk-live-abcdef123456")
    try:
        bus = EventBus()
        subscription = bus.subscribe()
        bus.publish("crash", model="demo", stderr_tail=["auth failed for sk-live-abcdef123456"])
        event = await anext(subscription)
        assert event.type == "crash"
        assert event.data["stderr_tail"] == ["auth failed for ***"]
        assert isinstance(event.data["at"], float)
    finally:
        secrets.forget("sk-live-abcdef123456")


async def test_throttled_events_keep_the_latest_and_send_it_when_the_interval_ends() -> None:
    bus = EventBus()
    subscription = bus.subscribe()
    for queued in (1, 2, 3):
        bus.publish_throttled("queue", "queue:demo", 0.05, model="demo", queued=queued)
    first = await anext(subscription)
    later = await anext(subscription)  # held back, then sent: the latest count, not every one
    assert (first.data["queued"], later.data["queued"]) == (1, 3)
    assert subscription.queue.empty()


async def test_with_nobody_subscribed_nothing_is_held_back_for_a_later_subscriber() -> None:
    bus = EventBus()
    first = bus.subscribe()
    bus.publish_throttled("queue", "queue:demo", 0.05, model="demo", queued=1)
    bus.publish_throttled("queue", "queue:demo", 0.05, model="demo", queued=5)  # held back
    first.close()
    bus.publish_throttled("queue", "queue:demo", 0.05, model="demo", queued=0)  # nobody to tell
    later = bus.subscribe()  # starts from a snapshot, which says 0
    await asyncio.sleep(0.1)  # the held-back interval has ended
    assert later.queue.empty()  # not the stale 5


async def test_forced_event_goes_at_once_and_replaces_a_held_back_one() -> None:
    bus = EventBus()
    subscription = bus.subscribe()
    bus.publish_throttled("pull", "pull:m", 60, status="downloading", completed=1)
    bus.publish_throttled("pull", "pull:m", 60, status="downloading", completed=2)
    bus.publish_throttled("pull", "pull:m", 60, force=True, status="success", completed=3)
    statuses = [e.data["completed"] for e in _drain(subscription.queue) if e is not None]
    assert statuses == [1, 3]


async def test_close_ends_every_stream_and_later_subscribers_at_once() -> None:
    bus = EventBus()
    subscription = bus.subscribe()
    bus.close()
    assert [e async for e in subscription] == []
    assert [e async for e in bus.subscribe()] == []
