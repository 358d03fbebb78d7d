"""Runtime load overrides: validated per engine, turned into the child's argv, and counted in the estimate."""

from __future__ import annotations

import json
import math
import subprocess
from fractions import Fraction
from pathlib import Path
from typing import Any, get_args

import gguf
import pytest

from supervisor import demo_model
from supervisor.errors import SupervisorError
from supervisor.estimates import (
    LLAMA_CACHE_TYPES,
    VLLM_KV_DTYPE_BYTES,
    ObservedVram,
    estimate_vram,
    fingerprint,
)
from supervisor.manifests import LlamaServerManifest, Manifest, VllmManifest
from supervisor.overrides import (
    MAX_CONTEXT,
    LlamaCacheType,
    LlamaServerOverrides,
    VllmKvCacheDtype,
    VllmOverrides,
    apply,
    describe,
    estimate,
    load_constraints,
    parse_overrides,
)
from workers.base import ChildKey, Endpoint, GpuPlacement
from workers.llama_server import LlamaServerWorker, bundled_binary
from workers.vllm_serve import VllmWorker

MIB = 1 << 20
KEY = ChildKey("the-childs-own-key", Path("/state/keys/abc.key"))
ONE_GPU = GpuPlacement({0: 4000}, {0: 16_000})

LLAMA_CONFIG: dict[str, object] = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def llama(model: Path, **fields: object) -> LlamaServerManifest:
    return LlamaServerManifest.model_validate(
        {"name": "m", "engine": "llama-server", "model": model, **fields}
    )


def vllm(model: Path | str = "org/v", **fields: object) -> VllmManifest:
    return VllmManifest.model_validate({"name": "v", "engine": "vllm", "model": str(model), **fields})


def refusal(manifest: Manifest, raw: object) -> str:
    with pytest.raises(SupervisorError) as info:
        parse_overrides(manifest, raw)
    assert (info.value.code, info.value.status) == ("invalid_load_request", 400)
    return info.value.message


def snapshot(directory: Path, config: dict[str, object] = LLAMA_CONFIG) -> Path:
    """A fake Hugging Face snapshot: 10 MiB of weights and a config.json."""
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"\0" * 10 * MIB)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def gguf_with_heads(path: Path, head_size: int) -> Path:
    """A tensorless llama GGUF whose attention heads are `head_size` wide (the demo model's are 16)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": 2,
        "context_length": 4096,
        "embedding_length": 4 * head_size,
        "attention.head_count": 4,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def flags_in(argv: list[str], *names: str) -> list[str]:
    """The values given to any of `names` in argv, in order."""
    return [argv[i + 1] for i, arg in enumerate(argv) if arg in names]


@pytest.fixture
def observed(tmp_path: Path) -> ObservedVram:
    return ObservedVram(tmp_path / "observed_vram.json")


# --- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctx_size", [1, 100, 255, -1])
def test_a_context_below_256_is_refused_naming_the_field(demo_gguf: Path, ctx_size: int) -> None:
    assert refusal(llama(demo_gguf), {"ctx_size": ctx_size}) == (
        "overrides.ctx_size: must be >= 256, or 0 for the model's own context"
    )


@pytest.mark.parametrize("ctx_size", [0, 256, 8192, MAX_CONTEXT])
def test_a_context_of_zero_or_256_and_more_is_taken(demo_gguf: Path, ctx_size: int) -> None:
    assert parse_overrides(llama(demo_gguf), {"ctx_size": ctx_size}) == LlamaServerOverrides(
        ctx_size=ctx_size
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"ctx_size": MAX_CONTEXT + 1}, f"overrides.ctx_size: must be <= {MAX_CONTEXT}"),
        ({"parallel": 0}, "overrides.parallel: must be >= 1"),
        ({"parallel": 257}, "overrides.parallel: must be <= 256"),
        ({"draft_n_max": 0}, "overrides.draft_n_max: must be >= 1"),
        ({"draft_n_max": 17}, "overrides.draft_n_max: must be <= 16"),
        ({"draft_p_min": -0.1}, "overrides.draft_p_min: must be >= 0"),
        ({"draft_p_min": 1.5}, "overrides.draft_p_min: must be <= 1"),
        ({"flash_attn": "yes"}, "overrides.flash_attn: must be one of 'on', 'off' or 'auto'"),
        ({"cache_type_k": "q6_K"}, "overrides.cache_type_k: must be one of 'f32', 'f16', 'bf16', 'q8_0'"),
        ({"n_gpu_layers": -1}, "overrides.n_gpu_layers: must be a number of layers >= 0, 'auto' or 'all'"),
        (
            {"n_gpu_layers": "most"},
            "overrides.n_gpu_layers: must be a number of layers >= 0, 'auto' or 'all'",
        ),
        ({"ctx_size": "4096"}, "overrides.ctx_size: must be an integer"),
        ({"ctx_size": 4096.0}, "overrides.ctx_size: must be an integer"),
        ({"parallel": True}, "overrides.parallel: must be an integer"),
    ],
)
def test_llama_server_bounds(demo_gguf: Path, raw: dict[str, Any], message: str) -> None:
    assert refusal(llama(demo_gguf), raw).startswith(message)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"max_model_len": 8}, "overrides.max_model_len: must be >= 16"),
        ({"kv_cache_dtype": "fp4"}, "overrides.kv_cache_dtype: must be one of 'auto', 'float16'"),
        ({"kv_cache_memory_bytes": 0}, "overrides.kv_cache_memory_bytes: must be >= 1"),
        ({"max_num_seqs": 0}, "overrides.max_num_seqs: must be >= 1"),
        ({"enforce_eager": 1}, "overrides.enforce_eager: must be true or false"),
        ({"speculative": "ngram"}, "overrides.speculative: must be an object"),
        ({"speculative": {"num_speculative_tokens": 3}}, "overrides.speculative: needs a `method`"),
    ],
)
def test_vllm_bounds(raw: dict[str, Any], message: str) -> None:
    assert refusal(vllm(), raw).startswith(message)


def test_an_unknown_field_is_named_with_the_fields_this_engine_takes(demo_gguf: Path) -> None:
    assert refusal(llama(demo_gguf), {"max_model_len": 4096}) == (
        "overrides.max_model_len: unknown field; llama-server accepts ctx_size, parallel, cache_type_k, "
        "cache_type_v, n_gpu_layers, flash_attn, draft_n_max, draft_p_min"
    )
    assert refusal(vllm(), {"ctx_size": 4096}).startswith(
        "overrides.ctx_size: unknown field; vllm accepts max_model_len, kv_cache_dtype"
    )


def test_every_wrong_field_is_named_at_once(demo_gguf: Path) -> None:
    message = refusal(llama(demo_gguf), {"ctx_size": 10, "parallel": 0, "colour": "red"})
    assert "overrides.ctx_size:" in message
    assert "overrides.parallel: must be >= 1" in message
    assert "overrides.colour: unknown field" in message


@pytest.mark.parametrize("raw", [[1, 2], "ctx_size=4096", 4096])
def test_overrides_must_be_an_object(demo_gguf: Path, raw: object) -> None:
    assert refusal(llama(demo_gguf), raw).startswith("overrides: must be a JSON object")


def test_no_overrides_and_nulls_mean_the_manifest_as_it_is(demo_gguf: Path) -> None:
    m = llama(demo_gguf)
    assert parse_overrides(m, None) == LlamaServerOverrides()
    assert parse_overrides(m, {"ctx_size": None}) == LlamaServerOverrides()
    assert parse_overrides(vllm(), {}) == VllmOverrides()


@pytest.mark.parametrize("layers", [0, 99, "auto", "all"])
def test_gpu_layers_are_a_count_or_auto_or_all(demo_gguf: Path, layers: int | str) -> None:
    assert parse_overrides(llama(demo_gguf), {"n_gpu_layers": layers}) == LlamaServerOverrides(
        n_gpu_layers=layers
    )


def test_a_quantized_v_cache_needs_flash_attention(tmp_path: Path) -> None:
    m = llama(gguf_with_heads(tmp_path / "m.gguf", 64))
    assert refusal(m, {"cache_type_v": "q8_0", "flash_attn": "off"}).startswith(
        "overrides.cache_type_v: a quantized V cache (q8_0) needs flash attention, but flash_attn is off"
    )
    # The manifest's own flash attention counts, and so does its own V cache type.
    assert refusal(llama(m.model, args=["-fa", "off"]), {"cache_type_v": "q4_0"}).startswith(
        "overrides.cache_type_v: a quantized V cache (q4_0)"
    )
    assert refusal(llama(m.model, args=["-ctv", "q8_0"]), {"flash_attn": "off"}).startswith(
        "overrides.flash_attn: a quantized V cache (q8_0) needs flash attention"
    )
    # Unquantized types and flash attention on or auto are fine; so is a quantized K cache without it.
    for fine in (
        {"cache_type_v": "bf16", "flash_attn": "off"},
        {"cache_type_v": "f32", "flash_attn": "off"},
        {"cache_type_v": "q8_0", "flash_attn": "on"},
        {"cache_type_v": "q4_0"},
        {"cache_type_k": "q8_0", "flash_attn": "off"},
    ):
        assert parse_overrides(m, fine).given() == fine


def test_a_quantized_cache_whose_blocks_split_the_heads_is_refused(demo_gguf: Path) -> None:
    # The demo model's heads are 16 wide; llama.cpp's quantized caches store blocks of 32.
    assert refusal(llama(demo_gguf), {"cache_type_v": "q8_0"}) == (
        "overrides.cache_type_v: q8_0 stores blocks of 32 values, which do not divide this model's value "
        "head size 16; use f16, bf16 or f32"
    )
    assert refusal(llama(demo_gguf), {"cache_type_k": "iq4_nl", "flash_attn": "on"}).startswith(
        "overrides.cache_type_k: iq4_nl stores blocks of 32 values"
    )
    # Without flash attention llama.cpp runs such a K cache; unquantized types fit any head.
    for fine in (
        {"cache_type_k": "q8_0", "flash_attn": "off"},
        {"cache_type_k": "bf16", "cache_type_v": "f32"},
    ):
        assert parse_overrides(llama(demo_gguf), fine).given() == fine


def test_the_allowed_values_are_those_the_estimate_can_size() -> None:
    assert get_args(LlamaCacheType) == LLAMA_CACHE_TYPES
    assert set(get_args(VllmKvCacheDtype)) == {"auto", *VLLM_KV_DTYPE_BYTES}


# --- apply: the child's argv -----------------------------------------------------------------------


def test_llama_server_overrides_reach_the_argv_once_each(demo_gguf: Path) -> None:
    m = llama(
        demo_gguf,
        ctx_size=2048,
        args=["-c", "1024", "-fa", "on", "--threads", "2", "-ngl", "10", "--draft-max", "2", "-np", "3"],
    )
    overrides = parse_overrides(
        m,
        {
            "ctx_size": 8192,
            "parallel": 2,
            "cache_type_k": "bf16",
            "cache_type_v": "f32",
            "n_gpu_layers": "all",
            "flash_attn": "off",
            "draft_n_max": 4,
            "draft_p_min": 0.5,
        },
    )
    argv = LlamaServerWorker().launch_spec(apply(m, overrides), Endpoint(port=8080), ONE_GPU, KEY).argv
    assert flags_in(argv, "-c", "--ctx-size") == ["8192"]
    assert flags_in(argv, "-np", "--parallel") == ["2"]
    assert flags_in(argv, "-ctk", "--cache-type-k") == ["bf16"]
    assert flags_in(argv, "-ctv", "--cache-type-v") == ["f32"]
    assert flags_in(argv, "-ngl", "--n-gpu-layers", "--gpu-layers") == ["all"]
    assert flags_in(argv, "-fa", "--flash-attn") == ["off"]
    # llama-server refuses the old `--draft-max` now; the override's flag replaces it.
    assert flags_in(argv, "--spec-draft-n-max", "--draft-max", "--draft", "--draft-n") == ["4"]
    assert argv[argv.index("--spec-draft-n-max") + 1] == "4"
    assert flags_in(argv, "--spec-draft-p-min", "--draft-p-min") == ["0.5"]
    assert flags_in(argv, "--threads") == ["2"]  # what the override does not touch stays


def test_a_flag_the_manifest_set_keeps_its_place_and_spelling(demo_gguf: Path) -> None:
    m = llama(demo_gguf, args=["-fa", "on", "--threads", "2"])
    same = apply(m, LlamaServerOverrides(flash_attn="on"))
    assert same.args == m.args
    assert fingerprint(same) == fingerprint(m)  # the same launch, so the same observed figure
    assert apply(m, LlamaServerOverrides(flash_attn="off")).args == ("-fa", "off", "--threads", "2")


def test_no_override_is_the_manifest_itself(demo_gguf: Path) -> None:
    m = llama(demo_gguf, ctx_size=2048, args=["-fa", "on"], vram_mib=100)
    assert apply(m, LlamaServerOverrides()) is m
    assert apply(vllm(), VllmOverrides()) == vllm()


def test_vllm_overrides_reach_the_argv_once_each() -> None:
    m = vllm(
        max_model_len=2048, kv_cache_dtype="auto", speculative={"method": "ngram"}, args=["--swap-space", "1"]
    )
    overrides = parse_overrides(
        m,
        {
            "max_model_len": 8192,
            "kv_cache_dtype": "fp8",
            "kv_cache_memory_bytes": 2 << 30,
            "max_num_seqs": 8,
            "enforce_eager": True,
            "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        },
    )
    argv = VllmWorker().launch_spec(apply(m, overrides), Endpoint(port=8000), ONE_GPU, KEY).argv
    assert flags_in(argv, "--max-model-len") == ["8192"]
    assert flags_in(argv, "--kv-cache-dtype") == ["fp8"]
    assert flags_in(argv, "--kv-cache-memory-bytes") == [str(2 << 30)]
    assert flags_in(argv, "--max-num-seqs") == ["8"]
    assert argv.count("--enforce-eager") == 1
    [speculative] = flags_in(argv, "--speculative-config")
    assert json.loads(speculative) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert argv[-2:] == ["--swap-space", "1"]


def test_overrides_of_the_other_engine_are_a_bug(demo_gguf: Path) -> None:
    with pytest.raises(TypeError):
        apply(llama(demo_gguf), VllmOverrides(max_num_seqs=2))
    with pytest.raises(TypeError):
        apply(vllm(), LlamaServerOverrides(parallel=2))


@pytest.mark.skipif(bundled_binary() is None, reason="no bundled llama-server")
def test_the_bundled_llama_server_knows_every_flag_an_override_sets() -> None:
    binary = bundled_binary()
    assert binary is not None
    result = subprocess.run(
        [str(binary), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"LD_LIBRARY_PATH": str(binary.parent)},
        check=False,
    )
    text = result.stdout + result.stderr
    for flag in ("--ctx-size", "--parallel", "--cache-type-k", "--cache-type-v", "--n-gpu-layers"):
        assert flag in text
    for flag in ("--flash-attn [on|off|auto]", "--spec-draft-n-max", "--spec-draft-p-min"):
        assert flag in text
    assert "'auto', or 'all'" in text  # -ngl's words
    assert f"allowed values: {', '.join(LLAMA_CACHE_TYPES)}" in text


# --- the VRAM estimate -----------------------------------------------------------------------------


def demo_kv_bytes(context: int, bytes_per_value: Fraction = Fraction(2)) -> int:
    head_dim = demo_model.N_EMBD // demo_model.N_HEAD
    return math.ceil(context * demo_model.N_LAYER * demo_model.N_HEAD * 2 * head_dim * bytes_per_value)


def test_the_estimate_grows_with_the_context_override(demo_gguf: Path, observed: ObservedVram) -> None:
    m = llama(demo_gguf, ctx_size=4096)
    before = estimate_vram(m, observed)
    after = estimate_vram(apply(m, LlamaServerOverrides(ctx_size=1_000_000)), observed)
    assert (before.source, after.source) == ("artifacts", "artifacts")
    size = demo_gguf.stat().st_size
    assert after.mib == math.ceil((size * Fraction(11, 10) + demo_kv_bytes(1_000_000)) / MIB)
    assert after.mib > before.mib
    assert "ctx 1000000" in after.detail


def test_the_estimate_counts_the_cache_type_override(demo_gguf: Path, observed: ObservedVram) -> None:
    m = llama(demo_gguf, ctx_size=1_000_000)
    # Not startable on the demo model (see above), but the arithmetic is the one for any model.
    f32 = estimate_vram(apply(m, LlamaServerOverrides(cache_type_k="f32", cache_type_v="f32")), observed)
    q8 = estimate_vram(apply(m, LlamaServerOverrides(cache_type_k="q8_0", cache_type_v="q8_0")), observed)
    size = demo_gguf.stat().st_size
    assert f32.mib == math.ceil((size * Fraction(11, 10) + demo_kv_bytes(1_000_000, Fraction(4))) / MIB)
    assert q8.mib == math.ceil((size * Fraction(11, 10) + demo_kv_bytes(1_000_000, Fraction(34, 32))) / MIB)
    assert f32.detail.endswith(", f32)")
    assert q8.mib < estimate_vram(m, observed).mib < f32.mib


def test_the_fingerprint_follows_what_changes_the_footprint(demo_gguf: Path) -> None:
    m = llama(demo_gguf, ctx_size=4096)
    base = fingerprint(m)
    changed = {
        fingerprint(apply(m, overrides))
        for overrides in (
            LlamaServerOverrides(ctx_size=8192),
            LlamaServerOverrides(parallel=2),
            LlamaServerOverrides(cache_type_k="q8_0"),
            LlamaServerOverrides(n_gpu_layers=0),
            LlamaServerOverrides(flash_attn="off"),
        )
    }
    assert base not in changed
    assert len(changed) == 5
    assert fingerprint(apply(m, LlamaServerOverrides(ctx_size=4096))) == base


def test_a_declared_budget_moves_by_the_kv_cache_difference(demo_gguf: Path, observed: ObservedVram) -> None:
    m = llama(demo_gguf, ctx_size=4096, vram_mib=1000)
    bigger = LlamaServerOverrides(ctx_size=1_000_000)
    delta = math.ceil(Fraction(demo_kv_bytes(1_000_000) - demo_kv_bytes(4096), MIB))
    assert delta == 487
    assert apply(m, bigger).vram_mib == 1000 + delta
    found = estimate(m, bigger, observed)
    assert (found.mib, found.source) == (1000 + delta, "declared")
    assert found.detail == "vram_mib 1000 in the manifest, +487 MiB for the overrides' KV cache"
    # A smaller cache frees its difference, rounded toward keeping memory: 486.x MiB frees 486.
    big = llama(demo_gguf, ctx_size=1_000_000, vram_mib=1000)
    assert apply(big, LlamaServerOverrides(ctx_size=4096)).vram_mib == 1000 - 486


def test_a_declared_budget_stays_when_the_kv_cache_does_not_change_or_cannot_be_told(
    demo_gguf: Path, tmp_path: Path, observed: ObservedVram
) -> None:
    m = llama(demo_gguf, ctx_size=4096, vram_mib=1000)
    for same_cache in (LlamaServerOverrides(flash_attn="on"), LlamaServerOverrides(parallel=8)):
        assert estimate(m, same_cache, observed) == estimate_vram(m, observed)
    absent = llama(tmp_path / "absent.gguf", ctx_size=4096, vram_mib=1000)
    assert apply(absent, LlamaServerOverrides(ctx_size=65536)).vram_mib == 1000


def test_a_vllm_estimate_follows_max_model_len_and_the_kv_dtype(
    tmp_path: Path, observed: ObservedVram
) -> None:
    m = vllm(snapshot(tmp_path / "snap"), max_model_len=2048)
    # 4 layers x 2 KV heads x 32 dims x K and V = 512 values a token, bfloat16.
    assert estimate_vram(m, observed).mib == 13 + 2
    assert estimate_vram(apply(m, VllmOverrides(max_model_len=4096)), observed).mib == 13 + 4
    fp8 = estimate_vram(apply(m, VllmOverrides(max_model_len=4096, kv_cache_dtype="fp8")), observed)
    assert fp8.mib == 13 + 2
    assert "kv_cache_dtype fp8" in fp8.detail
    exact = estimate_vram(apply(m, VllmOverrides(kv_cache_memory_bytes=100 * MIB)), observed)
    assert exact.mib == 13 + 100
    declared = vllm(m.model, max_model_len=2048, vram_mib=500)
    assert apply(declared, VllmOverrides(max_model_len=4096)).vram_mib == 502


# --- what operators see ----------------------------------------------------------------------------


def test_llama_constraints_give_bounds_allowed_values_and_the_manifests_defaults(demo_gguf: Path) -> None:
    schema = load_constraints(llama(demo_gguf, args=["-ctv", "bf16", "-fa", "on"]))
    properties = schema["properties"]
    assert schema["additionalProperties"] is False
    assert properties["ctx_size"]["default"] == demo_model.N_CTX_TRAIN  # the model's own, as -c 0 gives
    assert (properties["ctx_size"]["minimum"], properties["ctx_size"]["maximum"]) == (0, MAX_CONTEXT)
    assert properties["ctx_size"]["anyOf"] == [{"const": 0}, {"minimum": 256}]
    assert properties["parallel"] | {"description": ""} == {
        "type": "integer",
        "minimum": 1,
        "maximum": 256,
        "default": 4,
        "description": "",
    }
    assert properties["cache_type_k"]["enum"] == list(LLAMA_CACHE_TYPES)
    assert (properties["cache_type_k"]["default"], properties["cache_type_v"]["default"]) == ("f16", "bf16")
    assert properties["flash_attn"]["enum"] == ["on", "off", "auto"]
    assert properties["flash_attn"]["default"] == "on"
    assert properties["n_gpu_layers"]["default"] == "auto"
    assert (properties["draft_n_max"]["minimum"], properties["draft_n_max"]["maximum"]) == (1, 16)
    assert (properties["draft_p_min"]["minimum"], properties["draft_p_min"]["maximum"]) == (0, 1)
    assert all("title" not in p and "null" not in json.dumps(p) for p in properties.values())

    assert (
        load_constraints(llama(demo_gguf, ctx_size=2048, parallel=2))["properties"]["ctx_size"]["default"]
        == 2048
    )
    assert load_constraints(llama(demo_gguf, parallel=2))["properties"]["parallel"]["default"] == 2


def test_vllm_constraints_default_to_the_manifest_and_config_json(tmp_path: Path) -> None:
    properties = load_constraints(vllm(snapshot(tmp_path / "snap"), enforce_eager=True))["properties"]
    assert properties["max_model_len"]["default"] == 4096  # max_position_embeddings
    assert properties["max_model_len"]["minimum"] == 16
    assert properties["kv_cache_dtype"]["default"] == "auto"
    assert "fp8" in properties["kv_cache_dtype"]["enum"]
    assert properties["enforce_eager"] == {
        "type": "boolean",
        "default": True,
        "description": "no CUDA graphs: slower, starts faster",
    }
    assert properties["speculative"]["type"] == "object"
    assert load_constraints(vllm(max_model_len=1024))["properties"]["max_model_len"]["default"] == 1024


def test_describe_shows_only_what_is_overridden(demo_gguf: Path) -> None:
    assert describe(None) is None
    assert describe(LlamaServerOverrides()) is None
    assert describe(parse_overrides(llama(demo_gguf), {"ctx_size": 8192, "flash_attn": None})) == {
        "ctx_size": 8192
    }
    assert describe(VllmOverrides(enforce_eager=False, speculative={"method": "ngram"})) == {
        "enforce_eager": False,
        "speculative": {"method": "ngram"},
    }
