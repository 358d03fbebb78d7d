"""How a vLLM manifest and its lease become `vllm serve` argv: the memory fraction above all."""

from __future__ import annotations

import json
from typing import Any

from supervisor.manifests import VllmManifest
from workers.base import GpuPlacement
from workers.vllm_serve import VllmWorker, gpu_memory_utilization


def manifest(**fields: Any) -> VllmManifest:
    return VllmManifest.model_validate({"name": "v", "engine": "vllm", "model": "/models/v", **fields})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_memory_fraction_is_the_lease_over_the_gpus_total_rounded_down() -> None:
    # 20000 MiB of an 81559 MiB H100 is 0.24521...: vLLM must get 0.2452, never more, never its 0.9.
    assert gpu_memory_utilization(GpuPlacement({0: 20_000}, {0: 81_559})) == 0.2452
    # Two GPUs of different sizes: the smaller share binds.
    assert gpu_memory_utilization(GpuPlacement({0: 8000, 1: 8000}, {0: 16_000, 1: 24_000})) == 0.3333


def test_argv_carries_the_lease_the_fields_and_then_args() -> None:
    spec = VllmWorker().launch_spec(
        manifest(
            served_model_name="chat",
            max_model_len=2048,
            dtype="float32",
            enforce_eager=True,
            speculative={"method": "ngram", "num_speculative_tokens": 2},
            tensor_parallel_size=2,
            args=["--swap-space", "1"],
        ),
        8000,
        GpuPlacement({2: 4000, 3: 4000}, {2: 16_000, 3: 16_000}),
    )
    argv = spec.argv
    assert argv[:3] == ["vllm", "serve", "/models/v"]
    assert (flag(argv, "--port"), flag(argv, "--host"), flag(argv, "--served-model-name")) == (
        "8000",
        "127.0.0.1",
        "chat",
    )
    assert flag(argv, "--gpu-memory-utilization") == "0.2500"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert (flag(argv, "--max-model-len"), flag(argv, "--dtype")) == ("2048", "float32")
    assert "--enforce-eager" in argv
    assert json.loads(flag(argv, "--speculative-config")) == {"method": "ngram", "num_speculative_tokens": 2}
    assert argv[-2:] == ["--swap-space", "1"]
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_an_api_server_command_takes_the_model_as_a_flag() -> None:
    command = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    argv = VllmWorker().launch_spec(manifest(command=command), 1, GpuPlacement({0: 1}, {0: 10})).argv
    assert argv[:5] == [*command, "--model", "/models/v"]
