"""The daemon's work per request in CPU instructions, counted by valgrind's callgrind, from two source
trees: an A/B of a change to the request path that the machine's noise cannot blur.

Time-based figures (bench/cpu_ab.py) move by 5-10% between runs of the same code here; an instruction
count does not: the same daemon answering the same requests executes the same instructions, whatever
else the machine is doing (three windows of one daemon: 486,102 / 486,203 / 487,719 instructions per
request). So a change of 1% shows.

Each tree's daemon runs under `valgrind --tool=callgrind` (about 50 times slower; its llama-servers run
at full speed, outside valgrind), in front of the demo model served as bench/proxy_overhead.py serves it.
Per kind (plain chat, streamed chat, embeddings), one concurrency: requests warm the path, the counters
are zeroed, a fixed number of requests is sent, and the counters are dumped; the total over the requests
is the figure. What the count leaves out: the kernel's side of every system call (a read or a write costs
the same in both trees) and the time spent waiting. Work the daemon does by the clock (reading a child's
log output every 50 ms) is counted as it falls under valgrind's slower clock, the same in both trees.

Not part of `make bench` (valgrind is Debian's `valgrind` package, and a run takes minutes):

    git worktree add /tmp/base HEAD~1
    .venv/bin/python -m bench.instructions /tmp/base               # the base against this tree
    .venv/bin/python -m bench.instructions /tmp/base --kinds plain --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.proxy_overhead import (
    KINDS,
    REQUEST_ERRORS,
    Processes,
    Target,
    add_tree_arguments,
    body_for,
    free_port,
    new_session,
    one_request,
    prepare_models,
    resolve_trees,
    run,
    start_daemon,
    wait_healthy,
)

_STARTUP_S = 240.0  # imports and two llama-server starts, at valgrind's pace


def callgrind_argv(workdir: Path, label: str) -> list[str]:
    out = workdir / f"callgrind-{label}.out.%p"
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]


async def _control(pid: int, *command: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control",
        *command,
        str(pid),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(command)} failed: {err.decode(errors='replace')}")


def _newest_total(workdir: Path, label: str) -> int:
    """The instruction total of the newest dump of `label`'s daemon (a dump holds what was counted since
    the counters were last zeroed): its `summary:` line. Not `totals:`, the sum of the file's cost
    lines, which in a daemon's first dump came out about a third above the summary (and than the same
    requests counted in a later dump); in the others the two agree within about 1%."""
    dumps = sorted(workdir.glob(f"callgrind-{label}.out.*"), key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {dumps[-1]}")


async def _requests(target: Target, kind: str, count: int, concurrency: int, max_tokens: int) -> None:
    body = body_for(kind, max_tokens)

    async def worker(share: int) -> None:
        for _ in range(share):
            await one_request(target, kind, body)

    shares = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(worker(share) for share in shares))


async def _one_tree(
    procs: Processes, workdir: Path, tree: Path, label: str, args: argparse.Namespace
) -> dict[str, float]:
    """Instructions per request, by kind, for `tree`'s daemon."""
    port = free_port()
    wrapper = callgrind_argv(workdir, label)
    await start_daemon(
        procs, port, workdir, cwd=tree, wrapper=wrapper, log_level=args.log_level, log_format=args.log_format
    )
    assert procs.daemon is not None
    pid = procs.daemon.pid  # valgrind runs the daemon in its own process
    url = f"http://127.0.0.1:{port}"
    found: dict[str, float] = {}
    try:
        async with new_session(args.concurrency) as http:
            await wait_healthy(http, url, procs.daemon, procs.logs["daemon"], _STARTUP_S)
            urls = {"chat": url + "/v1/chat/completions", "embed": url + "/v1/embeddings"}
            target = Target(label, http, urls, False, lambda: [pid])
            for kind in args.kinds:  # loads the models, and every path is warm before any is counted
                await _requests(target, kind, args.warmup, args.concurrency, args.max_tokens)
            for kind in args.kinds:
                # The same kind again first: what the previous kind left to do by the clock is done.
                await _requests(target, kind, args.warmup, args.concurrency, args.max_tokens)
                await _control(pid, "--zero")
                await _requests(target, kind, args.requests, args.concurrency, args.max_tokens)
                await _control(pid, "--dump", kind)
                await asyncio.sleep(0.5)  # the dump is written by the daemon's own thread
                found[kind] = _newest_total(workdir, label) / args.requests
                print(f"  {label:<4} {kind:<7} {found[kind]:>12,.0f} instructions per request", flush=True)
    finally:
        await procs.stop()
        procs.daemon = None
    return found


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    if prepare_models(args, workdir) is None:
        return 2
    try:
        base = await _one_tree(procs, workdir, args.base, "base", args)
        new = await _one_tree(procs, workdir, args.new, "new", args)
    except REQUEST_ERRORS as exc:
        raise RuntimeError(f"a request failed: {exc!r}") from exc
    print(f"\nbase: {args.base}\nnew:  {args.new}")
    print(
        f"{args.requests} requests per kind at concurrency {args.concurrency}, max_tokens={args.max_tokens}\n"
    )
    print(f"{'kind':<8}{'base instr/req':>16}{'new instr/req':>16}{'new/base':>10}")
    for kind in args.kinds:
        print(f"{kind:<8}{base[kind]:>16,.0f}{new[kind]:>16,.0f}{new[kind] / base[kind]:>10.3f}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_tree_arguments(parser)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--requests", type=int, default=300, help="counted requests per kind")
    parser.add_argument("--warmup", type=int, default=100, help="uncounted requests before each count")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    resolve_trees(parser, args)
    if args.requests < 1 or args.warmup < 0 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be positive")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind is not installed (Debian's `valgrind` package)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(bench, parse_args(argv), "llmsup-instructions-")


if __name__ == "__main__":
    sys.exit(main())
