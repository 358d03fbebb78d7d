"""Chaos: one daemon, three models of which two fit, mixed clients, and faults at random moments.

Faults: SIGKILL or SIGSTOP/SIGCONT of an engine, SIGHUP with a valid or a broken manifest, clients that
leave mid-stream, `keep_alive: 0` unloads, and a state directory where no pid file can be written.
Invariants, checked throughout and at the end: leases within every GPU's capacity; no slot stuck in a
transient state past its deadlines; no lease without a child, no engine without a slot; every request
answered 2xx or a documented error, never 500, never a hang; after SIGTERM exit code 0 and no engine
left; no internal-error event in the log.

`make test` runs it for CHAOS_DURATION=30 s with a fixed seed; `make chaos SEED=123 DURATION=300` runs it
longer. The seed is printed, so a failure replays (the decisions replay; the timing is the machine's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from tests import fake_nvml
from tests.integration.conftest import DEMO
from tests.integration.harness import Daemon

SEED = int(os.environ.get("CHAOS_SEED", "1212"))
DURATION_S = float(os.environ.get("CHAOS_DURATION", "30"))
CLIENTS = int(os.environ.get("CHAOS_CLIENTS", "6"))

# With the fake NVML (tests/fake_nvml), the GPU comes from "NVML" and NVML queries can be made to fail.
USE_NVML = (fake_nvml.FOLDER / "pynvml.py").is_file() and os.environ.get("CHAOS_NVML", "1") != "0"

MODELS = ("m1", "m2", "m3")  # 500 MiB each on one 1024 MiB GPU: two fit, the third evicts one
QUEUE_TIMEOUT_S = 8.0
DRAIN_TIMEOUT_S = 4.0
STOP_GRACE_S = 2.0
START_TIMEOUT_S = 20.0
SIGSTOP_MAX_S = 3.0
CONFIG: dict[str, Any] = {
    "gpus": [{"index": 0, "total_mib": 1024}],
    "gpu_margin_mib": 0,
    "queue_timeout_s": QUEUE_TIMEOUT_S,
    "drain_timeout_s": DRAIN_TIMEOUT_S,
    "stop_grace_s": STOP_GRACE_S,
    "failure_backoff_s": 0.5,
    "failure_backoff_max_s": 2,
}
# Deadlines the daemon promises, plus a margin for a loaded machine (2 cores shared): a slot that stays
# longer in one of these states is stuck. STOPPING: grace, SIGKILL's 5 s, the 10 s VRAM check.
STUCK_AFTER_S = {
    "loading": START_TIMEOUT_S + SIGSTOP_MAX_S + 10,
    "draining": DRAIN_TIMEOUT_S + SIGSTOP_MAX_S + 10,
    "stopping": STOP_GRACE_S + 5 + 10 + 10,
}
STABLE = {"ready", "unloaded", "failed"}
# A request's answer head may wait for the queue (queue_timeout_s, a load included) and a stopped engine.
HEAD_DEADLINE_S = QUEUE_TIMEOUT_S + SIGSTOP_MAX_S + 15
BODY_DEADLINE_S = 60.0
# Documented 5xx answers (supervisor/errors.py); any 4xx is the client's doing and fine.
DOCUMENTED_5XX = {
    "model_failed",
    "model_crashed",
    "queue_timeout",
    "queue_full",
    "shutting_down",
    "upstream_error",
    "insufficient_vram",
    "vram_unknown",
    "generation_timeout",
    "engine_error",
    "server_busy",
}


@dataclass
class Chaos:
    daemon: Daemon
    end: float
    requests: int = 0
    responses: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)  # engines under SIGSTOP
    state_dir_broken: bool = False
    nvml_state: Path | None = None  # the fake NVML's control file, when the run uses it
    nvml_broken: bool = False
    started: float = field(default_factory=time.monotonic)

    def violation(self, kind: str, detail: str) -> None:
        line = f"[{time.monotonic() - self.started:7.2f}s] {kind}: {detail}"
        self.violations.append(line)
        print("VIOLATION", line, flush=True)

    def summary(self) -> str:
        lines = [
            f"chaos seed={SEED} duration={DURATION_S:g}s clients={CLIENTS}"
            f" nvml={'fake' if self.nvml_state else 'declared gpus'} (replay: CHAOS_SEED={SEED})",
            f"requests: {self.requests}",
            "faults: " + ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items())),
            "responses: " + ", ".join(f"{k}={v}" for k, v in sorted(self.responses.items())),
            f"violations: {len(self.violations)}",
            *(f"  {v}" for v in self.violations),
            f"daemon log: {self.daemon.log_path}",
        ]
        return "\n".join(lines)


# --- clients ------------------------------------------------------------------------------------------


async def client(chaos: Chaos, number: int) -> None:
    rng = random.Random(f"{SEED}-client-{number}")  # its own stream of decisions, whatever the timing
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < chaos.end:
            body: dict[str, Any] = {
                "model": rng.choice(MODELS),
                "messages": [{"role": "user", "content": rng.choice(["hi", "tell me a story", "count"])}],
                "max_tokens": rng.randint(4, 64),
                "x_priority": rng.choice([0, 0, 1, 5]),
            }
            streaming = rng.random() < 0.6
            leave_early = streaming and rng.random() < 0.25
            if rng.random() < 0.05:
                body["keep_alive"] = 0
                chaos.faults["request_keep_alive_0"] += 1
            if streaming:
                body["stream"] = True
            chaos.requests += 1
            outcome = await one_request(chaos, session, body, streaming, leave_early)
            chaos.responses[outcome] += 1
            await asyncio.sleep(rng.uniform(0, 0.3))


async def one_request(
    chaos: Chaos, session: aiohttp.ClientSession, body: dict[str, Any], streaming: bool, leave_early: bool
) -> str:
    """Send one chat; return how it ended ("200", "503 model_failed", ...); record what breaks a rule."""
    what = f"{body['model']} stream={streaming} leave_early={leave_early}"
    url = f"{chaos.daemon.url}/v1/chat/completions"
    try:
        async with asyncio.timeout(HEAD_DEADLINE_S):
            response = await session.post(url, json=body)
    except TimeoutError:
        chaos.violation("hang", f"{what}: no answer within {HEAD_DEADLINE_S:g}s")
        return "hang"
    except aiohttp.ClientError as exc:
        chaos.violation("connection_error", f"{what}: {exc!r}")
        return "connection_error"
    async with response:
        try:
            async with asyncio.timeout(BODY_DEADLINE_S):
                if response.status == 200 and streaming:
                    return await read_stream(chaos, response, what, leave_early)
                text = await response.text()
        except TimeoutError:
            chaos.violation("hang", f"{what}: body not complete within {BODY_DEADLINE_S:g}s")
            return "hang"
        except aiohttp.ClientError as exc:
            chaos.violation("body_cut", f"{what}: status {response.status}, {exc!r}")
            return f"{response.status} body_cut"
    if response.status == 200:
        return "200"
    try:
        code = str(json.loads(text)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        code = "?"
    outcome = f"{response.status} {code}"
    if response.status >= 500 and (response.status not in (502, 503, 504) or code not in DOCUMENTED_5XX):
        chaos.violation("undocumented_error", f"{what}: {response.status} {text[:300]}")
    return outcome


async def read_stream(chaos: Chaos, response: aiohttp.ClientResponse, what: str, leave_early: bool) -> str:
    error_code = None
    async for raw in response.content:
        line = raw.strip()
        if leave_early:
            return "200 left_mid_stream"  # leaving the `async with` closes the connection mid-stream
        if line == b"data: [DONE]":
            return "200" if error_code is None else f"200 stream_error {error_code}"
        if line.startswith(b"data: {") and b'"error"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                error_code = str(json.loads(line[6:])["error"].get("code"))
            error_code = error_code or "?"
    if error_code is not None:
        return f"200 stream_error {error_code}"
    chaos.violation("stream_truncated", f"{what}: ended with neither [DONE] nor an error event")
    return "200 truncated"


# --- faults -------------------------------------------------------------------------------------------


def engines(daemon: Daemon) -> list[psutil.Process]:
    """The engine children (each leads its own process group)."""
    leaders = []
    for proc in daemon.children():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == proc.pid:
                leaders.append(proc)
    return leaders


def write_manifest(daemon: Daemon, demo_gguf: Path, name: str, **changes: Any) -> None:
    daemon.write_manifest(
        name,
        **{"model": str(demo_gguf), **DEMO, "vram_mib": 500, "start_timeout_s": START_TIMEOUT_S, **changes},
    )


async def reloads_seen(chaos: Chaos, before: int) -> bool:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if count_reloads(chaos.daemon) > before:
            return True
        await asyncio.sleep(0.1)
    chaos.violation("reload_not_processed", "SIGHUP gave neither reload_applied nor reload_rejected in 15s")
    return False


def count_reloads(daemon: Daemon) -> int:
    return len(daemon.events("reload_applied")) + len(daemon.events("reload_rejected"))


async def continue_later(chaos: Chaos, proc: psutil.Process, after_s: float) -> None:
    await asyncio.sleep(after_s)
    with contextlib.suppress(psutil.Error):
        proc.send_signal(signal.SIGCONT)
    chaos.stopped.discard(proc.pid)


def break_state_dir(daemon: Daemon) -> None:
    """No pid file can be written: the children folder becomes a file (chmod stops nothing for root)."""
    children = daemon.state_dir / "children"
    if children.is_dir():
        children.rename(daemon.state_dir / "children.aside")
    children.write_text("no pid files here")


def mend_state_dir(daemon: Daemon) -> None:
    children, aside = daemon.state_dir / "children", daemon.state_dir / "children.aside"
    if children.is_file():
        children.unlink()
    if aside.is_dir():
        # Records of children stopped meanwhile could not be removed by the daemon; do it for it.
        for record in aside.glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                if not psutil.pid_exists(int(record.stem)):
                    record.unlink()
        try:
            aside.rename(children)
        except OSError:
            # The daemon made the folder again once the file was gone (a child started meanwhile): the
            # records set aside join the new ones.
            for entry in aside.iterdir():
                entry.replace(children / entry.name)
            aside.rmdir()


async def mend_state_dir_later(chaos: Chaos, after_s: float) -> None:
    await asyncio.sleep(after_s)
    mend_state_dir(chaos.daemon)
    chaos.state_dir_broken = False


def nvml_state(runtime_error: bool) -> dict[str, Any]:
    """One 1024 MiB device; each engine shows 450 MiB on it (under its 500 MiB lease), found by argv."""
    return {
        "runtime_error": runtime_error,
        "devices": [{"index": 0, "name": "Fake GPU", "total_mib": 1024, "used_mib": 0}],
        "processes": [{"gpu": 0, "argv_has": ["--alias", name], "used_mib": 450} for name in MODELS],
    }


def write_nvml_state(path: Path, runtime_error: bool) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps(nvml_state(runtime_error)))
    staged.replace(path)  # the fake re-reads the file on every call: never let it see half of one


async def nvml_heals_later(chaos: Chaos, path: Path, after_s: float) -> None:
    await asyncio.sleep(after_s)
    write_nvml_state(path, runtime_error=False)
    chaos.nvml_broken = False


async def inject_faults(chaos: Chaos, demo_gguf: Path) -> None:
    rng = random.Random(f"{SEED}-faults")
    daemon = chaos.daemon
    later: list[asyncio.Task[None]] = []
    kinds = ["sigkill_engine", "sigstop_engine", "sighup_valid", "sighup_broken", "unload", "state_dir"]
    weights = [3, 2, 2, 1, 2, 1]
    if chaos.nvml_state is not None:
        kinds.append("nvml_runtime_error")
        weights.append(1)
    try:
        while time.monotonic() < chaos.end:
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            kind = rng.choices(kinds, weights)[0]
            running = [p for p in engines(daemon) if p.pid not in chaos.stopped]
            if kind == "sigkill_engine" and running:
                with contextlib.suppress(psutil.Error):
                    rng.choice(running).send_signal(signal.SIGKILL)
                    chaos.faults[kind] += 1
            elif kind == "sigstop_engine" and running:
                victim = rng.choice(running)
                with contextlib.suppress(psutil.Error):
                    victim.send_signal(signal.SIGSTOP)
                    chaos.stopped.add(victim.pid)
                    chaos.faults[kind] += 1
                    later.append(
                        asyncio.create_task(continue_later(chaos, victim, rng.uniform(0.5, SIGSTOP_MAX_S)))
                    )
            elif kind == "sighup_valid":
                name = rng.choice(MODELS)
                change: dict[str, Any] = rng.choice(
                    [
                        {"priority": rng.randint(0, 3)},
                        {"keep_alive": rng.choice(["2s", "5m"])},
                        {"ctx_size": 1024},
                    ]
                )
                write_manifest(daemon, demo_gguf, name, **change)  # ctx_size: a restart on next use
                before = count_reloads(daemon)
                daemon.signal(signal.SIGHUP)
                chaos.faults[f"sighup_valid_{next(iter(change))}"] += 1
                await reloads_seen(chaos, before)
            elif kind == "sighup_broken":
                broken = daemon.manifests / "broken.yaml"
                broken.write_text("name: broken\nengine: llama-server\nctx_size: lots\n")
                before = count_reloads(daemon)
                daemon.signal(signal.SIGHUP)
                chaos.faults[kind] += 1
                await reloads_seen(chaos, before)
                broken.unlink()
            elif kind == "unload":
                name = rng.choice(MODELS)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with asyncio.timeout(HEAD_DEADLINE_S):
                        status, answer, _ = await daemon.post(
                            "/api/generate", {"model": name, "keep_alive": 0}
                        )
                        chaos.faults["unload_keep_alive_0"] += 1
                        if status >= 500:
                            chaos.violation("unload_failed", f"{name}: {status} {answer}")
            elif kind == "nvml_runtime_error" and chaos.nvml_state is not None and not chaos.nvml_broken:
                chaos.nvml_broken = True
                write_nvml_state(chaos.nvml_state, runtime_error=True)
                chaos.faults[kind] += 1
                later.append(
                    asyncio.create_task(nvml_heals_later(chaos, chaos.nvml_state, rng.uniform(0.5, 3.0)))
                )
            elif kind in ("sigkill_engine", "sigstop_engine"):
                chaos.faults[f"{kind}_skipped_none_running"] += 1
            elif kind == "state_dir" and not chaos.state_dir_broken:
                chaos.state_dir_broken = True
                break_state_dir(daemon)
                chaos.faults["state_dir_unwritable"] += 1
                later.append(asyncio.create_task(mend_state_dir_later(chaos, rng.uniform(1.0, 4.0))))
    finally:
        for task in later:
            task.cancel()
        for pid in list(chaos.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        chaos.stopped.clear()
        mend_state_dir(daemon)
        chaos.state_dir_broken = False
        if chaos.nvml_state is not None:
            write_nvml_state(chaos.nvml_state, runtime_error=False)
            chaos.nvml_broken = False
        (daemon.manifests / "broken.yaml").unlink(missing_ok=True)


# --- invariants ---------------------------------------------------------------------------------------


@dataclass
class Watch:
    """What the monitor remembers between polls: since when each thing has been as it is."""

    states: dict[str, tuple[str, float]] = field(default_factory=dict)
    orphan_leases: dict[str, float] = field(default_factory=dict)
    untracked: dict[int, float] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)


async def monitor(chaos: Chaos, stop: asyncio.Event) -> None:
    watch = Watch()
    polls = 0
    while not stop.is_set():
        polls += 1
        await check_health(chaos, watch)
        if polls % 4 == 0:
            await check_gpu_memory(chaos, watch)
            # The process scan reads /proc: in a thread, so the clients' loop is not held up.
            leaders = {p.pid for p in await asyncio.to_thread(engines, chaos.daemon)}
            health = await check_health(chaos, watch)  # after the scan: a child seen is already known
            if health is not None:
                check_engines_tracked(chaos, watch, leaders, health)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


def report_once(chaos: Chaos, watch: Watch, key: str, kind: str, detail: str) -> None:
    if key not in watch.reported:
        watch.reported.add(key)
        chaos.violation(kind, detail)


async def check_health(chaos: Chaos, watch: Watch) -> Any:
    try:
        async with asyncio.timeout(10):
            status, body = await chaos.daemon.get("/health")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        chaos.violation("health_unanswered", repr(exc))
        return None
    if status != 200:
        chaos.violation("health_not_ok", f"{status} {str(body)[:300]}")
        return None
    now = time.monotonic()
    for gpu in body["gpus"]:
        leased = sum(gpu["leases"].values())
        if leased > gpu["capacity_mib"] or gpu["leased_mib"] > gpu["capacity_mib"]:
            chaos.violation("over_capacity", f"GPU {gpu['gpu']}: {gpu}")
    for name, slot in body["models"].items():
        state = str(slot["state"])
        previous = watch.states.get(name)
        if previous is None or previous[0] != state:
            watch.states[name] = (state, now)
            continue
        limit = STUCK_AFTER_S.get(state)
        if limit is not None and now - previous[1] > limit:
            report_once(
                chaos,
                watch,
                f"stuck {name} {previous[1]}",
                "slot_stuck",
                f"{name} {state} for {now - previous[1]:.1f}s",
            )
    return body


async def check_gpu_memory(chaos: Chaos, watch: Watch) -> None:
    try:
        async with asyncio.timeout(10):
            status, body = await chaos.daemon.get("/v1/admin/gpu-memory")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        chaos.violation("gpu_memory_unanswered", repr(exc))
        return
    if status != 200:
        chaos.violation("gpu_memory_not_ok", f"{status} {str(body)[:300]}")
        return
    now = time.monotonic()
    seen = set()
    for gpu in body["gpus"]:
        if gpu["leased_mib"] > gpu["total_mib"] - gpu["margin_mib"] or gpu["leasable_mib"] < 0:
            chaos.violation("over_capacity", f"GPU {gpu['index']}: {gpu}")
        for lease in gpu["leases"]:
            # A lease must belong to a child that runs, or is being started or stopped.
            if lease["state"] in ("unloaded", "failed") and lease["pid"] is None:
                holder = lease["holder"]
                seen.add(holder)
                since = watch.orphan_leases.setdefault(holder, now)
                if now - since > STUCK_AFTER_S["stopping"]:
                    report_once(chaos, watch, f"lease {holder}", "lease_without_child", f"{lease}")
    for holder in set(watch.orphan_leases) - seen:
        del watch.orphan_leases[holder]


def check_engines_tracked(chaos: Chaos, watch: Watch, leaders: set[int], health: dict[str, Any]) -> None:
    """Every engine belongs to a slot that names it in /health, give or take a load's or a stop's time."""
    now = time.monotonic()
    known = {slot.get("pid") for slot in health["models"].values()}
    untracked = leaders - known
    for pid in untracked:
        since = watch.untracked.setdefault(pid, now)
        if now - since > STUCK_AFTER_S["stopping"] + STUCK_AFTER_S["loading"]:
            report_once(chaos, watch, f"untracked {pid}", "untracked_engine", f"pid {pid}: no slot names it")
    for pid in set(watch.untracked) - untracked:
        del watch.untracked[pid]


async def wait_stable(chaos: Chaos, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        status, body = await chaos.daemon.get("/health")
        states = {name: slot["state"] for name, slot in body["models"].items()}
        if status == 200 and set(states.values()) <= STABLE:
            return
        await asyncio.sleep(0.2)
    chaos.violation(
        "not_stable_at_end", f"slots not ready/unloaded/failed {deadline_s:g}s after the chaos: {states}"
    )


async def each_model_serves(chaos: Chaos) -> None:
    """Once the faults stop, every model answers again (after its back-off, if it has one).

    At a priority above every model's: an idle model of higher priority than the request is never evicted,
    so a low-priority request may rightly wait for ever behind two loaded models.
    """
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "x_priority": 10}
    for name in MODELS:
        deadline = time.monotonic() + QUEUE_TIMEOUT_S + 20
        last: Any = None
        while time.monotonic() < deadline:
            status, last, _ = await chaos.daemon.post("/v1/chat/completions", {**body, "model": name})
            if status == 200:
                break
            await asyncio.sleep(0.5)
        else:
            chaos.violation("no_recovery", f"{name} does not serve after the chaos: {last}")


# --- the run ------------------------------------------------------------------------------------------


@pytest.mark.timeout(DURATION_S + 300)
async def test_chaos(tmp_path: Path, demo_gguf: Path) -> None:
    print(f"\nchaos seed={SEED} duration={DURATION_S:g}s (replay: CHAOS_SEED={SEED})", flush=True)
    daemon = Daemon(tmp_path / "chaos", CONFIG)
    for priority, name in enumerate(MODELS):
        write_manifest(daemon, demo_gguf, name, priority=priority)
    env: dict[str, str] = {}
    nvml_state = None
    if USE_NVML:
        del daemon.config["gpus"]  # no declared GPUs: the inventory is NVML's
        nvml_state = tmp_path / "fake_nvml.json"
        write_nvml_state(nvml_state, runtime_error=False)
        env = fake_nvml.daemon_env(nvml_state, tmp_path)
    await daemon.start(env=env)
    chaos = Chaos(daemon, end=time.monotonic() + DURATION_S, nvml_state=nvml_state)
    stop_monitor = asyncio.Event()
    try:
        watcher = asyncio.create_task(monitor(chaos, stop_monitor))
        await asyncio.gather(inject_faults(chaos, demo_gguf), *(client(chaos, n) for n in range(CLIENTS)))
        await wait_stable(chaos, max(STUCK_AFTER_S.values()) + 10)
        await each_model_serves(chaos)
        stop_monitor.set()
        await watcher

        daemon.signal(signal.SIGTERM)
        try:
            code = await daemon.wait_exit(60)
            if code != 0:
                chaos.violation("exit_code", f"daemon exited with {code} after SIGTERM")
        except TimeoutError:
            chaos.violation("shutdown_hang", "daemon still running 60s after SIGTERM")
    finally:
        stop_monitor.set()
        for problem in await daemon.close():  # leftovers, exit code, handler_error / background_task_failed
            chaos.violation("after_shutdown", problem)
        print(chaos.summary(), flush=True)
    assert not chaos.violations, chaos.summary()
