"""How a vLLM manifest and its lease become `vllm serve` argv: the memory fraction above all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.gpus import Gpu
from supervisor.manifests import VllmManifest
from workers.base import ChildKey, Endpoint, GpuPlacement, LaunchError
from workers.vllm_serve import VllmWorker, gpu_memory_utilization

KEY = ChildKey("the-childs-own-key", Path("/state/keys/abc.key"))
PORT = Endpoint(port=8000)


def manifest(**fields: Any) -> VllmManifest:
    return VllmManifest.model_validate({"name": "v", "engine": "vllm", "model": "org/v", **fields})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_memory_fraction_is_the_lease_over_the_gpus_total_rounded_down() -> None:
    # 20000 MiB of an 81559 MiB H100 is 0.24521...: vLLM must get 0.2452, never more, never its 0.9.
    assert gpu_memory_utilization(GpuPlacement({0: 20_000}, {0: 81_559})) == 0.2452
    # Two GPUs of different sizes: the smaller share binds.
    assert gpu_memory_utilization(GpuPlacement({0: 8000, 1: 8000}, {0: 16_000, 1: 24_000})) == 0.3333


def test_on_a_socket_the_child_gets_uds_and_neither_host_nor_port() -> None:
    """vLLM checks its key on the /v1 routes only: on a loopback port, /invocations (chat, completions,
    embeddings by the body), /tokenize, /score... were open to any local user."""
    socket = Path("/tmp/llmsup-sockets-x/0123456789abcdef.sock")
    spec = VllmWorker().launch_spec(manifest(), Endpoint(socket=socket), GpuPlacement({0: 1}, {0: 2}), KEY)
    assert flag(spec.argv, "--uds") == str(socket)
    assert "--host" not in spec.argv
    assert "--port" not in spec.argv
    assert spec.leaves == (socket,)
    assert VllmWorker().endpoint(manifest()).socket is not None  # the default
    assert VllmWorker().endpoint(manifest(listen="tcp")).port is not None


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
        Endpoint(port=8000),
        GpuPlacement({2: 4000, 3: 4000}, {2: 16_000, 3: 16_000}),
        KEY,
    )
    argv = spec.argv
    assert argv[:3] == ["vllm", "serve", "org/v"]
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
    assert spec.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # the lease counts GPUs in NVML's order


def test_a_budget_declared_on_a_real_gpu_is_still_a_share_of_the_whole_device() -> None:
    # 40000 MiB declared on an 80 GB H100: a 30000 MiB lease is 0.3678 of the device, not 0.75 of it.
    gpu = Gpu(0, 40_000, "H100", None, True, physical_total_mib=81_559)
    assert gpu.device_total_mib == 81_559
    assert gpu_memory_utilization(GpuPlacement({0: 30_000}, {0: gpu.device_total_mib})) == 0.3678
    assert Gpu(0, 1024, "simulated GPU", None, True).device_total_mib == 1024


def test_an_api_server_command_takes_the_model_as_a_flag() -> None:
    command = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    argv = VllmWorker().launch_spec(manifest(command=command), PORT, GpuPlacement({0: 1}, {0: 10}), KEY).argv
    assert argv[:5] == [*command, "--model", "org/v"]


def test_a_missing_model_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="not found"):
        VllmWorker().launch_spec(
            manifest(model=str(tmp_path / "gone")), PORT, GpuPlacement({0: 1}, {0: 10}), KEY
        )
    (tmp_path / "here").mkdir()
    argv = VllmWorker().launch_spec(
        manifest(model=str(tmp_path / "here")), PORT, GpuPlacement({0: 1}, {0: 10}), KEY
    )
    assert argv.argv[2] == str(tmp_path / "here")


def test_the_childs_key_comes_from_the_environment_not_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "known-to-others")
    spec = VllmWorker().launch_spec(manifest(), PORT, GpuPlacement({0: 1}, {0: 10}), KEY)
    assert spec.env["VLLM_API_KEY"] == KEY.value
    assert spec.api_key == KEY.value
    assert not any(KEY.value in arg for arg in spec.argv)  # argv is what `ps` shows every local user
    assert "--api-key" not in spec.argv
    assert not spec.files
