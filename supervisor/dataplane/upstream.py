"""Connections to the children: one request at a time on each, kept open between requests when the child
allows it, and the response handed on piece by piece from the socket callback that received it.

llama-server ends every streamed answer by closing its connection (its chunked-content provider reports
the final call as a failure, which cpp-httplib answers by closing), while still saying `Keep-Alive`; so a
stream asks for `Connection: close` and its connection is never reused. What a stream can still be spared
is the connect itself: after a stream the pool opens a spare connection in the background (`warm`), so
the next stream to that child starts on an open socket. llama-server drops connections idle for 5 s;
pooled ones older than `IDLE_S` are closed rather than used.

httptools (llhttp, the parser of Node.js and uvicorn) reads the child's response; its callbacks run
inside `data_received`, so a body piece reaches the client's socket without a task switch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import monotonic, perf_counter
from typing import Final, cast

import httptools
import structlog

from supervisor import errors

log = structlog.get_logger("upstream")

IDLE_S: Final = 3.0  # below llama-server's 5 s keep-alive timeout, so no pooled connection is one it dropped
SPARES: Final = 1  # open connections kept ready per child for the next stream
# An EOF this soon after sending on a pooled connection is the child's idle close, not a crash.
_STALE_CONNECTION_S: Final = 0.1

Sink = Callable[[bytes], None]
# Where a connection goes: (host, port), or a Unix socket's path (a child's: workers/base.py Endpoint).
Address = tuple[str, int] | str


class UpstreamLost(Exception):
    """The connection to the child ended before the response head.

    `unread` is True when the child cannot have read the request (refused, reset with our bytes unread, or
    a pooled connection closed just as we sent): sending it again is safe. False when the child may have
    read it and died working on it: a crash, never to be retried behind the client's back.
    """

    def __init__(self, reason: str, unread: bool) -> None:
        super().__init__(reason)
        self.unread = unread


class UpstreamCut(Exception):
    """The connection ended in the middle of the response body (the child died mid-answer)."""


class Exchange:
    """One request sent to a child and its response: the head (awaited), then body pieces, handed to a
    sink once one is attached (kept until then), then the end (awaited)."""

    __slots__ = (
        "_pending",
        "_sink",
        "connection",
        "done",
        "first_piece_at",
        "head",
        "headers",
        "keep_alive",
        "last",
        "old",
        "older",
        "raw",
        "reason",
        "received",
        "status",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, raw: bool = False) -> None:
        self.raw = raw  # the sink gets the response's bytes as they came, head and framing included
        self.head: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.reason = b""
        # Each header line as (its name in lower case, its name, its value), lowered once as it is parsed
        # (as the front keeps the client's: front.Line) for the length, the content type and the filter.
        self.headers: list[tuple[bytes, bytes, bytes]] = []
        self.keep_alive = False
        self.received = False  # any byte of the response came back
        self.first_piece_at: float | None = None  # perf_counter of the first body piece
        self.older = self.old = self.last = b""  # the last three pieces: where a stream's usage is
        self._pending: list[bytes] = []
        self._sink: Sink | None = None
        self.connection: UpstreamConnection | None = None

    def header(self, lowered: bytes) -> bytes | None:
        """The value of the first header line of that (lower-case) name, as sent; None if there is none."""
        for name, _, value in self.headers:
            if name == lowered:
                return value
        return None

    @property
    def media_type(self) -> bytes:
        """The answer's media type, lowered, without parameters (b"text/event-stream"); b"" if none."""
        value = self.header(b"content-type")
        return b"" if value is None else value.split(b";")[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            return None

    def attach(self, sink: Sink) -> None:
        """From now on every body piece goes to `sink` as it arrives; those that came already go first."""
        pending, self._pending = self._pending, []
        for piece in pending:
            sink(piece)
        self._sink = sink

    def body(self) -> bytes:
        """The body received so far, for an exchange with no sink (a whole answer, read to its end)."""
        return b"".join(self._pending)

    def tail(self) -> bytes:
        return self.older + self.old + self.last

    def pause(self) -> None:
        """Stop reading from the child (its socket buffer fills and the engine waits): the client is slow."""
        if self.connection is not None and self.connection.transport is not None:
            self.connection.transport.pause_reading()

    def resume(self) -> None:
        if self.connection is not None and self.connection.transport is not None:
            self.connection.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection unless the response has ended: the child sees it and stops generating.
        Nobody waits for this exchange any more, so the loss is not reported to it."""
        connection, self.connection = self.connection, None
        if connection is not None:  # still set: the response has not ended (awaiting `done` and being
            # cancelled cancels that future, so its state says nothing here)
            connection.exchange = None
            connection.abort()

    # --- from the connection -----------------------------------------------------------------------

    def _piece(self, piece: bytes) -> None:
        if self.first_piece_at is None:
            self.first_piece_at = perf_counter()
        self.older, self.old, self.last = self.old, self.last, piece
        if self._sink is not None:
            self._sink(piece)
        else:
            self._pending.append(piece)

    def _lost(self, exc: BaseException | None, unread: bool) -> None:
        if not self.head.done():
            self.head.set_exception(UpstreamLost(_reason(exc), unread))
        elif not self.done.done():
            self.done.set_exception(UpstreamCut(_reason(exc)))


def _ends_at_close(exchange: Exchange) -> bool:
    """An answer whose head is in, with neither a length nor chunks: HTTP/1.1 ends its body at the
    connection's close (RFC 9112 6.3). Neither engine answers so; one that did would otherwise read as
    cut short."""
    return (
        exchange.head.done()
        and exchange.status not in (204, 304)
        and exchange.header(b"content-length") is None
        and exchange.header(b"transfer-encoding") is None
    )


def _reason(exc: BaseException | None) -> str:
    if exc is not None:
        log.debug("upstream_connection_lost", error=repr(exc))  # what the client's message leaves out
    return errors.connection_failure(exc)


def _then(first: UpstreamLost, second: UpstreamLost) -> str:
    return str(first) if str(first) == str(second) else f"{first}; then {second}"


class UpstreamConnection(asyncio.Protocol):
    """One connection to a child, carrying one exchange at a time."""

    def __init__(self, pool: UpstreamPool, key: Address) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.pooled = False  # taken from the pool: it may be one the child has just closed
        self.idle_since = monotonic()
        self.sent_at = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._arrived: list[bytes] = []  # the body pieces parsed from the bytes being fed (on_body)
        self._interim = False  # the head parsed is a 1xx one: the final answer follows it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def send(self, data: bytes, exchange: Exchange) -> None:
        assert self.transport is not None
        self.exchange = exchange
        exchange.connection = self
        self.sent_at = monotonic()
        self.transport.write(data)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # nothing asked: a child that talks out of turn is not to be trusted
            self.abort()
            return
        exchange.received = True
        if exchange.raw:
            exchange._piece(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._hand_on(exchange)
            self.exchange = None
            exchange._lost(exc, unread=False)
            self.abort()
            return
        self._hand_on(exchange)

    def _hand_on(self, exchange: Exchange) -> None:
        """The body pieces these bytes held, as one: they arrived together, so they leave together, in
        one write to the client (llama-server writes each SSE event on its own; a read often holds two
        or more, and a write per event doubled the system calls). Nothing waits: this runs in the
        callback that read them."""
        arrived = self._arrived
        if arrived:
            piece = arrived[0] if len(arrived) == 1 else b"".join(arrived)
            arrived.clear()
            exchange._piece(piece)

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says what it meant

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool._forget(self)
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        if exc is None and _ends_at_close(exchange):  # its body ran to the close: it is whole
            exchange.connection = None
            if not exchange.done.done():
                exchange.done.set_result(None)
            return
        exchange._lost(exc, unread=not exchange.received and self._unread(exc))

    def _unread(self, exc: BaseException | None) -> bool:
        """The connection failed in a way that says the child never read the request: reset with our bytes
        in its buffer, or a pooled connection the child closed (idle) just before our request crossed."""
        if isinstance(exc, ConnectionResetError | BrokenPipeError):
            return True
        return self.pooled and monotonic() - self.sent_at < _STALE_CONNECTION_S

    # --- httptools callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.exchange is None:  # a second response, to nothing we sent: the connection is not to be reused
            self.abort()

    def on_status(self, status: bytes) -> None:
        if self.exchange is not None:
            self.exchange.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.headers.append((name.lower(), name, value))

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            status = self._parser.get_status_code()
            if 100 <= status < 200 and status != 101:  # 100 Continue, 103 Early Hints: the answer follows
                self._interim = True
                exchange.headers.clear()
                exchange.reason = b""
                return
            exchange.status = status
            exchange.keep_alive = self._parser.should_keep_alive()
            if not exchange.head.done():  # cancelled when its waiter was
                exchange.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None and not self.exchange.raw:
            self._arrived.append(body)  # handed on once the bytes are parsed (_hand_on)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        keep = exchange.keep_alive and not self.closed
        exchange.connection = None
        if not exchange.done.done():
            exchange.done.set_result(None)
        self.pool._finished(self, keep)


class UpstreamPool:
    """Every connection to the children, by address: the idle ones ready for reuse, and spares."""

    def __init__(self) -> None:
        self._idle: dict[Address, list[UpstreamConnection]] = {}
        self._spare: dict[Address, list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._warming: set[asyncio.Task[None]] = set()
        self._opening: dict[Address, int] = {}  # spares being opened, by address (counted with the open)
        self.closing = False
        self.loop = asyncio.get_running_loop()  # once: on Python 3.11 each lookup is a getpid() call

    async def exchange(
        self, address: Address, data: bytes, *, fresh: bool = False, raw: bool = False
    ) -> Exchange:
        """Send `data` (one whole request) and return once the response head is in.

        `fresh` (a request that asked for `Connection: close`) takes a spare or new connection, never a
        used one. A connection lost in a way that says the child never read the request (UpstreamLost's
        `unread`: refused, reset, or a pooled one the child had just closed) is tried once more on a new
        connection; one the child may have read is not, or a child still alive would run it twice.
        Raises UpstreamLost, saying from the last failure whether the child may have read the request.
        `raw`: the exchange's sink gets the response's bytes as they came (see Exchange).
        """
        conn = self._take(address, fresh)
        loop = self.loop
        if conn is None:
            conn = await self._connect(address)
        exchange = Exchange(loop, raw)
        conn.send(data, exchange)
        try:
            await exchange.head
            return exchange
        except UpstreamLost as first:
            if not first.unread:
                raise
            failure = first
        except BaseException:
            exchange.abort()
            raise
        if fresh:
            self.warm(address)  # a spare that turned out dead: have another ready
        try:
            conn = await self._connect(address)
        except UpstreamLost as second:
            raise UpstreamLost(_then(failure, second), second.unread) from None
        exchange = Exchange(loop, raw)
        conn.send(data, exchange)
        try:
            await exchange.head
        except UpstreamLost as second:
            raise UpstreamLost(_then(failure, second), second.unread) from None
        except BaseException:
            exchange.abort()
            raise
        return exchange

    def warm(self, address: Address) -> None:
        """Open a spare connection to the child in the background, if it has none: the next stream's."""
        if self.closing or len(self._spare.get(address, ())) + self._opening.get(address, 0) >= SPARES:
            return
        self._opening[address] = self._opening.get(address, 0) + 1
        task = self.loop.create_task(self._open_spare(address))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _open_spare(self, address: Address) -> None:
        try:
            conn = await self._connect(address)
        except UpstreamLost:
            return  # the child is gone or going; the next request finds out for itself
        finally:
            if self._opening[address] > 1:
                self._opening[address] -= 1
            else:
                del self._opening[address]
        if self.closing:
            conn.abort()
            return
        conn.idle_since = monotonic()
        self._spare.setdefault(address, []).append(conn)

    def _take(self, address: Address, fresh: bool) -> UpstreamConnection | None:
        now = monotonic()
        for table in (self._spare,) if fresh else (self._idle, self._spare):
            found = table.get(address)
            while found:
                conn = found.pop()
                if not conn.closed and now - conn.idle_since < IDLE_S:
                    conn.pooled = True
                    return conn
                conn.abort()
        return None

    async def _connect(self, address: Address) -> UpstreamConnection:
        try:
            if isinstance(address, str):
                _, conn = await self.loop.create_unix_connection(
                    lambda: UpstreamConnection(self, address), address
                )
            else:
                _, conn = await self.loop.create_connection(
                    lambda: UpstreamConnection(self, address), *address
                )
        except OSError as exc:
            raise UpstreamLost(_reason(exc), unread=True) from None
        self._all.add(conn)
        return conn

    def _finished(self, conn: UpstreamConnection, keep: bool) -> None:
        if keep and not self.closing:
            conn.idle_since = monotonic()
            if conn.transport is not None:
                # A slow client may have paused it (Exchange.pause) with the answer's last bytes, which a
                # tunnelled exchange's sink gets before they are parsed: pooled paused, the next request on
                # it would never be answered.
                conn.transport.resume_reading()
            self._idle.setdefault(conn.key, []).append(conn)
        elif conn.transport is not None:
            conn.closed = True
            conn.transport.close()

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        for table in (self._idle, self._spare):
            found = table.get(conn.key)
            if found is not None and conn in found:
                found.remove(conn)
                if not found:
                    del table[conn.key]

    def close(self) -> None:
        """Close every connection (at shutdown, after the requests have drained)."""
        self.closing = True
        for task in self._warming:
            task.cancel()
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        self._spare.clear()
