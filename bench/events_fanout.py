"""What live subscribers cost: 50 followers of /v1/admin/events while clients swap two models.

A daemon serves two copies of the demo model on a simulated GPU that holds one, so requests that
alternate between them make a steady stream of events (transitions, evictions, loads). The same load
runs twice, without subscribers and then with 50 of them, and the bench prints requests/s, the events
each subscriber received, and the daemon's RSS in both phases.

    .venv/bin/python -m bench.events_fanout            # 2 x 15 s
    .venv/bin/python -m bench.events_fanout --quick    # 2 x 4 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml

from bench.proxy_overhead import REPO, Processes, free_port, run, start_daemon, wait_healthy

SUBSCRIBERS = 50
CLIENTS = 4
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def write_daemon_files(workdir: Path) -> list[str]:
    (workdir / "manifests").mkdir()
    for name in ("a", "b"):
        manifest: dict[str, Any] = {
            "name": name,
            "engine": "llama-server",
            "model": str(REPO / "models" / "demo.gguf"),
            "vram_mib": 700,
            "ctx_size": 512,
            "parallel": 1,
            "keep_alive": -1,
        }
        (workdir / "manifests" / f"{name}.yaml").write_text(yaml.safe_dump(manifest))
    config = {"gpus": [{"index": 0, "total_mib": 1024}], "gpu_margin_mib": 0}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    return ["--config", str(workdir / "config.yaml")]


async def clients(session: aiohttp.ClientSession, url: str, duration_s: float) -> int:
    """Requests answered by CLIENTS clients, each alternating between the two models."""
    deadline = time.monotonic() + duration_s

    async def client(n: int) -> int:
        done = 0
        while time.monotonic() < deadline:
            model = "ab"[(n + done) % 2]
            async with session.post(f"{url}/v1/chat/completions", json={**BODY, "model": model}) as r:
                await r.read()
                done += r.status == 200
        return done

    return sum(await asyncio.gather(*(client(n) for n in range(CLIENTS))))


async def subscriber(session: aiohttp.ClientSession, url: str, counts: list[int], i: int) -> None:
    """Count the events of one /v1/admin/events stream (the first, the snapshot, included)."""
    async with session.get(f"{url}/v1/admin/events", timeout=aiohttp.ClientTimeout(total=None)) as r:
        async for line in r.content:
            if line.startswith(b"event: "):
                counts[i] += 1


async def bench_main(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    duration_s = 4.0 if args.quick else 15.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    await start_daemon(procs, port, workdir, write_daemon_files(workdir))
    assert procs.daemon is not None
    daemon = psutil.Process(procs.daemon.pid)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_healthy(session, url, procs.daemon, procs.logs["daemon"], 30)
        await clients(session, url, 1.0)  # both models have loaded once
        alone = await clients(session, url, duration_s)
        rss_alone = daemon.memory_info().rss / 2**20
        counts = [0] * SUBSCRIBERS
        followers = [asyncio.create_task(subscriber(session, url, counts, i)) for i in range(SUBSCRIBERS)]
        await asyncio.sleep(0.5)
        rss_idle_subscribers = daemon.memory_info().rss / 2**20
        followed = await clients(session, url, duration_s)
        await asyncio.sleep(0.5)  # the last events reach every subscriber
        rss_followed = daemon.memory_info().rss / 2**20
        ended = sum(f.done() for f in followers)
        for follower in followers:
            follower.cancel()
        for follower in followers:
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await follower
    await procs.stop()
    report = {
        "subscribers": SUBSCRIBERS,
        "seconds_per_phase": duration_s,
        "requests_per_s_without": round(alone / duration_s, 1),
        "requests_per_s_with": round(followed / duration_s, 1),
        "events_per_subscriber_min": min(counts),
        "events_per_subscriber_max": max(counts),
        "events_delivered_total": sum(counts),
        "subscribers_cut_off": ended,
        "rss_mib_without": round(rss_alone, 1),
        "rss_mib_with_idle_subscribers": round(rss_idle_subscribers, 1),
        "rss_mib_with_subscribers_under_load": round(rss_followed, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 s per phase instead of 15")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir with the daemon's log")
    return run(bench_main, parser.parse_args(argv), "llmsup-events-")


if __name__ == "__main__":
    sys.exit(main())
