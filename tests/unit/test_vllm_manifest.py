"""vLLM manifests: fields, paths, and the combinations `check` refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from supervisor.manifests import VllmManifest


def vllm(tmp_path: Path | None = None, **fields: Any) -> VllmManifest:
    context = {"base_dir": tmp_path} if tmp_path is not None else None
    return VllmManifest.model_validate(
        {"name": "v", "engine": "vllm", "model": "org/model", **fields}, context=context
    )


def test_every_field_is_accepted() -> None:
    manifest = vllm(
        served_model_name="served",
        max_model_len=4096,
        dtype="bfloat16",
        quantization="fp8",
        tensor_parallel_size=2,
        kv_cache_dtype="fp8",
        kv_cache_memory_bytes=2**30,
        enforce_eager=True,
        max_num_seqs=32,
        speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
        command=["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
        args=["--swap-space", "4"],
    )
    assert manifest.served_name == "served"
    assert manifest.inflight_limit() == 32


def test_what_vllm_itself_accepts_is_not_refused_here() -> None:
    # AWQ/GPTQ run in bfloat16 too; MTP needs no num_speculative_tokens; newer KV cache dtypes pass
    # through (vLLM's own check names what is wrong with a value it does not know).
    assert vllm(quantization="awq", dtype="bfloat16").dtype == "bfloat16"
    assert vllm(speculative={"method": "mtp"}).speculative == {"method": "mtp"}
    assert vllm(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert vllm(args=["--swap-space", "4", "--max-num-batched-tokens=8192"]).args


def test_a_hub_repo_id_stays_as_it_is_and_a_local_directory_becomes_absolute(tmp_path: Path) -> None:
    (tmp_path / "snap").mkdir()
    assert vllm(tmp_path, model="org/model").model == "org/model"
    assert vllm(tmp_path, model="org/model").local_weights() is None
    assert vllm(tmp_path, model="snap").model == str(tmp_path / "snap")
    assert vllm(tmp_path, model="./other").local_weights() == tmp_path / "other"


def test_a_relative_command_is_relative_to_the_manifest(tmp_path: Path) -> None:
    manifest = vllm(tmp_path, command=[".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"])
    assert manifest.command[0] == str(tmp_path / ".venv-vllm/bin/python")
    assert vllm(command="vllm serve").command == ("vllm", "serve")


def test_defaults_name_the_model_and_allow_vllms_batch() -> None:
    manifest = vllm()
    assert (manifest.served_name, manifest.inflight_limit(), manifest.command) == (
        "v",
        256,
        ("vllm", "serve"),
    )


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"args": ["--port", "9000"]}, "args must not set --port; the supervisor picks where the child"),
        ({"args": ["--uds", "/tmp/x.sock"]}, "args must not set --uds"),
        # argparse takes a unique prefix for the whole option: these set --host and --api-key.
        ({"args": ["--hos", "0.0.0.0"]}, r"args must not set --hos \(vLLM reads it as --host\)"),
        ({"args": ["--api-ke=x"]}, r"args must not set --api-ke \(vLLM reads it as --api-key\)"),
        ({"args": ["--gpu-memory-utilization=0.9"]}, "computed from the model's lease"),
        ({"args": ["-tp", "2"]}, "set `tensor_parallel_size`"),
        ({"quantization": "awq", "dtype": "float32"}, "runs in float16 or bfloat16"),
        ({"speculative": {"num_speculative_tokens": 3}}, "needs a `method`"),
        ({"dtype": "fp7"}, "dtype"),
        # vLLM's parser reads `_` as `-`, a dotted flag as its JSON field, and aliases; none slips past.
        ({"args": ["--gpu_memory_utilization=0.95"]}, "computed from the model's lease"),
        ({"args": ["--device-memory-utilization", "0.95"]}, "computed from the model's lease"),
        ({"args": ["--speculative-config.method", "ngram"]}, "set `speculative`"),
        ({"args": ["-sc", "{}"]}, "set `speculative`"),
        ({"args": ["--max_model_len", "9999"]}, "set `max_model_len`"),
        ({"args": ["--config", "x.yaml"]}, "a config file could set"),
        (
            {"args": ["--api-key", "k"]},
            "args must not set --api-key; the daemon gives each child its own key",
        ),
        ({"args": ["--api_key=k"]}, "args must not set --api_key; the daemon gives each child its own key"),
        ({"env": {"VLLM_API_KEY": "k"}}, "env must not set VLLM_API_KEY; the daemon gives each child"),
        ({"max_model_len": 8}, "max_model_len"),
        ({"command": []}, "command"),
        ({"tensor_parallel_size": 2, "gpus": [0]}, "needs at least that many gpus"),
    ],
)
def test_contradictions_are_refused_with_a_reason(fields: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        vllm(**fields)
