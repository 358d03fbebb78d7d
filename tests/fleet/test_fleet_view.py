"""The fleet view against a real redis-server: a record it cannot read is skipped (and said so once), and
nothing in a refresh stops the view, which every route reads."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from supervisor.fleet import nodes
from supervisor.fleet.nodes import FleetView, Node, node_key
from supervisor.fleet.redis_link import RedisLink
from tests.fleet.conftest import RedisServer
from tests.integration.harness import eventually

REFRESH_S = 0.1


def record(node_id: str, **changes: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "url": f"http://{node_id}:11435",
        "healthy": True,
        "last_seen": time.time(),
        "version": "x",
        "weights_on_disk": [],
        "gpus": [{"index": 0, "capacity_mib": 1000, "leased_mib": 0, "free_mib": 1000, "shared": False}],
        "models": {"demo": {"state": "ready", "max_inflight": 4, "leases": {"0": 100}}},
        **changes,
    }


@pytest.fixture
async def view(redis_server: RedisServer) -> AsyncIterator[FleetView]:
    link = RedisLink(redis_server.url, CollectorRegistry())
    await link.start()
    fleet_view = FleetView(link, lambda: record("me"), refresh_s=REFRESH_S)
    fleet_view.start()
    yield fleet_view
    await fleet_view.close()
    await link.close()


async def _put(client: Redis, node_id: str, value: Any) -> None:
    await client.set(node_key(node_id), value if isinstance(value, str) else json.dumps(value), px=60_000)


@pytest.mark.parametrize(
    "bad",
    [
        {"models": ["demo"]},
        {"models": {"demo": {"state": "ready", "leases": [100]}}},
        {"models": {"demo": "ready"}},
        {"gpus": {"0": {}}},
        {"gpus": ["x"]},
        {"url": None},
        {"healthy": "yes"},
        {"models": {"demo": {"state": "ready", "inflight": "3"}}},
    ],
)
def test_a_record_of_the_wrong_shape_is_a_value_error_naming_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"is not (an?|true)"):
        Node.parse(json.dumps(record("x", **bad)))


async def test_a_malformed_record_is_skipped_once_logged_and_the_view_goes_on(
    view: FleetView, redis_client: Redis
) -> None:
    """A record whose `models` is a list (another version's layout, or a stray write) raised
    AttributeError, which the refresh did not catch: the view's task died silently and every node's
    view stayed as it was for good. It is now skipped, logged once, and the others are read."""
    await _put(redis_client, "good1", record("good1"))
    await eventually(lambda: _has(view, "good1"), 5, "good1 in the view")
    with structlog.testing.capture_logs() as logs:
        await _put(redis_client, "zz", {"node_id": "zz", "url": "http://x:1", "models": ["x"]})
        await asyncio.sleep(REFRESH_S * 5)
        await redis_client.delete(node_key("good1"))
        await _put(redis_client, "good2", record("good2"))
        await eventually(lambda: _has(view, "good2"), 5, "good2 in the view")
        await eventually(lambda: _lacks(view, "good1"), 5, "good1 gone from the view")
    invalid = [e for e in logs if e["event"] == "fleet_record_invalid"]
    assert len(invalid) == 1
    assert invalid[0]["key"] == node_key("zz")
    assert "models is not an object" in invalid[0]["error"]
    assert not view.has("zz")


UNREADABLE = {
    # an integer too big for a float: float() raised OverflowError, not ValueError
    "huge-int": '{"node_id": "zz", "url": "http://x:1", "last_seen": 1' + "0" * 400 + "}",
    # nesting deeper than Python's recursion limit: json raised RecursionError
    "deep-nesting": '{"node_id": "zz", "url": "http://x:1", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "infinite": '{"node_id": "zz", "url": "http://x:1", "last_seen": 1e400}',
}


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
async def test_a_record_past_pythons_number_or_nesting_limits_is_skipped_too(
    view: FleetView, redis_client: Redis, raw: str
) -> None:
    """Such a record raised past the refresh's `except ValueError`: every refresh failed, and the view
    stayed as it was for good (a dead node routable, a new one never seen)."""
    with pytest.raises(ValueError, match=r"unreadable|not a number"):
        Node.parse(raw)
    await _put(redis_client, "good1", record("good1"))
    await eventually(lambda: _has(view, "good1"), 5, "good1 in the view")
    await redis_client.set(node_key("zz"), raw, px=60_000)
    await asyncio.sleep(REFRESH_S * 5)
    await redis_client.delete(node_key("good1"))
    await _put(redis_client, "good2", record("good2"))
    await eventually(lambda: _has(view, "good2"), 5, "good2 in the view")
    await eventually(lambda: _lacks(view, "good1"), 5, "good1 gone from the view")


async def test_a_refresh_that_fails_for_a_bug_is_logged_and_the_view_goes_on(
    view: FleetView, redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a refresh (here: Node.parse raising what nothing expects, the one fake: a bug that cannot
    be made to happen for real) is logged at error, once, and the next refresh runs."""
    real = nodes.Node.parse
    broken = True

    def parse(raw: Any) -> Node:
        if broken:
            raise RuntimeError("a bug")
        return real(raw)

    monkeypatch.setattr(nodes.Node, "parse", staticmethod(parse))
    with structlog.testing.capture_logs() as logs:
        await _put(redis_client, "good", record("good"))
        await asyncio.sleep(REFRESH_S * 5)
        broken = False
        await eventually(lambda: _has(view, "good"), 5, "good in the view")
    failed = [e for e in logs if e["event"] == "fleet_view_refresh_failed"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "error"


async def _has(view: FleetView, node_id: str) -> bool:
    return view.has(node_id)


async def _lacks(view: FleetView, node_id: str) -> bool:
    return not view.has(node_id)
