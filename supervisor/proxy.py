"""Move a request to a child (on its Unix socket, or a loopback port) and its response back, as it arrives.

Bytes pass untouched (no decompression, no re-encoding), so SSE events reach the client as the engine
writes them. The client going away cancels the handler, which closes the upstream connection, which is
how llama-server and vLLM learn to stop generating.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from supervisor import embedding_dimensions, errors
from supervisor.metrics import CLIENT_GONE, REQUEST_ERROR, REQUEST_OUTCOME, TRACE, Trace
from workers import sockets
from workers.base import Endpoint

if TYPE_CHECKING:
    from workers.process import ChildProcess

log = structlog.get_logger("proxy")

# RFC 9110 hop-by-hop headers, plus those the proxy itself must set for its own connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# The daemon sets its own request id and timing: the child's (vLLM's --enable-request-id-headers) would
# be a second line of each, which clients join ("a, b").
NOT_FROM_UPSTREAM = HOP_BY_HOP - {"content-length"} | {"date", "server", "x-request-id", "server-timing"}
# An answer of these statuses has no body, whatever its headers say (RFC 9110 15.3.5, 15.4.5).
NO_BODY_STATUSES: Final = frozenset({204, 304})
# CORS is the daemon's to answer (llama-server reflects any Origin): none of the child's reaches a client.
CORS_PREFIX = "access-control-"
# Scheduling headers of ours (see api/openai.py), and the client's credentials (for the daemon, not for
# the child, which gets the daemon's key instead); the engine never sees them.
NOT_TO_UPSTREAM = HOP_BY_HOP | {"x-priority", "x-client-id", "authorization", "x-api-key"}
# Bodies up to this size with a known length are answered in one write, which is faster than streaming.
_SMALL_BODY = 1 << 20


# llama-server (cpp-httplib) drops a connection after 5 s idle; closing ours sooner means a pooled
# connection is never one the child has already given up on.
_UPSTREAM_KEEPALIVE_S = 3.0


class ChildConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector, which also opens the children's Unix sockets: a URL whose host names one
    (Endpoint.url) connects to that socket; any other goes over TCP.

    aiohttp's own UnixConnector serves a single path, so it would take a session per child. This overrides
    the method by which aiohttp's connectors make their connections (as UnixConnector does), in the
    version pyproject.toml pins; the children's tests go through it.
    """

    async def _create_connection(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        path = sockets.socket_named(req.url.raw_host or "")
        if path is None:
            return await super()._create_connection(req, traces, timeout)
        try:
            async with asyncio.timeout(timeout.sock_connect):
                _, protocol = await asyncio.get_running_loop().create_unix_connection(
                    self._factory, str(path)
                )
        except OSError as exc:
            raise aiohttp.ClientConnectorError(req.connection_key, exc) from exc
        return protocol


def new_upstream_session() -> aiohttp.ClientSession:
    """The one session for all upstream traffic: keep-alive pool with no cap, bytes left as they are."""
    connector = ChildConnector(limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        # No total timeout: a generation may run for many minutes; a dead child ends the stream instead.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
    )


def forwarded_headers(request: web.Request) -> CIMultiDict[str]:
    """The client's end-to-end headers, with those named in its Connection header dropped too."""
    # Every Connection line: repeated, they are one list (RFC 9110 5.3), and each names what stays here.
    named = {t.strip().lower() for line in request.headers.getall("Connection", ()) for t in line.split(",")}
    return CIMultiDict(
        (k, v)
        for k, v in request.headers.items()
        if k.lower() not in NOT_TO_UPSTREAM and k.lower() not in named
    )


def response_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The child's end-to-end response headers, without its CORS headers."""
    return CIMultiDict(
        (k, v)
        for k, v in upstream.headers.items()
        if k.lower() not in NOT_FROM_UPSTREAM and not k.lower().startswith(CORS_PREFIX)
    )


# An EOF this soon after sending is a pooled connection closed under us, not a child that read the request.
_STALE_CONNECTION_S = 0.1
# A connection that broke before the response head: worth one more try on a fresh connection.
_CONNECTION_LOST = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientConnectionResetError,
)


class UpstreamGone(Exception):
    """The child stopped answering before a response head came back (see `send`).

    `delivered` is False when the child cannot have read the request (the connection was refused, or reset
    with our bytes unread): sending it again once the model is back is safe. True when the child may have
    read it and died working on it: a crash, never to be retried behind the client's back.
    """

    def __init__(self, cause: aiohttp.ClientError, delivered: bool) -> None:
        super().__init__(errors.connection_failure(_os_error(cause)))
        log.debug("upstream_connection_lost", error=repr(cause))  # what the client's message leaves out
        self.cause = cause
        self.delivered = delivered


def _os_error(exc: aiohttp.ClientError) -> BaseException | None:
    """The system's error under aiohttp's, if any; None for a plain close (EOF)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error
    if isinstance(exc.__cause__, OSError):
        return exc.__cause__
    if isinstance(exc, aiohttp.ClientOSError) and exc.errno is not None:
        return OSError(exc.errno, exc.strerror)  # the subclass for its errno (ECONNRESET: reset)
    return None


class Unreachable(errors.SupervisorError):
    """502 `upstream_error` for a request the child never read: a route may acquire again, once
    (Scheduler.reacquire), and send it to the model once it is back."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__("upstream_error", f"could not reach model '{model}': {reason}", 502, 1)


def _unread(exc: aiohttp.ClientError, after_s: float) -> bool:
    """The connection failed, `after_s` after sending, in a way that says the child never read it."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return True  # refused: nothing was sent
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        # A pooled connection the child closed (dying, or idle) just before our request crossed its FIN.
        # Later than that, the child had the request: its socket would have answered RST, not EOF, had
        # our bytes been unread when it closed.
        return after_s < _STALE_CONNECTION_S
    # A socket closed with unread data answers RST: our request was still in the child's buffer.
    # A plain close (EOF, ServerDisconnectedError) means the child had read it.
    if isinstance(exc, aiohttp.ClientConnectionResetError):
        return True  # the transport was already closing when we came to write: nothing went out
    if isinstance(exc.__cause__, ConnectionResetError | BrokenPipeError):
        # "Can not write request body": the child never got the whole request, so it cannot have acted
        # on it. Seen on a child's Unix socket, whose close a write finds at once.
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)


async def send(
    session: aiohttp.ClientSession, method: str, url: str, body: bytes, headers: CIMultiDict[str]
) -> aiohttp.ClientResponse:
    """The upstream response's head; one retry when a pooled connection turns out to be closed.

    A keep-alive connection can be closed by the child while the request is on its way. The child never
    read it, so sending again on a fresh connection is safe and the client never sees the race. A
    connection lost once the child may have read the request is not retried (a child still up would run
    it twice), nor is a refused one: the child is gone. When the child is gone this raises UpstreamGone,
    which says whether the child may have read the request; other errors pass as they are.
    A redirect is the child's answer, passed on as the front passes it: never followed, so the daemon
    never sends a request anywhere but to the child.
    """
    sent = monotonic()
    try:
        return await session.request(method, url, data=body, headers=headers, allow_redirects=False)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamGone(exc, delivered=False) from exc
    except _CONNECTION_LOST as exc:
        after_s = monotonic() - sent
        if not _unread(exc, after_s):
            raise UpstreamGone(exc, delivered=True) from exc
        log.debug("upstream_retry", url=url, error=repr(exc), after_s=round(after_s, 3))
    try:
        return await session.request(method, url, data=body, headers=headers, allow_redirects=False)
    except _CONNECTION_LOST as exc:
        # Refused or cut again on a fresh connection: the child is gone, not just one connection. A
        # close on a fresh connection is never the pool's stale one: the child had the request.
        raise UpstreamGone(exc, delivered=not _unread(exc, math.inf)) from exc


async def open_upstream(
    session: aiohttp.ClientSession,
    method: str,
    endpoint: Endpoint,
    path_qs: str,
    body: bytes,
    headers: CIMultiDict[str],
    model: str,
    stream: bool,
    *,
    api_key: str | None,
    request_id: str | None = None,
) -> aiohttp.ClientResponse:
    """The child's response head; `Unreachable` (502) when the child never read the request, 503
    `model_crashed` when it died with the request in hand, 502 `upstream_error` for anything else.

    `api_key` is the child's own key (ModelSlot.api_key), sent as a bearer token; `request_id` goes as
    `X-Request-Id`, so that the child's logs can be matched with ours.

    llama-server closes the connection after a streamed answer while still advertising keep-alive, so a
    streamed request asks for `Connection: close` and its connection never goes back to the pool.
    """
    headers = CIMultiDict(headers)
    if body:
        headers["Content-Type"] = "application/json"  # every body a child gets is JSON the daemon read
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    if stream:
        headers["Connection"] = "close"
    try:
        return await send(session, method, endpoint.url + path_qs, body, headers)
    except UpstreamGone as exc:
        if exc.delivered:
            raise errors.model_crashed(model, f"it closed the connection before answering: {exc}") from exc
        raise Unreachable(model, str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise errors.upstream_failed(model, str(exc) or type(exc).__name__) from exc


async def forward(
    session: aiohttp.ClientSession,
    request: web.Request,
    endpoint: Endpoint,
    body: bytes,
    model: str,
    stream: bool,
    if_missing: errors.SupervisorError | None = None,
    *,
    api_key: str | None,
    timeout_s: float | None = None,
    dimensions: int | None = None,
    child: ChildProcess | None = None,
) -> web.StreamResponse:
    """Send `body` to the child (`child`, when it is ours) and stream its answer back to `request`'s
    client.

    `stream` says the client asked for SSE. `if_missing` is raised instead of passing on the child's
    404, for routes not every engine serves. `dimensions` shortens a whole embeddings answer's vectors.
    `timeout_s` (a manifest's request_timeout_s) ends a generation that runs longer: leaving
    `async with upstream` closes the connection, which stops it.

    The request's Trace (when the middleware made one) gets the first chunk's time and the engine's
    token counts, found only where they are cheap to find: the end of the body (see `engine_counts`).
    """
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    trace: Trace | None = request.get(TRACE)
    sent = perf_counter()
    try:
        async with asyncio.timeout_at(deadline):
            upstream = await open_upstream(
                session,
                request.method,
                endpoint,
                request.path_qs,
                body,
                forwarded_headers(request),
                model,
                stream,
                api_key=api_key,
                request_id=None if trace is None else trace.request_id,
            )
    except TimeoutError:
        raise errors.generation_timeout(model, timeout_s or 0) from None
    async with upstream:
        if upstream.status == 404 and if_missing is not None:
            raise if_missing
        headers = response_headers(upstream)
        length = upstream.content_length
        if dimensions is not None and upstream.status == 200 and not whole_length(length, dimensions):
            raise not_shortened(model, length)
        if whole_length(length, dimensions):
            try:
                async with asyncio.timeout_at(deadline):
                    payload = await upstream.read()
            except aiohttp.ClientError as exc:
                raise errors.cut_short(model, child, "the answer was cut short") from exc
            except TimeoutError:
                raise errors.generation_timeout(model, timeout_s or 0) from None
            if trace is not None and upstream.status == 200:
                count(trace, payload, sent, whole=True, embeddings=request.path == "/v1/embeddings")
            if dimensions is None:
                status, payload, refused = whole_answer(upstream.status, payload)
            else:
                status, payload, refused = await whole_answer_of(upstream.status, payload, dimensions)
            if refused is not None:
                request[REQUEST_ERROR] = refused
            reason = upstream.reason if status == upstream.status else None
            # The child's length no longer holds for a body changed above: aiohttp sends a Content-Length
            # given over the body's own, and the rest reads as the connection's next answer.
            headers.popall("Content-Length", None)
            return web.Response(status=status, reason=reason, body=payload, headers=headers)

        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        sse = upstream.content_type == "text/event-stream"
        whole = True  # an answer that is not SSE has no error event: cut short, it ends without its end
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    tail = await _relay(upstream, response, model, sse, trace, child, request.path)
                if tail is None:  # cut by the child's death: counted as the error the client saw
                    crashed = errors.cut_short(model, child, "")
                    request[REQUEST_OUTCOME], request[REQUEST_ERROR] = crashed.status, crashed.code
                    whole = sse
                elif trace is not None and upstream.status == 200:
                    count(trace, tail, sent, whole=False)
            except TimeoutError:
                log.warning("generation_timeout", model=model, limit_s=timeout_s)
                timed_out = errors.generation_timeout(model, timeout_s or 0)
                request[REQUEST_OUTCOME], request[REQUEST_ERROR] = timed_out.status, timed_out.code
                if sse:
                    await response.write(timed_out.openai_event(request.path))
                whole = sse
            if whole:
                await response.write_eof()
            elif request.transport is not None:
                # No end of the chunked body, and the connection closed once what was written is out:
                # the client's HTTP library reports a body cut short, not the part as the whole (as nginx
                # ends an answer its upstream cut). aiohttp's own write_eof then finds it closing.
                request.transport.close()
        except ConnectionResetError:
            # Our client went away (aiohttp's ClientConnectionResetError on write), usually noticed first
            # as the handler's cancellation. Leaving closes the upstream connection, which stops the engine.
            log.debug("client_gone", model=model)
            request[REQUEST_OUTCOME] = CLIENT_GONE
        return response


# An unfinished SSE event held back, at most (see events_end).
_HELD_MAX: Final = 1 << 16


def events_end(piece: bytes) -> int:
    """Where the last whole SSE event of `piece` ends: what may go to the client now, the rest held until
    its end comes (a client cannot use half an event, and a child that dies mid-event must not leave one
    glued to the error event that ends the stream). All of it past _HELD_MAX with no end in sight."""
    lf, crlf = piece.rfind(b"\n\n"), piece.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return len(piece) if end == 0 and len(piece) >= _HELD_MAX else end


async def _relay(
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    model: str,
    sse: bool,
    trace: Trace | None,
    child: ChildProcess | None = None,
    path: str = "",
) -> bytes | None:
    """Copy the child's body to the client chunk by chunk, as it arrives; return its last three chunks
    (where a stream's final usage is), or None when the child died mid-stream.

    The first chunk's arrival is the trace's first token. Nothing else is looked at per chunk.
    """
    older = old = last = b""
    held = b""  # an SSE event's start, until its end comes (events_end); dropped if it never does
    waiting = trace  # the trace, until the first chunk has come
    while True:
        try:
            chunk = await upstream.content.readany()
        except aiohttp.ClientError as exc:
            # The child died mid-stream: end the stream with an error the client can see, not a hang.
            log.warning("upstream_cut", model=model, error=repr(exc))
            if sse:
                await response.write(
                    errors.cut_short(model, child, "the stream was cut short").openai_event(path)
                )
            return None
        if not chunk:
            if held:
                await response.write(held)  # the stream ended: what the child wrote last goes out
            return older + old + last
        if waiting is not None:
            waiting.first_token = perf_counter()
            waiting = None
        older, old, last = old, last, chunk
        if sse:
            piece = held + chunk if held else chunk
            end = len(piece) if piece.endswith(b"\n\n") else events_end(piece)
            chunk, held = piece[:end], piece[end:]
            if not chunk:
                continue
        # A client that went away makes this raise, which closes the upstream connection too.
        await response.write(chunk)


# llama-server answers some refusals of the request itself as a 500 server_error: an input to embed longer
# than its batch, a modality the model lacks (audio). A 500 makes OpenAI clients retry it (and report a
# server fault): these are the client's to fix, so they are passed on as 400 with the engine's message.
_CLIENT_FAULTS: Final = (
    (b"too large to process", "context_length_exceeded"),
    (b"input is not supported", "modality_unsupported"),
    (b"Unknown reasoning format", "invalid_request"),  # reasoning_format: a string it does not know
    (b"[json.exception.type_error", "invalid_request"),  # a field of a type it cannot read
)


# The largest embeddings answer the daemon reads whole to shorten its vectors to `dimensions`.
SHORTENED_LIMIT: Final = 64 << 20


def whole_length(length: int | None, dimensions: int | None) -> bool:
    """Whether an answer of this Content-Length is read whole before it is sent (in one write); with
    `dimensions`, up to SHORTENED_LIMIT, so that its vectors can be shortened."""
    return length is not None and (
        length <= _SMALL_BODY or (dimensions is not None and length <= SHORTENED_LIMIT)
    )


def not_shortened(model: str, length: int | None) -> errors.SupervisorError:
    """The refusal of an embeddings answer too large (or of no stated length) to shorten to `dimensions`:
    passed on, it would hold vectors of another length than the client asked for."""
    size = "of no stated length" if length is None else f"of {length >> 20} MiB"
    return errors.SupervisorError(
        "answer_too_large",
        f"dimensions: model '{model}' answered with embeddings {size}, more than the "
        f"{SHORTENED_LIMIT >> 20} MiB the daemon shortens; send fewer inputs per request",
        400,
    )


async def whole_answer_of(status: int, payload: bytes, dimensions: int) -> tuple[int, bytes, str | None]:
    """`whole_answer` for an answer whose vectors may need shortening to `dimensions` (llama-server
    ignores the field): a large one in steps, which give the event loop its turns."""
    if status == 200:
        if len(payload) > embedding_dimensions.STEPPED_FROM:
            shortened = await embedding_dimensions.shortened_in_steps(payload, dimensions)
        else:
            shortened = embedding_dimensions.shortened_answer(payload, dimensions)
        made = embedding_dimensions.first_vector_length(payload) if shortened is None else None
        if made is not None and made < dimensions:
            # Vectors cannot be made longer: a 200 with shorter ones than asked for surprised a client
            # that sized its storage by the request. OpenAI and vLLM refuse it.
            raise errors.bad_request(
                f"dimensions: the model's vectors have {made} values; ask for at most {made}"
            )
        return status, shortened or payload, None
    return whole_answer(status, payload)


def whole_answer(status: int, payload: bytes) -> tuple[int, bytes, str | None]:
    """An engine's whole answer as the client gets it, on either relay: a 500 that refused the request
    itself as the 400 it is (`client_fault`), and an engine's own 4xx in OpenAI's shape
    (`engine_refusal`); with the error code for the access log (else None)."""
    if status == 500 and (fault := client_fault(payload)) is not None:
        code, body = fault
        return 400, body, code
    elif 400 <= status < 500 and (refusal := engine_refusal(status, payload)) is not None:
        code, body = refusal
        return status, body, code
    return status, payload, None


# What an engine's 4xx says when the prompt is longer than the context: llama-server's error type, vLLM's
# message.
_CONTEXT_EXCEEDED: Final = ("exceed_context_size_error", "maximum context length")


def engine_refusal(status: int, payload: bytes) -> tuple[str, bytes] | None:
    """An engine's own 4xx in OpenAI's error shape, with its error code; None when it is not JSON with a
    message (passed on as it came). llama-server writes `code` as the status (an integer) and has no
    `param`, and vLLM's older versions put the error at the top level: OpenAI's SDKs read a string code
    (`context_length_exceeded`, which apps catch to shorten a chat) and a param."""
    try:
        answer = json.loads(payload)
    except ValueError:
        return None
    error = answer.get("error", answer) if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(error, dict) or not isinstance(message, str):
        return None
    kind, given = error.get("type"), error.get("code")
    if kind in _CONTEXT_EXCEEDED or _CONTEXT_EXCEEDED[1] in message:
        code = "context_length_exceeded"
    else:
        code = given if isinstance(given, str) and given else "engine_error"
    param = error.get("param")
    body = {
        **error,  # what else the engine says: llama-server's n_ctx and n_prompt_tokens, which its UI reads
        "message": message,
        "type": errors.openai_type(status),
        "param": param if isinstance(param, str) else None,
        "code": code,
    }
    return code, json.dumps({"error": body}).encode()


def client_fault_code(payload: bytes) -> str | None:
    """The error code of an engine's 500 (its body, or its message) that refused the request itself."""
    return next((code for marker, code in _CLIENT_FAULTS if marker in payload), None)


def client_fault(payload: bytes) -> tuple[str, bytes] | None:
    """The error code and 400 body (OpenAI's shape) for an engine's 500 that refused the request itself;
    else None."""
    code = client_fault_code(payload)
    if code is None:
        return None
    try:
        message = json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(message, str):
        return None
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return code, json.dumps({"error": error}).encode()


# How much of a whole answer's ends is searched for `usage` and `timings` (engines put them last; some
# put an embedding's usage first), and how far into either object a count is looked for.
# Final: compiled, each is a constant, not a lookup in the module's dict.
_TAIL: Final = 4096
_HEAD: Final = 1024
_OBJECT_SPAN: Final = 1024
_COLON: Final = 58  # ":"
_BRACE: Final = 123  # "{"
_EXACT_DIGITS: Final = 15  # a run of up to 15 digits is a float exactly: float() would read it the same
_INFINITY: Final = float("inf")


def _object_start(data: bytes, key: bytes, start: int, end: int, last: bool = True) -> int:
    """Where the JSON object that the last (or first) `key` in `data[start:end]` holds begins, or -1 (no
    such key, or null)."""
    at = data.rfind(key, start, end) if last else data.find(key, start, end)
    if at < 0:
        return -1
    at = _value_at(data, at + len(key))
    return at if at < len(data) and data[at] == _BRACE else -1  # -1 for "usage": null, as vLLM streams say


def _value_at(data: bytes, at: int) -> int:
    """Where the value after a key that ends before `at` begins: past the colon and the spaces around it;
    len(data) when there is no colon. Read byte by byte: a call to a bytes method costs more than the walk."""
    at = _past_spaces(data, at)
    if at >= len(data) or data[at] != _COLON:
        return len(data)
    return _past_spaces(data, at + 1)


def _number_in(data: bytes, start: int, key: bytes) -> float | None:
    """The number `key` holds in the object that begins at `start`, or None (no object, no such key within
    _OBJECT_SPAN bytes, null, not a finite number).

    Read by name, not decoded: llama-server's `timings` are a dozen 17-digit floats, which cost the JSON
    decoder more than the rest of the answer's relay, and three numbers are wanted. `key` is a quoted
    name: inside a JSON string every quote is escaped, so text that merely mentions it cannot match.
    A token count (a short run of digits) is added up as it is read; anything else is float()'s to read.
    """
    if start < 0:
        return None
    at = data.find(key, start, start + _OBJECT_SPAN)
    if at < 0:
        return None
    begin = end = _value_at(data, at + len(key))
    size = len(data)
    digits = 0
    stop = min(size, begin + _EXACT_DIGITS)  # past that, float() reads the run: no long integer built
    while end < stop and 48 <= data[end] <= 57:
        digits = digits * 10 + data[end] - 48
        end += 1
    if begin < end and (end == size or not _in_number(data[end])):
        return float(digits)
    while end < size and _in_number(data[end]):
        end += 1
    try:
        number = float(data[begin:end])
    except ValueError:  # null, -Infinity, NaN, a string
        return None
    return number if -_INFINITY < number < _INFINITY else None  # not NaN, not infinite


def _past_spaces(data: bytes, at: int) -> int:
    while at < len(data) and data[at] in b" \t\r\n":
        at += 1
    return at


def _in_number(byte: int) -> bool:
    """A byte of a JSON number: digits, sign, point, exponent."""
    return 48 <= byte <= 57 or byte in b"+-.eE"


def engine_counts(data: bytes, since: int = 0) -> tuple[int | None, int | None, float | None, float | None]:
    """(prompt tokens, output tokens, tokens/s, generation ms) from the last `usage` and llama-server
    `timings` objects in `data` from `since` on: OpenAI's chat/completions/embeddings usage or the
    Responses API's. A `usage` not there is looked for in the first _HEAD bytes too, where some engines
    put an embedding's. The rate is the output over the generation time, as llama-server's own
    `predicted_per_second` is."""
    usage = _object_start(data, b'"usage"', since, len(data))
    if usage < 0 and since > 0:
        usage = _object_start(data, b'"usage"', 0, min(_HEAD, since))
    timings = _object_start(data, b'"timings"', since, len(data))
    prompt = _number_in(data, usage, b'"prompt_tokens"')
    if prompt is None:
        prompt = _number_in(data, usage, b'"input_tokens"')
    if prompt is None:
        # llama-server's timings count what it computed (`prompt_n`) apart from what its cache served
        # (`cache_n`): its usage, and so the counter, count both. A stream that asked for no usage has
        # only these, and counted 1 token for a prompt of 26 that the cache held.
        prompt = _number_in(data, timings, b'"prompt_n"')
        cached = _number_in(data, timings, b'"cache_n"')
        if prompt is not None and cached is not None:
            prompt += cached
    output = _number_in(data, usage, b'"completion_tokens"')
    if output is None:
        output = _number_in(data, usage, b'"output_tokens"')
    if output is None:
        output = _number_in(data, timings, b'"predicted_n"')
    generating_ms = _number_in(data, timings, b'"predicted_ms"')
    rate = output * 1000 / generating_ms if output and generating_ms else None
    return (
        None if prompt is None else int(prompt),
        None if output is None else int(output),
        rate,
        generating_ms,
    )


def embedding_prompt_tokens(data: bytes) -> int | None:
    """The prompt tokens of an embeddings list, from its one `usage`: before the vectors (llama-server) or
    after them (vLLM, OpenAI), looked for in that order. An embedding has no output and no timings, and
    looking for them meant reading past every vector for names that are not there."""
    usage = _object_start(data, b'"usage"', 0, _HEAD, last=False)
    if usage < 0:
        usage = _object_start(data, b'"usage"', max(0, len(data) - _TAIL), len(data))
    prompt = _number_in(data, usage, b'"prompt_tokens"')
    return None if prompt is None else int(prompt)


def count(trace: Trace, data: bytes, sent: float, whole: bool, embeddings: bool = False) -> None:
    """Give the trace what the engine said about the answer that just ended (`embeddings`: a whole
    embeddings list). For a whole answer the first token is when generation began (its end minus
    llama-server's predicted_ms), if it says."""
    end = perf_counter()
    if embeddings:
        trace.counted(embedding_prompt_tokens(data), None, None, end)
        return
    prompt, output, rate, generating_ms = engine_counts(data, max(0, len(data) - _TAIL) if whole else 0)
    if whole and generating_ms is not None:
        trace.first_token = max(sent, end - generating_ms / 1000)
    if whole and trace.first_token is None and output:
        rate = rate or output / max(end - sent, 1e-6)  # no timings: from sending, prompt time included
    trace.counted(prompt, output, rate, end)
