"""Runtime load overrides: what an operator may change for one load of a model, validated per engine.

An override lives only as long as the load it came with: an unload, a restart or a reload that restarts
the model drops it. `apply` turns a manifest and its overrides into the manifest the child is launched
from, so that the workers' argv, the VRAM estimate and the observed-VRAM fingerprint all follow it.

Flag names are those of the bundled llama-server (llama.cpp 2026: `--spec-draft-n-max` replaced
`--draft-max`) and of vLLM 0.32. Looking at a GGUF header or config.json (`parse_overrides`,
`load_constraints`, and `apply` for a declared `vram_mib`) reads files: on the event loop, call these
through `asyncio.to_thread`.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import ErrorDetails

from supervisor.errors import SupervisorError, bad_request
from supervisor.estimates import (
    LLAMA_CACHE_TYPE_K,
    LLAMA_CACHE_TYPE_V,
    LLAMA_CTX_SIZE,
    LLAMA_DEFAULT_CACHE_TYPE,
    MIB,
    KvShape,
    LlamaSetting,
    ObservedVram,
    VramEstimate,
    context_tokens,
    estimate_vram,
    kv_cache_bytes,
    kv_shape,
    llama_cache_type_bytes,
)
from supervisor.manifests import LlamaServerManifest, Manifest, VllmManifest, flag_name

MIN_CTX_SIZE = 256
# Far above any model's trained context (the longest are ~10M tokens); only absurd numbers stop here.
MAX_CONTEXT = 1 << 24
MAX_PARALLEL = 256

LlamaCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
FlashAttn = Literal["on", "off", "auto"]
# vLLM 0.32's --kv-cache-dtype choices (vllm.config.cache.CacheDType).
VllmKvCacheDtype = Literal[
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
]

# llama-server settings an override sets through `args`; the first flag is the one appended.
LLAMA_PARALLEL = LlamaSetting(("--parallel", "-np"), "LLAMA_ARG_N_PARALLEL")
LLAMA_N_GPU_LAYERS = LlamaSetting(("--n-gpu-layers", "-ngl", "--gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS")
LLAMA_FLASH_ATTN = LlamaSetting(("--flash-attn", "-fa"), "LLAMA_ARG_FLASH_ATTN")
# Today's llama-server refuses these old spellings with an error; an override replaces them by the new.
_RETIRED_FLAGS = frozenset({"--draft-max", "--draft", "--draft-n"})
LLAMA_DRAFT_N_MAX = LlamaSetting(
    ("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n"), "LLAMA_ARG_SPEC_DRAFT_N_MAX"
)
LLAMA_DRAFT_P_MIN = LlamaSetting(("--spec-draft-p-min", "--draft-p-min"), "LLAMA_ARG_SPEC_DRAFT_P_MIN")
_LLAMA_FLAG_FIELDS = {
    "cache_type_k": LlamaSetting(("--cache-type-k", "-ctk"), LLAMA_CACHE_TYPE_K.env),
    "cache_type_v": LlamaSetting(("--cache-type-v", "-ctv"), LLAMA_CACHE_TYPE_V.env),
    "n_gpu_layers": LLAMA_N_GPU_LAYERS,
    "flash_attn": LLAMA_FLASH_ATTN,
    "draft_n_max": LLAMA_DRAFT_N_MAX,
    "draft_p_min": LLAMA_DRAFT_P_MIN,
}
# What llama-server does when nothing sets them (its --help).
_LLAMA_DEFAULTS: dict[str, Any] = {
    "parallel": 4,  # `-np -1` (auto) gives 4 slots
    "cache_type_k": LLAMA_DEFAULT_CACHE_TYPE,
    "cache_type_v": LLAMA_DEFAULT_CACHE_TYPE,
    "n_gpu_layers": "auto",
    "flash_attn": "auto",
    "draft_n_max": 3,
    "draft_p_min": 0.0,
}


def _ctx_size_gap(value: int) -> int:
    if value != 0 and value < MIN_CTX_SIZE:
        raise ValueError(f"must be >= {MIN_CTX_SIZE}, or 0 for the model's own context")
    return value


def _gpu_layers(value: object) -> int | str:
    if value in ("auto", "all"):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError("must be a number of layers >= 0, 'auto' or 'all'")


CtxSize = Annotated[
    int,
    Field(le=MAX_CONTEXT),
    AfterValidator(_ctx_size_gap),
    WithJsonSchema(
        {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_CONTEXT,
            "anyOf": [{"const": 0}, {"minimum": MIN_CTX_SIZE}],
        }
    ),
]
GpuLayers = Annotated[
    int | str,
    PlainValidator(_gpu_layers),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "enum": ["auto", "all"]}]}
    ),
]


class _Overrides(BaseModel):
    # Strict: "4096" or true is a client's mistake to hear about, not to guess at.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # The fields that change how big the KV cache is: a declared vram_mib follows them.
    KV_FIELDS: ClassVar[frozenset[str]] = frozenset()

    def given(self) -> dict[str, Any]:
        """The fields this override sets (None means: as the manifest says)."""
        return self.model_dump(exclude_none=True)


class LlamaServerOverrides(_Overrides):
    """What one load of a llama-server model may change."""

    # Slots share the one `-c` context, so `parallel` splits the cache without growing it.
    KV_FIELDS: ClassVar[frozenset[str]] = frozenset({"ctx_size", "cache_type_k", "cache_type_v"})

    ctx_size: CtxSize | None = Field(
        default=None, description="total context (-c), shared by the slots; 0: the model's trained context"
    )
    parallel: int | None = Field(default=None, ge=1, le=MAX_PARALLEL, description="server slots (-np)")
    cache_type_k: LlamaCacheType | None = Field(default=None, description="K cache type (-ctk)")
    cache_type_v: LlamaCacheType | None = Field(
        default=None, description="V cache type (-ctv); a quantized one needs flash_attn on or auto"
    )
    n_gpu_layers: GpuLayers | None = Field(default=None, description="layers on the GPU (-ngl)")
    flash_attn: FlashAttn | None = Field(default=None, description="flash attention (-fa)")
    draft_n_max: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="speculative decoding: most tokens drafted (--spec-draft-n-max)",
    )
    draft_p_min: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="speculative decoding: least draft probability (--spec-draft-p-min)",
    )


class VllmOverrides(_Overrides):
    """What one load of a vLLM model may change."""

    KV_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"max_model_len", "kv_cache_dtype", "kv_cache_memory_bytes"}
    )

    max_model_len: int | None = Field(default=None, ge=16, le=MAX_CONTEXT, description="--max-model-len")
    kv_cache_dtype: VllmKvCacheDtype | None = Field(default=None, description="--kv-cache-dtype")
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1, description="KV cache per GPU, exactly (--kv-cache-memory-bytes)"
    )
    max_num_seqs: int | None = Field(default=None, ge=1, description="sequences batched at once")
    enforce_eager: bool | None = Field(default=None, description="no CUDA graphs: slower, starts faster")
    speculative: dict[str, Any] | None = Field(
        default=None, description="--speculative-config, with a `method` or a draft `model`"
    )

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not ({"method", "model"} & value.keys()):
            raise ValueError("needs a `method` (e.g. ngram, eagle, mtp) or a draft `model`")
        return value


Overrides = LlamaServerOverrides | VllmOverrides


def overrides_type(manifest: Manifest) -> type[LlamaServerOverrides] | type[VllmOverrides]:
    return LlamaServerOverrides if isinstance(manifest, LlamaServerManifest) else VllmOverrides


def invalid(message: str) -> SupervisorError:
    return bad_request(message, "invalid_load_request")


# --- validation -------------------------------------------------------------------------------------


def parse_overrides(manifest: Manifest, raw: object) -> Overrides:
    """The overrides a load request's `overrides` object asks for, checked against this model.

    Raises SupervisorError invalid_load_request (400) naming each wrong field, e.g.
    "overrides.ctx_size: must be >= 256, or 0 for the model's own context". None is no override.
    """
    cls = overrides_type(manifest)
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise invalid(f"overrides: must be a JSON object; {_engine(manifest)} accepts {_names(cls)}")
    try:
        overrides = cls.model_validate(raw)
    except ValidationError as exc:
        raise invalid("; ".join(_message(error, cls, manifest) for error in exc.errors())) from None
    if isinstance(overrides, LlamaServerOverrides):
        assert isinstance(manifest, LlamaServerManifest)
        _check_llama_cache(manifest, overrides)
    return overrides


def _engine(manifest: Manifest) -> str:
    return "llama-server" if isinstance(manifest, LlamaServerManifest) else "vllm"


def _names(cls: type[_Overrides]) -> str:
    return ", ".join(cls.model_fields)


def _message(error: ErrorDetails, cls: type[_Overrides], manifest: Manifest) -> str:
    where = ".".join(["overrides", *(str(part) for part in error["loc"])])
    context = error.get("ctx", {})
    kind = error["type"]
    if kind == "extra_forbidden":
        what = f"unknown field; {_engine(manifest)} accepts {_names(cls)}"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        sign = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
        bound = next(iter(context.values()))
        what = (
            f"must be {sign[kind]} {bound:g}" if isinstance(bound, float) else f"must be {sign[kind]} {bound}"
        )
    elif kind == "literal_error":
        what = f"must be one of {context['expected']}"
    elif kind.startswith("int_"):
        what = "must be an integer"
    elif kind.startswith("float_"):
        what = "must be a number"
    elif kind.startswith("bool_"):
        what = "must be true or false"
    elif kind.startswith("dict_"):
        what = "must be an object"
    else:  # our own validators' messages, and whatever pydantic adds later
        what = error["msg"].removeprefix("Value error, ")
    return f"{where}: {what}"


def _check_llama_cache(manifest: LlamaServerManifest, overrides: LlamaServerOverrides) -> None:
    """Refuse cache types llama-server would fail to start with, before anything is unloaded for them."""
    if overrides.cache_type_k is None and overrides.cache_type_v is None and overrides.flash_attn is None:
        return
    flash = overrides.flash_attn or LLAMA_FLASH_ATTN.value_in(manifest) or "auto"
    type_k = overrides.cache_type_k or LLAMA_CACHE_TYPE_K.value_in(manifest) or LLAMA_DEFAULT_CACHE_TYPE
    type_v = overrides.cache_type_v or LLAMA_CACHE_TYPE_V.value_in(manifest) or LLAMA_DEFAULT_CACHE_TYPE
    # "V cache quantization requires flash_attn", says llama.cpp, and exits.
    if flash == "off" and _block(type_v) > 1:
        field = "cache_type_v" if overrides.cache_type_v is not None else "flash_attn"
        raise invalid(
            f"overrides.{field}: a quantized V cache ({type_v}) needs flash attention, but flash_attn is "
            "off; set flash_attn to on or auto, or cache_type_v to f16, bf16 or f32"
        )
    quantized = _block(type_v) > 1 or (_block(type_k) > 1 and flash != "off")
    shape = kv_shape(manifest.model) if quantized else None
    if not isinstance(shape, KvShape):
        return  # nothing quantized, or a header we cannot read: llama-server will judge
    # With flash attention, llama.cpp also refuses a quantized K cache whose blocks split a head.
    checks = [("cache_type_v", type_v, shape.value_sizes, "value")]
    if flash != "off":
        checks.append(("cache_type_k", type_k, shape.key_sizes, "key"))
    for name, cache_type, sizes, kind in checks:
        block = _block(cache_type)
        if any(size % block for size in sizes):
            field = name if getattr(overrides, name) is not None else "flash_attn"
            heads = ", ".join(str(s) for s in sorted(sizes))
            raise invalid(
                f"overrides.{field}: {cache_type} stores blocks of {block} values, which do not divide this "
                f"model's {kind} head size {heads}; use f16, bf16 or f32"
            )


def _block(cache_type: str) -> int:
    found = llama_cache_type_bytes(cache_type)
    return found[0] if found is not None else 1


# --- the schema shown to operators -------------------------------------------------------------------


def load_constraints(manifest: Manifest) -> dict[str, Any]:
    """The JSON schema of the overrides this model's engine accepts: each field's type, minimum,
    maximum or allowed values (enum), and as default what the manifest gives it without an override."""
    cls = overrides_type(manifest)
    schema = cls.model_json_schema()
    defaults = _defaults(manifest)
    properties = {
        name: _tidy(prop) | {"default": defaults.get(name)} for name, prop in schema["properties"].items()
    }
    return {
        "type": "object",
        "description": f"runtime overrides for one load of this {_engine(manifest)} model",
        "properties": properties,
        "additionalProperties": False,
    }


def _tidy(prop: dict[str, Any]) -> dict[str, Any]:
    """A field's schema without pydantic's title and its `null` branch (null just means: no override)."""
    branches: list[dict[str, Any]] = [b for b in prop.get("anyOf", []) if b != {"type": "null"}]
    rest = {k: v for k, v in prop.items() if k not in ("anyOf", "title", "default")}
    if len(branches) == 1:
        return branches[0] | rest
    return ({"anyOf": branches} if branches else {}) | rest


def _defaults(manifest: Manifest) -> dict[str, Any]:
    """What each override field is when no override sets it: the manifest's value, else the engine's."""
    if isinstance(manifest, VllmManifest):
        trained = _trained_context(Path(manifest.model)) if manifest.local_weights() else None
        return {
            "max_model_len": manifest.max_model_len or trained,
            "kv_cache_dtype": manifest.kv_cache_dtype or "auto",
            "kv_cache_memory_bytes": manifest.kv_cache_memory_bytes,
            "max_num_seqs": manifest.max_num_seqs,  # None: vLLM picks one for the GPU
            "enforce_eager": manifest.enforce_eager,
            "speculative": manifest.speculative,
        }
    assert isinstance(manifest, LlamaServerManifest)
    defaults = {
        name: _number(given) if (given := setting.value_in(manifest)) is not None else _LLAMA_DEFAULTS[name]
        for name, setting in _LLAMA_FLAG_FIELDS.items()
    }
    defaults["parallel"] = manifest.slots() or _LLAMA_DEFAULTS["parallel"]
    defaults["ctx_size"] = context_tokens(manifest) or _trained_context(manifest.model) or 0
    return defaults


def _trained_context(path: Path) -> int | None:
    shape = kv_shape(path)
    return shape.trained_context if isinstance(shape, KvShape) else None


def _number(text: str) -> int | float | str:
    """A flag's value as JSON would carry it."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


# --- applying ---------------------------------------------------------------------------------------


def apply(manifest: Manifest, overrides: Overrides) -> Manifest:
    """A copy of `manifest` with `overrides` in effect, validated like any manifest.

    Fields carry what the manifest has fields for (llama-server ctx_size and parallel; every vLLM one);
    the rest become flags in `args`, replacing the manifest's own (so each appears once). A declared
    vram_mib moves by the change in KV cache bytes when the model's metadata can tell them.
    """
    given = overrides.given()
    if not given:
        return manifest
    if isinstance(manifest, LlamaServerManifest):
        if not isinstance(overrides, LlamaServerOverrides):
            raise TypeError(f"vLLM overrides for llama-server model '{manifest.name}'")
        update = _llama_update(manifest, overrides)
    else:
        if not isinstance(overrides, VllmOverrides):
            raise TypeError(f"llama-server overrides for vLLM model '{manifest.name}'")
        update = given
    try:
        applied = type(manifest).model_validate({**manifest.model_dump(), **update})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise invalid(f"overrides: the model's manifest would not hold with them: {problems}") from None
    delta = _vram_delta(manifest, applied, overrides)
    if delta and manifest.vram_mib is not None:
        applied = applied.model_copy(update={"vram_mib": max(1, manifest.vram_mib + delta)})
    return applied


def _llama_update(manifest: LlamaServerManifest, overrides: LlamaServerOverrides) -> dict[str, Any]:
    update: dict[str, Any] = {}
    args = manifest.args
    # Fields win only without the same flag in args, which come last in argv.
    for name, setting in (("ctx_size", LLAMA_CTX_SIZE), ("parallel", LLAMA_PARALLEL)):
        value = getattr(overrides, name)
        if value is not None:
            update[name] = value
            args = _set_flag(args, setting.flags, None)
    for name, setting in _LLAMA_FLAG_FIELDS.items():
        value = getattr(overrides, name)
        if value is not None:
            args = _set_flag(args, setting.flags, str(value))
    update["args"] = args
    return update


def _set_flag(args: tuple[str, ...], flags: tuple[str, ...], value: str | None) -> tuple[str, ...]:
    """`args` with one of `flags` (each takes one value) given once with `value`: in place of the first
    one there, in its spelling unless retired, else appended as `flags[0]`. None removes them all."""
    kept: list[str] = []
    placed = value is None
    position = 0
    while position < len(args):
        if flag_name(args[position]) in flags:
            if not placed:
                flag = args[position] if args[position] not in _RETIRED_FLAGS else flags[0]
                kept += [flag, str(value)]
                placed = True
            position += 2
            continue
        kept.append(args[position])
        position += 1
    if not placed:
        kept += [flags[0], str(value)]
    return tuple(kept)


def _vram_delta(before: Manifest, after: Manifest, overrides: Overrides) -> int:
    """MiB the KV cache grows (or, negative, shrinks) by; 0 when unchanged or when the metadata cannot
    tell. Only computed for a declared vram_mib: other estimates follow the applied manifest by themselves."""
    if before.vram_mib is None or not (overrides.given().keys() & overrides.KV_FIELDS):
        return 0
    old, new = kv_cache_bytes(before), kv_cache_bytes(after)
    if old is None or new is None:
        return 0
    # Rounded up: a shrink frees a little less than it could, a growth reserves all it needs.
    return math.ceil(Fraction(new - old, MIB))


def estimate(manifest: Manifest, overrides: Overrides, observed: ObservedVram) -> VramEstimate:
    """`estimate_vram` of the manifest with `overrides` applied, its detail saying how a declared figure
    moved. Raises VramUnknown as estimate_vram does."""
    applied = apply(manifest, overrides)
    found = estimate_vram(applied, observed)
    if found.source == "declared" and manifest.vram_mib is not None and applied.vram_mib != manifest.vram_mib:
        delta = found.mib - manifest.vram_mib
        moved = f"vram_mib {manifest.vram_mib} in the manifest, {delta:+d} MiB for the overrides' KV cache"
        found = dataclasses.replace(found, detail=moved)
    return found


def describe(overrides: Overrides | None) -> dict[str, Any] | None:
    """The overrides as the admin document's `load_override` shows them: the fields set, or None."""
    if overrides is None:
        return None
    return overrides.model_dump(mode="json", exclude_none=True) or None
