#!/usr/bin/env python3
"""A stand-in for llama-server's HTTP layer, for what the real engine cannot be made to do on demand.

It takes llama-server's command line (`--host`, which may name a Unix socket as `*.sock`, `--port`,
`--api-key-file`; the rest is ignored), or vLLM's (`--uds`, `--served-model-name`, the key in
`VLLM_API_KEY`) when a vLLM manifest's `command` runs it, and answers
`/health`, `/v1/models`, `/v1/embeddings` and `/v1/chat/completions`, and streams like llama-server: one
SSE event per HTTP chunk, then closes the connection. A request's `stand_in` field picks a behaviour:

    {"tokens": 5, "interval_ms": 0}   how many tokens, and the pause before each (a slow engine)
    {"split": true}                   each event written as two chunks, with a pause between: a chunk
                                      boundary inside an SSE event
    {"together": true}                every token's event (each its own chunk) in one write, as an
                                      engine that outruns its reader looks to it
    {"cut_after": 2}                  after 2 events, half of a chunk and then the connection closed
    {"chunked_json": true}            a whole answer (not a stream) sent chunked, a piece per chunk, as
                                      llama-server sends a large one; with cut_after, cut as above
    {"flood_mib": 50}                 50 MiB of events as fast as the socket takes them
    {"echo_headers": true}            a whole answer whose content is the request's header lines, as
                                      JSON: what a proxy in front passed on
    {"raw": "<base64>"}               exactly those bytes as the answer, head and all, then the
                                      connection closed: an answer no engine gives on demand (a 204)

With `--echo-body`, every chat answer is whole and its content is the request's body: what the daemon
made of a request (an Ollama one, say, which has no room for a `stand_in` field).

The demo model cannot hold 1,000 open streams on two cores; this engine can (bench/many_streams.py), and
the data plane's tests use it to cut streams and flood slow clients (tests/integration/test_dataplane.py).
Standard library only, so any python3 runs it as a manifest's `binary`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _event(text: str, finish: str | None = None) -> bytes:
    delta = {"content": text} if finish is None else {}
    chunk = {
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        "object": "chat.completion.chunk",
        "model": "stand-in",
        "created": int(time.time()),
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Server: stand-in\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Engine:
    def __init__(self, key: str | None, name: str = "stand-in", echo_body: bool = False) -> None:
        self.key = key
        self.name = name
        self.echo_body = echo_body

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                pairs = (line.partition(":") for line in lines[1:] if line)
                headers = {k.strip().lower(): v.strip() for k, _, v in pairs}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self.answer(method, path, headers, body, writer, lines[1:-2]):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def answer(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        writer: asyncio.StreamWriter,
        lines: list[str],
    ) -> bool:
        """Write the answer; False when the connection is to close after it. `lines`: the header lines as
        sent."""
        if path == "/health":
            return self.whole(writer, 200, {"status": "ok"})
        if self.key is not None and headers.get("authorization") != f"Bearer {self.key}":
            return self.whole(writer, 401, {"error": {"message": "Invalid API Key", "code": 401}})
        if path == "/v1/models":
            models = [{"id": self.name, "object": "model"}]
            return self.whole(writer, 200, {"object": "list", "data": models})
        request: dict[str, Any] = json.loads(body or b"{}")
        if path == "/v1/embeddings":
            usage = {"prompt_tokens": 3, "total_tokens": 3}
            data = [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3, 0.4]}]
            return self.whole(writer, 200, {"object": "list", "data": data, "usage": usage})
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return self.whole(writer, 404, {"error": {"message": "File Not Found", "code": 404}})
        how = request.get("stand_in") or {}
        if how.get("raw"):
            writer.write(base64.b64decode(how["raw"]))
            await writer.drain()
            return False
        if self.echo_body and request.get("stream"):
            writer.write(_STREAM_HEAD + _chunk(_event(body.decode())) + _chunk(_event("", "stop")))
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return False
        if how.get("echo_headers") or self.echo_body:
            echoed = body.decode() if self.echo_body else json.dumps(lines)
            message = {"role": "assistant", "content": echoed}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return self.whole(writer, 200, {"choices": [choice], "object": "chat.completion"})
        tokens = int(how.get("tokens", request.get("max_tokens") or 4))
        if how.get("chunked_json"):
            await self.chunked_json(writer, how, tokens)
            return False
        if not request.get("stream"):
            await asyncio.sleep(how.get("interval_ms", 0) * tokens / 1000)
            message = {"role": "assistant", "content": " word" * tokens}
            usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            return self.whole(writer, 200, {"choices": [choice], "object": "chat.completion", "usage": usage})
        writer.write(_STREAM_HEAD)
        await self.stream(writer, how, tokens)
        return False  # as llama-server does: a stream's connection is closed at its end

    async def stream(self, writer: asyncio.StreamWriter, how: dict[str, Any], tokens: int) -> None:
        interval = float(how.get("interval_ms", 0)) / 1000
        flood = int(float(how.get("flood_mib", 0)) * 2**20)
        cut_after = how.get("cut_after")
        while flood > 0:
            event = _event("x" * 16000)
            writer.write(_chunk(event))
            flood -= len(event)
            await writer.drain()
        if how.get("together"):
            writer.write(b"".join(_chunk(_event(f" w{i}")) for i in range(tokens)))
        else:
            for i in range(tokens):
                if interval:
                    await asyncio.sleep(interval)
                event = _event(f" w{i}")
                if cut_after is not None and i >= int(cut_after):
                    framed = _chunk(event)
                    writer.write(framed[: len(framed) // 2])
                    await writer.drain()
                    writer.transport.abort()
                    return
                if how.get("split"):
                    half = len(event) // 2
                    writer.write(_chunk(event[:half]))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(_chunk(event[half:]))
                else:
                    writer.write(_chunk(event))
                await writer.drain()
        usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
        last = json.loads(_event("", "length")[6:])
        last["usage"] = usage
        writer.write(_chunk(b"data: " + json.dumps(last).encode() + b"\n\n"))
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    async def chunked_json(writer: asyncio.StreamWriter, how: dict[str, Any], tokens: int) -> None:
        """A whole chat answer in `tokens` chunked pieces of its JSON; cut after `cut_after` of them."""
        message = {"role": "assistant", "content": " word" * tokens}
        body = json.dumps({"choices": [{"index": 0, "message": message, "finish_reason": "length"}]}).encode()
        size = len(body) // tokens + 1
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        cut_after = how.get("cut_after")
        for n, at in enumerate(range(0, len(body), size)):
            if cut_after is not None and n >= int(cut_after):
                await writer.drain()
                writer.transport.abort()
                return
            writer.write(_chunk(body[at : at + size]))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    def whole(writer: asyncio.StreamWriter, status: int, document: dict[str, Any]) -> bool:
        body = json.dumps(document).encode()
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
            b"Keep-Alive: timeout=5, max=100\r\n\r\n%s" % (status, len(body), body)
        )
        return True


async def main(args: argparse.Namespace, key: str | None) -> int:
    engine = Engine(key, args.served_model_name, args.echo_body)
    if args.uds or args.host.endswith(".sock"):  # as vLLM and llama-server: a Unix socket
        server = await asyncio.start_unix_server(engine.handle, args.uds or args.host, backlog=2048)
    else:
        server = await asyncio.start_server(engine.handle, args.host, args.port, backlog=2048)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    return 0


def parse(argv: list[str]) -> tuple[argparse.Namespace, str | None]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key-file")
    parser.add_argument("--uds")
    parser.add_argument("--served-model-name", default="stand-in")
    parser.add_argument("--echo-body", action="store_true")
    args, _ = parser.parse_known_args(argv)
    key = Path(args.api_key_file).read_text().strip() if args.api_key_file else os.environ.get("VLLM_API_KEY")
    return args, key


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*parse(sys.argv[1:]))))
