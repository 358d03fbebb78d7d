"""Integration fixtures: real daemons with real llama-server children, checked for leftovers afterwards."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor import proxy
from supervisor.config import Settings
from supervisor.gpus import GpuInventory
from supervisor.manifests import load_directory
from supervisor.metrics import Metrics
from supervisor.scheduler import Scheduler
from tests.integration.harness import Daemon
from tests.integration.vllm_child import make_tiny_llama
from workers import sockets

MakeDaemon = Callable[..., Awaitable[Daemon]]

# The demo model's manifest as most tests want it; tests override fields by keyword.
DEMO = {"ctx_size": 2048, "parallel": 4, "vram_mib": 512, "start_timeout_s": 30}
# A 1 GiB simulated GPU holds one of two 700 MiB models at a time; "a" serves one request at once.
TAKING_TURNS: dict[str, Any] = {
    "models": {"a": {"vram_mib": 700, "parallel": 1}, "b": {"vram_mib": 700}},
    "config": {"gpus": [{"index": 0, "total_mib": 1024}]},
}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random Llama that every `vllm serve` test loads, written once (the vLLM venv takes 10 s to
    import transformers)."""
    return make_tiny_llama(tmp_path_factory.mktemp("vllm") / "tiny-llama")


@pytest.fixture
async def make_daemon(tmp_path: Path, demo_gguf: Path) -> AsyncIterator[MakeDaemon]:
    """Build daemons: `await make_daemon(models={"demo": {...}}, config={...}, start=True)`.

    Teardown stops each daemon and fails the test if any engine process outlived it, if it exited with a
    code not in `daemon.expect_exit` ({0} unless the test says otherwise), or if it logged an internal
    error (`handler_error`, `background_task_failed`).
    """
    daemons: list[Daemon] = []
    counter = itertools.count()

    async def make(
        models: dict[str, dict[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        start: bool = True,
        root: Path | None = None,
    ) -> Daemon:
        daemon = Daemon(root or tmp_path / f"daemon{next(counter)}", config or {})
        for name, fields in (models if models is not None else {"demo": {}}).items():
            daemon.write_manifest(name, **{"model": str(demo_gguf), **DEMO, **fields})
        daemons.append(daemon)
        if start:
            await daemon.start()
        return daemon

    yield make
    problems = [problem for daemon in daemons for problem in await daemon.close()]
    assert not problems, "\n".join(problems)


@pytest.fixture
async def daemon(make_daemon: MakeDaemon) -> Daemon:
    """A running daemon serving the demo model (not yet loaded)."""
    return await make_daemon()


# --- a scheduler in process, without a daemon: tests that hold and release tickets themselves ---

MakeScheduler = Callable[..., Awaitable[Scheduler]]


@pytest.fixture
async def make_scheduler(tmp_path: Path, demo_gguf: Path) -> AsyncIterator[MakeScheduler]:
    made: list[Scheduler] = []
    session = proxy.new_upstream_session()

    async def make(models: dict[str, dict[str, Any]] | None = None, **config: Any) -> Scheduler:
        """A scheduler of `models` (name -> manifest fields; default: demo), all on the demo GGUF."""
        manifests = tmp_path / "manifests"
        manifests.mkdir(exist_ok=True)
        for name, fields in (models or {"demo": DEMO}).items():
            manifest = {
                "name": name,
                "engine": "llama-server",
                "model": str(demo_gguf),
                "ctx_size": 2048,
                "start_timeout_s": 30,
                **fields,
            }
            (manifests / f"{name}.yaml").write_text(yaml.safe_dump(manifest))
        settings = Settings.model_validate(
            {
                "manifests": manifests,
                "state_dir": tmp_path / "state",
                "gpus": [{"index": 0, "total_mib": 4096}],
                "gpu_margin_mib": 0,
                "stop_grace_s": 3,
                "queue_timeout_s": 15,
                "failure_backoff_s": 1,
                **config,
            }
        )
        inventory = GpuInventory.detect(settings.gpus)
        scheduler = Scheduler(settings, load_directory(manifests), inventory, session, Metrics())
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        await asyncio.wait_for(scheduler.shutdown(), 60)
    await session.close()
    sockets.remove_directory()  # the daemon's last step, after its schedulers' shutdown
