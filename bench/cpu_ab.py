"""The daemon's CPU per request from two source trees, A/B, in one run: to measure a change to the request
path on a machine whose noise moves absolute figures more than most changes do (README, Performance).

The trees take turns, round after round, each serving the same closed-loop load in every cell from a
daemon of its own (started in that tree, so `python -m supervisor` imports that tree's code) in front of
the same model and manifest as bench/proxy_overhead.py. A daemon's CPU (user + system, from /proc) over a
cell, divided by the requests answered, is one sample; the medians per cell are compared at the end.
Not part of `make bench`: run it by hand with a worktree of the base commit.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python -m bench.cpu_ab /tmp/base                  # the base against this tree
    .venv/bin/python -m bench.cpu_ab /tmp/base --rounds 5 --cells plain:8 stream:32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.proxy_overhead import (
    MODEL_NAME,
    Processes,
    Samples,
    Target,
    add_tree_arguments,
    body_for,
    free_port,
    new_session,
    prepare_model,
    resolve_trees,
    run,
    run_segment,
    start_daemon,
    wait_healthy,
)


@dataclass(frozen=True)
class CellSpec:
    kind: str  # "plain" or "stream", as bench/proxy_overhead.py names them
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.kind} c={self.concurrency}"

    @classmethod
    def parse(cls, text: str) -> CellSpec:
        kind, _, concurrency = text.partition(":")
        if kind not in ("plain", "stream") or not concurrency.isdigit() or int(concurrency) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a cell is plain:N or stream:N")
        return cls(kind, int(concurrency))


@dataclass
class Results:
    """Per cell and tree: daemon CPU us per request, one per round."""

    by_cell: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, cell: CellSpec, tree: str, cpu_us: float) -> None:
        self.by_cell.setdefault((cell.name, tree), []).append(cpu_us)

    def table(self, cells: Sequence[CellSpec]) -> str:
        lines = [
            f"{'cell':<14}{'base us/req':>14}{'new us/req':>14}{'new/base':>10}  every round (base | new)"
        ]
        for cell in cells:
            base = self.by_cell.get((cell.name, "base"), [])
            new = self.by_cell.get((cell.name, "new"), [])
            if not base or not new:
                continue
            base_cpu, new_cpu = statistics.median(base), statistics.median(new)
            rounds = " ".join(f"{cpu:.0f}" for cpu in base) + " | " + " ".join(f"{cpu:.0f}" for cpu in new)
            lines.append(
                f"{cell.name:<14}{base_cpu:>14.0f}{new_cpu:>14.0f}{new_cpu / base_cpu:>10.2f}  {rounds}"
            )
        return "\n".join(lines)


async def _measure(target: Target, cell: CellSpec, args: argparse.Namespace) -> Samples:
    """proxy_overhead's closed-loop segment: unmeasured for --warmup, then measured for --duration."""
    body = body_for(cell.kind, args.max_tokens)
    await run_segment(target, cell.kind, body, cell.concurrency, args.warmup, Samples())
    samples = Samples()
    await run_segment(target, cell.kind, body, cell.concurrency, args.duration, samples)
    if samples.errors:
        raise RuntimeError(f"{samples.errors} failed requests in {cell.name}, last: {samples.last_error}")
    return samples


async def _one_tree(
    procs: Processes, workdir: Path, tree: Path, label: str, args: argparse.Namespace, results: Results
) -> None:
    port = free_port()
    await start_daemon(procs, port, workdir, cwd=tree, log_level=args.log_level, log_format=args.log_format)
    assert procs.daemon is not None
    url = f"http://127.0.0.1:{port}"
    try:
        async with new_session(max(cell.concurrency for cell in args.cells)) as http:
            await wait_healthy(http, url, procs.daemon, procs.logs["daemon"], 60)
            pid = procs.daemon.pid
            target = Target(label, http, {"chat": url + "/v1/chat/completions"}, False, lambda: [pid])
            for cell in args.cells:
                samples = await _measure(target, cell, args)
                results.add(cell, label, samples.cpu_us_per_request)
                print(
                    f"  {label:<4} {cell.name:<14} {samples.rate:7.0f} r/s  "
                    f"{samples.cpu_us_per_request:6.0f} us/req",
                    flush=True,
                )
    finally:
        await procs.stop()
        procs.daemon = None


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    if prepare_model(args, workdir) is None:
        return 2
    results = Results()
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_}/{args.rounds}", flush=True)
        for label, tree in (("base", args.base), ("new", args.new)):
            await _one_tree(procs, workdir, tree, label, args, results)
    print(
        f"\nmodel {MODEL_NAME}: {args.model.name}, max_tokens={args.max_tokens}, {args.duration:g} s per cell"
    )
    print(f"base: {args.base}\nnew:  {args.new}\n")
    print(results.table(args.cells))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_tree_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cells",
        type=CellSpec.parse,
        nargs="+",
        default=[CellSpec("plain", 8), CellSpec("plain", 1), CellSpec("stream", 8)],
        help="plain:N or stream:N (default plain:8 plain:1 stream:8)",
    )
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of measured load per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured load before each")
    args = parser.parse_args(argv)
    resolve_trees(parser, args)
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds and --duration must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(bench, parse_args(argv), "llmsup-cpu-ab-")


if __name__ == "__main__":
    sys.exit(main())
