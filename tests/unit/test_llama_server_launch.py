"""How a lease becomes llama-server's argv and environment."""

from __future__ import annotations

from pathlib import Path

from supervisor.manifests import LlamaServerManifest
from workers.base import GpuPlacement
from workers.llama_server import LlamaServerWorker


def manifest(tmp_path: Path, **fields: object) -> LlamaServerManifest:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return LlamaServerManifest.model_validate(
        {"name": "m", "engine": "llama-server", "model": model, **fields}
    )


def lease(mib_by_gpu: dict[int, int]) -> GpuPlacement:
    return GpuPlacement(mib_by_gpu, dict.fromkeys(range(4), 1000))


def test_a_one_gpu_lease_shows_the_child_that_gpu_only(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), 8080, lease({3: 100}))
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "--tensor-split" not in spec.argv


def test_a_tensor_parallel_lease_splits_the_layers_evenly(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(
        manifest(tmp_path, tensor_parallel_size=2), 8080, lease({1: 50, 2: 50})
    )
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1,2"
    split = spec.argv.index("--tensor-split")
    assert spec.argv[split + 1] == "1,1"
    assert spec.argv[spec.argv.index("--split-mode") + 1] == "layer"


def test_manifest_args_come_last_so_they_can_override(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(
        manifest(tmp_path, args=["--tensor-split", "3,1"]), 8080, lease({0: 1, 1: 1})
    )
    assert spec.argv[-2:] == ["--tensor-split", "3,1"]
