"""1,000 SSE streams open through one daemon at once: every one must complete, and the daemon's memory
must stay small (issue 15: RSS under 150 MB with them open; idle RSS after start-up under 60 MB).

The engine is bench/stand_in_engine.py, not llama-server: the demo model on two cores cannot hold 1,000
slots, and what is measured here is the daemon's cost per open stream, not generation. Each stream gets
`--tokens` tokens, one every `--interval-ms`, so all of them are open at the same time.

    .venv/bin/python -m bench.many_streams                 # 1,000 streams of 20 tokens, 250 ms apart
    .venv/bin/python -m bench.many_streams --streams 200   # a smaller run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import psutil
import yaml

from bench.proxy_overhead import REPO, Processes, free_port, run, start_daemon, wait_healthy

STAND_IN = REPO / "bench" / "stand_in_engine.py"
GOAL_RSS_MIB = 150.0
GOAL_IDLE_RSS_MIB = 60.0


def _raise_open_files(needed: int) -> None:
    """Each stream holds a client socket here and two in the daemon (inherited limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(needed, soft), hard), hard))


async def _stream(http: aiohttp.ClientSession, url: str, body: bytes, tokens: int) -> bool:
    """One stream read to its end; True when all its tokens and the final [DONE] came."""
    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            return False
        seen = 0
        done = False
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: ") and b'"content"' in line:
                seen += 1
        return done and seen == tokens


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    _raise_open_files(4 * args.streams + 256)
    manifests = workdir / "manifests"
    manifests.mkdir()
    (manifests / "stand-in.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "stand-in",
                "engine": "llama-server",
                "model": str(args.model.resolve()),
                "binary": str(STAND_IN),
                "vram_mib": 64,
                "parallel": args.streams,
                "max_inflight": args.streams,
                "keep_alive": -1,
            }
        )
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    await start_daemon(procs, port, workdir)
    assert procs.daemon is not None
    daemon = psutil.Process(procs.daemon.pid)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        await wait_healthy(http, url, procs.daemon, procs.logs["daemon"], 60)
        await asyncio.sleep(1)  # start-up done: pinned nothing, so this is the daemon alone
        idle_rss = daemon.memory_info().rss / 2**20
        body = json.dumps(
            {
                "model": "stand-in",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stand_in": {"tokens": args.tokens, "interval_ms": args.interval_ms},
            }
        ).encode()
        await _stream(http, url + "/v1/chat/completions", body, args.tokens)  # loads the stand-in
        peak = daemon.memory_info().rss / 2**20
        started = time.perf_counter()
        tasks = [
            asyncio.ensure_future(_stream(http, url + "/v1/chat/completions", body, args.tokens))
            for _ in range(args.streams)
        ]
        open_at_once = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.25)
            peak = max(peak, daemon.memory_info().rss / 2**20)
            try:
                health = await (await http.get(url + "/health")).json()
                open_at_once = max(open_at_once, int(health["models"]["stand-in"]["inflight"]))
            except (aiohttp.ClientError, KeyError, ValueError):
                pass
        results = [t.result() if not t.exception() else False for t in tasks]
        elapsed = time.perf_counter() - started
        cpu = daemon.cpu_times()
    completed = sum(results)
    print(
        f"{args.streams} streams of {args.tokens} tokens {args.interval_ms} ms apart through one daemon: "
        f"{completed} completed, {args.streams - completed} failed, in {elapsed:.1f} s; "
        f"at most {open_at_once} in flight at once (the daemon's own count)"
    )
    print(
        f"daemon RSS: {idle_rss:.1f} MiB idle after start-up, {peak:.1f} MiB at most with the streams open; "
        f"daemon CPU over the whole run {cpu.user + cpu.system:.1f} s"
    )
    checks = [
        (completed == args.streams, "every stream completes", f"{completed}/{args.streams}"),
        (peak < GOAL_RSS_MIB, f"RSS < {GOAL_RSS_MIB:g} MiB with them open", f"{peak:.1f} MiB"),
        (idle_rss < GOAL_IDLE_RSS_MIB, f"idle RSS < {GOAL_IDLE_RSS_MIB:g} MiB", f"{idle_rss:.1f} MiB"),
    ]
    print("goals: " + "; ".join(f"{'PASS' if ok else 'MISS'} {goal} ({value})" for ok, goal, value in checks))
    return 0 if completed == args.streams else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--interval-ms", type=int, default=250)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after the run")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run(bench, parse_args(argv), "llmsup-streams-")


if __name__ == "__main__":
    sys.exit(main())
