"""The OpenAI inference routes as the front serves them: admission as the aiohttp route does it
(api/openai.check, then acquire), then the child's answer relayed through an upstream exchange.

A whole answer (a known length of at most 1 MiB) is read to its end and sent in one write; anything else
is streamed: what one read of the child's socket holds leaves as one chunk, from the socket callback
that read it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Final, TypeVar

import structlog

from supervisor import errors, proxy
from supervisor.api import openai
from supervisor.api.context import FLEET, REQUEST_MODEL, REQUEST_UPSTREAM, SCHEDULER
from supervisor.config import Settings
from supervisor.dataplane.front import FastRequest, FrontConnection, _as_web
from supervisor.dataplane.upstream import Exchange, UpstreamCut, UpstreamLost
from supervisor.fleet import HOP_HEADER, NOT_TO_NODE
from supervisor.metrics import REQUEST_ERROR
from supervisor.scheduler import Ticket

if TYPE_CHECKING:
    from supervisor.fleet.fleet import Fleet
    from supervisor.fleet.nodes import Node
    from workers.process import ChildProcess

log = structlog.get_logger("proxy")
T = TypeVar("T")

_SMALL_BODY: Final = 1 << 20
# The client's headers the child never sees: hop-by-hop ones, our scheduling headers, the client's key,
# and its Content-Type: the child is told the body is the JSON the daemon read (a client's multipart or
# text/plain label made it refuse a body the daemon had accepted, with an empty 400).
_NOT_TO_CHILD: Final = frozenset(name.encode() for name in proxy.NOT_TO_UPSTREAM) | {
    b"x-request-id",
    b"content-type",
}
_NOT_FROM_UPSTREAM: Final = frozenset(name.encode() for name in proxy.NOT_FROM_UPSTREAM) | {b"content-length"}
_CORS: Final = proxy.CORS_PREFIX.encode()
_NOT_TO_NODE: Final = frozenset(name.encode() for name in NOT_TO_NODE)


async def serve(front: FrontConnection, request: FastRequest, body: bytes) -> int:
    """Answer one inference request, here or (in a fleet) on the node that can serve it best; the
    status it was answered with."""
    as_web = _as_web(request)
    checked = await openai.check(as_web, body)
    fleet = request.app.get(FLEET)
    if fleet is not None and HOP_HEADER not in request.headers:
        from supervisor.fleet import routing  # with the fleet's modules: only in a fleet

        nodes = await routing.elsewhere(
            fleet, request.app[SCHEDULER], checked.model, checked.scheduling.priority
        )
        if nodes:
            forwarded = await _forward(front, request, checked, nodes, fleet)
            if forwarded is not None:
                return forwarded
    admitted = await openai.acquire(as_web, checked)
    ticket = admitted.ticket
    dimensions = openai.requested_dimensions(request.path, checked.payload)
    try:
        ticket, status = await openai.send_to_child(
            as_web, ticket, lambda t: _relay(front, request, t, admitted.body, admitted.stream, dimensions)
        )
        return status
    finally:
        ticket.release()


def upstream_request(request: FastRequest, ticket: Ticket, body: bytes, stream: bool) -> bytes:
    """The request as the child gets it: the client's end-to-end headers as sent, the child's own key,
    our request id, and `Connection: close` for a stream (see upstream.py)."""
    dropped = _NOT_TO_CHILD
    if "Connection" in request.headers:  # and the headers each Connection line names (one list)
        named = (value for lowered, _, value in request.raw if lowered == b"connection")
        dropped = dropped | {t.strip().lower() for value in named for t in value.split(b",")}
    # In pieces, joined once (as FrontConnection._head).
    head = [b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (request.path_qs.encode(), ticket.endpoint.host.encode())]
    for lowered, name, value in request.raw:
        if lowered not in dropped:
            head += (name, b": ", value, b"\r\n")
    if ticket.api_key:
        head += (b"Authorization: Bearer ", ticket.api_key.encode(), b"\r\n")
    head += (b"X-Request-Id: ", request.trace.request_id.encode(), b"\r\nContent-Type: application/json\r\n")
    if stream:
        head.append(b"Connection: close\r\n")
    head += (b"Content-Length: %d\r\n\r\n" % len(body), body)
    return b"".join(head)


def _answer_headers(exchange: Exchange) -> list[tuple[bytes, bytes]]:
    """The end-to-end headers of the answer (a child's or another node's), without those this node sets
    itself."""
    return [
        (name, value)
        for lowered, name, value in exchange.headers
        if lowered not in _NOT_FROM_UPSTREAM and not lowered.startswith(_CORS)
    ]


async def _forward(
    front: FrontConnection,
    request: FastRequest,
    checked: openai.Checked,
    nodes: list[Node],
    fleet: Fleet,
) -> int | None:
    """Send the request to the first of `nodes` that takes it and relay the answer; None when none took
    it before reading it (a node gone since the view was read): then it is served here."""
    from supervisor.fleet import routing

    model = checked.model.name
    body = routing.hop_body(checked.payload, checked.scheduling, checked.body, model)
    settings = fleet.settings
    for node in nodes:
        try:
            host, port = routing.address(node)
        except ValueError as exc:
            log.warning("forward_skipped", node=node.node_id, error=str(exc))
            continue
        data = _hop_request(request, body, host, port, settings)
        status = await _hop(front, request, node, (host, port), data, model, fleet)
        if status is not None:
            return status
    return None


async def _hop(
    front: FrontConnection,
    request: FastRequest,
    node: Node,
    address: tuple[str, int],
    data: bytes,
    model: str,
    fleet: Fleet,
) -> int | None:
    """One node's answer to the forwarded request relayed, its status; None when the node never read it.
    A node that drops out of the fleet view (hung, cut off) before its answer has ended ends the hop."""
    from supervisor.fleet import routing

    sent = perf_counter()
    async with routing.watched(fleet, node.node_id) as gone:
        try:
            exchange = await routing.unless_gone(gone, front.server.pool.exchange(address, data))
        except UpstreamLost as exc:
            log.warning("forward_failed", node=node.node_id, error=str(exc), unread=exc.unread)
            if exc.unread:
                return None  # it never read the request: the next node, or here
            raise errors.upstream_failed(
                model, f"node {node.node_id} closed the connection before answering"
            ) from exc
        except routing.NodeLeft as left:  # not `exc`: compiled, one name holds one type (UpstreamLost's)
            log.warning("forward_failed", node=node.node_id, error=str(left), unread=False)
            raise errors.upstream_failed(model, f"node {node.node_id}: {left} before answering") from None
        if exchange.status == 401:
            exchange.abort()
            routing.refused_node_key(node.node_id)
            return None
        if await _shutting_down(exchange):
            log.warning("forward_skipped", node=node.node_id, error="shutting down")
            return None  # refused before it ran: the next node, or here
        request[REQUEST_MODEL] = model
        request[REQUEST_UPSTREAM] = {"node": node.node_id}
        # It leaves mid-answer, or our shutdown's drain ends: the answer ends.
        gone.add_done_callback(_cut_when_gone(exchange))
        return await _answer(front, request, exchange, model, None, None, None, sent)


def _cut_when_gone(exchange: Exchange) -> Callable[[asyncio.Future[str]], None]:
    """`watched`'s callback for a hop whose head is in: the answer ends as cut (`_answer` ends a stream
    with its error event). Aborting alone detaches the exchange, whose end then never came: the
    stream hung until the client left."""

    def cut(gone: asyncio.Future[str]) -> None:
        if not exchange.done.done():
            exchange.done.set_exception(UpstreamCut(gone.result()))
        exchange.abort()

    return cut


async def _shutting_down(exchange: Exchange) -> bool:
    """Whether a node's answer is its `shutting_down` refusal (a rolling restart: it drains and takes
    nothing new). Read whole when it is a small 503; `_answer` relays it as it is otherwise."""
    length = exchange.content_length
    if exchange.status != 503 or length is None or length > _SMALL_BODY:
        return False
    try:
        await exchange.done
    except UpstreamCut:
        return False
    return b'"shutting_down"' in exchange.body()


def _hop_request(request: FastRequest, body: bytes, host: str, port: int, settings: Settings) -> bytes:
    """The request as another node gets it: the client's end-to-end and scheduling headers, this node's
    name (so it is never forwarded again), and the node key instead of the client's (checked here)."""
    head = bytearray(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\n" % (request.path_qs.encode(), host.encode(), port))
    for lowered, name, value in request.raw:
        if lowered not in _NOT_TO_NODE:
            head += name + b": " + value + b"\r\n"
    if settings.node_key is not None:
        head += b"Authorization: Bearer " + settings.node_key.get_secret_value().encode() + b"\r\n"
    head += HOP_HEADER.encode() + b": " + settings.node_id.encode() + b"\r\n"
    head += b"X-Request-Id: " + request.trace.request_id.encode() + b"\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    return bytes(head + body)


async def _relay(
    front: FrontConnection,
    request: FastRequest,
    ticket: Ticket,
    body: bytes,
    stream: bool,
    dimensions: int | None = None,
) -> int:
    as_web = _as_web(request)
    openai.note_ticket(as_web, ticket)
    manifest = ticket.slot.manifest
    model = ticket.slot.name
    timeout_s = openai.generation_limit_s(request.path, manifest)
    pool = front.server.pool
    deadline = None if timeout_s is None else pool.loop.time() + timeout_s
    address = ticket.endpoint.address
    sent = perf_counter()
    try:
        exchange = await _within(
            deadline, pool.exchange(address, upstream_request(request, ticket, body, stream), fresh=stream)
        )
    except TimeoutError:
        raise errors.generation_timeout(model, timeout_s or 0) from None
    except UpstreamLost as exc:
        if exc.unread:
            raise proxy.Unreachable(model, str(exc)) from exc
        raise errors.model_crashed(model, f"it closed the connection before answering: {exc}") from exc
    if stream:
        pool.warm(address)  # the child closes this one at the end: have the next one ready
    missing = openai.if_missing(request.path, manifest)
    return await _answer(
        front,
        request,
        exchange,
        model,
        missing,
        deadline,
        timeout_s,
        sent,
        dimensions=dimensions,
        child=ticket.process,
    )


async def _answer(
    front: FrontConnection,
    request: FastRequest,
    exchange: Exchange,
    model: str,
    missing: errors.SupervisorError | None,
    deadline: float | None,
    timeout_s: float | None,
    sent: float,
    dimensions: int | None = None,
    child: ChildProcess | None = None,
) -> int:
    """Relay the answer whose head is in: whole, or streamed piece by piece; the status. Embeddings are
    shortened to `dimensions`. `child`: the engine that answers (None for another node's answer)."""
    try:
        if exchange.status == 404 and missing is not None:
            raise missing
        headers = _answer_headers(exchange)
        length = exchange.content_length
        if length is None and exchange.status in proxy.NO_BODY_STATUSES:
            length = 0  # answered whole, with no body: relayed chunked, its `0` chunk led the next answer
        trace = request.trace
        if dimensions is not None and exchange.status == 200 and not proxy.whole_length(length, dimensions):
            raise proxy.not_shortened(model, length)
        if length is not None and (length <= _SMALL_BODY or proxy.whole_length(length, dimensions)):
            try:
                await _within(deadline, exchange.done)
            except UpstreamCut as exc:
                raise errors.cut_short(model, child, "the answer was cut short") from exc
            except TimeoutError:
                raise errors.generation_timeout(model, timeout_s or 0) from None
            payload = exchange.body()
            if exchange.status == 200:
                proxy.count(trace, payload, sent, whole=True, embeddings=request.path == "/v1/embeddings")
            if dimensions is None:
                status, payload, refused = proxy.whole_answer(exchange.status, payload)
            else:
                status, payload, refused = await proxy.whole_answer_of(exchange.status, payload, dimensions)
            if refused is not None:
                request[REQUEST_ERROR] = refused
            front.respond(
                request, status, exchange.reason if status == exchange.status else b"", headers, payload
            )
            return status

        sse = exchange.media_type == b"text/event-stream"
        front.start_stream(request, exchange.status, exchange.reason, headers)
        front.relay_from(exchange)
        exchange.attach(front.write_events if sse else front.write_chunk)
        # What the access log and the counters say: the head's status, or the error that ended the stream.
        outcome = exchange.status
        whole = True  # an answer that is not SSE has no error event: cut short, it ends without its end
        try:
            await _within(deadline, exchange.done)
            front.flush_events()
            if exchange.status == 200:
                proxy.count(trace, exchange.tail(), sent, whole=False)
        except UpstreamCut as exc:
            # The child died mid-stream: end the stream with an error the client can see, not a hang.
            log.warning("upstream_cut", model=model, error=str(exc))
            front.drop_partial_event()
            crashed = errors.cut_short(model, child, "the stream was cut short")
            outcome = crashed.status
            request[REQUEST_ERROR] = crashed.code
            if sse:
                front.write_chunk(crashed.openai_event(request.path))
            whole = sse
        except TimeoutError:
            log.warning("generation_timeout", model=model, limit_s=timeout_s)
            front.drop_partial_event()
            timed_out = errors.generation_timeout(model, timeout_s or 0)
            outcome = timed_out.status
            request[REQUEST_ERROR] = timed_out.code
            if sse:
                front.write_chunk(timed_out.openai_event(request.path))
            whole = sse
        finally:
            trace.first_token = exchange.first_piece_at  # the first token came, however the stream ended
        front.end_stream(request, outcome, whole)
        return outcome
    finally:
        front.exchange = None
        exchange.abort()  # nothing when the answer has ended; else the child stops generating


def _within(deadline: float | None, awaitable: Awaitable[T]) -> Awaitable[T]:
    """`awaitable`, by `deadline` (TimeoutError after it); with no deadline (the usual case) `awaitable`
    itself: a timeout costs a task lookup and a timer handle per use, and a coroutine around it one more
    frame for every await."""
    return awaitable if deadline is None else _by(deadline, awaitable)


async def _by(deadline: float, awaitable: Awaitable[T]) -> T:
    async with asyncio.timeout_at(deadline):
        return await awaitable
