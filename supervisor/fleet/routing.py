"""Where a request is served in a fleet: here, or on one other node (one hop, never two).

Served here when the model has a free place here. Else on the node that has it ready with room (fewest
in flight, then least queued). Else, if it is not up here, on the node that can place it with the least
eviction (free memory first, then idle low-priority models; the weights on disk win a tie), which may be
this one. Everything is read from the fleet view (records at most a few seconds old); without Redis the
view is this node alone, so every request is served here.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog

from supervisor.errors import SupervisorError
from supervisor.fleet import HOP_HEADER as HOP_HEADER
from supervisor.fleet.nodes import Node, best_node_to_load, ready_elsewhere
from supervisor.slots import SlotState

if TYPE_CHECKING:
    from supervisor.api.openai import Checked
    from supervisor.fleet.fleet import Fleet
    from supervisor.scheduler import Scheduler

log = structlog.get_logger("fleet")

_UP_HERE = (SlotState.LOADING, SlotState.READY)


async def elsewhere(fleet: Fleet, scheduler: Scheduler, checked: Checked) -> list[Node]:
    """The nodes to send this request to, best first; [] to serve it here."""
    name = checked.model.name
    if fleet.view is None or not fleet.link.healthy or scheduler.has_room(name):
        return []
    me = fleet.settings.node_id
    nodes = fleet.view.nodes()
    ready = [place.node for place in ready_elsewhere(nodes, name, exclude=me) if place.free_places > 0]
    if ready:
        return ready
    if any(slot.state in _UP_HERE for slot in scheduler.group(name)):
        return []  # up (or coming up) here: wait for a place here rather than load a second copy
    try:
        need = (await scheduler.vram_estimate(checked.model.manifest)).mib
    except SupervisorError:
        return []  # its size is unknown: the local load says why
    best = best_node_to_load(nodes, name, need, checked.scheduling.priority)
    return [] if best is None or best.node_id == me else [best]


def address(node: Node) -> tuple[str, int]:
    """The host and port of a node's advertised URL (http only: nodes talk on a private network)."""
    parts = urlsplit(node.url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"node {node.node_id} advertises {node.url!r}, not an http:// URL")
    return parts.hostname, parts.port or 80


def hop_body(checked: Checked) -> bytes:
    """The body the other node gets: ours with the scheduling fields put back as this node took them (the
    priority already capped to the caller's key, which the other node does not see)."""
    scheduling = checked.scheduling
    extra: dict[str, Any] = {}
    if scheduling.keep_alive is not None:
        extra["keep_alive"] = -1 if math.isinf(scheduling.keep_alive) else scheduling.keep_alive
    if scheduling.priority is not None:
        extra["x_priority"] = scheduling.priority
    if scheduling.client_id is not None:
        extra["x_client_id"] = scheduling.client_id
    if not extra:
        return checked.body
    return json.dumps({**checked.payload, **extra}).encode()
