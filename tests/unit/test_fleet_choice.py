"""The fleet view's pure choices: where a model is ready, and which node should load it."""

from __future__ import annotations

from typing import Any

from supervisor.fleet.nodes import Node, best_node_to_load, ready_elsewhere


def node(
    node_id: str,
    models: dict[str, dict[str, Any]],
    free: int = 0,
    on_disk: tuple[str, ...] = (),
    healthy: bool = True,
) -> Node:
    return Node.parse(
        {
            "node_id": node_id,
            "url": f"http://{node_id}:11435",
            "healthy": healthy,
            "last_seen": 0,
            "weights_on_disk": list(on_disk),
            "gpus": [
                {
                    "index": 0,
                    "capacity_mib": 8000,
                    "leased_mib": 8000 - free,
                    "free_mib": free,
                    "shared": False,
                }
            ],
            "models": {
                name: {"state": "unloaded", "priority": 0, "max_inflight": 4, **fields}
                for name, fields in models.items()
            },
        }
    )


def test_ready_elsewhere_goes_by_fewest_in_flight_then_least_queued() -> None:
    nodes = [
        node("a", {"m": {"state": "ready", "inflight": 3, "queued": 0}}),
        node("b", {"m": {"state": "ready", "inflight": 1, "queued": 5}}),
        node("c", {"m": {"state": "ready", "inflight": 1, "queued": 2}}),
        node("d", {"m": {"state": "loading"}}),
        node("e", {"m": {"state": "ready"}}, healthy=False),
        node("self", {"m": {"state": "ready"}}),
    ]
    places = ready_elsewhere(nodes, "m", exclude="self")
    assert [p.node.node_id for p in places] == ["c", "b", "a"]
    assert places[0].free_places == 3
    assert ready_elsewhere(nodes, "unknown") == []


def test_a_node_with_free_vram_wins_over_one_that_must_evict() -> None:
    nodes = [
        node(
            "full", {"m": {}, "idle": {"state": "ready", "evictable": True, "leases": {"0": 6000}}}, free=1000
        ),
        node("roomy", {"m": {}}, free=5000),
    ]
    assert best_node_to_load(nodes, "m", 4000).node_id == "roomy"  # type: ignore[union-attr]


def test_eviction_of_idle_lower_priority_models_when_no_node_has_room() -> None:
    nodes = [
        node(
            "busy", {"m": {}, "x": {"state": "ready", "evictable": False, "leases": {"0": 6000}}}, free=1000
        ),
        node("idle", {"m": {}, "x": {"state": "ready", "evictable": True, "leases": {"0": 6000}}}, free=1000),
        node(
            "vip", {"m": {}, "x": {"state": "ready", "evictable": True, "priority": 9, "leases": {"0": 6000}}}
        ),
    ]
    assert best_node_to_load(nodes, "m", 4000).node_id == "idle"  # type: ignore[union-attr]
    assert best_node_to_load(nodes[:1], "m", 4000) is None


def test_weights_on_disk_break_a_tie_and_a_node_without_the_model_is_never_chosen() -> None:
    nodes = [
        node("a", {"m": {}}, free=5000),
        node("b", {"m": {}}, free=5000, on_disk=("m",)),
        node("c", {}, free=8000),
    ]
    assert best_node_to_load(nodes, "m", 4000).node_id == "b"  # type: ignore[union-attr]


def test_on_a_full_tie_the_node_the_request_reached_keeps_it() -> None:
    nodes = [node("a", {"m": {}}, free=5000, on_disk=("m",)), node("b", {"m": {}}, free=5000, on_disk=("m",))]
    assert best_node_to_load(nodes, "m", 4000).node_id == "a"  # type: ignore[union-attr]
    assert best_node_to_load(nodes, "m", 4000, here="b").node_id == "b"  # type: ignore[union-attr]


def test_another_nodes_expiry_past_what_a_date_holds_is_written_as_never() -> None:
    """/api/ps writes other nodes' expiries as dates: a record's 1e18 (a stray write, another version)
    raised past the listing, a 500 on every node that saw it."""
    import time

    from supervisor.api import fleet_view
    from supervisor.api.ollama_models import NEVER, expires_at_text

    model = {"state": "ready", "max_inflight": 4, "leases": {"0": 100}, "keep_alive_expires_at": 1e18}
    record = {
        "node_id": "other",
        "url": "http://other:1",
        "last_seen": time.time(),
        "models": {"demo": model},
    }
    rows = fleet_view.running_elsewhere(("me", [Node.parse(record)]), lambda name: True, expires_at_text)
    assert [row["expires_at"] for row in rows] == [NEVER]
