"""The data plane (supervisor/dataplane/) against a real daemon: the inference routes served by the front,
the other routes handed to aiohttp on the same connection, and the stream cases a proxy gets wrong.

The child here is bench/stand_in_engine.py, a stand-in for llama-server's HTTP layer (same command line,
one SSE event per chunk, the connection closed after a stream), because the real engine cannot be made to
split an event across chunks, die in the middle of a chunk, or flood a slow client on demand. The
OpenAI and aiohttp clients on the other side are the real ones.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually

STAND_IN = Path(__file__).resolve().parents[2] / "bench" / "stand_in_engine.py"
MODELS: dict[str, dict[str, Any]] = {
    "standin": {"binary": str(STAND_IN), "vram_mib": 64, "parallel": 64, "args": ["--embeddings"]}
}
# The stand-in as a vLLM manifest's command, answering with the body it got: what the daemon sent vLLM.
ECHOING_VLLM: dict[str, Any] = {
    "engine": "vllm",
    "model": "org/stand-in",
    "command": [sys.executable, str(STAND_IN)],
    "args": ["--echo-body"],
    "vram_mib": 64,
}


@pytest.fixture
async def daemon(make_daemon: MakeDaemon) -> Daemon:
    return await make_daemon(models=MODELS)


def _chat(stream: bool, **stand_in: Any) -> dict[str, Any]:
    return {
        "model": "standin",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "stand_in": stand_in,
    }


async def test_the_child_gets_the_clients_end_to_end_headers_as_sent_and_nothing_else(daemon: Daemon) -> None:
    """Names keep the client's spelling; hop-by-hop headers (and those `Connection` names), the
    scheduling headers and the client's credentials stay here; the child gets its own key and our id."""
    headers = {
        "X-Custom-Thing": "kept as sent",
        "x-lower-case": "also kept",
        "Connection": "keep-alive, X-Hop-Only",
        "X-Hop-Only": "dropped: the Connection header names it",
        "X-Priority": "3",
        "Authorization": "Bearer the-clients-own",
        "X-Request-Id": "client-id-123",
    }
    assert daemon.http is not None
    url = daemon.url + "/v1/chat/completions"
    async with daemon.http.post(url, json=_chat(False, echo_headers=True), headers=headers) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    lines = json.loads(answer["choices"][0]["message"]["content"])
    names = [line.partition(":")[0] for line in lines]
    assert "X-Custom-Thing: kept as sent" in lines
    assert "x-lower-case: also kept" in lines
    assert "X-Request-Id: client-id-123" in lines  # the client's sane id, set by the daemon: one of them
    assert names.count("X-Request-Id") == 1
    assert "Authorization: Bearer the-clients-own" not in lines
    assert names.count("Authorization") == 1  # the child's own key, which the client never sees
    for gone in ("Connection", "X-Hop-Only", "X-Priority"):
        assert gone not in names, lines


async def test_an_event_split_across_chunks_reaches_the_openai_client_whole(daemon: Daemon) -> None:
    stream = await daemon.openai().chat.completions.create(
        model="standin",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"stand_in": {"tokens": 4, "split": True}},
    )
    texts = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
    assert "".join(t for t in texts if t) == " w0 w1 w2 w3"


async def _raw_chunks(daemon: Daemon, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    """The HTTP chunks of a streamed answer as they come off the socket, each with when it came."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    chunks = []
    async with asyncio.timeout(20):
        await reader.readuntil(b"\r\n\r\n")
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            chunks.append((asyncio.get_running_loop().time(), await reader.readexactly(size)))
            await reader.readexactly(2)
    writer.close()
    return chunks


async def test_events_that_arrive_together_leave_together_and_apart_leave_apart(daemon: Daemon) -> None:
    await daemon.chat("standin")  # loaded, so the first stream is not timed behind a load
    # Eight events in one write of the engine: one read of the daemon, one chunk to the client (with
    # the last two events too, when they were read with them).
    chunks = await _raw_chunks(daemon, _chat(True, tokens=8, together=True))
    assert chunks[0][1].count(b'" w') == 8
    assert b"".join(piece for _, piece in chunks).endswith(b"data: [DONE]\n\n")
    # Events 100 ms apart: each leaves as it comes, nothing held back for the next.
    chunks = await _raw_chunks(daemon, _chat(True, tokens=4, interval_ms=100))
    tokens = [(at, piece) for at, piece in chunks if b'" w' in piece]
    assert [piece.count(b'" w') for _, piece in tokens] == [1, 1, 1, 1]
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(tokens)]
    assert all(gap > 0.05 for gap in gaps), gaps


async def test_a_child_that_dies_mid_chunk_ends_the_stream_with_an_error_event(daemon: Daemon) -> None:
    url = daemon.url + "/v1/chat/completions"
    async with (
        asyncio.timeout(20),
        aiohttp.ClientSession() as http,  # a new connection: the front's
        http.post(url, json=_chat(True, tokens=6, cut_after=2)) as r,
    ):
        assert r.status == 200
        body = await r.read()  # the chunked framing ends properly: no hang, no payload error
    events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1].startswith(b'data: {"error"')
    assert json.loads(events[-1][6:])["error"]["code"] == "model_crashed"
    assert len([e for e in events if b'" w' in e]) == 2  # what came before the cut came through


@pytest.mark.parametrize("served_by", ["front", "aiohttp"])
async def test_a_whole_answer_cut_by_the_childs_death_does_not_end_as_if_whole(
    daemon: Daemon, served_by: str
) -> None:
    """A large whole answer (not SSE) comes chunked, and is relayed chunk by chunk. Cut by the child's
    death, it ended with the chunked body's end and the connection kept: a client took the part for the
    whole answer (a reviewer saw 3.1 MB of JSON cut mid-value, then `0\\r\\n\\r\\n`). It now ends
    without it, the connection closed, on the front's connections and on one handed to aiohttp (which an
    Ollama request took over first)."""
    await daemon.chat("standin")  # loaded
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    if served_by == "aiohttp":
        writer.write(b"GET /api/version HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    body = json.dumps(_chat(False, chunked_json=True, tokens=20, cut_after=5))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )
    async with asyncio.timeout(20):
        answer = await reader.read(-1)  # to the connection's end: it must close
    writer.close()
    head, _, chunked = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"transfer-encoding: chunked" in head.lower()
    assert chunked.startswith(b"%x\r\n" % int(chunked.split(b"\r\n")[0], 16))  # some of it came
    assert not chunked.endswith(b"0\r\n\r\n"), chunked[-40:]
    # Complete, the same answer ends with its chunked end
    whole = await _raw_answer(daemon, _chat(False, chunked_json=True, tokens=20))
    assert whole.endswith(b"\r\n0\r\n\r\n")


async def _raw_answer(daemon: Daemon, request: dict[str, Any]) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    body = json.dumps(request).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with asyncio.timeout(20):
        answer = await reader.read(-1)
    writer.close()
    return answer


async def _flood_not_read(
    daemon: Daemon, receive_buffer: int, version: bytes = b"1.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream of 100 MiB asked for on a connection with a small receive buffer, read up to its head and
    no further. (In HTTP/1.0 the front hands the request to aiohttp.)"""
    body = json.dumps(_chat(True, flood_mib=100, tokens=1)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    writer.write(
        b"POST /v1/chat/completions HTTP/%s\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (version, len(body), body)
    )
    await reader.readuntil(b"\r\n\r\n")
    return reader, writer


async def test_a_client_that_stops_reading_is_not_buffered_in_the_daemon(daemon: Daemon) -> None:
    assert daemon.proc is not None
    await daemon.chat("standin")  # loaded
    daemon_process = psutil.Process(daemon.proc.pid)
    before = daemon_process.memory_info().rss
    reader, writer = await _flood_not_read(daemon, 65536)
    await asyncio.sleep(2)  # the client reads nothing while the engine has 100 MiB to send
    grown_mib = (daemon_process.memory_info().rss - before) / 2**20
    assert grown_mib < 16, f"the daemon buffered {grown_mib:.0f} MiB for a client that does not read"
    received = 0
    async with asyncio.timeout(60):
        while chunk := await reader.read(1 << 20):
            received += len(chunk)
            if chunk.endswith(b"0\r\n\r\n"):
                break
    assert received > 100 * 2**20  # and then all of it arrives
    writer.close()


async def test_a_head_that_never_ends_is_refused_and_costs_the_daemon_nothing(daemon: Daemon) -> None:
    """Before heads were bounded, 200 MiB of header lines took the daemon from 58 MiB to 4.4 GiB (an
    attacker on the network needs no key for that: the head comes before the key is read)."""
    assert daemon.proc is not None
    assert daemon.http is not None
    daemon_process = psutil.Process(daemon.proc.pid)
    before = daemon_process.memory_info().rss
    chunk = b"X-a: b\r\n" * 8192
    _, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    sent = 0
    try:
        while sent < 64 << 20:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 10)
            sent += len(chunk)
    except ConnectionError:
        pass  # the daemon closed it: the lingering after its 431 is over
    writer.close()
    grown_mib = (daemon_process.memory_info().rss - before) / 2**20
    assert grown_mib < 16, f"the daemon grew {grown_mib:.0f} MiB for {sent >> 20} MiB of a head"
    headers = {f"X-{n}": "v" for n in range(200)}
    async with daemon.http.post(daemon.url + "/v1/chat/completions", json=_chat(False), headers=headers) as r:
        assert r.status == 431
        error = (await r.json())["error"]
    assert error["code"] == "header_too_large"
    assert error["message"] == "request header fields too large: more than 96 header lines"
    assert await daemon.chat("standin")  # and the daemon serves on


async def test_a_client_that_reads_nothing_is_not_buffered_for_behind_pipelined_answers(
    daemon: Daemon,
) -> None:
    """The pause lasted one answer: pipelined behind whole answers of about 1 MB, a 100 MiB stream (or a
    hundred more whole answers) was written while the client read nothing, and the daemon grew by the
    100 MiB (a reviewer measured 108). The next answer now waits until the client reads."""
    assert daemon.proc is not None
    await daemon.chat("standin")  # loaded
    daemon_process = psutil.Process(daemon.proc.pid)
    before = daemon_process.memory_info().rss
    whole = json.dumps(_chat(False, tokens=200_000)).encode()  # about 1 MB of answer
    stream = json.dumps(_chat(True, flood_mib=100, tokens=1)).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    _reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    writer.write(
        b"".join(
            head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body) for body in [whole] * 7 + [stream]
        )
    )
    await asyncio.sleep(3)  # the client reads nothing
    grown_mib = (daemon_process.memory_info().rss - before) / 2**20
    assert grown_mib < 32, f"the daemon buffered {grown_mib:.0f} MiB for a client that does not read"
    writer.close()


@pytest.mark.parametrize("version", [b"1.1", b"1.0"], ids=["front", "handed-to-aiohttp"])
async def test_a_client_that_reads_nothing_for_client_timeout_s_is_dropped_and_frees_its_slot(
    make_daemon: MakeDaemon, version: bytes
) -> None:
    """Paused, the relay waited for the client with no deadline: four clients that never read held four
    slots for ever, and everyone else got 503 queue_timeout. Now a client that drains nothing for
    client_timeout_s is dropped (nginx's send_timeout), and its generation stops. On a connection the
    front hands to aiohttp (HTTP/1.0 here; the Ollama API too) aiohttp's write waited with no limit,
    until the hang check took the blocked child for hung and stopped it; the guard drops it now."""
    daemon = await make_daemon(models=MODELS, config={"client_timeout_s": 1})
    await daemon.chat("standin")  # loaded
    _, writer = await _flood_not_read(daemon, 4096, version)

    async def inflight() -> int:
        return int((await daemon.health())["models"]["standin"]["inflight"])

    async def freed() -> bool:
        return await inflight() == 0

    assert await inflight() == 1
    # Within client_timeout_s of its last drain, and however long the test machine takes.
    await eventually(freed, 30, "the stalled client's slot to be given back")
    writer.close()  # (what the kernel had of the stream still trickles through a 4 KiB window)
    assert daemon.events("client_not_reading")
    assert not daemon.events("child_crashed")
    assert await daemon.chat("standin")  # and the daemon serves on


async def test_a_client_that_leaves_stops_its_request(daemon: Daemon) -> None:
    http = aiohttp.ClientSession()
    response = await http.post(
        daemon.url + "/v1/chat/completions", json=_chat(True, tokens=2000, interval_ms=20)
    )
    await response.content.readuntil(b"\n\n")

    async def inflight() -> int:
        return int((await daemon.health())["models"]["standin"]["inflight"])

    assert await inflight() == 1
    response.close()  # the client goes away mid-stream
    await http.close()

    async def ended() -> bool:
        return await inflight() == 0

    await eventually(ended, 10, "the abandoned stream to end")


async def test_a_request_queued_behind_a_busy_model_gives_up_at_its_deadline_and_loses_no_place(
    make_daemon: MakeDaemon,
) -> None:
    # The scheduler's wait for a turn has a timer of its own (scheduler._expire, not an asyncio.timeout):
    # it must end the wait at the deadline, say what was waited for, and leave the queue as it was. The
    # stand-in's slow stream holds the one place for as long as the test needs (the demo model would
    # finish its stream first).
    daemon = await make_daemon(
        models={"standin": {**MODELS["standin"], "parallel": 1, "max_inflight": 1}},
        config={"queue_timeout_s": 1.0},
    )
    async with aiohttp.ClientSession() as http:
        holder = await http.post(
            daemon.url + "/v1/chat/completions", json=_chat(True, tokens=300, interval_ms=20)
        )
        await holder.content.readuntil(b"\n\n")
        async with http.post(daemon.url + "/v1/chat/completions", json=_chat(False)) as queued:
            body = await queued.json()
            assert (queued.status, body["error"]["code"]) == (503, "queue_timeout"), body
            assert "busy with 1 requests (max_inflight)" in body["error"]["message"]
            assert int(queued.headers["Retry-After"]) > 0
        health = (await daemon.health())["models"]["standin"]
        assert (health.get("queued", 0), health["inflight"]) == (0, 1)
        holder.close()  # the place it held goes to whoever asks next: the one that gave up took none

        async def served() -> bool:
            async with http.post(daemon.url + "/v1/chat/completions", json=_chat(False)) as r:
                return r.status == 200

        await eventually(served, 10, "the next request to be served")


async def test_other_routes_and_old_clients_are_served_by_aiohttp_on_the_same_port(daemon: Daemon) -> None:
    # One connection, kept alive: inference (the front), a model list and health (tunnelled to aiohttp,
    # the connection stays the front's), inference again (still the front), then the Ollama API (the
    # connection is handed to aiohttp for good). Every answer names the same server, whichever wrote it.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        servers = []
        for method, path, body in (
            ("POST", "/v1/chat/completions", _chat(False)),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
            ("POST", "/v1/chat/completions", _chat(True)),
            ("POST", "/v1/embeddings", {"model": "standin", "input": "hi"}),
            ("GET", "/api/tags", None),
            ("POST", "/v1/chat/completions", _chat(False)),
        ):
            async with http.request(method, daemon.url + path, json=body) as r:
                assert r.status == 200, await r.text()
                assert "X-Request-Id" in r.headers
                await r.read()
                servers.append(r.headers["Server"])
        assert servers == ["llm-supervisor"] * 7
    # HTTP/1.0 has no chunked answers: aiohttp serves it.
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    old_body = json.dumps(_chat(False)).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(old_body), old_body)
    )
    answer = await asyncio.wait_for(reader.read(), 20)
    assert answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200"), answer[:200]
    writer.close()


async def test_header_bytes_read_the_same_on_the_front_and_on_aiohttp(daemon: Daemon) -> None:
    # aiohttp decodes a header as UTF-8, with bytes that are not UTF-8 kept as they came
    # (surrogateescape); the front must read the same text, or a key or client id that is not ASCII
    # would mean one thing on the front's routes and another on aiohttp's.
    body = json.dumps(_chat(False)).encode()
    # HTTP/1.1: the front; HTTP/1.0: aiohttp.
    for version, client in ((b"1.1", b"caf\xc3\xa9"), (b"1.0", b"caf\xc3\xa9"), (b"1.1", b"\xff\xfe")):
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/%s\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"X-Client-Id: %s\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (version, client, len(body), body)
        )
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        assert b" 200 " in answer.split(b"\r\n")[0], answer[:300]

    def logged() -> bool:
        return (
            len(daemon.events("request", client_id="caf\u00e9")) == 2
            and len(daemon.events("request", client_id="\udcff\udcfe")) == 1
        )

    await eventually(logged, 10, "the requests logged with their client ids")


async def test_malformed_and_refused_requests_get_the_openai_error_shape(daemon: Daemon) -> None:
    status, body, headers = await daemon.post(
        "/v1/chat/completions", raw=b'{"model": "standin", "messages": ['
    )
    assert status == 400
    assert body["error"]["code"] == "invalid_request"
    assert "X-Request-Id" in headers
    status, body, _ = await daemon.post("/v1/chat/completions", {**_chat(False), "model": "nope"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    # Not HTTP at all: a 400 and the connection closed.
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(b"\x16\x03\x01 hello\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    writer.close()


async def test_pipelined_requests_are_answered_in_order(daemon: Daemon) -> None:
    body = json.dumps(_chat(False, tokens=2)).encode()
    one = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    one += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(one + one)  # two requests in one write, before any answer
    answers = []
    for _ in range(2):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        answers.append((head.split(b" ")[1], await reader.readexactly(length)))
    writer.close()
    assert [status for status, _ in answers] == [b"200", b"200"]
    assert all(b'"choices"' in answer for _, answer in answers)


async def _http_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next answer on a connection: its status and its body, whole (Content-Length) or streamed
    (chunked, the chunks joined)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    status = head.split(b" ")[1]
    if b"\r\ntransfer-encoding: chunked" not in head.lower():
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return status, await reader.readexactly(length)
    body = b""
    while size := int(await asyncio.wait_for(reader.readuntil(b"\r\n"), 20), 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)  # the CRLF after the last chunk
    return status, body


@pytest.mark.parametrize("cuts", [(), (7, 190, 421, 700, 1000, -3)], ids=["one-write", "cut"])
async def test_a_pipelined_mix_of_routes_is_answered_in_order(daemon: Daemon, cuts: tuple[int, ...]) -> None:
    """Requests the front serves (whole, streamed, embeddings), one it tunnels to aiohttp (`/v1/models`)
    and a chunked upload to the chat route (aiohttp's, through the tunnel), pipelined on one connection
    in one write or cut in pieces: each answered once, in order, by the real daemon and its child."""

    def post(path: bytes, payload: dict[str, Any], chunked: bool = False) -> bytes:
        body = json.dumps(payload).encode()
        head = b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" % path
        if chunked:
            return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

    chat = b"/v1/chat/completions"
    requests = [
        (post(chat, _chat(False, tokens=2)), b'"choices"'),
        (b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", b'"standin"'),
        (post(chat, _chat(True, tokens=3)), b"data: [DONE]"),
        (post(b"/v1/embeddings", {"model": "standin", "input": "hi"}), b'"embedding"'),
        (post(chat, _chat(False, tokens=2), chunked=True), b'"choices"'),
        (post(chat, _chat(False, tokens=2)), b'"choices"'),
    ]
    data = b"".join(sent for sent, _ in requests)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    start = 0
    for cut in [*sorted(c % len(data) for c in cuts), len(data)]:
        writer.write(data[start:cut])
        await writer.drain()
        await asyncio.sleep(0.01)
        start = cut
    for n, (_, wanted) in enumerate(requests):
        status, body = await _http_answer(reader)
        assert status == b"200", (n, body)
        assert wanted in body, (n, body)
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # and no answer more than was asked for
    writer.close()


async def _trickled(daemon: Daemon, start: bytes, piece: Callable[[int], bytes]) -> tuple[bytes, float]:
    """Send `start`, then a piece every 0.2 s (which would keep a per-read timer alive for ever) until the
    daemon answers or closes; its answer, and how long that took in seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(start)
    started = asyncio.get_running_loop().time()
    answer = b""
    for n in range(20):
        writer.write(piece(n))
        await asyncio.sleep(0.2)
        if reader.at_eof() or (answer := answer + await _available(reader)):
            break
    answer += await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer, asyncio.get_running_loop().time() - started


async def test_a_body_that_trickles_in_past_client_timeout_s_gets_408(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=MODELS, config={"client_timeout_s": 1})
    answer, took_s = await _trickled(
        daemon,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n",
        lambda _: b" ",
    )
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert took_s < 3


@pytest.mark.parametrize("route", [b"POST /v1/chat/completions", b"GET /api/tags"])
async def test_a_head_that_trickles_in_past_client_timeout_s_gets_408(
    make_daemon: MakeDaemon, route: bytes
) -> None:
    """A byte now and then kept a connection's idle timer from ever firing: a head could take for ever,
    and a few thousand such connections hold as many sockets."""
    daemon = await make_daemon(models=MODELS, config={"client_timeout_s": 1})
    answer, took_s = await _trickled(
        daemon, route + b" HTTP/1.1\r\nHost: localhost\r\n", lambda n: b"X-%d: v\r\n" % n
    )
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"the request head did not arrive within 1s" in answer
    assert took_s < 3


async def test_a_body_too_large_for_another_route_is_refused_before_it_is_read(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(models=MODELS, config={"max_body_mib": 1})
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(
        b"POST /v1/admin/models/standin/load HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (2 * 2**20)
    )
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]


async def _available(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(4096), 0.01)
    except TimeoutError:
        return b""
