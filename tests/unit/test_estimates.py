"""VRAM estimates: declared beats observed beats artifacts; observed figures persist; weights are sized."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Literal, cast

import gguf
import pytest

from supervisor import demo_model
from supervisor.estimates import (
    KvCacheSettings,
    KvShape,
    ObservedVram,
    VramUnknown,
    context_tokens,
    estimate_from_artifacts,
    estimate_vram,
    fingerprint,
    kv_cache_bytes,
    kv_cache_settings,
    kv_shape,
)
from supervisor.manifests import LlamaServerManifest, Manifest, ManifestBase, VllmManifest

MIB = 1 << 20


def manifest(name: str = "m", **fields: object) -> LlamaServerManifest:
    values: dict[str, object] = {"name": name, "engine": "llama-server", "model": "/x.gguf", **fields}
    return LlamaServerManifest.model_validate(values)


def expected_mib(weight_bytes: int, overhead: Fraction, kv_bytes: int) -> int:
    return math.ceil((weight_bytes * overhead + kv_bytes) / MIB)


def demo_kv_bytes(context: int) -> int:
    """The demo model's f16 KV cache, from the hyperparameters it is written with (no GQA, no key_length)."""
    head_dim = demo_model.N_EMBD // demo_model.N_HEAD
    return context * demo_model.N_LAYER * demo_model.N_HEAD * (head_dim + head_dim) * 2


@pytest.fixture
def observed(tmp_path: Path) -> ObservedVram:
    return ObservedVram(tmp_path / "state" / "observed_vram.json")


# --- precedence ------------------------------------------------------------------------------------


def test_declared_vram_beats_observed_and_artifacts(demo_gguf: Path, observed: ObservedVram) -> None:
    m = manifest(model=str(demo_gguf), vram_mib=5000)
    observed.record(fingerprint(m), 1234)
    estimate = estimate_vram(m, observed)
    assert (estimate.mib, estimate.source) == (5000, "declared")


def test_observed_vram_beats_artifacts(demo_gguf: Path, observed: ObservedVram) -> None:
    m = manifest(model=str(demo_gguf), ctx_size=2048)
    observed.record(fingerprint(m), 1234)
    estimate = estimate_vram(m, observed)
    assert (estimate.mib, estimate.source) == (1234, "observed")


def test_artifacts_are_the_last_resort(demo_gguf: Path, observed: ObservedVram) -> None:
    m = manifest(model=str(demo_gguf), ctx_size=2048)
    estimate = estimate_vram(m, observed)
    assert estimate.source == "artifacts"
    assert (estimate.mib, estimate.detail) == estimate_from_artifacts(demo_gguf, 2048)


def test_observed_vram_of_another_launch_config_is_not_used(demo_gguf: Path, observed: ObservedVram) -> None:
    observed.record(fingerprint(manifest(model=str(demo_gguf), ctx_size=2048)), 1234)
    assert estimate_vram(manifest(model=str(demo_gguf), ctx_size=8192), observed).source == "artifacts"


def test_missing_weights_raise_vram_unknown_naming_vram_mib(tmp_path: Path, observed: ObservedVram) -> None:
    m = manifest("ghost", model=str(tmp_path / "nowhere.gguf"))
    with pytest.raises(VramUnknown, match="vram_mib") as info:
        estimate_vram(m, observed)
    assert "model 'ghost'" in str(info.value)
    assert "nowhere.gguf does not exist" in str(info.value)


def test_a_file_that_is_not_gguf_raises_vram_unknown(tmp_path: Path, observed: ObservedVram) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 100)
    with pytest.raises(VramUnknown, match=r"holds no GGUF or safetensors weights.*set vram_mib"):
        estimate_vram(manifest(model=str(weights)), observed)


def test_a_future_engine_with_a_directory_and_max_model_len(tmp_path: Path, observed: ObservedVram) -> None:
    class VllmLike(ManifestBase):
        engine: Literal["vllm"]
        model: Path
        max_model_len: int | None = None

    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=3 * MIB, config=LLAMA_CONFIG)
    m = VllmLike(name="v", engine="vllm", model=snapshot, max_model_len=1024)
    # Manifest is one class today; a vLLM manifest joins its union later.
    estimate = estimate_vram(cast(Manifest, m), observed)
    assert estimate.source == "artifacts"
    assert estimate.mib == expected_mib(3 * MIB, Fraction(13, 10), 1024 * 4 * 2 * 32 * 2 * 2)


# --- observed VRAM persistence ---------------------------------------------------------------------


def test_observed_vram_survives_a_new_instance(tmp_path: Path) -> None:
    path = tmp_path / "state" / "observed_vram.json"
    ObservedVram(path).record("abc", 4321)
    again = ObservedVram(path)
    assert again.get("abc") == 4321
    assert again.get("other") is None
    assert json.loads(path.read_text()) == {"abc": 4321}


def test_recording_again_replaces_the_figure_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "observed_vram.json"
    first = ObservedVram(path)
    first.record("abc", 100)
    first.record("abc", 200)
    first.record("def", 300)
    assert ObservedVram(path).get("abc") == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["observed_vram.json"]


def test_a_non_positive_reading_is_not_recorded(observed: ObservedVram) -> None:
    observed.record("abc", 0)
    observed.record("abc", -5)
    assert observed.get("abc") is None
    assert not observed.path.exists()


def test_missing_observed_file_is_empty(tmp_path: Path) -> None:
    assert ObservedVram(tmp_path / "absent.json").get("abc") is None


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'"text"', b""],
    ids=["broken-json", "not-utf8", "a-list", "a-string", "empty"],
)
def test_corrupt_observed_file_is_empty(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "observed_vram.json"
    path.write_bytes(content)
    observed = ObservedVram(path)
    assert observed.get("abc") is None
    observed.record("abc", 10)  # and it can be written over
    assert ObservedVram(path).get("abc") == 10


def test_bad_entries_are_dropped_and_good_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "observed_vram.json"
    path.write_text(json.dumps({"good": 512, "negative": -1, "text": "512", "flag": True, "float": 1.5}))
    observed = ObservedVram(path)
    assert observed.get("good") == 512
    assert [observed.get(k) for k in ("negative", "text", "flag", "float")] == [None] * 4


# --- fingerprint -----------------------------------------------------------------------------------


def test_fingerprint_is_stable_and_short() -> None:
    a = fingerprint(manifest(ctx_size=4096, args=["--flash-attn", "on"]))
    b = fingerprint(manifest(ctx_size=4096, args=["--flash-attn", "on"]))
    assert a == b
    assert len(a) == 16
    int(a, 16)


@pytest.mark.parametrize(
    "change",
    [
        {"ctx_size": 8192},
        {"parallel": 4},
        {"args": ["--flash-attn", "off"]},
        {"model": "/y.gguf"},
        {"binary": "/opt/llama-cuda/llama-server"},
        {"library_path": ["/opt/cuda/lib"]},
    ],
)
def test_fingerprint_changes_with_what_changes_memory(change: dict[str, object]) -> None:
    base: dict[str, object] = {"ctx_size": 4096, "args": ["--flash-attn", "on"]}
    assert fingerprint(manifest("m", **base)) != fingerprint(manifest("m", **{**base, **change}))


@pytest.mark.parametrize(
    "change",
    [
        {"keep_alive": "10m"},
        {"priority": 5},
        {"pinned": True},
        {"aliases": ["other"]},
        {"description": "a model"},
        {"start_timeout_s": 600},
        {"env": {"LLAMA_ARG_X": "1"}},
        {"vram_mib": 4096},
    ],
)
def test_fingerprint_ignores_what_does_not_change_memory(change: dict[str, object]) -> None:
    assert fingerprint(manifest(ctx_size=4096)) == fingerprint(manifest("m", ctx_size=4096, **change))


def test_fingerprint_ignores_the_name() -> None:
    assert fingerprint(manifest("a", ctx_size=4096)) == fingerprint(manifest("b", ctx_size=4096))


# --- GGUF ------------------------------------------------------------------------------------------


def test_demo_model_metadata_is_what_the_expectations_assume(demo_gguf: Path) -> None:
    fields = gguf.GGUFReader(demo_gguf).fields
    arch = demo_model.ARCH
    assert fields["general.architecture"].contents() == arch
    assert fields[f"{arch}.block_count"].contents() == demo_model.N_LAYER
    assert fields[f"{arch}.attention.head_count"].contents() == demo_model.N_HEAD
    assert fields[f"{arch}.attention.head_count_kv"].contents() == demo_model.N_HEAD
    assert fields[f"{arch}.embedding_length"].contents() == demo_model.N_EMBD
    assert fields[f"{arch}.context_length"].contents() == demo_model.N_CTX_TRAIN
    assert f"{arch}.attention.key_length" not in fields


def test_gguf_estimate_is_file_size_plus_kv_cache(demo_gguf: Path) -> None:
    size = demo_gguf.stat().st_size
    found = estimate_from_artifacts(demo_gguf, 2048)
    assert found is not None
    mib, detail = found
    assert mib == expected_mib(size, Fraction(11, 10), demo_kv_bytes(2048))
    assert "x 1.1" in detail
    assert "ctx 2048, 2 layers, 4 KV heads x 16 dims, f16" in detail


def test_gguf_kv_cache_dominates_a_long_context(demo_gguf: Path) -> None:
    # At a million tokens the cache is ~488 MiB, so an error in it cannot hide in the rounding.
    size = demo_gguf.stat().st_size
    assert demo_kv_bytes(1_000_000) == 512_000_000
    assert estimate_from_artifacts(demo_gguf, 1_000_000) == (
        expected_mib(size, Fraction(11, 10), 512_000_000),
        "GGUF 0.6 MiB x 1.1 + KV cache 488.3 MiB (ctx 1000000, 2 layers, 4 KV heads x 16 dims, f16)",
    )


def test_a_larger_context_gives_a_larger_estimate(demo_gguf: Path) -> None:
    small = estimate_from_artifacts(demo_gguf, 4096)
    large = estimate_from_artifacts(demo_gguf, 65536)
    assert small is not None
    assert large is not None
    assert large[0] > small[0]


@pytest.mark.parametrize("context", [None, 0])
def test_no_context_means_the_trained_context(demo_gguf: Path, context: int | None) -> None:
    found = estimate_from_artifacts(demo_gguf, context)
    assert found is not None
    size = demo_gguf.stat().st_size
    assert found[0] == expected_mib(size, Fraction(11, 10), demo_kv_bytes(demo_model.N_CTX_TRAIN))
    assert f"ctx {demo_model.N_CTX_TRAIN}" in found[1]


def test_manifest_ctx_size_reaches_the_estimate(demo_gguf: Path, observed: ObservedVram) -> None:
    size = demo_gguf.stat().st_size
    estimate = estimate_vram(manifest(model=str(demo_gguf), ctx_size=300_000), observed)
    assert estimate.mib == expected_mib(size, Fraction(11, 10), demo_kv_bytes(300_000))


def write_gguf(path: Path, arch: str, metadata: Mapping[str, int | list[int]]) -> Path:
    """A tensorless GGUF holding only `metadata` (keys without the `arch.` prefix)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        else:
            writer.add_uint32(full, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_per_layer_kv_heads_are_summed_over_layers(tmp_path: Path) -> None:
    # Three layers: full attention, none (a recurrent block), grouped-query with 2 KV heads.
    path = write_gguf(
        tmp_path / "hybrid.gguf",
        "llama",
        {
            "block_count": 3,
            "context_length": 100,
            "embedding_length": 256,
            "attention.head_count": 8,
            "attention.head_count_kv": [8, 0, 2],
            "attention.key_length": 64,
            "attention.value_length": 32,
        },
    )
    kv = 100 * (8 * (64 + 32) + 0 + 2 * (64 + 32)) * 2
    assert estimate_from_artifacts(path, None) == (
        expected_mib(path.stat().st_size, Fraction(11, 10), kv),
        "GGUF 0.0 MiB x 1.1 + KV cache 0.2 MiB "
        "(ctx 100, 3 layers, 960 K+V values per token over the layers, f16)",
    )


def test_gguf_of_an_unknown_architecture_is_sized_without_kv_cache(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "ssm.gguf", "mamba", {"block_count": 4, "context_length": 1000})
    found = estimate_from_artifacts(path, 2048)
    assert found is not None
    assert found[0] == expected_mib(path.stat().st_size, Fraction(11, 10), 0)
    assert "KV cache not counted" in found[1]
    assert "'mamba'" in found[1]


def test_a_gguf_with_unreadable_metadata_is_sized_without_kv_cache(broken_gguf: Path) -> None:
    found = estimate_from_artifacts(broken_gguf, 2048)
    assert found is not None
    assert found[0] == expected_mib(broken_gguf.stat().st_size, Fraction(11, 10), 0)
    assert "KV cache not counted: metadata unreadable" in found[1]


def test_a_split_gguf_counts_every_shard(demo_gguf: Path, tmp_path: Path) -> None:
    first = tmp_path / "big-00001-of-00002.gguf"
    shutil.copy(demo_gguf, first)
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"\0" * 5 * MIB)
    found = estimate_from_artifacts(first, 2048)
    assert found is not None
    size = demo_gguf.stat().st_size + 5 * MIB
    assert found[0] == expected_mib(size, Fraction(11, 10), demo_kv_bytes(2048))
    assert "in 2 shards" in found[1]


def test_nothing_to_size_gives_none(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not weights")
    assert estimate_from_artifacts(tmp_path / "absent.gguf", 2048) is None
    assert estimate_from_artifacts(tmp_path / "empty", 2048) is None
    assert estimate_from_artifacts(tmp_path / "notes.txt", 2048) is None


# --- safetensors -----------------------------------------------------------------------------------

LLAMA_CONFIG: dict[str, object] = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def write_snapshot(directory: Path, weight_bytes: int, config: dict[str, object] | None) -> Path:
    """A fake Hugging Face snapshot: the sizes of the weights are all the estimate reads."""
    directory.mkdir(parents=True)
    half = weight_bytes // 2
    (directory / "model-00001-of-00002.safetensors").write_bytes(b"\0" * half)
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"\0" * (weight_bytes - half))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_safetensors_estimate_is_size_plus_kv_cache(tmp_path: Path) -> None:
    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=10 * MIB, config=LLAMA_CONFIG)
    # 2048 tokens x 4 layers x 2 KV heads x 32 dims (256 / 8) x K and V x 2 bytes = 2 MiB
    assert estimate_from_artifacts(snapshot, 2048) == (
        15,  # 10 MiB x 1.3 = 13 MiB, + 2 MiB
        "safetensors 10.0 MiB in 2 files x 1.3 + KV cache 2.0 MiB "
        "(ctx 2048, 4 layers, 2 KV heads x 32 dims, bfloat16)",
    )


def test_safetensors_defaults_context_to_max_position_embeddings(tmp_path: Path) -> None:
    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=10 * MIB, config=LLAMA_CONFIG)
    found = estimate_from_artifacts(snapshot, None)
    assert found is not None
    assert found[0] == 13 + 4  # the 4096-token cache is 4 MiB


def test_safetensors_config_defaults_and_float32(tmp_path: Path) -> None:
    # No num_key_value_heads (so all 8 heads), an explicit head_dim, and 4-byte float32.
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "head_dim": 128}
    snapshot = write_snapshot(
        tmp_path / "snap", weight_bytes=MIB, config={**config, "torch_dtype": "float32"}
    )
    kv = 1000 * 2 * 8 * 128 * 2 * 4
    found = estimate_from_artifacts(snapshot, 1000)
    assert found is not None
    assert found[0] == expected_mib(MIB, Fraction(13, 10), kv)


def test_safetensors_reads_a_nested_text_config(tmp_path: Path) -> None:
    config: dict[str, object] = {
        "model_type": "llava",
        "vision_config": {"hidden_size": 1024},
        "text_config": LLAMA_CONFIG,
    }
    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=10 * MIB, config=config)
    found = estimate_from_artifacts(snapshot, 2048)
    assert found is not None
    assert found[0] == 15


def test_safetensors_without_config_is_sized_without_kv_cache(tmp_path: Path) -> None:
    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=10 * MIB, config=None)
    assert estimate_from_artifacts(snapshot, 2048) == (
        13,
        "safetensors 10.0 MiB in 2 files x 1.3; KV cache not counted: no config.json",
    )


# --- what the launch config says about the KV cache ------------------------------------------------


def test_llama_cache_types_in_args_size_the_kv_cache(demo_gguf: Path, observed: ObservedVram) -> None:
    size = demo_gguf.stat().st_size
    m = manifest(model=str(demo_gguf), ctx_size=1_000_000, args=["-ctk", "q8_0", "--cache-type-v", "q4_0"])
    assert kv_cache_settings(m) == KvCacheSettings(type_k="q8_0", type_v="q4_0")
    # Half the demo cache is K and half V: q8_0 stores 32 values in 34 bytes, q4_0 in 18.
    kv = math.ceil(Fraction(demo_kv_bytes(1_000_000), 4) * (Fraction(34, 32) + Fraction(18, 32)))
    estimate = estimate_vram(m, observed)
    assert estimate.mib == expected_mib(size, Fraction(11, 10), kv)
    assert estimate.detail.endswith("(ctx 1000000, 2 layers, 4 KV heads x 16 dims, K q8_0, V q4_0)")
    assert kv_cache_bytes(m) == kv


def test_llama_cache_types_from_the_environment_and_the_last_flag(demo_gguf: Path) -> None:
    from_env = manifest(model=str(demo_gguf), env={"LLAMA_ARG_CACHE_TYPE_K": "f32"})
    assert kv_cache_settings(from_env) == KvCacheSettings(type_k="f32", type_v="f16")
    # llama-server takes the last flag given, and a flag over the environment.
    both = manifest(
        model=str(demo_gguf), args=["-ctk", "q8_0", "-ctk", "bf16"], env={"LLAMA_ARG_CACHE_TYPE_K": "f32"}
    )
    assert kv_cache_settings(both).type_k == "bf16"


def test_an_unknown_cache_type_is_sized_as_f16_and_said_so(demo_gguf: Path) -> None:
    found = estimate_from_artifacts(demo_gguf, 2048, KvCacheSettings(type_k="q6_K2"))
    assert found is not None
    assert found[0] == expected_mib(demo_gguf.stat().st_size, Fraction(11, 10), demo_kv_bytes(2048))
    assert "K q6_K2 (unknown, taken as f16), V f16" in found[1]


def test_a_context_in_args_beats_the_field_and_the_environment(demo_gguf: Path) -> None:
    assert context_tokens(manifest(model=str(demo_gguf), ctx_size=2048, args=["-c", "8192"])) == 8192
    assert context_tokens(manifest(model=str(demo_gguf), env={"LLAMA_ARG_CTX_SIZE": "1024"})) == 1024
    assert context_tokens(manifest(ctx_size=2048, env={"LLAMA_ARG_CTX_SIZE": "1024"})) == 2048
    assert context_tokens(manifest(ctx_size=0, env={"LLAMA_ARG_CTX_SIZE": "1024"})) is None  # the model's own
    # llama-server reads a long flag's `_` as `-`.
    assert context_tokens(manifest(ctx_size=2048, args=["--ctx_size", "768"])) == 768


def vllm_manifest(model: Path, **fields: object) -> VllmManifest:
    return VllmManifest.model_validate({"name": "v", "engine": "vllm", "model": str(model), **fields})


def test_vllm_kv_cache_dtype_sizes_the_cache(tmp_path: Path, observed: ObservedVram) -> None:
    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=10 * MIB, config=LLAMA_CONFIG)
    # 4096 tokens x 4 layers x 2 KV heads x 32 dims x K and V: 4 MiB in bfloat16, 2 MiB in fp8.
    assert estimate_vram(vllm_manifest(snapshot, max_model_len=4096), observed).mib == 13 + 4
    fp8 = estimate_vram(vllm_manifest(snapshot, max_model_len=4096, kv_cache_dtype="fp8"), observed)
    assert (fp8.mib, fp8.detail.endswith("kv_cache_dtype fp8)")) == (13 + 2, True)
    auto = estimate_vram(vllm_manifest(snapshot, max_model_len=4096, kv_cache_dtype="auto"), observed)
    assert auto.mib == 13 + 4
    odd = estimate_vram(vllm_manifest(snapshot, max_model_len=4096, kv_cache_dtype="fp3"), observed)
    assert (odd.mib, "kv_cache_dtype fp3 unknown, so bfloat16" in odd.detail) == (13 + 4, True)


def test_vllm_kv_cache_memory_bytes_is_the_cache_on_each_gpu(tmp_path: Path, observed: ObservedVram) -> None:
    snapshot = write_snapshot(tmp_path / "snap", weight_bytes=10 * MIB, config=None)
    m = vllm_manifest(snapshot, kv_cache_memory_bytes=64 * MIB, tensor_parallel_size=2)
    estimate = estimate_vram(m, observed)
    assert estimate.mib == 13 + 128
    assert estimate.detail.endswith("+ KV cache 128.0 MiB (kv_cache_memory_bytes)")
    assert kv_cache_bytes(m) == 128 * MIB


def test_kv_shape_reads_gguf_and_config_json(demo_gguf: Path, tmp_path: Path) -> None:
    shape = kv_shape(demo_gguf)
    assert isinstance(shape, KvShape)
    head = demo_model.N_EMBD // demo_model.N_HEAD
    assert (shape.key_sizes, shape.value_sizes, shape.trained_context) == (
        frozenset({head}),
        frozenset({head}),
        demo_model.N_CTX_TRAIN,
    )
    hf = kv_shape(write_snapshot(tmp_path / "snap", weight_bytes=MIB, config=LLAMA_CONFIG))
    assert isinstance(hf, KvShape)
    assert (hf.k_values, hf.trained_context, hf.dtype) == (4 * 2 * 32, 4096, "bfloat16")
    assert kv_shape(tmp_path / "absent") == f"{tmp_path / 'absent'} does not exist here"
    assert kv_cache_bytes(manifest(model=str(tmp_path / "absent.gguf"))) is None
