"""What the listings add in a fleet: which node an entry is on, and the model's state on every node.

Read from the fleet view (records a few seconds old at most); without `redis_url` nothing is added and
no fleet module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from supervisor.api.context import FLEET
from supervisor.manifests import ollama_name

if TYPE_CHECKING:
    from supervisor.fleet.nodes import Node

_RUNNING = ("loading", "ready", "draining")


def nodes(app: web.Application) -> tuple[str, list[Node]] | None:
    """(this node's id, every node in the view), or None outside a fleet."""
    fleet = app.get(FLEET)
    if fleet is None or fleet.view is None:
        return None
    return fleet.settings.node_id, fleet.view.nodes()


def annotate(entry: dict[str, Any], name: str, fleet: tuple[str, list[Node]] | None) -> dict[str, Any]:
    """`node` (this one) and `nodes` ({node id: the model's state there}) on a listing's entry."""
    if fleet is not None:
        me, every = fleet
        entry["node"] = me
        entry["nodes"] = {n.node_id: n.models[name].state for n in every if name in n.models}
    return entry


def running_elsewhere(
    fleet: tuple[str, list[Node]] | None,
    allowed: Any,
    expires_at: Callable[[float | None, bool], str],
) -> list[dict[str, Any]]:
    """Rows for /api/ps: the models loaded on the other nodes, each with its `node`; `expires_at` writes
    the time keep-alive ends there (None: never) as this node's rows have it."""
    if fleet is None:
        return []
    me, every = fleet
    rows = []
    for node in every:
        if node.node_id == me:
            continue
        for name, state in sorted(node.models.items()):
            if state.state not in _RUNNING or not allowed(name):
                continue
            leased = sum(state.leases.values()) * 2**20
            rows.append(
                {
                    "name": ollama_name(name),
                    "model": ollama_name(name),
                    "size": leased,
                    "size_vram": leased,
                    "state": state.state,
                    "inflight": state.inflight,
                    "replicas": state.replicas,
                    "gpus": sorted(state.leases),
                    "expires_at": expires_at(state.keep_alive_expires_at, state.state == "draining"),
                    "node": node.node_id,
                }
            )
    return rows
