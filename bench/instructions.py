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
    .venv/bin/python -m bench.instructions /tmp/base --steps     # and where each tree's count goes

With --steps, each kind's count is also split into the request's steps (STEPS): the instructions spent
inside each, callees included, from callgrind_annotate. A step is found by the C name mypyc gives a
compiled function, so a tree run as Python (no `make native`) shows none.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

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

# The steps of a request (--steps): (label, the compiled function whose inclusive count it is). mypyc
# names a function's C symbol after its module, class and name; `CPyPy_` is the wrapper Python-level
# callers enter by, `CPyDef_` the function itself, and the larger of the two is taken. Parts of a step
# are indented under it.
_GENERATOR: Final = "_____mypyc_generator_helper__"  # what runs an async function's body
STEPS: Final = (
    ("the client's bytes: read, parsed, checked", "dataplane___front___FrontConnection___data_received"),
    ("  the request object", "dataplane___front___FastRequest_____init__"),
    ("  the gate (origin, host, key, body budget)", "dataplane___front___FrontConnection____admit_head"),
    ("  the request's task", "dataplane___front___FrontConnection____next"),
    ("openai.check", "api___openai___check_gen" + _GENERATOR),
    ("  the body parsed", "bodies___parse_body"),
    ("  the field checks", "bodies___check_openai_fields"),
    ("  the capabilities asked", "capabilities___openai_needs"),
    ("  the key and the model", "api___openai___authorize"),
    ("the ticket (Scheduler.acquire)", "api___openai___acquire_gen" + _GENERATOR),
    ("the child's request built", "dataplane___relay___upstream_request"),
    (
        "the child's request sent",
        "dataplane___upstream___exchange_UpstreamPool_gen" + _GENERATOR,
    ),
    ("the child's answer read and parsed", "dataplane___upstream___UpstreamConnection___data_received"),
    ("token counts (proxy.count)", "proxy___count"),
    ("the whole answer written", "dataplane___front___FrontConnection___respond"),
    ("  its head", "dataplane___front___FrontConnection____head"),
    ("  its access log line and metrics", "dataplane___front___FrontConnection____log"),
    ("a stream's events written", "dataplane___front___FrontConnection___write_events"),
)
# A line of callgrind_annotate's inclusive report: "12,345 (1.23%)  file:function [object]".
_REPORT_LINE: Final = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*?:(\S+)")


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


def _newest_dump(workdir: Path, label: str) -> Path:
    """The newest dump of `label`'s daemon: what was counted since the counters were last zeroed."""
    return max(workdir.glob(f"callgrind-{label}.out.*"), key=lambda p: p.stat().st_mtime)


def _total(dump: Path) -> int:
    """A dump's instruction total: its `summary:` line. Not `totals:`, the sum of the file's cost lines,
    which in a daemon's first dump came out about a third above the summary (and than the same requests
    counted in a later dump); in the others the two agree within about 1%."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {dump}")


async def steps(dump: Path) -> dict[str, int]:
    """Each of STEPS' instructions in the dump, callees included; a step not run is left out."""
    proc = await asyncio.create_subprocess_exec(
        "callgrind_annotate",
        "--inclusive=yes",
        "--threshold=100",
        str(dump),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    inclusive: dict[str, int] = {}
    for line in out.decode(errors="replace").splitlines():
        match = _REPORT_LINE.match(line)
        if match is not None:
            name = match.group(2)
            inclusive[name] = max(inclusive.get(name, 0), int(match.group(1).replace(",", "")))
    found: dict[str, int] = {}
    for label, function in STEPS:
        counts = [inclusive.get(f"{prefix}_supervisor___{function}", 0) for prefix in ("CPyDef", "CPyPy")]
        if max(counts):
            found[label] = max(counts)
    return found


def steps_table(kind: str, requests: int, base: dict[str, int], new: dict[str, int]) -> str:
    """The steps of one kind's request in both trees, per request."""
    rows = [f"\n{kind}: instructions per request in each step (callees included)"]
    rows.append(f"{'step':<48}{'base':>10}{'new':>10}{'new/base':>10}")
    for label, _ in STEPS:
        if label not in base and label not in new:
            continue
        old, now = base.get(label, 0) / requests, new.get(label, 0) / requests
        ratio = f"{now / old:>10.3f}" if old else f"{'':>10}"
        rows.append(f"{label:<48}{old:>10,.0f}{now:>10,.0f}{ratio}")
    return "\n".join(rows)


async def _requests(target: Target, kind: str, count: int, concurrency: int, max_tokens: int) -> None:
    body = body_for(kind, max_tokens)

    async def worker(share: int) -> None:
        for _ in range(share):
            await one_request(target, kind, body)

    shares = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(worker(share) for share in shares))


async def _one_tree(
    procs: Processes, workdir: Path, tree: Path, label: str, args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, dict[str, int]]]:
    """Instructions per request, by kind, for `tree`'s daemon; and with --steps, each kind's steps."""
    port = free_port()
    wrapper = callgrind_argv(workdir, label)
    await start_daemon(
        procs, port, workdir, cwd=tree, wrapper=wrapper, log_level=args.log_level, log_format=args.log_format
    )
    assert procs.daemon is not None
    pid = procs.daemon.pid  # valgrind runs the daemon in its own process
    url = f"http://127.0.0.1:{port}"
    found: dict[str, float] = {}
    split: dict[str, dict[str, int]] = {}
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
                dump = _newest_dump(workdir, label)
                found[kind] = _total(dump) / args.requests
                print(f"  {label:<4} {kind:<7} {found[kind]:>12,.0f} instructions per request", flush=True)
                if args.steps:
                    split[kind] = await steps(dump)
    finally:
        await procs.stop()
        procs.daemon = None
    return found, split


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    if prepare_models(args, workdir) is None:
        return 2
    try:
        base, base_steps = await _one_tree(procs, workdir, args.base, "base", args)
        new, new_steps = await _one_tree(procs, workdir, args.new, "new", args)
    except REQUEST_ERRORS as exc:
        raise RuntimeError(f"a request failed: {exc!r}") from exc
    print(f"\nbase: {args.base}\nnew:  {args.new}")
    print(
        f"{args.requests} requests per kind at concurrency {args.concurrency}, max_tokens={args.max_tokens}\n"
    )
    print(f"{'kind':<8}{'base instr/req':>16}{'new instr/req':>16}{'new/base':>10}")
    for kind in args.kinds:
        print(f"{kind:<8}{base[kind]:>16,.0f}{new[kind]:>16,.0f}{new[kind] / base[kind]:>10.3f}")
    for kind in args.kinds if args.steps else ():
        print(steps_table(kind, args.requests, base_steps.get(kind, {}), new_steps.get(kind, {})))
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
    parser.add_argument("--steps", action="store_true", help="also split each count into the request's steps")
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
