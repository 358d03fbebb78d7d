"""The data plane's connections to the children (supervisor/dataplane/upstream.py) against a peer that
writes exactly the bytes a test asks for.

The peer stands in for a child's HTTP layer: llama-server and vLLM cannot be made to answer twice, close
without answering while staying up, or send an answer's last bytes in the one read that a slow client
pauses on. The pool, its parser and the sockets are the real ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from supervisor.dataplane.upstream import SPARES, UpstreamLost, UpstreamPool

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: child\r\nContent-Length: 0\r\n\r\n"
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Peer"], Awaitable[None]]


@dataclass
class Peer:
    address: tuple[str, int] = ("", 0)
    requests: int = 0
    connections: int = 0
    script: Script | None = None
    server: asyncio.Server | None = field(default=None, repr=False)

    async def request(self, reader: asyncio.StreamReader) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    found = Peer()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        found.connections += 1
        try:
            assert found.script is not None
            await found.script(reader, writer, found)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    found.server = await asyncio.start_server(handle, "127.0.0.1", 0)
    found.address = found.server.sockets[0].getsockname()[:2]
    try:
        yield found
    finally:
        found.server.close()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    made = UpstreamPool()
    try:
        yield made
    finally:
        made.close()


async def test_a_connection_paused_on_its_answers_last_read_is_pooled_reading(
    peer: Peer, pool: UpstreamPool
) -> None:
    """A tunnelled exchange's sink gets a read's bytes before they are parsed. When that write paused the
    exchange (a slow client: FrontConnection.pause_writing), the answer then ended and its connection
    went back to the pool paused: the next request on it was never answered."""

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer) -> None:
        while True:
            await peer.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            await asyncio.sleep(0.2)  # the body comes once the relay has attached its sink
            writer.write(b"x" * 100_000)
            await writer.drain()

    peer.script = answers
    exchange = await pool.exchange(peer.address, REQUEST, raw=True)

    def slow_client(piece: bytes) -> None:  # every piece crosses its high-water mark; it drains soon after
        exchange.pause()
        asyncio.get_running_loop().call_later(0.01, exchange.resume)

    exchange.attach(slow_client)
    await asyncio.wait_for(exchange.done, 10)
    again = await asyncio.wait_for(pool.exchange(peer.address, REQUEST), 10)
    assert again.status == 200
    await asyncio.wait_for(again.done, 10)
    assert (peer.connections, peer.requests) == (1, 2)


async def test_a_second_answer_to_one_request_keeps_its_connection_out_of_the_pool(
    peer: Peer, pool: UpstreamPool
) -> None:
    """Bytes after a whole answer were parsed with no exchange, and the connection pooled in the middle of
    them: the next request on it failed to parse, and was sent again on a new connection."""

    async def answers_twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer) -> None:
        while True:
            await peer.request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
            )
            await writer.drain()

    peer.script = answers_twice
    first = await pool.exchange(peer.address, REQUEST)
    await asyncio.wait_for(first.done, 10)
    assert first.body() == b"hi"
    second = await asyncio.wait_for(pool.exchange(peer.address, REQUEST), 10)
    await asyncio.wait_for(second.done, 10)
    assert second.body() == b"hi"
    assert (peer.connections, peer.requests) == (2, 2)


async def test_a_request_the_child_may_have_read_is_not_sent_again(peer: Peer, pool: UpstreamPool) -> None:
    """A child that read the request and closed without answering, still up: the request was sent again
    on a new connection, so a child that was working on it ran it twice."""

    async def reads_and_closes(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer
    ) -> None:
        await peer.request(reader)

    peer.script = reads_and_closes
    with pytest.raises(UpstreamLost) as lost:
        await asyncio.wait_for(pool.exchange(peer.address, REQUEST), 10)
    assert not lost.value.unread
    assert str(lost.value) == "the connection was closed"
    assert (peer.connections, peer.requests) == (1, 1)


async def test_a_refused_child_is_told_in_plain_words(pool: UpstreamPool) -> None:
    # The Unix socket of a child that has gone: the error's own text names the daemon's private path.
    with pytest.raises(UpstreamLost) as lost:
        await asyncio.wait_for(pool.exchange("/nonexistent/llmsup-test/child.sock", REQUEST), 10)
    assert lost.value.unread
    assert str(lost.value) == "the connection was refused"


async def test_spares_being_opened_count_against_the_spares_wanted(peer: Peer, pool: UpstreamPool) -> None:
    """Each stream asks for a spare as it starts; twenty at once opened twenty connections, each able to
    hold one of llama-server's HTTP threads."""

    async def idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer) -> None:
        await reader.read()

    peer.script = idle
    for _ in range(20):
        pool.warm(peer.address)
    for _ in range(100):
        if not pool._opening:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert peer.connections == SPARES


async def test_an_interim_answer_is_passed_over_for_the_final_one(peer: Peer, pool: UpstreamPool) -> None:
    """A 100 Continue (or 103 Early Hints) was taken for the answer, and the real one dropped."""

    async def interim_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer) -> None:
        while True:
            await peer.request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
            await writer.drain()

    peer.script = interim_first
    for _ in range(2):
        exchange = await asyncio.wait_for(pool.exchange(peer.address, REQUEST), 10)
        await asyncio.wait_for(exchange.done, 10)
        assert (exchange.status, exchange.reason, exchange.body()) == (200, b"OK", b"hi")
    assert (peer.connections, peer.requests) == (1, 2)  # and its connection was pooled between answers


async def test_an_answer_that_ends_at_the_close_is_whole(peer: Peer, pool: UpstreamPool) -> None:
    """With neither a length nor chunks, HTTP/1.1 ends a body at the close: it read as cut short."""

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer) -> None:
        await peer.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nthe whole body")
        await writer.drain()

    peer.script = until_close
    exchange = await asyncio.wait_for(pool.exchange(peer.address, REQUEST), 10)
    await asyncio.wait_for(exchange.done, 10)
    assert exchange.body() == b"the whole body"
