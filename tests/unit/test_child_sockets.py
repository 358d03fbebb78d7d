"""The children's Unix sockets: where they are made, how a URL reaches one (aiohttp's side and the data
plane's), and what is left behind. Real sockets, served by aiohttp and asyncio; no engine needed."""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import uvloop
from aiohttp import web
from multidict import CIMultiDict

from supervisor import proxy
from supervisor.dataplane.upstream import UpstreamLost, UpstreamPool
from workers import sockets
from workers.base import Endpoint


@pytest.fixture
def own_directory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test's socket directory, not the one the test process may already have."""
    monkeypatch.setattr(sockets, "_directory", None)
    yield
    sockets.remove_directory()


@pytest.fixture
async def child(own_directory: None) -> AsyncIterator[Endpoint]:
    """An HTTP server on a new socket, standing in for the child's HTTP side: it says what it got."""
    endpoint = sockets.new_endpoint()
    assert endpoint.socket is not None

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"host": request.host, "body": (await request.read()).decode()})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(endpoint.socket)).start()
    yield endpoint
    await runner.cleanup()
    endpoint.socket.unlink(missing_ok=True)  # the child's stop does this for a real child


async def _post(session: aiohttp.ClientSession, child: Endpoint, path: str) -> aiohttp.ClientResponse:
    return await proxy.open_upstream(
        session, "POST", child, path, b"{}", CIMultiDict(), "demo", False, api_key=None
    )


def test_a_socket_is_a_short_new_path_in_a_directory_only_the_daemons_user_can_open(
    own_directory: None,
) -> None:
    first, second = sockets.new_endpoint(), sockets.new_endpoint()
    assert first.socket is not None
    assert second.socket is not None
    assert first.socket != second.socket
    assert first.socket.parent == second.socket.parent  # one directory per daemon
    assert stat.S_IMODE(first.socket.parent.stat().st_mode) == 0o700
    assert len(os.fsencode(first.socket)) <= 107  # what fits in a sockaddr_un
    assert first.port is None
    assert first.url == f"http://{first.socket.name}"
    assert first.address == str(first.socket)


def test_only_a_name_of_ours_is_taken_for_a_socket(own_directory: None) -> None:
    endpoint = sockets.new_endpoint()
    assert endpoint.socket is not None
    assert sockets.socket_named(endpoint.host) == endpoint.socket
    for host in ("127.0.0.1", "example.com", "../etc.sock", "0123.sock", "ABCDEF0123456789.sock"):
        assert sockets.socket_named(host) is None, host


def test_a_path_too_long_for_a_socket_gets_a_loopback_port_instead(
    own_directory: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    endpoint = sockets.new_endpoint()
    assert endpoint.socket is None
    assert endpoint.port is not None
    assert endpoint.url == f"http://127.0.0.1:{endpoint.port}"


def test_the_directory_goes_at_shutdown_unless_something_is_still_in_it(own_directory: None) -> None:
    endpoint = sockets.new_endpoint()
    assert endpoint.socket is not None
    directory = endpoint.socket.parent
    endpoint.socket.touch()  # a child's socket still there, or a file the daemon did not put there
    sockets.remove_directory()
    assert endpoint.socket.exists()  # nothing deleted that the daemon did not create
    endpoint.socket.unlink()
    sockets.remove_directory()
    assert not directory.exists()


async def test_the_upstream_session_reaches_a_child_on_its_socket(child: Endpoint) -> None:
    async with proxy.new_upstream_session() as session:
        for _ in range(2):  # the second on the kept-alive connection
            response = await _post(session, child, "/v1/chat/completions")
            assert response.status == 200
            assert await response.json() == {"host": child.host, "body": "{}"}


async def test_a_socket_nobody_listens_on_is_unreachable_not_a_crash(own_directory: None) -> None:
    gone = sockets.new_endpoint()  # its child has exited and its socket is gone
    async with proxy.new_upstream_session() as session:
        with pytest.raises(proxy.Unreachable):
            await _post(session, gone, "/")


def test_a_child_killed_while_idle_is_unreachable_not_a_crash(own_directory: None) -> None:
    """Its kept-alive connection is closed just as the next request comes: aiohttp then cannot write
    the body to the closing socket. The child never got the request, so it may be sent again. On
    uvloop, as the daemon runs: its transports are what a child's closing socket meets."""
    uvloop.run(_killed_while_idle())


async def _killed_while_idle() -> None:
    endpoint = sockets.new_endpoint()
    assert endpoint.socket is not None
    answered: list[asyncio.StreamWriter] = []
    done = asyncio.Event()

    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        answered.append(writer)
        await done.wait()

    server = await asyncio.start_unix_server(one_answer, str(endpoint.socket))
    try:
        async with proxy.new_upstream_session() as session:
            response = await _post(session, endpoint, "/")
            await response.read()
            response.release()  # back to the pool, kept alive
            server.close()
            answered[0].transport.abort()  # SIGKILL: the engine's end goes, and nobody listens any more
            await asyncio.sleep(0)  # the client sees it closing, the pool does not know yet
            with pytest.raises(proxy.Unreachable):
                await _post(session, endpoint, "/")
    finally:
        done.set()
        server.close()
        endpoint.socket.unlink(missing_ok=True)


async def test_the_data_plane_pool_keeps_a_connection_to_a_socket_alive(child: Endpoint) -> None:
    assert child.socket is not None
    pool = UpstreamPool()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Length: 2\r\n\r\n{}" % (
        child.host.encode()
    )
    try:
        connections = set()
        for _ in range(2):
            exchange = await pool.exchange(child.address, request)
            connection = exchange.connection
            await asyncio.wait_for(exchange.done, 5)
            assert exchange.status == 200
            assert b'"body": "{}"' in exchange.body()
            connections.add(id(connection))
        assert len(connections) == 1  # reused, not a connect per request
    finally:
        pool.close()


async def test_a_socket_the_child_left_is_refused_as_unread(own_directory: None) -> None:
    gone = sockets.new_endpoint()
    assert gone.socket is not None
    pool = UpstreamPool()
    try:
        with pytest.raises(UpstreamLost) as raised:
            await pool.exchange(gone.address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raised.value.unread  # safe to send again once the model is back
    finally:
        pool.close()


async def test_a_url_of_no_child_still_goes_over_tcp() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="tcp")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with proxy.new_upstream_session() as session, session.get(f"http://127.0.0.1:{port}/") as r:
            assert await r.text() == "tcp"
    finally:
        await runner.cleanup()
