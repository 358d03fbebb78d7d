"""What the Ollama translation costs: streaming /api/chat against streaming /v1/chat/completions.

One run starts one daemon serving the tiny demo model and drives it with the same closed-loop load on
both routes, alternating between them so that machine noise hits both. The OpenAI route passes the
engine's SSE bytes through untouched; the Ollama route parses every SSE event and writes an NDJSON line
for it. Both ask for the same greedy answer (temperature 0, the same seed, usage included), so the engine
does the same work; the difference is the translation. Every cell (concurrency) reports requests/s and
tokens/s of each route, their ratio (goal: >= 0.95, translation costs < 5%), the time to first token
that the translation adds (p50), and the daemon's CPU per request.

    .venv/bin/python -m bench.ollama_translation            # ~6 s per route per cell, about a minute
    .venv/bin/python -m bench.ollama_translation --quick    # a smoke run

The process handling (marker, stop on Ctrl-C, sweep) is bench/proxy_overhead.py's.
Exit status: 0, or 1 if any request failed or a process had to be swept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from bench.proxy_overhead import (
    MODEL_NAME,
    REPO,
    Processes,
    default_timing,
    free_port,
    new_session,
    percentile,
    prepare_model,
    run,
    start_daemon,
    tail,
    wait_healthy,
)

CONCURRENCIES = (1, 8)
GOAL_RATIO = 0.95
ROUTES = ("openai", "ollama")
PROMPT = [{"role": "user", "content": "Say something about proxies."}]
ERRORS = (aiohttp.ClientError, RuntimeError, TimeoutError)


def openai_body(max_tokens: int) -> bytes:
    body = {
        "model": MODEL_NAME,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        "stream": True,
        "stream_options": {"include_usage": True},  # the Ollama route asks for it too
    }
    return json.dumps(body).encode()


def ollama_body(max_tokens: int) -> bytes:
    body = {
        "model": MODEL_NAME,
        "messages": PROMPT,
        "options": {"num_predict": max_tokens, "temperature": 0, "seed": 42},
        "stream": True,
    }
    return json.dumps(body).encode()


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)  # seconds
    ttfts: list[float] = field(default_factory=list)  # first token line
    tokens: int = 0
    errors: int = 0
    last_error: str = ""
    elapsed: float = 0.0
    cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    @property
    def token_rate(self) -> float:
        return self.tokens / self.elapsed if self.elapsed else 0.0


async def openai_request(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, int]:
    """One streamed chat completion; returns (time to first token, tokens)."""
    started = time.perf_counter()
    ttft, tokens, done = None, 0, False
    async with session.post(f"{url}/v1/chat/completions", data=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data:") and b'"content":"' in line:
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
    if ttft is None or not done:
        raise RuntimeError("stream ended without tokens or without [DONE]")
    return ttft, tokens


async def ollama_request(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, int]:
    """One streamed /api/chat; returns (time to first token, tokens)."""
    started = time.perf_counter()
    ttft, tokens, final = None, 0, None
    async with session.post(f"{url}/api/chat", data=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
        async for line in response.content:
            if not line.strip():
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            event = json.loads(line)
            if "error" in event:
                raise RuntimeError(f"error line: {event['error']}")
            if event.get("done"):
                final = event
            else:
                tokens += 1
    if ttft is None or final is None:
        raise RuntimeError("stream ended without tokens or without done")
    return ttft, tokens


async def run_segment(
    route: str,
    session: aiohttp.ClientSession,
    url: str,
    max_tokens: int,
    concurrency: int,
    duration_s: float,
    samples: Samples,
    daemon_pid: int,
) -> None:
    request, body = (
        (openai_request, openai_body(max_tokens))
        if route == "openai"
        else (ollama_request, ollama_body(max_tokens))
    )

    async def worker() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                ttft, tokens = await request(session, url, body)
            except ERRORS as exc:
                samples.errors += 1
                samples.last_error = repr(exc)
                continue
            samples.latencies.append(time.perf_counter() - started)
            samples.ttfts.append(ttft)
            samples.tokens += tokens

    await asyncio.gather(*(request(session, url, body) for _ in range(concurrency)))  # untimed warm-up
    process = psutil.Process(daemon_pid)
    cpu = sum(process.cpu_times()[:2])
    started = time.perf_counter()
    deadline = started + duration_s
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    samples.elapsed += time.perf_counter() - started
    samples.cpu_s += sum(process.cpu_times()[:2]) - cpu


@dataclass
class Cell:
    concurrency: int
    routes: dict[str, Samples] = field(default_factory=lambda: {r: Samples() for r in ROUTES})

    @property
    def ratio(self) -> float:
        openai = self.routes["openai"].token_rate
        return self.routes["ollama"].token_rate / openai if openai else float("nan")

    def added_ttft_ms(self) -> float:
        return (
            percentile(self.routes["ollama"].ttfts, 50) - percentile(self.routes["openai"].ttfts, 50)
        ) * 1000


def table(cells: Sequence[Cell]) -> str:
    header = (
        f"{'cell':<6} {'openai r/s':>10} {'ollama r/s':>10} {'openai tok/s':>12} {'ollama tok/s':>12} "
        f"{'ratio':>6} {'openai ttft':>11} {'+ttft ms':>8} {'cpu/req o/O':>13} {'n':>11} {'err':>5}"
    )
    rows = [header, "-" * len(header)]
    for cell in cells:
        a, b = cell.routes["openai"], cell.routes["ollama"]
        cpu_a, cpu_b = (s.cpu_s * 1000 / max(1, len(s.latencies)) for s in (a, b))
        cpu = f"{cpu_a:.2f}/{cpu_b:.2f}ms"
        rows.append(
            f"c={cell.concurrency:<4} {a.rate:>10.1f} {b.rate:>10.1f} "
            f"{a.token_rate:>12.0f} {b.token_rate:>12.0f} "
            f"{cell.ratio:>6.3f} {percentile(a.ttfts, 50) * 1000:>9.2f}ms {cell.added_ttft_ms():>+8.2f} "
            f"{cpu:>13} {len(a.latencies):>5}/{len(b.latencies):<5} {a.errors:>2}/{b.errors:<2}"
        )
    rows.append(
        "ratio: ollama tok/s over openai tok/s; +ttft: ollama minus openai, p50 (first token line); "
        "cpu/req: the daemon process's CPU per request, openai/Ollama"
    )
    return "\n".join(rows)


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    if prepare_model(args, workdir) is None:
        return 2
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    await start_daemon(procs, port, workdir)
    assert procs.daemon is not None
    async with new_session(max(args.concurrency)) as session:
        await wait_healthy(session, url, procs.daemon, procs.logs["daemon"], 60)
        try:
            _, tokens = await ollama_request(session, url, ollama_body(args.max_tokens))  # loads the model
            _, openai_tokens = await openai_request(session, url, openai_body(args.max_tokens))
        except ERRORS as exc:
            raise RuntimeError(f"warm-up failed: {exc!r}\n{tail(procs.logs['daemon'])}") from exc
        if tokens != openai_tokens:
            print(f"note: answers differ in length: ollama {tokens}, openai {openai_tokens} tokens")
        cells = [Cell(c) for c in args.concurrency]
        segment_s = args.duration / args.rounds
        print(
            f"{len(cells)} cells x 2 routes x {args.duration:g} s ({args.rounds} alternating segments each), "
            f"max_tokens={args.max_tokens} ({tokens} per answer)"
        )
        for cell in cells:
            for r in range(args.rounds):
                for route in ROUTES if r % 2 == 0 else ROUTES[::-1]:
                    await run_segment(
                        route,
                        session,
                        url,
                        args.max_tokens,
                        cell.concurrency,
                        segment_s,
                        cell.routes[route],
                        procs.daemon.pid,
                    )
            print(f"  c={cell.concurrency}: ratio {cell.ratio:.3f}", flush=True)
            for route, samples in cell.routes.items():
                if samples.errors:
                    print(f"  {route}: {samples.errors} errors, last: {samples.last_error}", file=sys.stderr)
    print()
    print(table(cells))
    worst = min(cells, key=lambda c: c.ratio)
    verdict = "PASS" if worst.ratio >= GOAL_RATIO else "MISS"
    print(
        f"goal: {verdict} translation costs < {1 - GOAL_RATIO:.0%} (worst ratio {worst.ratio:.3f}, "
        f"c={worst.concurrency}); added TTFT p50 up to {max(c.added_ttft_ms() for c in cells):+.2f} ms"
    )
    return 1 if any(s.errors for c in cells for s in c.routes.values()) else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short cells (1.5 s per route), a smoke run")
    parser.add_argument("--duration", type=float, help="seconds of load per route per cell (default 6)")
    parser.add_argument("--rounds", type=int, help="alternating segments per route per cell (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    parser.add_argument("--server-threads", type=int, default=1, metavar="N", help="llama-server --threads")
    parser.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG", help="extra llama-server arg"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after the run")
    return default_timing(parser, parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    return run(bench, parse_args(argv), "llmsup-bench-ollama-")


if __name__ == "__main__":
    sys.exit(main())
