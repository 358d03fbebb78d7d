"""What replicas buy: requests/s of one model with 1 and 2 replicas, and the wait under a burst with
scale-up on and off.

1. Throughput. One daemon per run serves the demo model on two simulated GPUs (standing in for two real
   ones: the children run on the CPU), each child with one thread and one slot. Clients at concurrency 8
   and 32 send short chats for a fixed time, with `replicas: 1` and then `replicas: 2`. On a two-core
   machine the second replica can use the second core, but the daemon and the clients share them too, so
   it may not double; the bench prints what it does.
2. Scale-up. `replicas: 1` with `max_replicas: 2` (on) or 1 (off), `scale_up_wait_s` 0.5: a burst of
   192 requests at once (seconds of work for one replica) against a loaded model, and the p50/p99 of
   their latency (queue wait plus the generation). With scale-up on, a second replica starts once a
   request has queued 0.5 s.

    .venv/bin/python -m bench.replicas            # ~1 minute
    .venv/bin/python -m bench.replicas --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.proxy_overhead import REPO, Processes, free_port, percentile, start_daemon, wait_healthy

TOKENS = 16
BODY = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS}
BURST_TOKENS = 64
TWO_GPUS = {"gpus": [{"index": 0, "total_mib": 1024}, {"index": 1, "total_mib": 1024}], "gpu_margin_mib": 0}


async def chat(session: aiohttp.ClientSession, url: str, max_tokens: int = TOKENS) -> float:
    started = time.perf_counter()
    body = {**BODY, "max_tokens": max_tokens}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
    return (time.perf_counter() - started) * 1000


class Daemon:
    """A daemon serving the demo model with the given manifest fields, for one measurement."""

    def __init__(self, workdir: Path, fields: dict[str, Any]) -> None:
        self.workdir = workdir
        self.fields = fields
        self.procs = Processes(marker=uuid.uuid4().hex)
        self.url = ""

    async def __aenter__(self) -> Daemon:
        (self.workdir / "manifests").mkdir(parents=True)
        manifest = {
            "name": "demo",
            "engine": "llama-server",
            "model": str(REPO / "models" / "demo.gguf"),
            "vram_mib": 700,
            "ctx_size": 1024,
            "parallel": 1,
            "keep_alive": -1,
            "args": ["--threads", "1"],
            **self.fields,
        }
        (self.workdir / "manifests" / "demo.yaml").write_text(yaml.safe_dump(manifest))
        (self.workdir / "config.yaml").write_text(yaml.safe_dump({**TWO_GPUS, "max_queue": 1024}))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        await start_daemon(self.procs, port, self.workdir, ["--config", str(self.workdir / "config.yaml")])
        async with aiohttp.ClientSession() as session:
            assert self.procs.daemon is not None
            await wait_healthy(session, self.url, self.procs.daemon, self.procs.logs["daemon"], 30)
            async with session.post(f"{self.url}/v1/admin/models/demo/load", json={}) as response:
                if response.status != 200:
                    raise RuntimeError(f"load: HTTP {response.status}: {await response.text()}")
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.procs.stop()
        left = self.procs.sweep()
        if left:
            print(f"error: processes outlived the daemon: {left}", file=sys.stderr)


async def throughput(url: str, concurrency: int, duration_s: float) -> float:
    """Requests per second that `concurrency` clients, each sending one after another, get done."""
    done = 0
    deadline = time.perf_counter() + duration_s

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await chat(session, url)
            done += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(4)))  # warm both replicas' caches
        done = 0
        started = time.perf_counter()
        deadline = started + duration_s
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


async def burst(url: str, requests: int) -> list[float]:
    """Latencies of `requests` chats sent at once, long enough together (seconds on one replica) that a
    replica started after scale_up_wait_s can still take a share."""
    connector = aiohttp.TCPConnector(limit=requests)
    async with aiohttp.ClientSession(connector=connector) as session:
        return list(await asyncio.gather(*(chat(session, url, BURST_TOKENS) for _ in range(requests))))


async def main_async(args: argparse.Namespace) -> int:
    duration = 3.0 if args.quick else 10.0
    rates: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="llmsup-bench-") as tmp:
        for replicas in (1, 2):
            async with Daemon(Path(tmp) / f"r{replicas}", {"replicas": replicas}) as daemon:
                for concurrency in (8, 32):
                    rates[(replicas, concurrency)] = await throughput(daemon.url, concurrency, duration)
        waits: dict[str, list[float]] = {}
        size = 48 if args.quick else 192
        for label, limit in (("off", 1), ("on", 2)):
            fields = {"replicas": 1, "max_replicas": limit, "scale_up_wait_s": 0.5}
            async with Daemon(Path(tmp) / f"s{label}", fields) as daemon:
                waits[label] = await burst(daemon.url, size)
    print("requests/s of one model (demo, 1 thread and 1 slot per child, two simulated GPUs)")
    print("| concurrency | 1 replica | 2 replicas | ratio |")
    print("|---|---|---|---|")
    for concurrency in (8, 32):
        one, two = rates[(1, concurrency)], rates[(2, concurrency)]
        print(f"| {concurrency} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    print(f"a burst of {size} requests at once (max_tokens {BURST_TOKENS}), latency in ms")
    print("| scale-up | p50 | p99 | max |")
    print("|---|---|---|---|")
    for label in ("off", "on"):
        values = waits[label]
        print(
            f"| {label} | {percentile(values, 50):.0f} | {percentile(values, 99):.0f} | {max(values):.0f} |"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs: a smoke run")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
