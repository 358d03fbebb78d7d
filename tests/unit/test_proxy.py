"""proxy: a pooled connection that the child closed under us is retried once, on a fresh one; the child
gets the daemon's key and never the client's credentials; the child's CORS headers never reach a client.

The server here is a few lines of raw asyncio standing in for llama-server's HTTP layer, which closes a
kept-alive connection without saying so (after a streamed answer, or after 5 s idle). Reproducing that race
with the real binary depends on timing; this server loses the race on purpose, every time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from supervisor import errors, proxy
from supervisor.api.middleware import timing_headers
from supervisor.metrics import TRACE, Trace
from workers.base import Endpoint, free_port, http_ok

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nKeep-Alive: timeout=5\r\n\r\nok"


class ForgetfulServer:
    """Answers the first request on each connection, then drops the connection at the next one."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for answer in (True, False):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if not answer:
                    self.dropped += 1
                    break
                writer.write(_OK)
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[ForgetfulServer, str]]:
    forgetful = ForgetfulServer()
    port = free_port()
    listener = await asyncio.start_server(forgetful.handle, "127.0.0.1", port)
    yield forgetful, f"http://127.0.0.1:{port}/v1/chat/completions"
    listener.close()
    await listener.wait_closed()


async def test_a_connection_closed_by_the_child_is_retried_on_a_fresh_one(
    server: tuple[ForgetfulServer, str],
) -> None:
    forgetful, url = server
    async with proxy.new_upstream_session() as session:
        for _ in range(3):
            async with await proxy.send(session, "POST", url, b"{}", CIMultiDict()) as response:
                assert await response.read() == b"ok"
    assert forgetful.answered == 3
    assert forgetful.dropped == 2  # the second and third requests each met a dead pooled connection


async def test_a_refused_connection_is_not_retried_and_counts_as_not_delivered() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
    async with proxy.new_upstream_session() as session:
        with pytest.raises(proxy.UpstreamGone) as gone:
            await proxy.send(session, "POST", url, b"{}", CIMultiDict())
    assert isinstance(gone.value.cause, aiohttp.ClientConnectorError)
    assert not gone.value.delivered
    # In a client's message: plain words, not aiohttp's text (which names the child's socket path).
    assert str(gone.value) == "the connection was refused"


async def test_a_request_the_child_may_have_read_is_not_sent_again() -> None:
    """A child that read the request, worked on it a while and closed without answering, still up: the
    request was sent again on a fresh connection (and run twice), as the data plane's pool no longer did."""
    connections = 0

    async def reads_and_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(proxy._STALE_CONNECTION_S * 3)
        writer.close()

    port = free_port()
    listener = await asyncio.start_server(reads_and_closes, "127.0.0.1", port)
    try:
        async with proxy.new_upstream_session() as session:
            with pytest.raises(proxy.UpstreamGone) as gone:
                await proxy.send(session, "POST", f"http://127.0.0.1:{port}/v1/x", b"{}", CIMultiDict())
    finally:
        listener.close()
    assert gone.value.delivered
    assert str(gone.value) == "the connection was closed"
    assert connections == 1


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (None, "the connection was closed"),
        (ConnectionRefusedError(111, "Connection refused"), "the connection was refused"),
        (
            FileNotFoundError(2, "No such file or directory", "/tmp/x/child.sock"),
            "the connection was refused",
        ),
        (OSError(104, "Connection reset by peer"), "the connection was reset"),
        (BrokenPipeError(32, "Broken pipe"), "the connection was reset"),
        (TimeoutError(), "the connection timed out"),
        (OSError(22, "Invalid argument"), "the connection failed"),
    ],
)
def test_a_lost_connection_is_told_in_plain_words(error: BaseException | None, words: str) -> None:
    assert errors.connection_failure(error) == words


class DyingServer:
    """A child that dies with a request: having read it (`read_first`), or before reading a byte of it.

    The first connection is accepted and handled as told, and then the listener goes away, as a killed
    child's does, so the proxy's retry on a fresh connection is refused.
    """

    def __init__(self, read_first: bool) -> None:
        self.read_first = read_first
        self.port = free_port()
        self.listener: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.listener is not None
        self.listener.close()  # nothing listens any more: the retry is refused
        sock = writer.get_extra_info("socket")
        if self.read_first:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(proxy._STALE_CONNECTION_S * 3)  # works on it a while, then dies
            writer.close()  # FIN: the request was read, and the answer never comes
        else:
            await asyncio.sleep(0.05)  # let the request arrive unread
            # SO_LINGER 0: the close resets the connection, as a killed process's socket with unread data
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    async def __aenter__(self) -> DyingServer:
        self.listener = await asyncio.start_server(self.handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.listener is not None
        self.listener.close()


@pytest.mark.parametrize(
    ("read_first", "code", "status"), [(True, "model_crashed", 503), (False, "upstream_error", 502)]
)
async def test_a_child_that_dies_with_the_request_is_a_crash_only_if_it_read_it(
    read_first: bool, code: str, status: int
) -> None:
    async with DyingServer(read_first) as server, proxy.new_upstream_session() as session:
        with pytest.raises(errors.SupervisorError) as raised:
            await proxy.open_upstream(
                session,
                "POST",
                Endpoint(port=server.port),
                "/v1/chat/completions",
                b"{}",
                CIMultiDict(),
                "demo",
                False,
                api_key=None,
            )
    assert (raised.value.code, raised.value.status) == (code, status)
    assert "127.0.0.1" not in raised.value.message
    assert "Cannot connect" not in raised.value.message
    # Only a request the child never read may be sent again once the model is back.
    assert isinstance(raised.value, proxy.Unreachable) is (not read_first)


async def test_a_route_the_engine_lacks_becomes_the_error_we_name() -> None:
    """A child's 404 on a route not every engine build serves (/v1/responses) is our 501, not its page.

    The upstream app stands in for an older llama-server build without the Responses API.
    """

    async def not_found(_: web.Request) -> web.Response:
        return web.Response(status=404, text="File Not Found")

    engine = web.Application()
    engine.router.add_post("/v1/responses", not_found)
    upstream = TestServer(engine, port=free_port())
    await upstream.start_server()
    missing = errors.not_supported("demo", "llama-server", "/v1/responses")

    child = Endpoint(port=upstream.port)

    async def route(request: web.Request) -> web.StreamResponse:
        async with proxy.new_upstream_session() as session:
            try:
                return await proxy.forward(
                    session, request, child, b"{}", "demo", False, missing, api_key=None
                )
            except errors.SupervisorError as exc:
                return web.json_response(exc.openai_body(), status=exc.status)

    front = web.Application()
    front.router.add_post("/v1/responses", route)
    async with TestClient(TestServer(front)) as client:
        response = await client.post("/v1/responses", data=b"{}")
        assert response.status == 501
        body = await response.json()
        assert body["error"]["code"] == "unsupported_endpoint"
        assert "does not serve /v1/responses" in body["error"]["message"]
    await upstream.close()


async def test_the_child_gets_its_key_and_never_the_clients_credentials() -> None:
    seen: list[dict[str, str]] = []

    async def engine_route(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        # llama-server reflects any Origin; the daemon answers CORS itself.
        return web.json_response(
            {"ok": True},
            headers={
                "Access-Control-Allow-Origin": "http://evil.example",
                "Access-Control-Allow-Credentials": "true",
                "X-Engine": "kept",
            },
        )

    engine = web.Application()
    engine.router.add_post("/v1/chat/completions", engine_route)
    upstream = TestServer(engine, port=free_port())
    await upstream.start_server()

    child = Endpoint(port=upstream.port)

    async def route(request: web.Request) -> web.StreamResponse:
        async with proxy.new_upstream_session() as session:
            return await proxy.forward(
                session, request, child, b"{}", "demo", False, api_key="childs-own-key"
            )

    front = web.Application()
    front.router.add_post("/v1/chat/completions", route)
    async with TestClient(TestServer(front)) as client:
        response = await client.post(
            "/v1/chat/completions",
            data=b"{}",
            headers={
                "Authorization": "Bearer the-clients-key",
                "X-Api-Key": "the-clients-key",
                "X-Other": "passes",
            },
        )
        assert response.status == 200
        assert response.headers["X-Engine"] == "kept"
        assert not [h for h in response.headers if h.lower().startswith("access-control-")]
    await upstream.close()

    (headers,) = seen
    assert headers["Authorization"] == "Bearer childs-own-key"
    assert "the-clients-key" not in str(headers)
    assert headers["X-Other"] == "passes"


class TracedProxy:
    """A front app proxying to an engine app, with a Trace on each request as the middleware puts one and
    the daemon's hook that puts it on the answer's head."""

    def __init__(self, engine: web.Application) -> None:
        self.engine = engine
        self.traces: list[Trace] = []

    async def route(self, request: web.Request) -> web.StreamResponse:
        trace = request[TRACE] = Trace("rid-1", time.perf_counter())
        trace.waited(0.001, 0.0)
        self.traces.append(trace)
        stream = request.path.endswith("/stream")
        assert self.upstream.port is not None
        async with proxy.new_upstream_session() as session:
            return await proxy.forward(
                session, request, Endpoint(port=self.upstream.port), b"{}", "demo", stream, api_key=None
            )

    async def __aenter__(self) -> TestClient[web.Request, web.Application]:
        self.upstream = TestServer(self.engine, port=free_port())
        await self.upstream.start_server()
        front = web.Application()
        front.router.add_post("/{tail:.*}", self.route)
        front.on_response_prepare.append(timing_headers)  # as the daemon's app does
        self.client = TestClient(TestServer(front))
        await self.client.start_server()
        return self.client

    async def __aexit__(self, *_: object) -> None:
        await self.client.close()
        await self.upstream.close()


async def test_the_child_gets_the_request_id_and_a_stream_names_it_before_its_first_token() -> None:
    seen: list[str | None] = []

    async def engine_stream(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Request-Id"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in (
            b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
            b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n',
            b"data: [DONE]\n\n",
        ):
            await asyncio.sleep(0.02)
            await response.write(event)
        return response

    engine = web.Application()
    engine.router.add_post("/v1/chat/completions/stream", engine_stream)
    traced = TracedProxy(engine)
    async with traced as client:
        response = await client.post(
            "/v1/chat/completions/stream", data=b"{}", headers={"X-Request-Id": "the-clients-own"}
        )
        assert response.status == 200
        assert response.headers["X-Request-Id"] == "rid-1"
        assert response.headers["Server-Timing"] == "queue;dur=1.0, load;dur=0.0"  # no ttft yet
        assert (await response.read()).endswith(b"data: [DONE]\n\n")
    assert seen == ["rid-1"]  # the trace's id, which the middleware chose, not whatever the client sent
    (trace,) = traced.traces
    assert trace.first_token is not None
    assert trace.first_token - trace.arrived >= 0.02
    assert (trace.prompt_tokens, trace.output_tokens) == (3, 2)
    assert trace.tokens_per_s is not None


async def test_a_whole_answer_gives_the_trace_its_counts() -> None:
    async def engine_whole(request: web.Request) -> web.Response:
        body = {
            "choices": [{"message": {"content": "a b"}}],
            "usage": {"prompt_tokens": 26, "completion_tokens": 5},
            "timings": {"predicted_ms": 1.0, "predicted_per_second": 5000.0},
        }
        return web.json_response(body)

    engine = web.Application()
    engine.router.add_post("/v1/chat/completions", engine_whole)
    traced = TracedProxy(engine)
    async with traced as client:
        response = await client.post("/v1/chat/completions", data=b"{}")
        assert response.status == 200
    (trace,) = traced.traces
    assert (trace.prompt_tokens, trace.output_tokens, trace.tokens_per_s) == (26, 5, 5000.0)
    assert trace.first_token is not None


async def test_a_childs_redirect_is_its_answer_and_is_not_followed() -> None:
    followed: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": f"http://127.0.0.1:{port}/elsewhere"})

    async def elsewhere(request: web.Request) -> web.Response:
        followed.append(request.method)
        return web.Response(text="followed")

    engine = web.Application()
    engine.router.add_post("/v1/chat/completions", redirect)
    engine.router.add_get("/health", redirect)
    engine.router.add_route("*", "/elsewhere", elsewhere)
    port = free_port()
    async with TestServer(engine, port=port), proxy.new_upstream_session() as session:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with await proxy.send(session, "POST", url, b"{}", CIMultiDict()) as response:
            assert response.status == 307  # passed on to the client as the child answered
        assert not await http_ok(session, Endpoint(port=port), "/health")
    assert followed == []


def test_an_engines_context_refusal_keeps_what_else_it_says_in_openais_shape() -> None:
    """llama-server's refusal of a prompt longer than the context carries n_ctx and n_prompt_tokens,
    which llama.cpp-aware clients read: OpenAI's fields are set, the engine's others kept."""
    engine = {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 5000,
            "n_ctx": 4096,
        }
    }
    status, body, code = proxy.whole_answer(400, json.dumps(engine).encode())
    error = json.loads(body)["error"]
    assert (status, code) == (400, "context_length_exceeded")
    assert error == {
        "message": engine["error"]["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
        "n_prompt_tokens": 5000,
        "n_ctx": 4096,
    }
