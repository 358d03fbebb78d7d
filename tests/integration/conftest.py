"""Integration fixtures: real daemons with real llama-server children, checked for leftovers afterwards."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Daemon
from tests.integration.vllm_child import make_tiny_llama

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
