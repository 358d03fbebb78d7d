"""Where a request is served in a fleet: here, or on one other node (one hop, never two), and how the
routes aiohttp serves (the Ollama API, and an OpenAI request on a connection the front handed over) send
one there.

Served here when the model has a free place here. Else on the node that has it ready with room (fewest
in flight, then least queued). Else, if it is not up here, on the node that can place it with the least
eviction (free memory first, then idle low-priority models; the weights on disk win a tie, then this
node), which may be this one. Everything is read from the fleet view (records at most a few seconds
old); without Redis the view is this node alone, so every request is served here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import structlog
from aiohttp import web

from supervisor import errors
from supervisor.api.context import REQUEST_MODEL, REQUEST_OUTCOME, REQUEST_UPSTREAM, UPSTREAM
from supervisor.errors import SupervisorError
from supervisor.fleet import HOP_HEADER as HOP_HEADER
from supervisor.fleet import NOT_TO_NODE
from supervisor.fleet.forwarded import SHUTTING_DOWN
from supervisor.fleet.nodes import VIEW_REFRESH_S, Node, best_node_to_load, ready_elsewhere
from supervisor.metrics import REQUEST_ERROR, TRACE
from supervisor.slots import SlotState

if TYPE_CHECKING:
    from supervisor.api.openai import Scheduling
    from supervisor.fleet.fleet import Fleet
    from supervisor.scheduler import Scheduler
    from supervisor.slots import ModelSlot

log = structlog.get_logger("fleet")

T = TypeVar("T")

_UP_HERE = (SlotState.LOADING, SlotState.READY)


async def elsewhere(fleet: Fleet, scheduler: Scheduler, model: ModelSlot, priority: int | None) -> list[Node]:
    """The nodes to send a request for `model` to, best first; [] to serve it here."""
    name = model.name
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
        need = (await scheduler.vram_estimate(model.manifest)).mib
    except SupervisorError:
        return []  # its size is unknown: the local load says why
    best = best_node_to_load(nodes, name, need, priority, here=me)
    return [] if best is None or best.node_id == me else [best]


def address(node: Node) -> tuple[str, int]:
    """The host and port of a node's advertised URL (http only: nodes talk on a private network)."""
    parts = urlsplit(node.url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"node {node.node_id} advertises {node.url!r}, not an http:// URL")
    return parts.hostname, parts.port or 80


def hop_body(payload: dict[str, Any], scheduling: Scheduling, body: bytes, model: str) -> bytes:
    """The body the other node gets: `body` (the request's, our fields taken off), with the scheduling
    fields put back as this node took them (the priority already capped to the caller's key, which the
    other node does not see), and the model by its name (an alias, or a name in another case, may be
    known only here)."""
    extra: dict[str, Any] = {}
    if payload.get("model") != model:
        extra["model"] = model
    if scheduling.keep_alive is not None:
        extra["keep_alive"] = -1 if math.isinf(scheduling.keep_alive) else scheduling.keep_alive
    if scheduling.priority is not None:
        extra["x_priority"] = scheduling.priority
    if scheduling.client_id is not None:
        extra["x_client_id"] = scheduling.client_id
    if not extra:
        return body
    return json.dumps({**payload, **extra}).encode()


_NOT_FROM_NODE = frozenset(NOT_TO_NODE | {"date", "server"})

# A node's 401 to a hop refuses the node key, not the client's (checked here, and not sent): the nodes
# were set up with different keys. Passed on, it told a client its good key was wrong.
NODE_KEY_REFUSED = "it refused this node's node_key: every node of a fleet needs the same node_key"


def refused_node_key(node_id: str) -> None:
    """Log a node's 401 to a hop (the request is then served elsewhere, or here)."""
    log.error("forward_refused", node=node_id, reason=NODE_KEY_REFUSED)


class NodeLeft(Exception):
    """The hop ended before the node answered (`watched`'s future was set); the reason as the message."""


@contextlib.asynccontextmanager
async def watched(fleet: Fleet, node_id: str) -> AsyncIterator[asyncio.Future[str]]:
    """A future set (to the reason) once the hop to `node_id` must end, watched for as long as the block
    runs: the node dropped out of the fleet view while Redis answers (hung, paused, cut off: it will
    answer nothing more, and a hop to it must not wait for ever), or this node's shutdown drain ended.
    (While Redis is away the view is this node alone: the other nodes are not taken for gone then.)
    The block counts as a forwarded request in flight, which the shutdown drains."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[str] = loop.create_future()

    async def watch() -> None:
        while not gone.done():
            await asyncio.sleep(VIEW_REFRESH_S)
            view = fleet.view
            if view is not None and view.link.healthy and not view.has(node_id) and not gone.done():
                gone.set_result("left the fleet")

    task = loop.create_task(watch())
    fleet.forwarded.add(gone)
    try:
        yield gone
    finally:
        fleet.forwarded.discard(gone)
        task.cancel()


def _shutting_down(body: bytes) -> bool:
    """Whether a node's 503 body is its `shutting_down` refusal, in the Ollama API's shape."""
    try:
        payload = json.loads(body)
    except ValueError:  # not JSON (nor UTF-8): some other 503
        return False
    return isinstance(payload, dict) and payload.get("error") == errors.shutting_down().message


def ending(stop: Callable[[], object]) -> Callable[[asyncio.Future[str]], None]:
    """`watched`'s callback that stops a hop's answer in flight (closes its connection)."""

    def stop_it(_: asyncio.Future[str]) -> None:
        stop()

    return stop_it


async def unless_gone(gone: asyncio.Future[str], awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or NodeLeft (and `awaitable` cancelled) once `gone` is set first."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    if task.done():
        return task.result()
    raise NodeLeft(gone.result())


async def forward(
    request: web.Request, fleet: Fleet, nodes: list[Node], body: bytes
) -> web.StreamResponse | None:
    """Send a request aiohttp serves (an Ollama one as it came: the other node translates it) to the first
    of `nodes` that takes it, and stream its answer back as it arrives; None when none took it before
    reading it."""
    settings = fleet.settings
    headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_TO_NODE}
    headers[HOP_HEADER] = settings.node_id
    trace = request.get(TRACE)
    if trace is not None:
        headers["X-Request-Id"] = trace.request_id
    if settings.node_key is not None:
        headers["Authorization"] = f"Bearer {settings.node_key.get_secret_value()}"
    session = request.app[UPSTREAM]
    for node in nodes:
        try:
            address(node)  # http only, as the OpenAI routes' forwarding (a record in Redis may say otherwise)
        except ValueError as exc:
            log.warning("forward_skipped", node=node.node_id, error=str(exc))
            continue
        async with watched(fleet, node.node_id) as gone:
            try:
                upstream = await unless_gone(
                    gone,
                    session.post(
                        node.url + request.path_qs, data=body, headers=headers, allow_redirects=False
                    ),
                )
            except aiohttp.ClientConnectorError as exc:
                log.warning("forward_failed", node=node.node_id, error=str(exc), unread=True)
                continue  # it never read the request: the next node, or here
            except aiohttp.ClientError as exc:
                raise errors.upstream_failed(
                    request.get(REQUEST_MODEL, "?"), f"node {node.node_id}: {exc}"
                ) from exc
            except NodeLeft as exc:
                log.warning("forward_failed", node=node.node_id, error=str(exc), unread=False)
                raise errors.upstream_failed(
                    request.get(REQUEST_MODEL, "?"), f"node {node.node_id}: {exc} before answering"
                ) from None
            if upstream.status == 401:
                upstream.release()
                refused_node_key(node.node_id)
                continue
            refusal = None  # a 503's body, read whole (small) to see whether it is `shutting_down`
            if upstream.status == 503:
                try:
                    refusal = await upstream.read()
                except aiohttp.ClientError as exc:
                    upstream.release()
                    raise errors.upstream_failed(
                        request.get(REQUEST_MODEL, "?"), f"node {node.node_id}: {exc}"
                    ) from exc
                if _shutting_down(refusal):
                    upstream.release()
                    log.warning("forward_skipped", node=node.node_id, error="shutting down")
                    continue  # refused before it ran (a rolling restart): the next node, or here
            request[REQUEST_UPSTREAM] = {"node": node.node_id}
            gone.add_done_callback(ending(upstream.close))  # it leaves mid-answer: the answer ends
            async with upstream:
                return await _relay_from_node(request, upstream, node.node_id, gone, refusal)
    return None


# How a streamed answer's records end: Ollama's NDJSON lines, OpenAI's SSE events.
_RECORD_ENDS = {"application/x-ndjson": b"\n", "text/event-stream": b"\n\n"}


async def _relay_from_node(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    node_id: str,
    gone: asyncio.Future[str],
    read: bytes | None = None,
) -> web.StreamResponse:
    """Relay a node's answer as it arrives. An answer the node stops sending (it died, or left the fleet)
    must not end like a whole one: a stream of NDJSON lines ends with an `{"error": ...}` line, and an
    SSE stream with an error event, as a local engine's crash ends them (neither after half a line or
    event); any other answer loses its connection, a transfer error to the client (aiohttp ends a
    returned response cleanly, which a client takes for the whole answer)."""
    answer = web.StreamResponse(
        status=upstream.status,
        headers={k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FROM_NODE},
    )
    await answer.prepare(request)
    if read is not None:  # the body, already read (a 503's): its connection has nothing more
        await answer.write(read)
        await answer.write_eof()
        return answer
    # An NDJSON line or SSE event not ended yet: held back, so that an error never follows half of one.
    end = _RECORD_ENDS.get(upstream.content_type)
    partial = b""
    cut: str | None = None
    try:
        async for piece in upstream.content.iter_any():
            if end is not None:
                whole, ended, partial = (partial + piece).rpartition(end)
                piece = whole + ended
            if piece:
                await answer.write(piece)
    except aiohttp.ClientError as exc:
        if isinstance(exc, ConnectionResetError):
            raise  # our client, not the node, is gone
        cut = repr(exc)
    if gone.done():
        cut = gone.result()  # the connection was closed on purpose: the reason, not the read's error
    if cut is None:
        if partial:
            await answer.write(partial)
        await answer.write_eof()
        return answer
    log.warning("forward_cut", node=node_id, error=cut)
    why = "this node shut down" if cut == SHUTTING_DOWN else f"node {node_id} stopped answering"
    crashed = errors.model_crashed(request.get(REQUEST_MODEL, "?"), f"{why}: the stream was cut short")
    request[REQUEST_OUTCOME], request[REQUEST_ERROR] = crashed.status, crashed.code  # as the relays note it
    if end == b"\n":
        await answer.write(json.dumps({"error": crashed.message}).encode() + b"\n")
        await answer.write_eof()
    elif end is not None:
        await answer.write(crashed.openai_event(request.path))
        await answer.write_eof()
    elif request.transport is not None:
        request.transport.close()
    return answer
