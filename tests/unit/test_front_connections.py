"""A front connection's requests, each served by a task of its own, on real sockets: in order on a
kept-alive connection, no task left behind between requests or when the connection closes or is handed to
aiohttp, a fault in serving answered with a 500 on a connection that goes on, and a connection closed
once it has been idle for the keep-alive timeout, however many requests came before.

`serve` is a stand-in for relay.serve (which needs a scheduler and a child): it answers at once, or
raises, as the test asks; the front, aiohttp's request handler and the client's sockets are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from supervisor.access import AccessControl
from supervisor.api.context import ACCESS
from supervisor.api.middleware import front_refusals
from supervisor.config import Settings
from supervisor.dataplane.front import REFUSED_TARGET, FastRequest, FrontConnection, FrontServer
from supervisor.dataplane.handoff import new_handler
from supervisor.dataplane.upstream import UpstreamPool
from supervisor.keys import KeyEntry, KeyRing

BODY = b'{"model": "m"}'


def _post(path: str = "/v1/chat/completions", body: bytes = BODY) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


class Front:
    def __init__(self, server: FrontServer, port: int) -> None:
        self.server = server
        self.port = port
        self.served: list[bytes] = []
        self.release = asyncio.Event()  # what /api/stream?held=1 waits for after its first line

    def tasks(self) -> set[asyncio.Task[Any]]:
        """The tasks running now, but the test's own."""
        return asyncio.all_tasks() - {asyncio.current_task()}


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    app = web.Application(middlewares=[front_refusals])  # as the daemon's app has it (app.build_app)
    app[ACCESS] = AccessControl(Settings(), KeyRing([]))
    front: Front | None = None

    async def tags(request: web.Request) -> web.Response:
        return web.json_response({"models": []})

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def closing(request: web.Request) -> web.Response:
        response = web.Response(text="bye")
        response.force_close()  # aiohttp's answer says `Connection: close`
        return response

    async def stream(request: web.Request) -> web.StreamResponse:
        """`?n=` NDJSON lines, as the Ollama API streams an answer; with `held`, the rest of them once the
        test sets `release`."""
        assert front is not None
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for n in range(int(request.query["n"])):
            await asyncio.sleep(0.01)
            await response.write(b'{"n": %d}\n' % n)
            if n == 0 and "held" in request.query:
                await front.release.wait()
        await response.write_eof()
        return response

    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/stream", stream)
    app.router.add_post("/v1/closing", closing)
    app.router.add_post("/v1/echo", echo)  # a route of aiohttp's that the front tunnels to it
    app.router.add_post("/api/echo", echo)  # one that takes the connection with it (as the Ollama API's)
    runner = web.AppRunner(app)
    await runner.setup()
    internal = web.TCPSite(runner, "127.0.0.1", 0)  # the app's internal listener, as the daemon has it
    await internal.start()
    internal_port = runner.addresses[0][1]

    async def serve(conn: FrontConnection, request: FastRequest, body: bytes) -> int:
        assert front is not None
        front.served.append(body)
        if body == b'{"model": "fault"}':
            raise RuntimeError("a fault of ours")
        conn.respond(request, 200, b"", [(b"Content-Type", b"text/plain")], b"ok %d" % len(front.served))
        return 200

    assert runner.server is not None
    handoff = functools.partial(new_handler, runner.server)  # as the daemon hands over (app.serve)
    server = FrontServer(app, handoff, UpstreamPool(), serve, 5.0, ("127.0.0.1", internal_port))
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    front = Front(server, listener.sockets[0].getsockname()[1])
    try:
        yield front
    finally:
        listener.close()
        server.close_all()
        await runner.cleanup()


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head, body = await _answer_with_head(reader)
    return head.split(b" ")[1], body


async def _answer_with_head(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


async def _settled(front: Front, count: int) -> None:
    for _ in range(200):
        if len(front.tasks()) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(front.tasks())} tasks running, not {count}: {front.tasks()}")


async def test_a_kept_alive_connection_holds_no_task_between_requests(front: Front) -> None:
    before = len(front.tasks())
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    for n in range(1, 4):  # in turn, and then two in one write
        writer.write(_post())
        assert await _answer(reader) == (b"200", b"ok %d" % n)
        await _settled(front, before)  # the request's task has ended
    writer.write(_post() + _post())
    assert [await _answer(reader) for _ in range(2)] == [(b"200", b"ok 4"), (b"200", b"ok 5")]
    writer.close()
    await _settled(front, before)


async def test_a_connection_handed_to_aiohttp_leaves_no_task_behind(front: Front) -> None:
    before = len(front.tasks())
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post())
    assert await _answer(reader) == (b"200", b"ok 1")
    writer.write(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")  # the Ollama API: aiohttp's
    status, body = await _answer(reader)
    assert (status, body) == (b"200", b'{"models": []}')
    assert not front.server.connections  # the connection is aiohttp's now
    # aiohttp's handler has a task of its own for the connection; the front has none left.
    await _settled(front, before + 1)
    writer.close()
    await _settled(front, before)


async def test_a_fault_in_serving_is_a_500_and_the_connection_goes_on(front: Front) -> None:
    before = len(front.tasks())
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post(body=b'{"model": "fault"}') + _post())
    status, body = await _answer(reader)
    assert status == b"500"
    assert b"internal error" in body
    assert await _answer(reader) == (b"200", b"ok 2")  # the next one is served all the same
    writer.close()
    await _settled(front, before)


async def test_a_connection_closes_once_idle_for_the_keep_alive_timeout_and_not_before(front: Front) -> None:
    """The timer is moved on lazily (a request only notes the new deadline): a connection busy for
    several timeouts in a row stays open, and closes one timeout after its last answer. The bounds are
    loose: only a stall of most of a second between two requests could close it early."""
    front.server.keepalive_s = 1.0
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    started = loop.time()
    n = 0
    while loop.time() - started < 3.5:  # three and a half timeouts, a request every 0.1 s
        writer.write(_post())
        n += 1
        assert await _answer(reader) == (b"200", b"ok %d" % n)
        await asyncio.sleep(0.1)
    last = loop.time()
    assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the front
    idle = loop.time() - last
    assert idle >= 0.75, idle
    writer.close()


async def test_a_connection_with_no_request_closes_after_the_keep_alive_timeout(front: Front) -> None:
    front.server.keepalive_s = 0.3
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")  # a head that never ends
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


# --- a request's head: bounded as aiohttp bounds it --------------------------------------------------------


def _post_with(headers: bytes, target: bytes = b"/v1/chat/completions") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: localhost\r\n%sContent-Length: %d\r\n\r\n%s" % (
        target,
        headers,
        len(BODY),
        BODY,
    )


async def _refused(front: Front, data: bytes) -> tuple[bytes, Any]:
    """What the front answers `data` with, and that it then closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(data)
    status, body = await _answer(reader)
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed: what follows cannot be parsed
    writer.close()
    return status, json.loads(body)["error"]


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        (b"".join(b"X-%d: v\r\n" % n for n in range(95)), "more than 96 header lines"),
        (b"X-Big: " + b"v" * 8184 + b"\r\n", "a header of more than 8188 bytes"),
        (b"".join(b"X-%d: %s\r\n" % (n, b"v" * 8000) for n in range(9)), "more than 65536 bytes of headers"),
    ],
    ids=["lines", "line", "total"],
)
async def test_a_head_past_its_limits_is_a_431_that_says_which(
    front: Front, headers: bytes, why: str
) -> None:
    status, error = await _refused(front, _post_with(headers))
    assert status == b"431"
    assert error["code"] == "header_too_large"
    assert error["message"] == f"request header fields too large: {why}"
    assert not front.served


async def test_a_target_past_8190_bytes_is_a_414(front: Front) -> None:
    status, error = await _refused(front, _post_with(b"", b"/v1/chat/completions?" + b"q" * 8170))
    assert status == b"414"
    assert error["code"] == "uri_too_long"
    assert not front.served


async def test_a_head_just_within_every_limit_is_served(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    lines = b"".join(b"X-%d: v\r\n" % n for n in range(93))  # with Host, X-Big, Content-Length: 96
    writer.write(
        _post_with(lines + b"X-Big: " + b"v" * 8183 + b"\r\n", b"/v1/chat/completions?" + b"q" * 8169)
    )
    assert await _answer(reader) == (b"200", b"ok 1")
    writer.close()


async def test_a_route_of_aiohttps_gets_the_same_limits(front: Front) -> None:
    lines = b"".join(b"X-%d: v\r\n" % n for n in range(200))
    head = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + lines
    status, error = await _refused(front, head + b"\r\n")
    assert status == b"431"
    assert error["code"] == "header_too_large"


@pytest.mark.parametrize(
    ("request_bytes", "status", "message"),
    [
        (b"POST /api/chat HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"400", "more than one Host header"),
        (b"POST /api/chat HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", b"400", "needs a Host header"),
        (b"POST /api/chat HTTP/1.1\r\nHost: a\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n", b"431", "too large"),
        (b"GET /api/tags?q=" + b"q" * 8200 + b" HTTP/1.1\r\nHost: a\r\n\r\n", b"414", "target is longer"),
        (b"GET /api/tags HTTP/2.0\r\nHost: a\r\n\r\n", b"505", "only HTTP/1.1 and HTTP/1.0"),
    ],
    ids=["two-hosts", "no-host", "header", "target", "version"],
)
async def test_a_refusal_of_an_ollama_request_s_head_is_in_ollamas_shape(
    front: Front, request_bytes: bytes, status: bytes, message: str
) -> None:
    """They came in OpenAI's shape, which an Ollama client shows as a whole dict for the message."""
    got, error = await _refused(front, request_bytes)
    assert got == status
    assert isinstance(error, str)
    assert message in error


@pytest.mark.parametrize(
    "start",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Endless: ",
        b"GET /v1/models HTTP/1.1\r\nX-",
        # A chunked upload's trailer: httptools holds its lines as it holds the head's.
        b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: ",
    ],
    ids=["value", "name", "trailer"],
)
async def test_a_head_sent_past_its_limit_is_answered_though_most_of_it_is_never_read(
    front: Front, start: bytes
) -> None:
    """A header line httptools has not seen the end of is past every callback: the front counts the
    head's chunks. What it did not read is dropped while the connection lingers, so the client gets
    the 431 rather than a reset."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(start + b"v" * (1 << 20))
    await writer.drain()
    status, body = await _answer(reader)
    assert status == b"431"
    assert json.loads(body)["error"]["message"] == (
        "request header fields too large: a line of more than 65536 bytes"
    )
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


async def test_a_head_that_never_ends_costs_the_front_no_memory(front: Front) -> None:
    """200 MiB of header lines took the daemon from 58 MiB to 4.4 GiB before heads were bounded. Now
    the front keeps at most a head's limit and a read: sending 32 MiB of them allocates a few KiB."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    peak = await _peak_sending(writer, b"X-a: b\r\n" * 8192, 32 << 20)
    assert peak < 4 << 20, peak
    writer.close()


async def _peak_sending(writer: asyncio.StreamWriter, chunk: bytes, total: int) -> int:
    """The most memory traced while `total` bytes of `chunk`s go to the front (or until it closes)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(ConnectionError):
            for _ in range(total // len(chunk)):
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 10)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def test_an_answer_in_hand_is_finished_before_a_head_past_its_limits_gets_its_431(
    front: Front,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post() + _post_with(b"X-Big: " + b"v" * 9000 + b"\r\n"))
    assert await _answer(reader) == (b"200", b"ok 1")
    assert (await _answer(reader))[0] == b"431"
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert len(front.served) == 1
    writer.close()


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n",
            "more than one Host",
        ),
        (b"POST /v1/chat/completions HTTP/1.1\r\n", "an HTTP/1.1 request needs a Host"),
        (b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nhost: localhost\r\n", "more than one Host"),
    ],
    ids=["two", "none", "two-for-aiohttp"],
)
async def test_a_request_without_exactly_one_host_is_a_400(front: Front, head: bytes, message: str) -> None:
    """RFC 9112 3.2: the Host check (DNS rebinding) and whatever stands in front of the daemon must not
    each read a different one."""
    status, error = await _refused(front, head + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
    assert status == b"400"
    assert error["message"] == f"bad request: {message} header"
    assert not front.served


async def test_an_http_1_0_request_needs_no_host(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"GET /api/tags HTTP/1.0\r\n\r\n")
    assert await _answer(reader) == (b"200", b'{"models": []}')
    writer.close()


async def test_a_pipelined_uploads_body_keeps_its_deadline_after_the_answer_before_it(front: Front) -> None:
    """The answer before it ended by arming the idle timer, which does not close a connection with a body
    on its way: an upload that never came held the connection, and its share of max_buffered_mib,
    for ever."""
    front.server.gate = AccessControl(Settings(client_timeout_s=0.5), KeyRing([]))
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(
        _post() + b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    assert await _answer(reader) == (b"200", b"ok 1")
    status, _ = await _answer(reader)
    assert status == b"408"
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert front.server.gate.buffered_bytes == 0
    writer.close()


async def test_a_request_behind_one_for_aiohttp_in_the_same_read_is_aiohttps_alone(front: Front) -> None:
    """The front handed the connection over with every byte of the read, and also served the request
    that followed in it: aiohttp then answered it a second time."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n" + _post())
    assert await _answer(reader) == (b"200", b'{"models": []}')
    status, _ = await _answer(reader)
    assert status in (b"404", b"405")  # aiohttp's answer: the fixture's app has no such route
    assert not front.served
    writer.close()


def _answers_held(front: Front) -> asyncio.Event:
    """Every request's answer waits until the event is set: later requests arrive behind one in hand."""
    release = asyncio.Event()
    serve = front.server.serve

    async def held(conn: FrontConnection, request: FastRequest, body: bytes) -> int:
        await release.wait()
        status: int = await serve(conn, request, body)
        return status

    front.server.serve = held
    return release


async def test_a_refusal_behind_an_answer_gives_an_uploads_budget_back_at_once(front: Front) -> None:
    release = _answers_held(front)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(
        _post() + b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    gate = front.server.gate
    for _ in range(200):
        if gate.buffered_bytes > len(BODY):
            break
        await asyncio.sleep(0.01)
    assert gate.buffered_bytes > len(BODY)  # the first body's, and the upload's share as its head came
    writer.write(b"zz\r\n")  # not a chunk size: nothing after it can be parsed
    for _ in range(200):
        if gate.buffered_bytes == len(BODY):
            break
        await asyncio.sleep(0.01)
    assert gate.buffered_bytes == len(BODY)  # the upload's given back while the answer before it is in hand
    release.set()
    assert await _answer(reader) == (b"200", b"ok 1")
    assert (await _answer(reader))[0] == b"400"  # the chunk size that is not one, in its turn
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


# --- RFC 9112 9.6: an answer that says `Connection: close` is the connection's last ----------------------


async def _answers_until_closed(reader: asyncio.StreamReader) -> list[tuple[bytes, bytes]]:
    """Every answer (status, head) until the front closes the connection."""
    answers = []
    while head := await asyncio.wait_for(reader.read(4096), 10):
        while True:  # an answer's head, then its Content-Length of body
            if b"\r\n\r\n" not in head:
                head += await asyncio.wait_for(reader.read(4096), 10)
                continue
            start, _, rest = head.partition(b"\r\n\r\n")
            length = int(start.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(rest) < length:
                rest += await asyncio.wait_for(reader.readexactly(length - len(rest)), 10)
            answers.append((start.split(b" ")[1], start))
            head = rest[length:]
            if not head:
                break
    return answers


def _says_close(head: bytes) -> bool:
    return b"\r\nconnection: close" in head.lower()


async def test_nothing_pipelined_behind_a_request_that_says_close_is_served(front: Front) -> None:
    """RFC 9112 9.6: after the answer to a request with `Connection: close`, no further request on the
    connection is processed, and no answer before that one says close (each of them did)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    close = _post_with(b"Connection: close\r\n")
    writer.write(_post() + close + _post() + b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")
    answers = await _answers_until_closed(reader)
    assert [status for status, _ in answers] == [b"200", b"200"]
    assert [_says_close(head) for _, head in answers] == [False, True]
    assert front.served == [BODY, BODY]
    assert front.server.gate.buffered_bytes == 0
    writer.close()


async def test_only_the_refusal_behind_answers_says_close(front: Front) -> None:
    """A head past its limits behind two requests: both are answered, then it gets its 431, then the
    connection closes; only the 431 says so (an earlier answer saying close would end the connection
    there)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post() + _post() + _post_with(b"X-Big: " + b"v" * 9000 + b"\r\n"))
    answers = await _answers_until_closed(reader)
    assert [status for status, _ in answers] == [b"200", b"200", b"431"]
    assert [_says_close(head) for _, head in answers] == [False, False, True]
    writer.close()


async def test_a_tunnelled_request_that_says_close_ends_the_connection(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(
        b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi"
        + _post()
    )
    answers = await _answers_until_closed(reader)
    assert [status for status, _ in answers] == [b"200"]
    assert _says_close(answers[0][1])
    assert not front.served
    writer.close()


async def test_nothing_pipelined_behind_an_answer_of_aiohttps_that_says_close_is_served(front: Front) -> None:
    """aiohttp may end a connection of its own accord; the front served the requests queued behind."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"POST /v1/closing HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n" + _post())
    answers = await _answers_until_closed(reader)
    assert [status for status, _ in answers] == [b"200"]
    assert _says_close(answers[0][1])
    assert not front.served
    assert front.server.gate.buffered_bytes == 0
    writer.close()


@pytest.mark.parametrize(("client_timeout_s", "held_s"), [(60.0, 0.1), (0.5, 1.0)], ids=["short", "long"])
async def test_a_pipelined_upload_that_expects_100_continue_gets_it_after_the_answer_before_it(
    front: Front, client_timeout_s: float, held_s: float
) -> None:
    """`Expect: 100-continue` behind an answer in hand: the 100 cannot go out in the middle of that
    answer; it went out never, and the client waited (curl gives up waiting after a second). Its
    body's deadline counts from the 100: it ran from its head, so an answer in hand longer than
    client_timeout_s ("long") made it a 408 before it was ever told to send."""
    front.server.gate = AccessControl(Settings(client_timeout_s=client_timeout_s), KeyRing([]))
    release = _answers_held(front)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(
        _post() + b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
        b"Content-Length: 5\r\n\r\n"
    )
    await asyncio.sleep(held_s)
    release.set()
    assert await _answer(reader) == (b"200", b"ok 1")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    assert await _answer(reader) == (b"200", b"hello")
    writer.close()


# --- pipelining, fuzzed: any mix of requests, cut anywhere, answered once each and in order --------------

# A request of a kind the front serves itself, tunnels to aiohttp or hands the connection over with, and
# what it is answered with. The stand-in `serve` below answers a body with itself (after a pause, for a
# "slow" one, so that later requests arrive behind an answer in hand); aiohttp's /v1/echo and /api/echo
# answer with the body they read.
SERVED_HERE = ("fast", "slow", "fault")
KINDS = (*SERVED_HERE, "tunnelled", "chunked", "expects", "handed")


def _pipelined_request(kind: str, n: int, size: int) -> tuple[bytes, tuple[bytes, bytes]]:
    """The request's bytes, and the (status, body) it must be answered with."""
    padding = b"x" * size
    if kind in SERVED_HERE:
        body = b'{"model": "%s", "n": %d, "pad": "%s"}' % (kind.encode(), n, padding)
        return _post(body=body), (b"500" if kind == "fault" else b"200", body)
    body = b"upload %d %s" % (n, padding)
    head = b"POST /%s/echo HTTP/1.1\r\nHost: localhost\r\n" % (b"api" if kind == "handed" else b"v1")
    if kind == "chunked":
        half = len(body) // 2
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]) if part)
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n", (b"200", body)
    if kind == "expects":
        head += b"Expect: 100-continue\r\n"
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body), (b"200", body)


Example = tuple[list[tuple[str, int]], bool, list[float]]  # (kind, size) per request; close; cut points


def _pipelining_examples() -> list[Example]:
    """Drawn up front (as tests/integration/test_fuzz.py does): @given does not drive async fixtures."""
    examples: list[Example] = []

    @settings(max_examples=60, database=None, derandomize=True, phases=[Phase.generate])
    @given(
        st.lists(
            st.tuples(st.sampled_from(KINDS), st.sampled_from([0, 10, 3000, 70_000])), min_size=1, max_size=6
        ),
        st.booleans(),
        st.lists(st.floats(0, 1), max_size=8),
    )
    def collect(requests: list[tuple[str, int]], close: bool, cuts: list[float]) -> None:
        examples.append((requests, close, cuts))

    collect()
    return examples


async def _next_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next final answer (interim 100s skipped), or None once the connection has closed."""
    while True:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise AssertionError(f"the connection closed in an answer: {exc.partial!r}") from exc
            return None
        status = head.split(b" ")[1]
        if status == b"100":
            continue
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return status, await reader.readexactly(length)


async def test_pipelined_requests_cut_anywhere_are_each_answered_once_in_order(front: Front) -> None:
    """The bugs found in the front by reading it (a request served twice behind a hand-off, an upload's
    deadline lost behind an answer) were all about where a read ends among pipelined requests. Here
    hypothesis makes the mixes and the cuts: requests the front serves, slow ones, faults, uploads
    tunnelled to aiohttp (with a length, chunked, or expecting 100 Continue), requests that hand the
    connection over, bodies from 0 to 70 KB, sometimes the last asking to close. Each answer must come
    once, in order, and be the right one; nothing may stay reserved.

    A request that hands the connection over is handed over only at the start of a read (the front
    keeps no bytes of a read it has begun to serve from); pipelined further in, the connection closes
    after the answers before it (the client sends it again, RFC 9112 9.3.2). Either may happen here,
    as the kernel joins the cuts. After a hand-off, aiohttp answers what follows: 404 for the routes
    the front serves (the fixture's app has none of them), or a close rather than reading their body."""

    async def serve(conn: FrontConnection, request: FastRequest, body: bytes) -> int:
        front.served.append(body)
        if b'"slow"' in body:
            await asyncio.sleep(0.02)
        if b'"fault"' in body:
            raise RuntimeError("a fault of ours")
        conn.respond(request, 200, b"", [(b"Content-Type", b"application/json")], body)
        return 200

    front.server.serve = serve
    for requests, close, cuts in _pipelining_examples():
        front.served.clear()
        data, expected = b"", []
        for n, (kind, size) in enumerate(requests):
            sent, answer = _pipelined_request(kind, n, size)
            if close and n == len(requests) - 1:
                sent = sent.replace(b"Host: localhost\r\n", b"Host: localhost\r\nConnection: close\r\n")
            data += sent
            expected.append(answer)
        seen = (requests, close, cuts)
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        try:
            start = 0
            for cut in sorted({int(c * len(data)) for c in cuts} | {len(data)}):
                writer.write(data[start:cut])
                await writer.drain()
                await asyncio.sleep(0.002)  # most cuts reach the front as reads of their own
                start = cut
            handed = closed = False
            for index, ((kind, _), (status, body)) in enumerate(zip(requests, expected, strict=True)):
                got = await _next_answer(reader)
                if got is None and (kind == "handed" or (handed and kind in SERVED_HERE)):
                    closed = True
                    break
                assert got is not None, (seen, index)
                if handed and kind in SERVED_HERE:
                    assert got[0] == b"404", (seen, got)
                    continue
                handed = handed or kind == "handed"
                assert got[0] == status, (seen, got)
                if status == b"200":
                    assert got[1] == body, seen
            if not closed:
                if not close:
                    writer.write_eof()  # then the connection ends: no answer comes that was not asked for
                assert await _next_answer(reader) is None, seen
            first_handed = next(
                (n for n, (kind, _) in enumerate(requests) if kind == "handed"), len(requests)
            )
            served_here = [
                body
                for (_, body), (kind, _) in zip(expected[:first_handed], requests, strict=False)
                if kind in SERVED_HERE
            ]
            assert front.served == served_here, seen
        finally:
            writer.close()
        for _ in range(200):  # what the answers held is given back as each one's task ends
            if front.server.gate.buffered_bytes == 0:
                break
            await asyncio.sleep(0.01)
        assert front.server.gate.buffered_bytes == 0, seen


# --- the body budget: not for a caller the gate would refuse ---------------------------------------------


async def test_a_caller_without_a_key_holds_none_of_the_body_budget(front: Front) -> None:
    """A request for aiohttp took its share of max_buffered_mib (a chunked upload, or a declared length:
    up to max_body_mib each) before any key was checked. Four such heads from a client with no key, their
    bodies never sent, held the whole 256 MiB for client_timeout_s, and every request with a body, from
    every caller, was answered 503 meanwhile."""
    key = "team-key-0123456789"
    front.server.gate = AccessControl(Settings(), KeyRing([KeyEntry(name="team", key=key)]))
    uploads = [
        b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"POST /v1/admin/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"PUT /v1/anything HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\nContent-Length: 9\r\n\r\n",
        # A route that needs no key takes no body from a caller without one (the reviewer's way round).
        b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"GET /health HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
    ]
    held = []
    for upload in uploads:
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        held.append(writer)
        writer.write(upload)
        status, body = await _answer(reader)
        assert status == b"401", body
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key"
        assert await asyncio.wait_for(reader.read(), 10) == b""  # its body is not waited for
    assert front.server.gate.buffered_bytes == 0
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post_with(b"Authorization: Bearer %s\r\n" % key.encode()))
    assert await _answer(reader) == (b"200", b"ok 1")
    for other in (*held, writer):
        other.close()


async def test_a_chunked_upload_holds_what_its_body_is_once_it_is_in(front: Front) -> None:
    """Until its end, a chunked body counts as the largest allowed; once in, as what it is: pipelined
    uploads waiting their turn held max_body_mib each, four of them the whole budget."""
    gate = front.server.gate = AccessControl(Settings(max_body_mib=1, max_buffered_mib=2), KeyRing([]))
    chunked = b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(b"".join(chunked + b"2\r\n%02d\r\n0\r\n\r\n" % n for n in range(6)))
    assert [await _answer(reader) for _ in range(6)] == [(b"200", b"%02d" % n) for n in range(6)]
    for _ in range(200):  # the last one's share goes back as its task ends, just after its answer
        if not gate.buffered_bytes:
            break
        await asyncio.sleep(0.01)
    assert gate.buffered_bytes == 0
    writer.close()


async def test_an_upload_refused_behind_an_answer_is_answered_in_its_turn(front: Front) -> None:
    """A tunnelled upload refused for want of budget, or for its size, was answered only when nothing
    was in hand; behind an answer the connection just closed after that answer, and the client never
    learnt why (hypothesis found it: five 70 KB chunked uploads in one write, the fifth over budget)."""
    gate = front.server.gate = AccessControl(Settings(max_body_mib=1, max_buffered_mib=2), KeyRing([]))
    chunked = b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    _, holder = await asyncio.open_connection("127.0.0.1", front.port)
    holder.write(chunked)  # its body never comes: it holds max_body_mib, half the budget
    for _ in range(200):
        if gate.buffered_bytes:
            break
        await asyncio.sleep(0.01)
    assert gate.buffered_bytes == 1 << 20
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post() + chunked)
    assert await _answer(reader) == (b"200", b"ok 1")
    status, body = await _answer(reader)
    assert status == b"503"
    assert json.loads(body)["error"]["code"] == "server_busy"
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    holder.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(
        _post() + b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (2 << 20)
    )
    assert await _answer(reader) == (b"200", b"ok 2")
    status, body = await _answer(reader)
    assert status == b"413"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    writer.close()


@pytest.mark.parametrize(
    "before",
    [
        _post(),
        b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\nhi",
        _post_with(b"Origin: https://evil.example\r\n"),  # refused (403), the upgrade behind it
    ],
    ids=["served-here", "tunnelled", "refused"],
)
async def test_an_upgrade_pipelined_behind_another_request_is_not_handed_over(
    front: Front, before: bytes
) -> None:
    """llhttp stops at an upgrade, and the front took that for a hand-off whatever it had decided: it
    handed aiohttp the whole read, so aiohttp answered the request before the upgrade a second time (in
    the daemon, a second completion), on a connection the front had said it would close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    upgrade = b"GET /ws HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    writer.write(before + upgrade)
    answers = await _answers_until_closed(reader)
    assert len(answers) == 1, answers
    if b"/v1/echo" not in before:  # aiohttp's answer is relayed as it wrote it: it cannot say so
        assert _says_close(answers[0][1])
    assert len(front.served) == (1 if before == _post() else 0)
    writer.close()


async def test_answers_wait_while_the_client_reads_nothing(front: Front) -> None:
    """pause_writing paused only the exchange being relayed at that moment; answers started after it,
    while the client's socket stayed full, were written regardless and piled up in the daemon (a reviewer
    measured 96 MiB for 100 pipelined answers of 1 MB to a client that never read). Now the next job
    waits until the client reads, and every answer still comes, in order."""
    answer = b"x" * (1 << 20)

    async def serve(conn: FrontConnection, request: FastRequest, body: bytes) -> int:
        front.served.append(body)
        conn.respond(request, 200, b"", [], answer)
        return 200

    front.server.serve = serve
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", front.port))
    reader, writer = await asyncio.open_connection(sock=client)
    writer.write(_post() * 40)
    await asyncio.sleep(1.0)
    started = len(front.served)
    assert started < 12, started  # what the two sockets' buffers took (a few MiB), and one answer more
    for _ in range(40):
        assert await _answer(reader) == (b"200", answer)
    assert len(front.served) == 40
    writer.close()


# --- CONNECT and upgrades: the head bounds hold for the rest of the connection -----------------------------

_TAGS = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n"
# Past the front's 64 KiB a head, within aiohttp's own bounds (100 lines of 8 KiB).
_HEAD_PAST_64K = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n" + b"".join(
    b"X-%d: %s\r\n" % (n, b"v" * 8000) for n in range(9)
)


async def test_connect_is_a_405_and_the_connection_closes(front: Front) -> None:
    """llhttp reads CONNECT as an upgrade: it was handed to aiohttp, which answered 404 and parsed the
    heads after it with its own bounds only (100 connections of those took 134 MB)."""
    status, error = await _refused(
        front, b"CONNECT localhost:443 HTTP/1.1\r\nHost: localhost:443\r\n\r\n" + _HEAD_PAST_64K
    )
    assert status == b"405"
    assert error["code"] == "method_not_allowed"
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "declined",
    [
        b"CONNECT localhost:443 HTTP/1.1\r\nHost: localhost:443\r\n\r\n",
        b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    ],
    ids=["connect", "upgrade"],
)
async def test_a_declined_upgrade_on_a_handed_off_connection_leaves_the_heads_after_it_bounded(
    front: Front, declined: bytes
) -> None:
    """The guard stopped parsing at an upgrade; aiohttp declines it (the app upgrades nothing), answers
    it and parses on, so the heads after it had only aiohttp's bounds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_TAGS)
    assert (await _answer(reader))[0] == b"200"  # the connection is aiohttp's now
    writer.write(declined)
    assert (await _answer(reader))[0] in (b"200", b"404")  # aiohttp's answer to it
    writer.write(_HEAD_PAST_64K + b"\r\n")
    assert (await _answer(reader))[0] == b"431"  # the head past 64 KiB refused, as before the upgrade
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (_HEAD_PAST_64K + b"\r\n", b"431", "header_too_large"),
        (b"GET /api/tags?" + b"q" * 70_000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", b"414", "uri_too_long"),
    ],
    ids=["head", "target"],
)
async def test_a_head_past_the_bounds_on_a_handed_off_connection_gets_the_fronts_refusal_in_turn(
    front: Front, head: bytes, status: bytes, code: str
) -> None:
    """It closed the connection with no answer at all. The head is held until whole, so aiohttp has none
    of it: it answers the requests before it, then the refusal the front gives the same head on a
    connection of its own (in Ollama's shape here: the target is under /api/), then closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_TAGS)
    assert await _answer(reader) == _TAGS_ANSWER  # the connection is aiohttp's now
    writer.write(_TAGS + head)
    assert await _answer(reader) == _TAGS_ANSWER
    answered, body = await _answer(reader)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert answered == status
    assert (answered, json.loads(body)["error"]) == await _refused(front, head)
    assert code  # (Ollama's shape has no code; the status says which bound)
    writer.close()


async def test_an_upgrade_with_a_body_on_a_handed_off_connection_closes_it(front: Front) -> None:
    """aiohttp reads an upgrade's body as its body, llhttp as the next request: where the two part, the
    guard cannot follow aiohttp's parse, so it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_TAGS)
    assert (await _answer(reader))[0] == b"200"
    body = _HEAD_PAST_64K + b"\r\n"  # a head to the guard's new parser, were it to take it for one
    writer.write(
        b"POST /api/echo HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


async def test_a_chunked_upload_in_tiny_chunks_is_held_in_about_its_own_size(front: Front) -> None:
    """llhttp calls back once per chunk, and each was kept as a bytes object in a list: 8 MiB sent as
    2-byte chunks took 230 MB, ~28 times what max_buffered_mib counted for it."""
    payload = 1 << 20
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    tracemalloc.start()
    try:
        writer.write(b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(payload // (2 << 10)):
            writer.write(b"2\r\nab\r\n" * (1 << 10))
            await writer.drain()
        (conn,) = front.server.connections
        for _ in range(1000):  # every byte sent has been read
            if conn._tunnelled is not None and conn._tunnelled.received == payload:
                break
            await asyncio.sleep(0.01)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 3 * payload, held
    writer.write(b"0\r\n\r\n")
    assert await _answer(reader) == (b"200", b"ab" * (payload // 2))
    writer.close()


async def test_a_body_the_front_stopped_reading_for_queued_requests_gets_no_408(front: Front) -> None:
    """With _MAX_QUEUED requests waiting, the front stops reading, and the body arriving behind them
    kept its deadline: a client that did nothing wrong got 408 once the answers ahead took longer than
    client_timeout_s. Its deadline now waits while the front is not reading, and starts again after."""
    front.server.gate = AccessControl(Settings(client_timeout_s=0.5), KeyRing([]))
    go_on = asyncio.Event()

    async def serve(conn: FrontConnection, request: FastRequest, body: bytes) -> int:
        await go_on.wait()
        front.served.append(body)
        conn.respond(request, 200, b"", [], b"ok")
        return 200

    front.server.serve = serve
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    last = _post()
    writer.write(_post() * 9 + last[:-4])  # one in hand, eight queued, the last one's body begun
    await asyncio.sleep(1.5)  # three of its deadlines, while the front reads nothing
    go_on.set()
    writer.write(last[-4:])
    for _ in range(10):
        assert await _answer(reader) == (b"200", b"ok")
    writer.close()


@pytest.mark.parametrize(
    "target",
    [b"*", b"http://[::1/v1/models", b"http://localhost:x/v1/models", b"http:/v1/models"],
    ids=["asterisk", "ipv6", "port", "no-authority"],
)
async def test_a_target_aiohttp_would_refuse_gets_the_fronts_own_400(front: Front, target: bytes) -> None:
    """llhttp takes these targets, aiohttp's parser does not: its own 400 reached the client (text/plain,
    HTTP/1.0, `Server: Python/3.11 aiohttp/...`, the target echoed)."""
    status, error = await _refused(front, b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % target)
    assert status == b"400"
    assert error["code"] == "invalid_request"
    assert error["type"] == "invalid_request_error"


# --- a request llhttp refuses on a connection handed to aiohttp: the front's 400, in its turn ------------

# Requests llhttp refuses, and where to cut each to send it in two reads (before what it refuses): a space
# in the method (the target unread: OpenAI's shape, as for any bytes that are not HTTP), a space in a
# header's name (the target read, under /api/: Ollama's shape), and the start of a TLS handshake.
_NOT_HTTP = {
    "method": (b"GE T /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n", 2),
    "header": (b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nBa d: x\r\n\r\n", 44),
    "tls": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(32), 1),
}
_TAGS_ANSWER = (b"200", b'{"models": []}')


def _stream(n: int, held: bool = False) -> bytes:
    return b"GET /api/stream?n=%d%s HTTP/1.1\r\nHost: localhost\r\n\r\n" % (n, b"&held=1" if held else b"")


async def _refusal_then_close(front: Front, reader: asyncio.StreamReader, data: bytes) -> None:
    """The next answer is the 400 the front gives `data` before a hand-off, and then the connection closes."""
    status, body = await _answer(reader)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert (status, json.loads(body)["error"]) == await _refused(front, data)


@pytest.mark.parametrize("sent", ["one-read", "later", "cut"])
@pytest.mark.parametrize("refused", sorted(_NOT_HTTP))
async def test_a_request_llhttp_refuses_after_a_hand_off_gets_the_fronts_400_in_its_turn(
    front: Front, refused: str, sent: str
) -> None:
    """aiohttp's parser answered it: a 400 in text/plain naming aiohttp's parser, and one in the same read
    as the request before it cost that request its answer. The guard keeps it from aiohttp, which
    answers the requests before it, then the front's 400 for the same bytes; then the connection closes."""
    data, cut = _NOT_HTTP[refused]
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    if sent == "later":
        writer.write(_TAGS)
        assert await _answer(reader) == _TAGS_ANSWER
        writer.write(data)
    else:
        writer.write(_TAGS + (data if sent == "one-read" else data[:cut]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(data[cut:] if sent == "cut" else b"")
        assert await _answer(reader) == _TAGS_ANSWER
    await _refusal_then_close(front, reader, data)
    writer.close()


@pytest.mark.parametrize("refused", sorted(_NOT_HTTP))
async def test_a_request_aiohttps_parser_refuses_gets_a_400_in_the_api_shape(
    front: Front, refused: str
) -> None:
    """A head that begins in the read where a chunked body ends reaches aiohttp's parser (the guard feeds
    such a body whole and cannot tell where the head begins). aiohttp answered it with its own text/plain
    400, which no OpenAI or Ollama client reads; its handler now answers in OpenAI's error shape (aiohttp
    knows no path by then), and closes the connection, after the answers before it."""
    chunked = b"POST /api/echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_TAGS + chunked + b"5\r\nhello\r\n0\r\n\r\n" + _NOT_HTTP[refused][0])
    assert await _answer(reader) == _TAGS_ANSWER
    assert await _answer(reader) == (b"200", b"hello")
    head, body = await _answer_with_head(reader)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert head.split(b" ")[1] == b"400"
    assert b"\r\nContent-Type: application/json" in head
    error = json.loads(body)["error"]
    assert (error["code"], error["type"]) == ("invalid_request", "invalid_request_error")
    assert error["message"].startswith("bad request: ")
    writer.close()


@pytest.mark.parametrize("sent", ["one-read", "later"])
@pytest.mark.parametrize("refused", sorted(_NOT_HTTP))
async def test_bytes_llhttp_refuses_behind_a_request_served_here_get_the_400_in_their_turn(
    front: Front, refused: str, sent: str
) -> None:
    """They closed the connection after the answer before them, with no word of why. Now that answer
    keeps the connection (it says nothing of a close), and the 400 the same bytes get on a connection of
    their own follows it, saying `Connection: close`; then the connection closes."""
    data, _ = _NOT_HTTP[refused]
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    if sent == "one-read":
        writer.write(_post() + data)
    else:
        writer.write(_post())
        writer.write(data)  # while the first is being answered
    head, _ = await _answer_with_head(reader)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert not _says_close(head)
    head, body = await _answer_with_head(reader)
    assert _says_close(head)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert (head.split(b" ")[1], json.loads(body)["error"]) == await _refused(front, data)
    writer.close()


async def test_bytes_llhttp_refuses_behind_a_request_that_says_close_get_no_answer(front: Front) -> None:
    """Its answer says the connection closes (RFC 9112 9.6): nothing may follow it, a 400 neither."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_post_with(b"Connection: close\r\n") + _NOT_HTTP["method"][0])
    answers = await _answers_until_closed(reader)
    assert [status for status, _ in answers] == [b"200"]
    assert _says_close(answers[0][1])
    writer.close()


async def test_a_refused_request_gets_its_400_in_turn_wherever_the_reads_cut_it(front: Front) -> None:
    """A request before it with a body, and every cut of the three: the guard holds a head until it is
    whole, and passes a body to its length's end."""
    refused = _NOT_HTTP["header"][0]
    data = _TAGS + b"POST /api/echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello" + refused
    expected = await _refused(front, refused)
    for cut in range(1, len(data)):
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(data[:cut])
        await writer.drain()
        await asyncio.sleep(0.002)
        writer.write(data[cut:])
        assert await _answer(reader) == _TAGS_ANSWER, cut
        assert await _answer(reader) == (b"200", b"hello"), cut
        status, body = await _answer(reader)
        assert (status, json.loads(body)["error"]) == expected, cut
        assert await asyncio.wait_for(reader.read(), 10) == b"", cut
        writer.close()


async def test_a_refused_request_behind_a_streamed_answer_is_answered_after_its_end(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_stream(5) + _NOT_HTTP["header"][0])
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    streamed = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)  # the chunked answer's end
    assert all(b'{"n": %d}\n' % n in streamed for n in range(5))
    await _refusal_then_close(front, reader, _NOT_HTTP["header"][0])
    writer.close()


async def test_a_refused_request_behind_an_answer_that_says_close_gets_none(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    closing = _TAGS.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    writer.write(closing + _NOT_HTTP["header"][0])
    answers = await _answers_until_closed(reader)
    assert [status for status, _ in answers] == [b"200"]
    assert _says_close(answers[0][1])
    writer.close()


async def test_a_client_gone_with_a_refusal_pending_leaves_no_task_behind(front: Front) -> None:
    before = len(front.tasks())
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_stream(3, held=True) + _NOT_HTTP["method"][0])
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b'{"n": 0}' in await asyncio.wait_for(reader.readuntil(b"}\n"), 10)
    writer.close()  # while the answer before the refused request is still streaming
    await asyncio.sleep(0.05)
    front.release.set()  # (the fixture's aiohttp does not cancel a handler when its client leaves)
    await _settled(front, before)


async def test_what_comes_after_a_refused_request_is_dropped(front: Front) -> None:
    """A peer that goes on sending bytes after it, while the answer before it streams: the guard parses and
    keeps none of them, and the 400 still comes after that answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_stream(3, held=True) + _NOT_HTTP["tls"][0])
    assert b'{"n": 0}' in await asyncio.wait_for(reader.readuntil(b"}\n"), 10)
    peak = await _peak_sending(writer, b"\x16\x03\x01 not HTTP\r\n" * 4096, 16 << 20)
    assert peak < 4 << 20, peak
    front.release.set()
    streamed = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)
    assert b'{"n": 2}' in streamed
    await _refusal_then_close(front, reader, _NOT_HTTP["tls"][0])
    writer.close()


async def test_the_refusals_own_path_is_no_route_for_a_client(front: Front) -> None:
    """The guard gives aiohttp a request for REFUSED_TARGET in place of the one it refused: a client that
    asks for it gets aiohttp's 404, and a request of its own refused later gets its 400."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_TAGS + b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % REFUSED_TARGET.encode())
    assert await _answer(reader) == _TAGS_ANSWER
    assert (await _answer(reader))[0] == b"404"
    writer.write(_NOT_HTTP["header"][0])
    await _refusal_then_close(front, reader, _NOT_HTTP["header"][0])
    writer.close()


async def test_a_head_padded_past_what_is_held_goes_on_as_it_comes(front: Front) -> None:
    """No bound counts a value's leading spaces: 90 lines padded with 60 KB each were held whole (5.8 MB
    for one head). Past 128 KiB as sent a head goes on to aiohttp as it comes; the next one is held
    again, and refused in its turn."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(_TAGS)
    assert await _answer(reader) == _TAGS_ANSWER
    writer.write(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n")
    padded = b"X-Pad: " + b" " * 60_000 + b"v\r\n"
    peak = await _peak_sending(writer, padded, 90 * len(padded))
    assert peak < 2 << 20, peak
    writer.write(b"\r\n" + _NOT_HTTP["header"][0])
    assert await _answer(reader) == _TAGS_ANSWER
    await _refusal_then_close(front, reader, _NOT_HTTP["header"][0])
    writer.close()


async def test_an_exception_no_middleware_caught_is_a_500_in_the_api_shape() -> None:
    """The daemon's middlewares turn every handler's exception into the API's error; should one escape
    them, aiohttp's handler (as the front makes it) answers a JSON 500 too, not aiohttp's text/plain."""

    async def broken(request: web.BaseRequest) -> web.StreamResponse:
        raise RuntimeError("a bug")

    server = web.Server(broken)
    listener = await asyncio.get_running_loop().create_server(
        functools.partial(new_handler, server), "127.0.0.1", 0
    )
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.sockets[0].getsockname()[1])
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head, body = await _answer_with_head(reader)
        assert head.split(b" ")[1] == b"500"
        error = json.loads(body)["error"]
        assert (error["code"], error["message"]) == ("internal_error", "internal error")
        assert "a bug" not in body.decode()
        writer.close()
    finally:
        listener.close()
        await server.shutdown()


@pytest.mark.parametrize(("closing", "code"), [(False, "unavailable"), (True, "shutting_down")])
async def test_a_tunnelled_request_with_aiohttps_listener_gone_gets_an_error_in_its_apis_shape(
    closing: bool, code: str
) -> None:
    """The daemon's shutdown closes aiohttp's internal listener while the front's kept-alive connections
    are open: a request tunnelled then (a load balancer's /health) got a 503 with an empty body, and an
    error in the log, on every shutdown with clients connected."""
    app = web.Application()
    app[ACCESS] = AccessControl(Settings(), KeyRing([]))
    runner = web.AppRunner(app)
    await runner.setup()
    assert runner.server is not None

    async def serve(conn: FrontConnection, request: FastRequest, body: bytes) -> int:
        raise AssertionError("not a request the front serves itself")

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nobody = ("127.0.0.1", int(unused.getsockname()[1]))  # nothing listens there once it closes
    handoff = functools.partial(new_handler, runner.server)
    server = FrontServer(app, handoff, UpstreamPool(), serve, 5.0, nobody)
    server.closing = closing
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(*listener.sockets[0].getsockname()[:2])
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")  # tunnelled to aiohttp
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert b"connection: close" in head.lower(), head
        assert json.loads(body)["error"]["code"] == code
    finally:
        listener.close()
        server.close_all()
        await runner.cleanup()
