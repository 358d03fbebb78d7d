"""What the scheduler costs: the overhead of a model swap, and the time to choose what to evict.

1. Swap overhead. A daemon serves two copies of the demo model on a simulated GPU that holds one, and a
   client asks for them in turn, so every request unloads one child and starts the other. For each swap,
   the overhead is the request's latency minus the engine's own start (spawn to /health 200, which the
   daemon logs as `engine_s`) minus a warm request's latency. What is left is ours: the estimate, the
   eviction decision, draining and stopping the old child (its whole process tree, then confirming its
   memory is free), leasing, and the proxy. Goal: <= 150 ms at p50.
2. Eviction decision. plan_placement with 200 loaded models on 16 GPUs, for a request that must evict.
   Goal: < 1 ms.

    .venv/bin/python -m bench.scheduling            # ~30 s
    .venv/bin/python -m bench.scheduling --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
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
from supervisor.placement import Holder, Request, plan_placement

GOAL_SWAP_MS = 150.0
GOAL_DECISION_MS = 1.0
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def post(session: aiohttp.ClientSession, url: str, model: str) -> float:
    started = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json={**BODY, "model": model}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}")
    return (time.perf_counter() - started) * 1000


def transitions(log: Path) -> list[dict[str, Any]]:
    """Every slot_transition event in the daemon's JSON log, in order."""
    lines = log.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{") and '"slot_transition"' in line]


async def swap_overhead(swaps: int, workdir: Path) -> dict[str, float]:
    model = REPO / "models" / "demo.gguf"
    (workdir / "manifests").mkdir()
    for name in ("a", "b"):
        manifest: dict[str, Any] = {
            "name": name,
            "engine": "llama-server",
            "model": str(model),
            "vram_mib": 700,
        }
        manifest |= {"ctx_size": 512, "parallel": 1, "args": ["--threads", "1"], "keep_alive": -1}
        (workdir / "manifests" / f"{name}.yaml").write_text(yaml.safe_dump(manifest))
    config = {"gpus": [{"index": 0, "total_mib": 1024}], "gpu_margin_mib": 0}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    procs = Processes(marker=uuid.uuid4().hex)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--config", str(workdir / "config.yaml"), "--log-format", "json", "--log-level", "info"]
    await start_daemon(procs, port, workdir, extra)
    try:
        async with aiohttp.ClientSession() as session:
            assert procs.daemon is not None
            await wait_healthy(session, url, procs.daemon, procs.logs["daemon"], 30)
            await post(session, url, "a")  # the first load has no swap in it
            warm = statistics.median([await post(session, url, "a") for _ in range(20)])
            latencies = []
            for i in range(swaps):
                latencies.append(await post(session, url, "b" if i % 2 == 0 else "a"))
    finally:
        await procs.stop()
        left = procs.sweep()
        if left:
            print(f"error: processes outlived the daemon: {left}", file=sys.stderr)
    events = transitions(procs.logs["daemon"])
    engine = [e["engine_s"] * 1000 for e in events if e["to"] == "ready"][1:]  # skip the first load, as above
    stops = [e["in_state_s"] * 1000 for e in events if e["from"] == "stopping" and e["to"] == "unloaded"]
    overhead = [total - start - warm for total, start in zip(latencies, engine, strict=True)]
    return {
        "swaps": swaps,
        "warm_request_ms": warm,
        "swap_request_p50_ms": percentile(latencies, 50),
        "engine_start_p50_ms": percentile(engine, 50),
        "stop_p50_ms": percentile(stops, 50),
        "stop_p99_ms": percentile(stops, 99),
        "overhead_p50_ms": percentile(overhead, 50),
        "overhead_p99_ms": percentile(overhead, 99),
    }


def eviction_decision(models: int, gpus: int, rounds: int) -> dict[str, float]:
    rng = random.Random(1)
    total_mib = 81_920
    holders = []
    used = dict.fromkeys(range(gpus), 0)
    for i in range(models):
        gpu = i % gpus
        mib = rng.randint(300, total_mib // (models // gpus) - 100)
        used[gpu] += mib
        holders.append(Holder(f"m{i}#{i}", {gpu: mib}, rng.randint(0, 3), rng.random(), rng.random() < 0.7))
    free = {g: total_mib - used[g] for g in range(gpus)}
    request = Request(max(free.values()) + 2_000, priority=2)  # fits nowhere without evicting
    assert plan_placement(request, free, holders) is not None
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        plan_placement(request, free, holders)
        timings.append((time.perf_counter() - started) * 1000)
    return {
        "models": models,
        "gpus": gpus,
        "decision_p50_ms": percentile(timings, 50),
        "decision_p99_ms": percentile(timings, 99),
    }


def report(swap: dict[str, Any], decision: dict[str, Any]) -> bool:
    print(
        f"swap ({swap['swaps']} swaps): request {swap['swap_request_p50_ms']:.1f} ms p50; the engine's own "
        f"start {swap['engine_start_p50_ms']:.1f} ms; a warm request {swap['warm_request_ms']:.1f} ms\n"
        f"  scheduling overhead {swap['overhead_p50_ms']:.1f} ms p50, {swap['overhead_p99_ms']:.1f} ms p99 "
        f"(goal <= {GOAL_SWAP_MS:.0f} ms), of which stopping the evicted child's tree "
        f"{swap['stop_p50_ms']:.1f} ms p50, {swap['stop_p99_ms']:.1f} ms p99"
    )
    print(
        f"eviction decision ({decision['models']} models, {decision['gpus']} GPUs): "
        f"{decision['decision_p50_ms']:.3f} ms p50, {decision['decision_p99_ms']:.3f} ms p99 "
        f"(goal < {GOAL_DECISION_MS:.0f} ms)"
    )
    ok = bool(swap["overhead_p50_ms"] <= GOAL_SWAP_MS and decision["decision_p50_ms"] < GOAL_DECISION_MS)
    print("goals: met" if ok else "goals: MISSED")
    return ok


async def main_async(args: argparse.Namespace) -> int:
    decision = eviction_decision(200, 16, 200 if args.quick else 2000)
    with tempfile.TemporaryDirectory(prefix="llmsup-bench-") as tmp:
        swap = await swap_overhead(6 if args.quick else 30, Path(tmp))
    report(swap, decision)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer swaps and rounds: a smoke run")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
