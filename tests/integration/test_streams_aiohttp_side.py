"""Streams served by aiohttp's side of the daemon (HTTP/1.0, the Ollama routes, a connection an Ollama
request took over): how they end, as the front's do."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon
from tests.integration.test_dataplane import STAND_IN

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
STANDIN_MODELS: dict[str, dict[str, Any]] = {
    "standin": {"binary": str(STAND_IN), "vram_mib": 64, "parallel": 8}
}


def _post(path: str, body: dict[str, Any], version: str = "1.1", extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def _read_to_eof(reader: asyncio.StreamReader, quiet_s: float) -> tuple[bytes, bool]:
    """What the connection brings, and whether it ended (False: nothing more came for `quiet_s`)."""
    got = b""
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), quiet_s)
        except TimeoutError:
            return got, False
        if not chunk:
            return got, True
        got += chunk


def _body(data: bytes) -> bytes:
    """The answer's body, its chunked coding undone."""
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return rest
    body = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            break
        body, rest = body + rest[:length], rest[length + 2 :]
    return body


@pytest.mark.parametrize(
    ("path", "body", "end"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 5, "stream": True}, b"data: [DONE]"),
        ("/api/chat", {**CHAT, "options": {"num_predict": 5}}, b'"done":true'),
    ],
    ids=["openai-sse", "ollama-ndjson"],
)
async def test_an_http_1_0_keep_alive_clients_stream_ends_with_the_connection(
    daemon: Daemon, path: str, body: dict[str, Any], end: bytes
) -> None:
    """HTTP/1.0 has no chunked coding: a body without a Content-Length ends only when the connection
    closes. A client that sends `Connection: keep-alive` (ab -k, HTTP/1.0 proxies) gets a stream with
    neither a length nor `Connection: keep-alive` in its head, and then the connection stays open
    (aiohttp's StreamResponse drops keep-alive in a local variable only): the client waits for the end
    of the body until the daemon's 75 s keep-alive timeout."""
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(_post(path, body, "1.0", "Connection: keep-alive\r\n"))
    data, ended = await _read_to_eof(reader, 10)
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert end in rest, rest[-300:]
    assert b"content-length" not in head.lower()  # the body is delimited by the close, then
    assert ended, "the stream's last line came, but the connection stayed open: its body never ends"


@pytest.mark.parametrize("served_by", ["http-1.0", "after-an-ollama-request"])
async def test_a_child_that_dies_mid_event_leaves_no_half_event_glued_to_the_error_on_aiohttp(
    make_daemon: MakeDaemon, served_by: str
) -> None:
    """The front holds the start of an SSE event until its end comes, so a stream cut mid-event ends with
    a clean `model_crashed` event. proxy._relay (aiohttp's side: HTTP/1.0, chunked or 100-continue
    uploads, any connection an Ollama request took over) writes each piece as it comes, and the error
    event is glued to the half event: `..."finish_reason": nulldata: {"error": ...}`, which no SSE
    client can parse (the openai SDK raises a JSON error instead of the API error)."""
    daemon = await make_daemon(models=STANDIN_MODELS)
    await daemon.chat("standin")  # loaded
    body = {
        "model": "standin",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stand_in": {"tokens": 6, "cut_after": 2},
    }
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    if served_by == "http-1.0":
        writer.write(_post("/v1/chat/completions", body, "1.0"))
    else:
        writer.write(b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(_post("/v1/chat/completions", body, "1.1", "Connection: close\r\n"))
    data, ended = await _read_to_eof(reader, 20)
    writer.close()
    assert ended
    text = _body(data).decode(errors="replace")
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    for event in events:
        try:
            json.loads(event)
        except ValueError:
            raise AssertionError(f"an event no client can read: {event!r}") from None
    assert json.loads(events[-1])["error"]["code"] == "model_crashed"
