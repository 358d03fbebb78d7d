"""The daemon's listening socket: the OpenAI inference routes are served here, on plain asyncio protocols;
every other request hands its connection to the aiohttp application.

Why: the aiohttp server and client cost about a millisecond of CPU per proxied request on a small machine,
more than a tiny model's whole answer takes (issue 15's figures). Here a request costs one parse of its
head (httptools), the checks every route makes (the same functions the aiohttp middleware calls), the
scheduler's ticket and one write each way; a streamed chunk costs a socket read and a socket write.

What is served here: POST to the OpenAI inference routes (api/openai.py INFERENCE_PATHS: chat,
completions, embeddings, responses, rerank), in HTTP/1.1 with a Content-Length body. Other HTTP/1.1
requests (other routes; chunked or `Expect: 100-continue` uploads) are tunnelled: sent to the aiohttp
app's internal listener, the connection staying the front's. The Ollama API, HTTP/1.0, HEAD and
upgrades go to aiohttp with the bytes read so far, at a request boundary; from then on that connection
is aiohttp's. A client that pipelines one of those behind a request served here gets the first answered
and the connection closed (RFC 9112 9.3.2: it sends the rest again). CONNECT gets a 405 and the
connection closed.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import re
import resource
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from time import time as wall_time
from typing import Any, Final, cast

import httptools
import structlog
from aiohttp import web
from yarl import URL

from supervisor import logs
from supervisor.access import Caller
from supervisor.api.context import ACCESS, METRICS
from supervisor.api.gate import (
    CLIENT_GONE,
    admit_body,
    body_too_large,
    check_origin_and_host,
    cors_allow,
    error_parts,
    identify_caller,
    log_answer,
    request_id_from,
)
from supervisor.api.openai import INFERENCE_PATHS
from supervisor.dataplane import handoff
from supervisor.dataplane.upstream import Address, Exchange, UpstreamCut, UpstreamLost, UpstreamPool
from supervisor.errors import SupervisorError, shutting_down
from supervisor.metrics import REQUEST_PEER, TRACE, Trace
from supervisor.proxy import NO_BODY_STATUSES, events_end

log = structlog.get_logger("api")

HOT_PATHS: Final = frozenset(path.encode() for path in INFERENCE_PATHS)
# Headers that make a request aiohttp's: it handles chunked uploads, 100-continue and upgrades.
_NOT_FAST: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})  # headers that announce a body
# The headers aiohttp's parser refuses twice (aiohttp.http_parser.SINGLETON_HEADERS, at the version pinned),
# in its own text/plain 400, but llhttp takes: refused here, in the API's shape, whoever serves the request.
# (Host is counted on its own: RFC 9112 wants exactly one; llhttp refuses two Content-Lengths.)
# Each has a bit of its own: a head's are an int (no list per request: every request has a few of them).
_ONCE: Final = {
    name: 1 << bit
    for bit, name in enumerate(
        (
            b"content-location",
            b"content-range",
            b"content-type",
            b"etag",
            b"max-forwards",
            b"server",
            b"transfer-encoding",
            b"user-agent",
        )
    )
}
_SPACE: Final = 32
_TAB: Final = 9
_REASONS: Final = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    414: b"URI Too Long",
    415: b"Unsupported Media Type",
    417: b"Expectation Failed",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}
_JSON: Final = b"application/json; charset=utf-8"
_LOGGED: Final = "llm_supervisor.logged"
_MAX_QUEUED: Final = 8  # pipelined requests parsed ahead of the one being answered; more pause reading
# A request's task is made directly, named: loop.create_task makes one with no name, and the Task then
# formats "Task-<n>" for it. The daemon sets no task factory that this would bypass.
_Task: Final = asyncio.Task
_REQUEST_TASK: Final = "front-request"
_TUNNEL_TASK: Final = "front-tunnel"
# What a connection's timer does when it fires (FrontConnection._on_timer).
_NOTHING_DUE: Final = 0
_IDLE_DUE: Final = 1  # close the idle connection
_BODY_DUE: Final = 2  # answer 408: the body did not come in time
_HEAD_DUE: Final = 3  # answer 408: the head did not come in time
_TIMER_SLACK_S: Final = 0.001  # libuv's timers count whole milliseconds: one may fire that much early
# What a request's head may hold. Without a bound, a client that never ends its head grew the daemon
# without limit: httptools and the hand-off keep every byte of it, and each header line costs a tuple and
# three bytes objects (200 MiB of short lines took 4.4 GiB). The bounds are what llama-server (its HTTP
# library, cpp-httplib) takes of the request the child gets, which it refuses past them with an empty 400
# that would reach the client as is: at most 100 header lines of at most 8192 bytes each (name, ": ",
# value, CRLF), and a target of 8192. The child gets the client's lines less Host and Content-Length (and
# those it must not see), and up to six of the front's (relay.upstream_request: Host, its key,
# X-Request-Id, Content-Type, Connection for a stream, Content-Length): four more than the client sent,
# at most. A head is 64 KiB in all (Envoy's default is 60). Beyond any of them, 414 or 431 and the
# connection closed.
_MAX_TARGET_BYTES: Final = 8190  # and aiohttp's
_MAX_FIELD_BYTES: Final = 8192 - 4  # a header's name and value, without ": " and CRLF
_MAX_HEADERS: Final = 100 - 4
_MAX_HEAD_BYTES: Final = 1 << 16
# How long a connection the front stopped reading mid-request stays open after its last answer, dropping
# what the client still sends (a lingering close, as nginx's): closed with bytes unread, the kernel resets
# the connection, and the client can lose the answer that says what was wrong.
_LINGER_S: Final = 2.0
_PRUNE_MIN: Final = 64  # handed-off transports kept before the closed ones are looked for
_FULL_LOG_EVERY_S: Final = 10.0  # `connections_full` at most this often
_UNPROVEN_S: Final = 2.0  # a connection with no whole head by then may be closed for a new one, when full


class _BodyRefused(Exception):
    """A chunked body's trailer that frames a body (Content-Length, Transfer-Encoding), which aiohttp's
    parser refuses and llhttp takes: the body is refused as llhttp refuses a malformed one."""


class _HeadRefused(Exception):
    """A request's head the front will not take (past a limit, no single Host): raised from a parser
    callback, which stops the parser there."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _error_body(code: str, message: str, kind: str, ollama: bool) -> bytes:
    """The body of a refusal made before any request could be parsed (and so before the gate's
    `error_parts`, which reads the request): in OpenAI's error shape, or with `ollama` (a target under
    /api/, as `error_parts` decides) in Ollama's, whose clients read only that."""
    error: object = message if ollama else {"message": message, "type": kind, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _not_http(exc: Exception) -> str:
    """What the 400 for bytes llhttp refused says: the front's (FrontConnection), and HandedOffGuard's on
    a connection handed to aiohttp."""
    return f"bad request: {exc}"


def _closing_error(
    status: int, code: str, message: str, kind: str, date: bytes, headers: bytes = b"", ollama: bool = False
) -> bytes:
    """A whole answer that closes the connection, for a refusal made before any request could be parsed,
    with `_error_body`; `date` as FrontServer.date() makes it (RFC 9110 wants it on every such answer)."""
    body = _error_body(code, message, kind, ollama)
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\n%sContent-Length: %d\r\n"
        b"Connection: close\r\nDate: %s\r\nServer: llm-supervisor\r\n\r\n%s"
        % (status, _REASONS.get(status, b"Error"), headers, len(body), date, body)
    )


def _head_too_large(why: str) -> _HeadRefused:
    return _HeadRefused(431, "header_too_large", f"request header fields too large: {why}")


def _field_too_large(lines: int, size: int) -> _HeadRefused:
    if lines > _MAX_HEADERS:
        return _head_too_large(f"more than {_MAX_HEADERS} header lines")
    if size > _MAX_FIELD_BYTES:
        return _head_too_large(f"a header of more than {_MAX_FIELD_BYTES} bytes")
    return _head_too_large(f"more than {_MAX_HEAD_BYTES} bytes of headers")


# The bounds of a request's head, checked as the parser calls back: by FrontConnection for the requests
# it reads, and by HandedOffGuard for those of a connection handed to aiohttp.


def _check_target(length: int) -> None:
    """414 for a request target past _MAX_TARGET_BYTES (`length`: its bytes so far)."""
    if length > _MAX_TARGET_BYTES:
        raise _HeadRefused(
            414, "uri_too_long", f"the request target is longer than {_MAX_TARGET_BYTES} bytes"
        )


def _check_aiohttp_target(method: bytes, target: bytes) -> None:
    """400 for a target llhttp took that aiohttp's parser refuses (its own 400 in text/plain, HTTP/1.0,
    naming itself): what it takes is origin-form, `OPTIONS *`, or absolute-form with a host yarl reads."""
    if target.startswith(b"/") or (target == b"*" and method == b"OPTIONS"):
        return
    text = header_text(target)
    rest = text.partition(":")[2]
    if rest[:2] == "//" and rest[2:3] not in ("", "/", "?", "#"):  # an authority (aiohttp's check too)
        try:
            if URL(text, encoded=True).raw_host is not None:
                return
        except ValueError:
            pass
    raise _HeadRefused(400, "invalid_request", "bad request: the request target is not a path or a URL")


def _once(bit: int, name: bytes, seen: int) -> int:
    """The head's headers that may come once (_ONCE) with this one's `bit`; a 400 for its second line.
    `seen`: those the head had so far."""
    if seen & bit:
        raise _HeadRefused(
            400, "invalid_request", f"bad request: more than one {name.decode('latin-1')} header"
        )
    return seen | bit


def _check_expectation(value: bytes, version: str) -> None:
    """417 for an HTTP/1.1 Expect other than 100-continue (RFC 9110 10.1.1): aiohttp answered it in
    text/plain, before any middleware could give it the API's shape or log it. An empty one expects
    nothing, and HTTP/1.0 has none (aiohttp looks at neither)."""
    expected = value.strip().lower()
    if expected and expected != b"100-continue" and version == "1.1":
        raise _HeadRefused(
            417,
            "expectation_failed",
            f"Expect: {value[:40].decode('latin-1')!r} is not served (only 100-continue)",
        )


def _check_one_host(hosts: int, version: str) -> None:
    """RFC 9112 3.2: a request with more than one Host, or an HTTP/1.1 one with none, is a 400 (two
    readers of the request could each take a different one for the name it was sent to)."""
    if hosts > 1:
        raise _HeadRefused(400, "invalid_request", "bad request: more than one Host header")
    if hosts == 0 and version != "1.0":
        raise _HeadRefused(400, "invalid_request", "bad request: an HTTP/1.1 request needs a Host header")


def _check_field(lines: int, size: int, head_size: int) -> None:
    """431 for a header line past a bound: `lines` with this one, its `size` (name and value), and the
    `head_size` of the head's names and values so far, this one's included."""
    if size > _MAX_FIELD_BYTES or head_size > _MAX_HEAD_BYTES or lines > _MAX_HEADERS:
        raise _field_too_large(lines, size)


# A header line as the client sent it: (its name in lower case, its name, its value). The name is lowered
# once, as it is parsed, for every check and filter that looks at it.
Line = tuple[bytes, bytes, bytes]


def header_text(data: bytes) -> str:
    """Header bytes as aiohttp's parser reads them: UTF-8, other bytes kept as surrogates, so a value means
    the same on the front's routes and on aiohttp's."""
    return data.decode("utf-8", "surrogateescape")


def header_bytes(text: str) -> bytes:
    """Header text back to the bytes it came as (header_text's inverse)."""
    return text.encode("utf-8", "surrogateescape")


# The names HeaderLines is asked for, as it compares them (lowered bytes). The handlers ask a dozen names
# on every request, always the same ones; bounded, whatever else is asked.
_LOWERED_NAMES: Final[dict[str, bytes]] = {}
_LOWERED_NAMES_MAX: Final = 256


def _lowered(name: str) -> bytes | None:
    """A header name as HeaderLines compares it (lowered bytes); None for one no line can carry."""
    wanted = _LOWERED_NAMES.get(name)
    if wanted is None:
        try:
            wanted = header_bytes(name.lower())
        except UnicodeEncodeError:
            return None
        if len(_LOWERED_NAMES) < _LOWERED_NAMES_MAX:
            _LOWERED_NAMES[name] = wanted
    return wanted


class HeaderLines:
    """The request's headers, read-only, over its lines as parsed: what the request's handlers use of a
    CIMultiDict (`get`, `getall`, `in`, `[]`, `items()`), answered as a CIMultiDict of the same lines
    answers it: a name's first line, found by its lowered bytes; every line in `items()` and `getall`.
    The handlers look up a dozen names, most of them absent; building a CIMultiDict of every line
    instead cost about 1,000 instructions per header, and the OpenAI SDK sends fifteen. A plain dict of
    lowered names costs a tenth of that, made when the first name is asked. Not a `Mapping`: its
    helpers (`values()`, `dict(...)`) would treat a repeated name as one. Text is read by header_text,
    as aiohttp reads it."""

    def __init__(self, lines: list[Line]) -> None:
        self._lines = lines
        self._first: dict[bytes, bytes] | None = None  # lowered name -> its first line's value, once asked

    def _find(self, name: str) -> bytes | None:
        wanted = _lowered(name)
        if wanted is None:
            return None
        first = self._first
        if first is None:  # one pass over the lines, then a dict lookup for each name asked
            first = self._first = {}
            for lowered, _, value in self._lines:
                if lowered not in first:
                    first[lowered] = value
        return first.get(wanted)

    def get(self, name: str, default: Any = None) -> Any:
        value = self._find(name)
        return default if value is None else header_text(value)

    def __getitem__(self, name: str) -> str:
        value = self._find(name)
        if value is None:
            raise KeyError(name)
        return header_text(value)

    def getall(self, name: str, default: Any = None) -> Any:
        """Every line's value of `name`, in order (a repeated header is one list, RFC 9110 5.3)."""
        wanted = _lowered(name)
        found = [header_text(value) for lowered, _, value in self._lines if lowered == wanted]
        return found if found else default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def items(self) -> list[tuple[str, str]]:
        return [(header_text(name), header_text(value)) for _, name, value in self._lines]

    def __iter__(self) -> Iterator[str]:
        return (header_text(name) for _, name, _ in self._lines)

    def __len__(self) -> int:
        return len(self._lines)


class FastRequest(dict[Any, Any]):
    """A request the front serves itself, with what the inference route reads of an aiohttp request:
    `app` (the app's state: FrontServer.state), `method`, `path`, `path_qs`, `headers` and item access
    (the caller, the trace, the model; a dict underneath, so those cost no Python call). `trace` is also
    an attribute, for the same reason."""

    __slots__ = (
        "app",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "path",
        "path_qs",
        "raw",
        "trace",
    )

    def __init__(
        self,
        app: dict[Any, Any],
        path: str,
        path_qs: str,
        raw: list[Line],
        keep_alive: bool,
        content_length: int,
        arrived: float,
    ) -> None:
        # No dict.__init__: the dict is empty as made, and the call would cost a lookup through the MRO.
        self.app = app
        self.method = "POST"
        self.path = path
        self.path_qs = path_qs
        self.raw = raw  # the client's header lines as sent: forwarded without decoding
        self.headers = HeaderLines(raw)
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.trace = self[TRACE] = Trace(request_id_from(self.headers.get("X-Request-Id")), arrived)

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)  # one request, not its items: usable as a key (as aiohttp's requests are)

    def __eq__(self, other: object) -> bool:
        return self is other


class Tunnelled:
    """A request for the aiohttp application, on a connection the front keeps: sent to the app's internal
    listener as the client sent it (its body now with a Content-Length), and the answer's bytes relayed
    back untouched."""

    __slots__ = ("body", "continue_due", "head", "keep_alive", "received", "request", "reserved")

    def __init__(self, head: bytes, keep_alive: bool, continue_due: bool, request: FastRequest) -> None:
        self.head = head
        self.keep_alive = keep_alive
        self.continue_due = continue_due  # it sent `Expect: 100-continue` and has had no 100 yet
        self.request = request  # what the gate checks, and what a refusal of it answers
        # As it came when it came in one piece; a chunked one gathered in a bytearray: llhttp calls back per
        # chunk, and each kept as a bytes object in a list took ~28 times the bytes counted (2-byte chunks).
        self.body: bytes | bytearray = b""
        self.received = 0
        # Its share of max_buffered_mib: a chunked body's counts as the largest allowed until it is in, then
        # as what it is; given back once it has been answered.
        self.reserved = 0


# What waits its turn on a connection: a request the front serves (with its body, or the refusal it
# gets), or one tunnelled to aiohttp.
Job = tuple[FastRequest, bytes, SupervisorError | None] | Tunnelled


class FrontServer:
    """The protocol factory behind the daemon's listening socket, and what its connections share."""

    def __init__(
        self,
        app: web.Application,
        handoff: Callable[[], asyncio.Protocol],
        pool: UpstreamPool,
        serve: Callable[[FrontConnection, FastRequest, bytes], Any],
        keepalive_s: float,
        internal: Address,
    ) -> None:
        # The app's state (what its AppKeys hold) as a plain dict: what a fast request's `app` is. Each
        # lookup in aiohttp's Application is a Python call, and a request made seven. By now the state is
        # final (set while the app starts; aiohttp warns on a change after), so the copy stays true.
        self.state: dict[Any, Any] = dict(app.items())
        self.gate = app[ACCESS]  # the settings as last reloaded (a reload changes what it holds)
        self.internal = internal  # the aiohttp app's own listener (a private Unix socket): tunnelled requests
        self.handoff = handoff  # aiohttp's RequestHandler factory (AppRunner.server)
        self.pool = pool
        self.serve = serve
        self.keepalive_s = keepalive_s
        self.connections: set[FrontConnection] = set()
        self.closing = False  # the daemon is shutting down: see stop_tunnelling
        # Connections handed to aiohttp still take a descriptor each: counted against max_connections
        # until seen closed (pruned when the set has doubled since, and when the limit is reached).
        self.handed_off: set[asyncio.BaseTransport] = set()
        self._prune_at = _PRUNE_MIN
        self.default_max_connections = max(_PRUNE_MIN, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)
        self._full_logged_at = -_FULL_LOG_EVERY_S
        # Looked up once: on Python 3.11 every get_running_loop() is a getpid() system call.
        self.loop = asyncio.get_running_loop()
        self._date = b""
        self._date_at = 0

    def __call__(self) -> FrontConnection:
        return FrontConnection(self)

    def date(self) -> bytes:
        """The `Date` header's value, made once a second."""
        now = int(wall_time())
        if now != self._date_at:
            self._date_at = now
            self._date = email.utils.formatdate(now, usegmt=True).encode()
        return self._date

    def has_room(self) -> bool:
        """Room for one more client connection under max_connections, made if need be by closing a
        kept-alive connection that waits for its next request (as nginx does when it runs short). Past
        that, a descriptor per connection would sooner or later leave the daemon none to start a child,
        read a manifest or reach a child with."""
        limit = self.gate.settings.max_connections or self.default_max_connections
        if len(self.connections) + len(self.handed_off) < limit:
            return True
        self.prune_handed_off()
        if len(self.connections) + len(self.handed_off) < limit:
            return True
        for conn in self.connections:
            if conn.idle and conn.transport is not None:
                self.connections.discard(conn)
                conn.transport.close()
                self._count_connections("closed_idle")
                return True
        # And one handed to aiohttp that waits for its next request: a peer with no key kept such
        # connections open with a request to an open route every minute, and everyone else out.
        for transport in self.handed_off:
            guard = transport.get_protocol()
            if isinstance(guard, HandedOffGuard) and guard.idle and not transport.is_closing():
                self.handed_off.discard(transport)
                transport.close()
                self._count_connections("closed_idle")
                return True
        # Then the one that has been sending a head the longest, past _UNPROVEN_S: one peer trickling
        # heads over every connection otherwise kept everyone else out, admin keys included (a first head,
        # or a later one: a whole first head proves nothing of the next).
        now = self.loop.time()
        slow = [(since, c) for c in self.connections if (since := c.head_pending_since()) < now - _UNPROVEN_S]
        if slow:
            _, oldest = min(slow, key=lambda pair: pair[0])
            self.connections.discard(oldest)
            if oldest.transport is not None:
                oldest.transport.abort()
            self._count_connections("closed_unproven")
            return True
        self._count_connections("refused")
        if now - self._full_logged_at >= _FULL_LOG_EVERY_S:
            self._full_logged_at = now
            log.warning("connections_full", max_connections=limit, handed_to_aiohttp=len(self.handed_off))
        return False

    def _count_connections(self, action: str) -> None:
        metrics = self.state.get(METRICS)
        if metrics is not None:
            metrics.connections_shed.labels(action).inc()

    def handed(self, transport: asyncio.BaseTransport) -> None:
        self.handed_off.add(transport)
        if len(self.handed_off) >= self._prune_at:
            self.prune_handed_off()

    def prune_handed_off(self) -> None:
        self.handed_off = {t for t in self.handed_off if not t.is_closing()}
        self._prune_at = max(_PRUNE_MIN, 2 * len(self.handed_off))

    def stop_tunnelling(self) -> None:
        """Before aiohttp's listener closes (the end of a shutdown): a kept-alive connection waiting for its
        next request closes, and a request tunnelled after is answered `shutting_down` in its API's
        shape (it was an empty 503, and an error in the log, on every shutdown with clients connected)."""
        self.closing = True
        for conn in list(self.connections):
            if conn.idle and conn.transport is not None:
                conn.transport.close()

    def close_all(self) -> None:
        """After the drain: whatever is still open closes."""
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()


# The request a handed-off connection's guard gives aiohttp in place of one llhttp refused: aiohttp
# answers it in its turn, once every answer before it is out, and api/middleware.py's front_refusals
# answers it with the guard's 400 (refusal_for). On a connection with no refusal it is a request as any.
REFUSED_TARGET: Final = "/.llm-supervisor/refused"
_REFUSED_REQUEST: Final = b"GET " + REFUSED_TARGET.encode() + b" HTTP/1.1\r\nHost: localhost\r\n\r\n"
_CRLFS: Final = re.compile(rb"[\r\n]*")  # what llhttp skips between requests
# A head within the bounds is at most this long as sent, unless padded with whitespace, which llhttp does
# not count (a value's leading spaces): a head longer than that is not held back.
_MAX_HELD_BYTES: Final = 2 * _MAX_HEAD_BYTES


class HandedOffGuard(asyncio.Protocol):
    """Between a connection handed to aiohttp and aiohttp's handler: the same bytes are parsed again (by
    llhttp, cheaply) to hold every later request's head to the front's bounds, and to keep from aiohttp
    the requests llhttp refuses. aiohttp's own bounds allow 100 lines of 8 KiB each, and none on a head
    as a whole: a peer with no key kept 760 KB heads open on hundreds of connections.

    A head reaches aiohttp once llhttp has taken all of it. One it refuses (not HTTP, an invalid line),
    or one past a bound, never does, nor anything after it: aiohttp gets REFUSED_TARGET in its place,
    and answers it in its turn with the 400 (431, 414) the front gives the same bytes before a hand-off
    (front_refusals), then closes. (aiohttp's own answer was text/plain, naming its parser, and lost the
    requests before it in the same read; a head past a bound closed the connection with no answer.) To
    know where each head begins, llhttp is fed a line at a time outside bodies, and a Content-Length body
    to its end. A chunked body is fed whole: a head that begins in the read where one ends is passed on
    as it comes, as is one past _MAX_HELD_BYTES; if llhttp refuses either, aiohttp answers it (losing a
    request that ended in that same read too), in the API's shape (handoff.py), and past a bound the
    connection closes unanswered (aiohttp has the head's start: no answer of ours can go before it)."""

    def __init__(self, inner: asyncio.Protocol, server: FrontServer) -> None:
        self._inner = inner
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._dropping = False  # refused, or closed for a bound: what still comes is dropped, unparsed
        self.refusal: tuple[int, bytes] | None = None  # what REFUSED_TARGET is answered with: status, body
        self._held = bytearray()  # the head being parsed, from its start: aiohttp gets it once it is whole
        self._placed = True  # where the head being parsed began is known (see data_received)
        self._in_message = False
        self._in_head = False
        self._ended = False  # a request ended in the bytes just fed
        self._progress = False
        self._stalled = 0  # bytes fed since a head's parse last moved on (a line that does not end)
        self._hosts = 0  # the head's Host lines
        self._seen_once = 0  # the head's headers that may come once (_ONCE), a bit each
        self._target = b""  # the start of the request's target: a refusal is in the API it names
        self._url = 0
        self._lines = 0
        self._head_size = 0
        self._framed = False  # the request being parsed announced a body (Content-Length, Transfer-Encoding)
        self._length = -1  # its Content-Length; -1: none
        self._remaining = -1  # what is still to come of a Content-Length body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        """Parse `data` in pieces that end where a request may (a line's end outside bodies, a
        Content-Length body's end) and pass aiohttp every byte but those of a head not yet whole. A head
        that began inside a piece, after a request ended there (in a chunked body's piece), is not
        `_placed`: its bytes go on as they come."""
        if self._dropping:
            return
        self._progress = False
        size = len(data)
        view = memoryview(data)
        passing = 0  # data[:passing] goes to aiohttp (after what is held)
        at = 0
        while at < size:
            end = self._piece_end(data, at)
            in_body = self._in_message and not self._in_head
            self._ended = False
            try:
                self._parser.feed_data(view[at:end])
            except httptools.HttpParserUpgrade as upgrade:
                # The app upgrades nothing (it has no WebSocket route): aiohttp declines the upgrade (or
                # CONNECT), answers it and parses on, and so does the guard, with a new parser for the
                # bytes after its head. (Had it stopped, the heads after it had only aiohttp's bounds.)
                # aiohttp reads an upgrade's announced body as its body, llhttp as the next request: the
                # two could not be told to agree, so such a request closes the connection.
                if self._framed:
                    self._refuse("an upgrade request with a body")
                    return
                self._parser = httptools.HttpRequestParser(self)
                self._in_message = self._in_head = False
                end = at + upgrade.args[0]
            except httptools.HttpParserError as exc:
                if isinstance(exc.__context__, _HeadRefused):
                    self._refuse_head(exc.__context__, data, passing)
                elif (in_body and not self._ended) or isinstance(exc.__context__, _BodyRefused):
                    # A body aiohttp's handler is reading (not a head after its end, in the same piece):
                    # aiohttp's parser drops one it cannot frame but leaves its reader waiting for the
                    # rest, holding the body's reservation, until client_timeout_s (then a 408). Its
                    # reader gets the 400 now; nothing more is read.
                    self._dropping = True
                    self._pass(data, passing)
                    error = SupervisorError("invalid_request", f"{_not_http(exc)} (in the chunked body)", 400)
                    handoff.refuse_body(self._inner, error)
                elif in_body or not self._placed:
                    # aiohttp has this request's head: it answers the rest itself (handoff.py; its
                    # parser also drops the requests that end in the read where it refuses one)
                    self._dropping = True
                    self._pass(data, passing)
                    self._inner.data_received(data[passing:])
                else:
                    self._refuse_in_turn(exc, data, passing)
                return
            at = end
            if not self._in_head:
                passing = at
                self._placed = True
            elif self._ended or not self._placed:
                passing = at
                self._placed = False
        self._stalled = 0 if self._progress or not self._in_head else self._stalled + size
        if self._stalled > _MAX_HEAD_BYTES:
            self._refuse_head(_head_too_large(f"a line of more than {_MAX_HEAD_BYTES} bytes"), data, passing)
            return
        if size - passing + (0 if passing else len(self._held)) > _MAX_HELD_BYTES:
            passing = size  # held no longer: it goes on as it comes, and aiohttp answers it if refused
            self._placed = False
        self._pass(data, passing)
        if passing < size:
            self._held += view[passing:]

    def _piece_end(self, data: bytes, at: int) -> int:
        """Where the piece of `data` that llhttp is fed next ends."""
        if self._in_message and not self._in_head:  # in a body: a Content-Length one to its end
            return min(at + self._remaining, len(data)) if self._remaining > 0 else len(data)
        start = at
        if not self._in_message:  # from the request line's start: an empty line is no piece of its own
            skipped = _CRLFS.match(data, at)
            start = skipped.end() if skipped is not None else at
        line_end = data.find(b"\n", start)
        return len(data) if line_end < 0 else line_end + 1

    def _pass(self, data: bytes, end: int) -> None:
        """aiohttp gets what is held and data[:end]."""
        if not end:
            return
        if self._held:
            passed = bytes(self._held) + data[:end]
            self._held.clear()
        else:
            passed = data if end == len(data) else data[:end]
        self._inner.data_received(passed)

    def _refuse_in_turn(self, exc: httptools.HttpParserError, data: bytes, passing: int) -> None:
        """A request llhttp refused: aiohttp gets the requests before it, then REFUSED_TARGET in its place;
        nothing more is parsed."""
        self._answer_in_turn(400, "invalid_request", _not_http(exc), data, passing)

    def _refuse_head(self, refused: _HeadRefused, data: bytes, passing: int) -> None:
        """A head past a bound: answered in its turn, as a request llhttp refused is, with the front's own
        refusal of the same head (431, 414). It used to close the connection with no answer. One whose
        start aiohttp has already been given (not `_placed`) cannot be: the connection is closed."""
        if not self._placed:
            self._refuse(str(refused))
            return
        log.warning("handed_off_head_refused", reason=str(refused))
        self._answer_in_turn(refused.status, refused.code, str(refused), data, passing)

    def _answer_in_turn(self, status: int, code: str, message: str, data: bytes, passing: int) -> None:
        """aiohttp gets the requests before the refused one, then REFUSED_TARGET in its place, which it
        answers with this refusal in its turn; nothing more is parsed."""
        self._dropping = True
        self._pass(data, passing)
        self._held.clear()  # the refused head's start
        # The target is read before the headers: a refusal of the head knows whose API it was for.
        ollama = self._in_message and self._target.startswith(b"/api/")
        self.refusal = (status, _error_body(code, message, "invalid_request_error", ollama))
        self._inner.data_received(_REFUSED_REQUEST)

    def _refuse(self, why: str) -> None:
        """Close the connection unanswered: aiohttp may be answering a request whose head or body the
        guard cannot place (an upgrade with a body, a head whose start aiohttp has), and no answer of
        ours could be put in between."""
        log.warning("handed_off_connection_closed", reason=why)
        self._dropping = True
        self._held.clear()
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_send_timer()
        self._inner.connection_lost(exc)

    @property
    def idle(self) -> bool:
        """aiohttp waits for the connection's next request: no head arriving, nothing held or refused,
        no answer still being written, and aiohttp's handler between requests."""
        return (
            not self._in_message
            and not self._held
            and not self._dropping
            and self._transport is not None
            and not self._transport.get_write_buffer_size()
            and handoff.idle(self._inner)
        )

    def pause_writing(self) -> None:
        # A client that reads nothing for client_timeout_s is dropped, as the front drops its own
        # (FrontConnection.pause_writing): aiohttp's write waited for it with no limit, the request holding
        # its ticket and its child blocked, until the hang check took the child for hung and stopped it.
        self._cancel_send_timer()
        self._send_timer = self._server.loop.call_later(
            self._server.gate.settings.client_timeout_s, self._send_too_slow
        )
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        self._inner.resume_writing()

    def _send_too_slow(self) -> None:
        self._send_timer = None
        if self._transport is not None:
            peer = self._transport.get_extra_info("peername")
            limit_s = self._server.gate.settings.client_timeout_s
            log.warning(
                "client_not_reading", peer=peer[0] if isinstance(peer, tuple) else None, limit_s=limit_s
            )
            self._transport.abort()  # aiohttp cancels the request's handler: its child's answer stops

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # --- httptools callbacks: the bounds FrontConnection holds a head to --------------------------------

    def on_message_begin(self) -> None:
        self._in_message = self._in_head = self._progress = True
        self._url = self._lines = self._head_size = self._hosts = 0
        self._seen_once = 0
        self._framed = False
        self._length = -1
        self._target = b""

    def on_url(self, url: bytes) -> None:
        self._progress = True
        if len(self._target) < 5:
            self._target += url[:5]
        self._url += len(url)
        _check_target(self._url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progress = True
        size = len(name) + len(value)
        self._head_size += size
        self._lines += 1
        _check_field(self._lines, size, self._head_size)
        lowered = name.lower()
        if not self._in_head:  # a chunked body's trailer: aiohttp ignores it, unless it frames a body
            if lowered in _FRAMING:
                raise _BodyRefused(f"{name.decode('latin-1')} in a chunked body's trailer")
            return
        if lowered in _FRAMING:
            self._framed = True
            if lowered == b"content-length":
                self._length = int(value)  # llhttp has checked it: digits, and only one
        # A later head is held to what the front holds a first one to: aiohttp's parser refused it in its
        # own words, and lost the answers to the requests before it in the same read.
        if lowered == b"host":
            self._hosts += 1
        elif (bit := _ONCE.get(lowered, 0)) != 0:
            self._seen_once = _once(bit, name, self._seen_once)
        elif lowered == b"expect":
            _check_expectation(value, self._parser.get_http_version())

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._progress = True
        self._remaining = self._length
        if self._hosts != 1:
            _check_one_host(self._hosts, self._parser.get_http_version())

    def on_body(self, body: bytes) -> None:
        self._remaining -= len(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._ended = True


def refusal_for(transport: asyncio.BaseTransport | None) -> tuple[int, bytes] | None:
    """The status and body that a handed-off connection's REFUSED_TARGET is to be answered with, if this
    is such a connection and its guard put one in (HandedOffGuard._answer_in_turn)."""
    protocol = transport.get_protocol() if transport is not None else None
    return protocol.refusal if isinstance(protocol, HandedOffGuard) else None


class FrontConnection(asyncio.Protocol):
    """One client connection, until it closes or is handed to aiohttp.

    Requests are answered one at a time, in order. A client that goes away cancels the request being
    answered, which drops its child connection, which stops the engine.
    """

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._peer: str | None = None  # the client's address, for the access log
        self.opened_at = 0.0  # loop time
        self.heads_done = 0  # request heads it has sent whole: none yet, it has proved nothing
        self.exchange: Exchange | None = None  # the child's answer being relayed (for backpressure)
        self._parser = httptools.HttpRequestParser(self)
        self._raw = bytearray()  # bytes since the last request boundary: what a hand-off passes on
        self._completed_in_feed = False
        self._in_message = False
        self._keep_raw = True
        self._clean_start = True
        self._url = b""
        self._lines: list[Line] = []
        self._head_size = 0  # the lengths of the head's header names and values so far
        self._hosts = 0  # its Host lines: RFC 9112 3.2 wants exactly one (none in HTTP/1.0)
        self._in_head = False  # between a request's first byte and the end of its head
        # Bytes fed since a parser callback last came: what httptools holds of a header or trailer line it
        # has not finished (it calls back with a line only once the line ends), counted by the chunks fed
        # after the one with the last callback. The callbacks below set _progress.
        self._progress = False
        self._stalled = 0
        self._head_deadline = 0.0  # loop time by which a head that came in pieces must be in; 0: not set
        self._length: bytes | None = None  # the request's Content-Length, as sent
        self._not_fast = False  # a header that makes the request aiohttp's (_NOT_FAST)
        self._seen_once = 0  # the head's headers that may come once (_ONCE), a bit each
        self._current: FastRequest | None = None  # the request whose body is arriving
        self._ignoring = False  # the body of a refused request: read and dropped
        self._body: list[bytes] = []
        self._queue: deque[Job] = deque()
        self._tunnelled: Tunnelled | None = None  # the request for aiohttp whose body is arriving
        self._task: asyncio.Task[None] | None = None
        self._job: Job | None = None  # the one the task serves
        self._body_deadline = 0.0  # loop time by which the arriving body must be in
        self._queue_paused = False  # reading paused for _MAX_QUEUED jobs: no body deadline runs meanwhile
        self._hand_off = False
        self._closing = False
        self._close_said = False  # an answer has said `Connection: close`: no other may follow it
        # The 400 for bytes that are not HTTP, pipelined behind an answer in hand: sent after the answers
        # before it (_go_on), which then do not say the connection closes.
        self._unparsed: bytes | None = None
        self._timer: asyncio.TimerHandle | None = None  # fires at _timer_at, then acts on what is due
        self._timer_at = 0.0
        self._due = _NOTHING_DUE  # what the timer does at _due_at (loop time): see `timers` below
        self._due_at = 0.0
        self._streaming = False
        self._write_paused = False  # the client's socket buffer is full (pause_writing until resume_writing)
        self._send_timer: asyncio.TimerHandle | None = None  # drops a client paused too long (pause_writing)
        self._held = b""  # the start of an SSE event whose end has not come yet
        self._dropping = False  # refused and closing: whatever comes is dropped, unparsed
        self._linger: asyncio.TimerHandle | None = None
        # This connection's requests counted against their key's max_concurrent, by key: a request
        # pipelined behind them runs after them, not beside them (identify_caller's `ahead`).
        self._counted: dict[str, int] = {}

    # --- connection ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.opened_at = self.server.loop.time()
        if not self.server.has_room():
            self._refuse_connection()
            return
        self.server.connections.add(self)
        self._arm_idle()

    @property
    def idle(self) -> bool:
        """Kept alive between requests: nothing in hand, nothing arriving."""
        return self._task is None and not self._queue and not self._in_message and not self._hand_off

    def head_pending_since(self) -> float:
        """Since when (loop time) the connection has been sending a head it has not finished: since it
        opened, until its first head is whole; for a later one, since the read that left it unfinished
        (its deadline was set then: see _arm_idle). Infinity when no head is pending."""
        if not self.heads_done:
            return self.opened_at
        if self._in_head and self._head_deadline:
            return self._head_deadline - self.server.gate.settings.client_timeout_s
        return math.inf

    def _refuse_connection(self) -> None:
        """max_connections are open and none is idle: a 503 and the connection closed at once (a refusal
        that lingered would hold the descriptor it is meant to spare)."""
        transport, self.transport = self.transport, None
        if transport is None:
            return
        self._dropping = True  # whatever it sent before the close is not read
        message = "too many connections are open (max_connections); try again shortly"
        transport.write(
            _closing_error(
                503,
                "too_many_connections",
                message,
                "server_error",
                self.server.date(),
                b"Retry-After: 1\r\n",
            )
        )
        transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.server.connections.discard(self)
        self._cancel_timer()
        self._cancel_send_timer()
        if self._linger is not None:
            self._linger.cancel()
        self._release_reservation()
        if self._task is not None:
            self._task.cancel()  # the client is gone: its request (and the child's generation) stops
        self.transport = None

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.exchange is not None:
            self.exchange.pause()  # the client reads slowly: stop reading the child, hold nothing more
        # A client that reads nothing for client_timeout_s is dropped (nginx's send_timeout): paused, it
        # held its generation's slot, and its ticket, for ever. Its task is cancelled as it goes.
        self._cancel_send_timer()
        self._send_timer = self.server.loop.call_later(
            self.server.gate.settings.client_timeout_s, self._send_too_slow
        )

    def _send_too_slow(self) -> None:
        self._send_timer = None
        if self.transport is not None and self._write_paused:
            log.warning(
                "client_not_reading", peer=self._peer, limit_s=self.server.gate.settings.client_timeout_s
            )
            self.transport.abort()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def resume_writing(self) -> None:
        self._write_paused = False
        self._cancel_send_timer()
        if self.exchange is not None:
            self.exchange.resume()
        elif self._task is None and (self._queue or self._hand_off):
            self._go_on()  # what waited for the client to read

    def relay_from(self, exchange: Exchange) -> None:
        """`exchange`'s answer is being relayed to the client: paused at once if the client is not reading
        (pause_writing came before, for an earlier answer, and will not come again until it resumes)."""
        self.exchange = exchange
        if self._write_paused:
            exchange.pause()

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        if self._hand_off:
            self._raw += data  # the request aiohttp is to get, behind the answer in hand
            self._hold_for_hand_off()
            return
        if not self._in_message:
            self._raw = bytearray(data)  # a request starts with this chunk: keep it for a hand-off
        elif self._keep_raw:
            self._raw += data
        self._completed_in_feed = False
        self._due = _NOTHING_DUE  # bytes came: neither idle nor waiting in vain (the timer may stay)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # llhttp stops at an upgrade. on_headers_complete has decided: handed over, or (pipelined
            # behind our own answers, or after a refusal) the connection closes after those answers.
            if not self._hand_off:
                self._dropping = True  # nothing after it can be parsed
        except httptools.HttpParserError as exc:
            if not self._hand_off:
                cause = exc.__context__
                if isinstance(cause, _HeadRefused):
                    self._refuse_unparsed(cause.status, cause.code, str(cause))
                else:
                    self._refuse_malformed(exc)
                return
        if self._hand_off:
            self._hand_off_when_idle()
            return
        if self._progress:
            self._progress = False
            self._stalled = 0
        else:
            self._stalled += len(data)
            if self._stalled > _MAX_HEAD_BYTES:  # a line far past _MAX_FIELD_BYTES that has not ended
                too_large = _head_too_large(f"a line of more than {_MAX_HEAD_BYTES} bytes")
                self._refuse_unparsed(too_large.status, too_large.code, str(too_large))
                return
        if not self._keep_raw or not self._in_message:
            self._raw.clear()
        if self._current is not None or self._tunnelled is not None:
            self._arm_body_deadline()
        elif self._task is None and not self._queue:
            self._arm_idle()
        if len(self._queue) >= _MAX_QUEUED and self.transport is not None:
            self.transport.pause_reading()
            # The daemon, not the client, stops the body here: its deadline waits (see _go_on).
            self._queue_paused = True
            self._due = _NOTHING_DUE

    # --- httptools callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._clean_start = not self._completed_in_feed and not self._ignoring
        self._keep_raw = self._clean_start
        self._url = b""
        self._lines = []
        self._head_size = 0
        self._hosts = 0
        self._seen_once = 0
        self._in_head = self._progress = True
        self._head_deadline = 0.0
        self._length = None
        self._not_fast = False

    def on_url(self, url: bytes) -> None:
        self._progress = True
        self._url += url
        _check_target(len(self._url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progress = True
        size = len(name) + len(value)
        self._head_size += size
        _check_field(len(self._lines) + 1, size, self._head_size)
        lowered = name.lower()
        # RFC 9112 5: whitespace around a value is not part of it. llhttp drops only what comes before;
        # aiohttp drops both, and a key or Origin with a space after it meant one thing here, another there.
        if value and (value[-1] == _SPACE or value[-1] == _TAB):
            value = value.rstrip(b" \t")
        self._lines.append((lowered, name, value))
        if lowered == b"content-length":
            if self._length is None:
                self._length = value
        elif lowered == b"host":
            self._hosts += 1
        else:
            bit = _ONCE.get(lowered, 0)
            if bit != 0:
                self._seen_once = _once(bit, name, self._seen_once)
            if lowered in _NOT_FAST:
                if lowered == b"expect":
                    _check_expectation(value, self._parser.get_http_version())
                self._not_fast = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._progress = True
        self.heads_done += 1
        if self._hand_off:
            return  # behind a request for aiohttp, in the same read: aiohttp's too, with every byte after
        if self._parser.get_method() == b"CONNECT":
            # Not a proxy. Handed to aiohttp, it was answered 404 on a connection that went on with only
            # aiohttp's bounds on the heads after it (llhttp reads a CONNECT as an upgrade).
            raise _HeadRefused(405, "method_not_allowed", "CONNECT is not served: this is not a proxy")
        if self._parser.get_http_version() not in ("1.1", "1.0"):
            # aiohttp would serve it and answer in HTTP/1 framing under the client's version.
            raise _HeadRefused(505, "http_version_not_supported", "only HTTP/1.1 and HTTP/1.0 are served")
        if self._hosts != 1:
            _check_one_host(self._hosts, self._parser.get_http_version())
        path, _, _ = self._url.partition(b"?")
        fast = (
            self._parser.get_method() == b"POST"
            and path in HOT_PATHS
            and self._parser.get_http_version() == "1.1"
            and self._length is not None  # a body of known length, and nothing that makes it aiohttp's
            and not self._not_fast
        )
        if not fast:
            if self._ignoring:
                return
            _check_aiohttp_target(self._parser.get_method(), self._url)
            if self._tunnels(path):
                self._start_tunnel(path)
            elif self._clean_start and not self._hand_off:
                self._hand_off = True  # aiohttp's, with every byte since this request began
            else:
                self._closing = True  # pipelined behind our own answers: answer those, then close
                self._ignoring = True
            return
        if self._ignoring:
            return  # after a refused request on this connection: not served, the connection closes
        assert self._length is not None  # a fast request has one
        request = self._request(path, int(self._length))  # llhttp has checked that it is a number
        try:
            self._admit_head(request)
        except SupervisorError as refusal:
            self._refuse_in_turn(request, refusal)
            return
        self._current = request
        self._body = []
        self._keep_raw = False  # ours: its bytes are never handed on
        self._body_deadline = self.server.loop.time() + self.server.gate.settings.client_timeout_s

    def _request(self, path: bytes, content_length: int) -> FastRequest:
        """The request whose head has just been parsed."""
        request = FastRequest(
            self.server.state,
            path.decode("latin-1"),
            self._url.decode("latin-1"),
            self._lines,
            self._parser.should_keep_alive(),
            content_length,
            perf_counter(),
        )
        request[REQUEST_PEER] = self._peer
        return request

    def _tunnels(self, path: bytes) -> bool:
        """Whether a request for aiohttp goes through the internal listener (the connection stays the
        front's) rather than taking the connection with it. The Ollama API's clients speak nothing else,
        so their connections are handed over; HTTP/1.0, HEAD (whose answer has no body to find the end
        of) and upgrades are handed over too."""
        method = self._parser.get_method()
        return (
            self._parser.get_http_version() == "1.1"
            and method not in (b"HEAD", b"CONNECT")
            and not path.startswith(b"/api/")
            and not any(lowered == b"upgrade" for lowered, _, _ in self._lines)
        )

    def _start_tunnel(self, path: bytes) -> None:
        head = bytearray(self._parser.get_method() + b" " + self._url + b" HTTP/1.1\r\n")
        expects = False
        for lowered, name, value in self._lines:
            if lowered == b"expect":
                expects = value.strip().lower() == b"100-continue"
            elif lowered not in (b"content-length", b"transfer-encoding"):
                head += name + b": " + value + b"\r\n"
        self._keep_raw = False
        gate = self.server.gate
        # llhttp has checked the value and frames the body by it; int() takes the spaces it allows around
        # the digits (an isdigit() test did not, and such a body escaped the gate's checks).
        length = int(self._length) if self._length is not None else None
        chunked = any(lowered == b"transfer-encoding" for lowered, _, _ in self._lines)
        request = self._request(path, length or 0)
        request.method = self._parser.get_method().decode("latin-1")
        tunnelled = Tunnelled(bytes(head), request.keep_alive, expects, request)
        if length or chunked:
            try:
                _, tunnelled.reserved = self._admit_body(request, length)
            except SupervisorError as refusal:
                self._refuse_in_turn(request, refusal)
                return
        self._tunnelled = tunnelled
        self._body_deadline = self.server.loop.time() + gate.settings.client_timeout_s
        if self._task is None and not self._queue:
            self._send_continue()

    def _send_continue(self) -> None:
        """The `100 Continue` that an arriving upload asked for before sending its body. Only between
        answers: behind one in hand, it waits for that answer's end (_served). Its body's deadline counts
        from here: a client that waits for the 100 before sending is not too slow while it waits."""
        tunnelled = self._tunnelled
        if tunnelled is not None and tunnelled.continue_due and self.transport is not None:
            tunnelled.continue_due = False
            self._body_deadline = self.server.loop.time() + self.server.gate.settings.client_timeout_s
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._progress = True
        if self._current is not None:
            self._body.append(body)
        elif self._tunnelled is not None:
            tunnelled = self._tunnelled
            tunnelled.received += len(body)
            if tunnelled.received > self.server.gate.max_body_bytes:
                self._tunnelled = None  # a chunked upload past the limit: refused as aiohttp would
                self._give_back(tunnelled)
                self._refuse_in_turn(tunnelled.request, body_too_large(tunnelled.received, self.server.gate))
                return
            held = tunnelled.body
            if isinstance(held, bytearray):
                held += body
            elif held:
                tunnelled.body = bytearray(held) + body
            else:
                tunnelled.body = body

    def on_message_complete(self) -> None:
        self._progress = True
        self._completed_in_feed = True
        self._in_message = False
        tunnelled, self._tunnelled = self._tunnelled, None
        if tunnelled is not None:
            if tunnelled.reserved > tunnelled.received:  # a chunked body, in: it holds what it is
                self.server.gate.buffered_bytes -= tunnelled.reserved - tunnelled.received
                tunnelled.reserved = tunnelled.received
            self._queue.append(tunnelled)
            self._next()
            return
        request, self._current = self._current, None
        if request is None:
            return
        self._queue.append((request, b"".join(self._body), None))
        self._body = []
        self._next()

    # --- requests ------------------------------------------------------------------------------------

    def _admit_head(self, request: FastRequest) -> None:
        """What the aiohttp middleware checks before a body is read: Origin, Host, key, per-key
        concurrency, body size and the memory budget for bodies."""
        who, request["reserved"] = self._admit_body(request, request.content_length, self._counted)
        if who.name is not None:
            self.server.gate.inflight[who.name] += 1
            self._counted[who.name] = self._counted.get(who.name, 0) + 1
        request["key_name"] = who.name

    def _admit_body(
        self, request: FastRequest, length: int | None, ahead: dict[str, int] | None = None
    ) -> tuple[Caller, int]:
        """Origin, Host, key and size, then the body's share of max_buffered_mib (`length` bytes; None:
        chunked, which counts as the largest allowed, as aiohttp's gate has it): the caller, and the bytes
        reserved. For a tunnelled upload too, before the front holds its body: a caller the gate would
        refuse must not take the budget every request shares. aiohttp checks a tunnelled request again,
        and counts it against its key's concurrency, when it gets it."""
        gate = self.server.gate
        as_web = _as_web(request)
        check_origin_and_host(as_web, gate)
        who = identify_caller(as_web, gate, ahead)
        return who, admit_body(as_web, length, gate, who)

    def _refuse_in_turn(self, request: FastRequest, refusal: SupervisorError) -> None:
        """Answer `request` with `refusal` once the answers before it are out, then close the connection
        (lingering); the rest of its body is read and dropped, and nothing after it is served."""
        self._queue.append((request, b"", refusal))
        self._closing = True
        self._ignoring = True
        self._next()

    def _next(self) -> None:
        if self._task is not None or not self._queue or self._write_paused:
            return
        job = self._job = self._queue.popleft()
        loop = self.server.loop
        if isinstance(job, Tunnelled):
            self._task = _Task(self._tunnel(job), loop=loop, name=_TUNNEL_TASK)
        else:
            self._task = _Task(self._serve(*job), loop=loop, name=_REQUEST_TASK)
        self._task.add_done_callback(self._served)

    async def _tunnel(self, job: Tunnelled) -> None:
        """Send a request to the aiohttp app's internal listener and relay its answer's bytes as they come."""
        body = job.body
        data = b"".join((job.head, b"Content-Length: %d\r\n\r\n" % len(body), body))
        try:
            exchange = await self.server.pool.exchange(self.server.internal, data, raw=True)
        except UpstreamLost as exc:
            self._serve_no_more()
            if self.server.closing:  # its listener closed as the daemon shuts down: not an error of ours
                error = shutting_down()
            else:
                log.error("internal_listener_unreachable", error=str(exc))
                error = SupervisorError("unavailable", "the daemon cannot serve this request now", 503, 1)
            if (status := self._answer_error(job.request, error)) is not None:
                self._log(job.request, status)
            return
        self.relay_from(exchange)
        try:
            exchange.attach(self._write_raw)
            try:
                await exchange.done
            except UpstreamCut:
                self._closing = True  # the answer was cut: the client must see the connection end
                if self.transport is not None:
                    self.transport.close()
                return
            if not exchange.keep_alive or not job.keep_alive:
                self._serve_no_more()  # the answer said `Connection: close`
        finally:
            exchange.abort()

    def _write_raw(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    async def _serve(self, request: FastRequest, body: bytes, refusal: SupervisorError | None) -> None:
        trace = request.trace
        status: int | None = None
        with logs.RequestScope(trace.request_id):
            try:
                if refusal is not None:
                    raise refusal
                status = await self.server.serve(self, request, body)
            except asyncio.CancelledError:
                # The client went away (connection_lost cancels the task): logged and counted as nginx's 499.
                if not request.get(_LOGGED):
                    self._log(request, CLIENT_GONE)
                raise
            except SupervisorError as exc:
                status = self._answer_error(request, exc)
            except Exception:
                log.exception("handler_error", method=request.method, path=request.path)
                status = self._answer_error(request, SupervisorError("internal_error", "internal error", 500))
            if status is not None and not request.get(_LOGGED):
                self._log(request, status)

    def _log(self, request: FastRequest, status: int) -> None:
        """The access log line and the metrics, written before the answer's last bytes leave: whoever
        reads the answer can find its log line."""
        request[_LOGGED] = True
        trace = request.trace
        log_answer(_as_web(request), status, trace, perf_counter() - trace.arrived)

    def _give_back(self, job: Job | FastRequest | None) -> None:
        """A job's (or an arriving request's) share of the body budget and of its key's concurrency."""
        if job is None:
            return
        gate = self.server.gate
        if isinstance(job, Tunnelled):
            gate.buffered_bytes -= job.reserved
            return
        request = job if isinstance(job, FastRequest) else job[0]
        gate.buffered_bytes -= request.get("reserved", 0)
        name = request.get("key_name")
        request["reserved"] = 0  # once: an answer gives its share back as it ends, its job again after
        request["key_name"] = None
        if name is not None:
            gate.inflight[name] -= 1
            if not gate.inflight[name]:
                del gate.inflight[name]
            self._counted[name] -= 1
            if not self._counted[name]:
                del self._counted[name]

    def _served(self, task: asyncio.Task[None]) -> None:
        """The job's task has ended (also when cancelled before it ran): what it held is given back."""
        job, self._job = self._job, None
        if job is not None:
            self._give_back(job)
        self._task = None
        self.exchange = None
        self._go_on()

    def _go_on(self) -> None:
        """Between jobs: the next one, the hand-off, the close, or the wait for another request. The next
        job and the hand-off wait while the client is not reading what it was sent (resume_writing goes
        on): answers started regardless would pile up here, however slowly it reads."""
        if self.transport is None:
            return
        if self._queue or (self._hand_off and not self._closing):
            if self._write_paused:
                return
            if self._queue:
                self._next()
            else:
                self._do_hand_off()
        elif self._closing:
            if self._unparsed is not None:  # the bytes that were not HTTP: their 400, in its turn
                refusal, self._unparsed = self._unparsed, None
                if not self._close_said:
                    self.transport.write(refusal)
                self._close_lingering()
            elif self._ignoring:  # it stopped reading a request midway: the client may still be sending
                self._close_lingering()
            else:
                self.transport.close()
        else:
            self.transport.resume_reading()
            if self._queue_paused:  # a body it did not read for want of room has its time again
                self._queue_paused = False
                self._body_deadline = self.server.loop.time() + self.server.gate.settings.client_timeout_s
            if self._current is not None or self._tunnelled is not None:
                self._send_continue()
                self._arm_body_deadline()  # a pipelined request's body is on its way: its deadline stands
            else:
                self._arm_idle()

    def _serve_no_more(self) -> None:
        """An answer said, or is about to say, `Connection: close` (aiohttp's through the tunnel, or our
        503 when the internal listener is unreachable): no request after it is served (RFC 9112 9.6). What
        waits, or is arriving, gives its budget back; what still comes is dropped until the connection
        closes."""
        self._closing = self._ignoring = self._dropping = True
        self._hand_off = False
        self._unparsed = None  # that answer was the last
        self._release_reservation()

    def _hand_off_when_idle(self) -> None:
        if self._task is None and not self._queue:
            self._do_hand_off()
        else:
            self._hold_for_hand_off()

    def _hold_for_hand_off(self) -> None:
        """Bytes for aiohttp wait behind the answer in hand: past what a head may hold, no more are read
        until the hand-off (reading on, a client that leaves is noticed, and its request cancelled)."""
        if len(self._raw) > _MAX_HEAD_BYTES and self.transport is not None:
            self.transport.pause_reading()

    def _do_hand_off(self) -> None:
        """Give the connection to aiohttp with every byte of the request it starts with."""
        transport = self.transport
        if transport is None:
            return
        self._cancel_timer()
        self.server.connections.discard(self)
        self.server.handed(transport)
        self.transport = None
        handler = HandedOffGuard(self.server.handoff(), self.server)
        transport.set_protocol(handler)
        handler.connection_made(transport)
        transport.resume_reading()  # first: aiohttp may pause it again as it takes the bytes
        handler.data_received(bytes(self._raw))
        self._raw.clear()

    def _refuse_malformed(self, exc: Exception) -> None:
        """Bytes that are not HTTP: a 400 and the connection closed (what aiohttp answers too)."""
        self._refuse_unparsed(400, "invalid_request", _not_http(exc))

    def _refuse_unparsed(self, status: int, code: str, message: str) -> None:
        """A request the front stopped parsing (not HTTP, or a head past its limits): the error and the
        connection closed; behind an answer in hand, the error in its turn, after the answers before it
        (none of which then says the connection closes), unless one of them closes it for another
        reason. Nothing more is read: what follows cannot be told apart into requests."""
        transport = self.transport
        if transport is None:
            return
        # The target is read before the headers: a refusal of the head knows whose API it was for.
        ollama = self._in_message and self._url.startswith(b"/api/")
        date = self.server.date()
        refusal = _closing_error(status, code, message, "invalid_request_error", date, ollama=ollama)
        closing_already = self._closing  # for another reason, said or to be said by an answer in hand
        self._closing = True
        self._ignoring = True
        self._in_head = False
        self._dropping = True  # read on (a client that leaves is noticed), but parse nothing more
        self._drop_arriving()
        if self._task is not None:
            if not closing_already:
                self._unparsed = refusal  # after the answers before it (_go_on)
            return
        transport.write(refusal)
        self._close_lingering()

    def _close_lingering(self) -> None:
        """Close once the answers are out, without resetting the connection under them: stop sending
        (the client sees the end), drop whatever it still sends, and close when it does or after
        _LINGER_S, whichever comes first."""
        transport = self.transport
        if transport is None or self._linger is not None:
            return
        self._dropping = True
        self._cancel_timer()
        try:
            transport.write_eof()
        except OSError:  # the client is already gone (asyncio's own loop raises here; uvloop does not)
            transport.close()
            return
        transport.resume_reading()
        self._linger = self.server.loop.call_later(_LINGER_S, transport.close)

    # --- answers -------------------------------------------------------------------------------------

    def _head(
        self,
        request: FastRequest,
        status: int,
        reason: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        framing: bytes,
        whole: bool,
    ) -> list[bytes]:
        """The answer's head in pieces, joined once by the caller: each `+=` on a growing head cost a new
        object and a generic add, about a thousand instructions a line."""
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason or _REASONS.get(status, b"Unknown"))]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        for name_s, value_s in answer_headers(request, whole):
            head += (header_bytes(name_s), b": ", header_bytes(value_s), b"\r\n")
        head.append(framing)
        # No answer before the last says the connection closes: after an answer that says close, the client
        # expects no other (RFC 9112 9.6). (A close decided after the last answer's head has left is not
        # said at all; the client sees the connection end.)
        if not request.keep_alive or (self._closing and not self._queue and self._unparsed is None):
            self._closing = self._close_said = True
            head.append(b"Connection: close\r\n")
        head += (b"Date: ", self.server.date(), b"\r\nServer: llm-supervisor\r\n\r\n")
        return head

    def respond(
        self,
        request: FastRequest,
        status: int,
        reason: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """A whole answer in one write (a 204's or 304's without a Content-Length, as they have no body)."""
        if self.transport is None:
            return
        length = b"Content-Length: %d\r\n" % len(body) if status not in NO_BODY_STATUSES else b""
        head = self._head(request, status, reason, headers, length, True)
        head.append(body)
        self._log(request, status)
        # Its key's count goes back before the client can read the end: a client that sends its next
        # request as soon as it has this answer must not find this one still counted (max_concurrent).
        self._give_back(request)
        self.transport.write(b"".join(head))

    def start_stream(
        self, request: FastRequest, status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> None:
        """The head of an answer sent chunk by chunk as the child writes it."""
        if self.transport is None:
            return
        self._streaming = True
        self.transport.write(
            b"".join(self._head(request, status, reason, headers, b"Transfer-Encoding: chunked\r\n", False))
        )

    def write_chunk(self, piece: bytes) -> None:
        if self.transport is not None and piece:
            self.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))

    def write_events(self, piece: bytes) -> None:
        """An SSE stream's piece: whole events leave at once; the start of an event whose end has not come
        yet waits for it (a client cannot use half an event, and a child that dies mid-event must not
        leave one glued to the error event that ends the stream). Held text is bounded (proxy.events_end)."""
        if self._held:
            piece, self._held = self._held + piece, b""
        if piece.endswith(b"\n\n") or piece.endswith(b"\r\n\r\n"):
            self.write_chunk(piece)
            return
        end = events_end(piece)
        self.write_chunk(piece[:end])
        self._held = piece[end:]

    def flush_events(self) -> None:
        """The stream ended: whatever the child wrote last goes out, ended or not."""
        held, self._held = self._held, b""
        self.write_chunk(held)

    def drop_partial_event(self) -> None:
        self._held = b""

    def end_stream(self, request: FastRequest, status: int, whole: bool = True) -> None:
        """The answer sent chunk by chunk has ended: with its last chunk, or, not `whole` (cut short,
        with no error event in its own format to say so), without it and with the connection closed
        once what was written is out, so that the client's HTTP library reports a body cut short
        instead of taking the part for the whole."""
        self._streaming = False
        self._log(request, status)
        self._give_back(request)  # as respond() does
        if self.transport is None:
            return
        if whole:
            self.transport.write(b"0\r\n\r\n")
            return
        self._closing = True
        self.transport.close()

    def _answer_error(self, request: FastRequest, error: SupervisorError) -> int | None:
        """The error in the client's API shape, or, once an answer has begun, the connection closed."""
        if self._streaming or self.transport is None:
            if self.transport is not None:
                self.transport.close()
            return None
        body, headers = error_parts(_as_web(request), error)
        payload = json.dumps(body).encode()
        pairs = [(b"Content-Type", _JSON), *((k.encode(), v.encode()) for k, v in headers.items())]
        self.respond(request, error.status, b"", pairs, payload)
        return error.status

    # --- timers --------------------------------------------------------------------------------------

    # One timer per connection, moved on lazily: a request only notes when the connection will have been
    # idle too long, and the timer, when it fires, acts on what is due then or sleeps until it is (a
    # timer handle made and cancelled for every request was 2-4% of the request's instructions).

    def _set_due(self, due: int, at: float) -> None:
        self._due, self._due_at = due, at
        if self._timer is not None:
            if self._timer_at <= at:
                return  # it fires first, and sleeps again until `at`
            self._timer.cancel()
        self._timer = self.server.loop.call_at(at, self._on_timer)
        self._timer_at = at

    def _on_timer(self) -> None:
        self._timer = None
        due = self._due
        if due == _NOTHING_DUE or self.transport is None:
            return
        if self.server.loop.time() + _TIMER_SLACK_S < self._due_at:  # moved on since it was set
            self._timer = self.server.loop.call_at(self._due_at, self._on_timer)
            self._timer_at = self._due_at
            return
        self._due = _NOTHING_DUE
        if due == _IDLE_DUE:
            self._expired()
        elif due == _HEAD_DUE:
            self._head_too_slow()
        else:
            self._body_too_slow()

    def _cancel_timer(self) -> None:
        """Nothing will be due any more: the connection is gone or aiohttp's."""
        self._due = _NOTHING_DUE
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm_idle(self) -> None:
        """An idle connection closes after the keep-alive timeout, as aiohttp's do; one whose request
        head has begun, then too, or client_timeout_s after the head began, however it trickles in (a
        byte now and then would keep an idle timer from ever firing)."""
        if self.transport is None:
            return
        now = self.server.loop.time()
        idle_at = now + self.server.keepalive_s
        if self._in_head:
            if not self._head_deadline:
                self._head_deadline = now + self.server.gate.settings.client_timeout_s
            if self._head_deadline < idle_at:
                self._set_due(_HEAD_DUE, self._head_deadline)
                return
        self._set_due(_IDLE_DUE, idle_at)

    def _arm_body_deadline(self) -> None:
        """A body must be in within client_timeout_s of its head, however it trickles in."""
        if self.transport is not None:
            self._set_due(_BODY_DUE, self._body_deadline)

    def _expired(self) -> None:
        if (
            self.transport is not None
            and self._task is None
            and self._current is None
            and self._tunnelled is None
        ):
            self.transport.close()

    def _head_too_slow(self) -> None:
        if self._task is None and not self._queue and self._in_head:
            limit = self.server.gate.settings.client_timeout_s
            self._refuse_unparsed(
                408, "request_timeout", f"the request head did not arrive within {limit:g}s"
            )

    def _body_too_slow(self) -> None:
        if self._tunnelled is not None and self._tunnelled.continue_due:
            return  # it waits for its 100 behind an answer in hand; _send_continue sets its deadline
        tunnelled, self._tunnelled = self._tunnelled, None
        if tunnelled is not None:  # aiohttp's request: it would have answered 408 and closed too
            # Its share goes back now: the refusal's request holds none. (A request of ours holds its own
            # share, given back once its refusal has been answered.)
            self._give_back(tunnelled)
            request: FastRequest | None = tunnelled.request
        else:
            request, self._current = self._current, None
        if request is None:
            return
        limit = self.server.gate.settings.client_timeout_s
        self._refuse_in_turn(
            request,
            SupervisorError("request_timeout", f"the request body did not arrive within {limit:g}s", 408),
        )

    def _drop_arriving(self) -> None:
        """The request whose body is arriving will never be served: its budget goes back now."""
        self._give_back(self._current)
        self._give_back(self._tunnelled)
        self._current = self._tunnelled = None

    def _release_reservation(self) -> None:
        """Nothing on this connection will be served: what arrives and what waits give their budget back."""
        self._drop_arriving()
        for job in self._queue:
            self._give_back(job)
        self._queue.clear()


def answer_headers(request: FastRequest, whole: bool) -> list[tuple[str, str]]:
    """What the aiohttp app's on_response_prepare hooks add: X-Request-Id, Server-Timing, CORS."""
    trace = request.trace
    out = [("X-Request-Id", trace.request_id)]
    if trace.acquired:
        total_s = perf_counter() - trace.arrived if whole else None
        out.append(("Server-Timing", trace.server_timing(total_s)))
    out.extend(cors_allow(_as_web(request)))
    return out


def _as_web(request: FastRequest) -> web.Request:
    """The fast request where a function typed for aiohttp's reads only what FastRequest has."""
    return request  # type: ignore[return-value]
