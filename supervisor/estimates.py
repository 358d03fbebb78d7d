"""How much GPU memory a model needs, and where that number comes from.

The scheduler must reserve memory before a child starts, so a figure is needed even for a model that has
never run. In order of trust: what the manifest declares, what the model really took at its last load
(remembered across restarts), and a conservative estimate from the weights on disk plus the KV cache.
The artifact estimate reads files, so callers on the event loop may prefer `asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import structlog

from supervisor.manifests import LlamaServerManifest, Manifest, flag_value_in

log = structlog.get_logger("estimates")

MIB = 1 << 20

# Engines allocate compute buffers, CUDA context and scratch space beyond the weights; vLLM more so.
GGUF_OVERHEAD = Fraction(11, 10)
SAFETENSORS_OVERHEAD = Fraction(13, 10)

# llama-server's KV cache types (--cache-type-k / --cache-type-v); f16 is its default. The quantized ones
# store blocks of 32 values, so a head size must be a multiple of 32 for them.
LLAMA_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
LLAMA_DEFAULT_CACHE_TYPE = "f16"

# Bytes per cached value of vLLM's --kv-cache-dtype choices (0.32); "auto" is the model's dtype. The 4-bit
# and 3-bit formats are approximate: their per-block scales are left out, except NVFP4's 1 byte per 16.
VLLM_KV_DTYPE_BYTES: dict[str, Fraction] = {
    "float16": Fraction(2),
    "bfloat16": Fraction(2),
    "fp8": Fraction(1),
    "fp8_e4m3": Fraction(1),
    "fp8_e5m2": Fraction(1),
    "fp8_inc": Fraction(1),
    "fp8_ds_mla": Fraction(1),
    "fp8_per_token_head": Fraction(1),
    "int8_per_token_head": Fraction(1),
    "turboquant_k8v4": Fraction(3, 4),
    "turboquant_4bit_nc": Fraction(1, 2),
    "turboquant_k3v4_nc": Fraction(7, 16),
    "turboquant_3bit_nc": Fraction(3, 8),
    "ultraquant_4bit": Fraction(1, 2),
    "int4_per_token_head": Fraction(1, 2),
    "nvfp4": Fraction(9, 16),
    "nvfp4_4over6": Fraction(9, 16),
    "nvfp4_ds_mla": Fraction(9, 16),
}

# Manifest fields that change how a model is scheduled or named, never what its child allocates.
# Everything else, including fields added later, counts: a stale fingerprint would under-reserve.
_NOT_MEMORY_FIELDS = frozenset(
    {
        "name",
        "aliases",
        "description",
        "keep_alive",
        "priority",
        "pinned",
        "start_timeout_s",
        "env",
        "vram_mib",
        "max_inflight",  # our queue's limit, not the engine's slots
        "gpus",  # where it may be placed, not how much it takes
    }
)


@dataclass(frozen=True)
class LlamaSetting:
    """How llama-server spells one setting: its flags (each takes one value; the last one given wins) and
    the environment variable it falls back to when no flag is given."""

    flags: tuple[str, ...]
    env: str

    def in_args(self, manifest: LlamaServerManifest) -> str | None:
        """The value the manifest's `args` give this setting, or None."""
        return flag_value_in(manifest.args, self.flags)

    def value_in(self, manifest: LlamaServerManifest) -> str | None:
        """The value the manifest's `args` (else its `env`) give this setting; None when neither does."""
        given = self.in_args(manifest)
        return given if given is not None else manifest.env.get(self.env)


LLAMA_CTX_SIZE = LlamaSetting(("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE")
LLAMA_CACHE_TYPE_K = LlamaSetting(("-ctk", "--cache-type-k"), "LLAMA_ARG_CACHE_TYPE_K")
LLAMA_CACHE_TYPE_V = LlamaSetting(("-ctv", "--cache-type-v"), "LLAMA_ARG_CACHE_TYPE_V")

_GGUF_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_HF_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class VramEstimate:
    mib: int
    source: str  # "declared" | "observed" | "artifacts"
    detail: str  # for logs and `llm-supervisor check`: how the figure was reached


class VramUnknown(Exception):
    """Raised when nothing tells us the size; the message names the manifest field to set (vram_mib)."""


class ObservedVram:
    """MiB a model's child really took at its last load (NVML delta), by fingerprint, kept in a JSON file.

    The file maps fingerprint -> MiB. It is rewritten atomically (temp file + os.replace), so a crash never
    leaves half a file. A missing file is a first start; an unreadable or corrupt one is logged and treated as
    empty, since losing these figures only costs a fallback to the artifact estimate.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mib: dict[str, int] = self._load()

    def get(self, fingerprint: str) -> int | None:
        return self._mib.get(fingerprint)

    def record(self, fingerprint: str, mib: int) -> None:
        """Remember `mib` for `fingerprint` and persist it; a non-positive reading is a measuring glitch."""
        if mib <= 0:
            log.warning("observed_vram_ignored", fingerprint=fingerprint, mib=mib)
            return
        if self._mib.get(fingerprint) == mib:
            return
        self._mib[fingerprint] = mib
        try:
            self._write()
        except OSError as exc:
            # The figure still serves this run; only its memory across restarts is lost.
            log.warning("observed_vram_write_failed", path=str(self.path), error=str(exc))

    def _load(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            log.warning("observed_vram_unreadable", path=str(self.path), error=str(exc))
            return {}
        if not isinstance(data, dict):
            log.warning("observed_vram_unreadable", path=str(self.path), error="not a JSON object")
            return {}
        good = {k: v for k, v in data.items() if _count(v) is not None}
        if len(good) != len(data):
            log.warning("observed_vram_entries_dropped", path=str(self.path), dropped=len(data) - len(good))
        return good

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(self._mib, out, indent=2, sort_keys=True)
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise


def fingerprint(manifest: Manifest) -> str:
    """A short hash of what decides a model's memory use, stable across runs and Python processes.

    It covers every manifest field except name, aliases, description, keep_alive, priority, pinned,
    start_timeout_s, env, vram_mib, max_inflight and gpus: so engine, model path, ctx_size, parallel, args,
    tensor_parallel_size, binary and library_path (another llama-server build may allocate differently),
    and any field added later.
    The weights file's contents are not hashed: replacing a file in place keeps the old figure until the
    next load records a new one.
    """
    launch = manifest.model_dump(mode="json", exclude=set(_NOT_MEMORY_FIELDS))
    text = json.dumps(launch, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class KvCacheSettings:
    """How a launch config stores its KV cache, beyond how many tokens it holds."""

    type_k: str = LLAMA_DEFAULT_CACHE_TYPE  # llama-server --cache-type-k
    type_v: str = LLAMA_DEFAULT_CACHE_TYPE  # llama-server --cache-type-v
    dtype: str | None = None  # vLLM --kv-cache-dtype; None or "auto": the model's own dtype
    exact_bytes: int | None = None  # vLLM --kv-cache-memory-bytes, summed over the model's GPUs


DEFAULT_KV_CACHE = KvCacheSettings()


def kv_cache_settings(manifest: Manifest) -> KvCacheSettings:
    """The KV cache settings `manifest` launches its engine with (llama-server's from its args or env)."""
    if isinstance(manifest, LlamaServerManifest):
        return KvCacheSettings(
            type_k=LLAMA_CACHE_TYPE_K.value_in(manifest) or LLAMA_DEFAULT_CACHE_TYPE,
            type_v=LLAMA_CACHE_TYPE_V.value_in(manifest) or LLAMA_DEFAULT_CACHE_TYPE,
        )
    # Read by name, so that any engine with vLLM's fields gets them counted.
    dtype = getattr(manifest, "kv_cache_dtype", None)
    per_gpu = _count(getattr(manifest, "kv_cache_memory_bytes", None))
    return KvCacheSettings(
        dtype=dtype if isinstance(dtype, str) else None,
        exact_bytes=per_gpu * manifest.tensor_parallel_size if per_gpu is not None else None,
    )


def estimate_from_artifacts(
    path: Path, context_tokens: int | None, kv: KvCacheSettings = DEFAULT_KV_CACHE
) -> tuple[int, str] | None:
    """(MiB, detail) from the weights at `path` with a KV cache for `context_tokens`, or None.

    A GGUF file (the first shard of a split one counts all shards) is sized x 1.1 and its KV cache is read
    from the GGUF metadata, at the cache types `kv` gives (f16 by default); a directory of *.safetensors is
    sized x 1.3 and its KV cache comes from config.json, in `kv.dtype` or else the model's dtype, unless
    `kv.exact_bytes` says its size outright. `context_tokens` None or 0 means the model's own trained
    context, as `-c 0` does for llama-server. Weights whose architecture cannot be read give the size-only
    figure, said so in detail.
    """
    context = context_tokens or None
    if path.is_file():
        return _estimate_gguf(path, context, kv) if is_gguf(path) else None
    if path.is_dir():
        return _estimate_safetensors(path, context, kv)
    return None


def kv_cache_bytes(manifest: Manifest) -> int | None:
    """The bytes of KV cache `manifest`'s launch config implies, or None when its metadata cannot tell.

    The same figure the artifact estimate adds to the weights; it reads the model's metadata.
    """
    kv = kv_cache_settings(manifest)
    if kv.exact_bytes is not None:
        return kv.exact_bytes
    found = _kv_cache(Path(manifest.model), context_tokens(manifest), kv)
    return None if isinstance(found, str) else found[0]


def estimate_vram(manifest: Manifest, observed: ObservedVram) -> VramEstimate:
    """The GPU memory to reserve for `manifest`: declared, else observed at last load, else estimated.

    Raises VramUnknown, naming vram_mib, when none of the three can tell.
    """
    if manifest.vram_mib is not None:
        return VramEstimate(manifest.vram_mib, "declared", "vram_mib in the manifest")
    key = fingerprint(manifest)
    seen = observed.get(key)
    if seen is not None:
        return VramEstimate(seen, "observed", f"taken at its last load (fingerprint {key})")
    # A future engine's `model` may be a directory or a hub id, and its context field `max_model_len`.
    weights = Path(manifest.model)
    context = context_tokens(manifest)
    found = estimate_from_artifacts(weights, context, kv_cache_settings(manifest))
    if found is not None:
        mib, detail = found
        return VramEstimate(mib, "artifacts", detail)
    why = "never loaded, and " + (
        f"{weights} holds no GGUF or safetensors weights to size"
        if weights.exists()
        else f"{weights} does not exist here"
    )
    raise VramUnknown(
        f"model '{manifest.name}': cannot tell how much GPU memory it needs: {why}; "
        "set vram_mib in its manifest"
    )


def context_tokens(manifest: Manifest) -> int | None:
    """The context the engine is told to hold; None for the model's own (trained) context."""
    if isinstance(manifest, LlamaServerManifest):
        # `args` come after the field's `--ctx-size` in argv, and LLAMA_ARG_CTX_SIZE counts when neither
        # is given: llama-server takes the last flag, and the environment only without one.
        given = LLAMA_CTX_SIZE.in_args(manifest)
        if given is None:
            given = (
                str(manifest.ctx_size)
                if manifest.ctx_size is not None
                else manifest.env.get(LLAMA_CTX_SIZE.env)
            )
        return _count(int(given)) if given is not None and given.strip().isdecimal() else None
    # Another engine's field: llama-server's name or vLLM's.
    for name in ("ctx_size", "max_model_len"):
        value = getattr(manifest, name, None)
        if value is not None:
            return _count(value)
    return None


def _count(value: object) -> int | None:
    """`value` if it is a positive int (JSON and GGUF hand us anything, and bool is an int), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _mib(weight_bytes: int, overhead: Fraction, kv_bytes: int) -> int:
    # Exact arithmetic, so that a figure does not drift by one MiB across platforms.
    return math.ceil((weight_bytes * overhead + kv_bytes) / MIB)


def _human(size: int | Fraction) -> str:
    return f"{float(size) / MIB / 1024:.1f} GiB" if size >= 1024 * MIB else f"{float(size) / MIB:.1f} MiB"


def _overhead(factor: Fraction) -> str:
    return f"{float(factor):g}"


# --- the KV cache's shape --------------------------------------------------------------------------


@dataclass(frozen=True)
class KvShape:
    """What a model's metadata says its KV cache holds per token, over all its layers."""

    layers: int
    k_values: int  # key values cached per token, summed over the layers
    v_values: int
    key_sizes: frozenset[int]  # per-head dims: block-quantized cache types need multiples of their block
    value_sizes: frozenset[int]
    heads: str  # for details, e.g. "4 KV heads x 16 dims"
    trained_context: int | None
    trained_context_source: str  # where the trained context is read, for the detail when it is missing
    dtype: str | None = None  # a Hugging Face config's torch dtype; None for GGUF


def kv_shape(path: Path) -> KvShape | str:
    """The KV cache shape of the weights at `path` (GGUF file or Hugging Face directory), or why the
    metadata cannot tell."""
    if path.is_file():
        if not is_gguf(path):
            return "not a GGUF file"
        meta = _gguf_metadata(path)
        return _gguf_kv_shape(meta) if meta is not None else "metadata unreadable"
    if path.is_dir():
        return _hf_kv_shape(path / "config.json")
    return f"{path} does not exist here"


def llama_cache_type_bytes(cache_type: str) -> tuple[int, Fraction] | None:
    """(values per block, bytes per value) of a llama.cpp cache type, from ggml's own table; None when the
    name is not one."""
    import gguf  # here, not at the top: it pulls in numpy, ~20 MB that an idle daemon does not need

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[cache_type.upper()]]
    except KeyError:
        return None
    return block, Fraction(size, block)


def _kv_cache(path: Path, context: int | None, kv: KvCacheSettings) -> tuple[int, str] | str:
    """(bytes, detail) of the KV cache of the weights at `path`, or why the metadata cannot tell."""
    shape = kv_shape(path)
    if isinstance(shape, str):
        return shape
    context = context or shape.trained_context
    if context is None:
        return f"no context size, and no {shape.trained_context_source}"
    where = f"ctx {context}, {shape.layers} layers, {shape.heads}"
    if path.is_file():
        k_type, k_bytes = _llama_type(kv.type_k)
        v_type, v_bytes = _llama_type(kv.type_v)
        kv_bytes = math.ceil(context * (shape.k_values * k_bytes + shape.v_values * v_bytes))
        types = k_type if k_type == v_type else f"K {k_type}, V {v_type}"
        return kv_bytes, f"{where}, {types}"
    dtype_bytes, dtype_name = _hf_kv_dtype(shape.dtype, kv.dtype)
    kv_bytes = math.ceil(context * (shape.k_values + shape.v_values) * dtype_bytes)
    return kv_bytes, f"{where}, {dtype_name}"


def _llama_type(cache_type: str) -> tuple[str, Fraction]:
    found = llama_cache_type_bytes(cache_type)
    if found is None:
        # llama-server refuses a type it does not know, so this estimate is never the one that runs.
        return f"{cache_type} (unknown, taken as f16)", Fraction(2)
    return cache_type, found[1]


def _hf_kv_dtype(model_dtype: str | None, kv_dtype: str | None) -> tuple[Fraction, str]:
    """Bytes per cached value and how to name them: vLLM's kv_cache_dtype, else the model's dtype."""
    if kv_dtype is not None and kv_dtype != "auto":
        if kv_dtype in VLLM_KV_DTYPE_BYTES:
            return VLLM_KV_DTYPE_BYTES[kv_dtype], f"kv_cache_dtype {kv_dtype}"
        kv_note = f"kv_cache_dtype {kv_dtype} unknown, so "
    else:
        kv_note = ""
    if model_dtype in _HF_DTYPE_BYTES:
        return Fraction(_HF_DTYPE_BYTES[model_dtype]), f"{kv_note}{model_dtype}"
    return Fraction(2), f"{kv_note}{model_dtype or 'no dtype'}, taken as 2 bytes"


# --- GGUF -------------------------------------------------------------------------------------------


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_files(path: Path) -> list[Path]:
    """`path`, or every shard of the split GGUF it begins: llama-server loads them all."""
    shard = _GGUF_SHARD.match(path.name)
    if shard is None:
        return [path]
    count = int(shard["count"])
    names = (f"{shard['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
    return [p for p in (path.with_name(n) for n in names) if p.is_file()]


def _gguf_metadata(path: Path) -> dict[str, Any] | None:
    import gguf  # here, not at the top: it pulls in numpy, ~20 MB that an idle daemon does not need

    try:
        reader = gguf.GGUFReader(path)
        return {key: field.contents() for key, field in reader.fields.items()}
    except Exception as exc:  # the parser meets arbitrary bytes and has no single error type
        log.warning("gguf_metadata_unreadable", path=str(path), error=str(exc))
        return None


def _estimate_gguf(path: Path, context: int | None, kv: KvCacheSettings) -> tuple[int, str]:
    files = gguf_files(path)
    size = sum(p.stat().st_size for p in files)
    what = f"GGUF {_human(size)}" if len(files) == 1 else f"GGUF {_human(size)} in {len(files)} shards"
    weights = f"{what} x {_overhead(GGUF_OVERHEAD)}"

    found = _kv_cache(path, context, kv)
    if isinstance(found, str):
        return _mib(size, GGUF_OVERHEAD, 0), f"{weights}; KV cache not counted: {found}"
    kv_bytes, kv_detail = found
    return _mib(size, GGUF_OVERHEAD, kv_bytes), f"{weights} + KV cache {_human(kv_bytes)} ({kv_detail})"


def _gguf_kv_shape(meta: Mapping[str, Any]) -> KvShape | str:
    """The KV cache shape GGUF metadata gives, or why it cannot tell."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        return "no general.architecture"
    layers = _count(meta.get(f"{arch}.block_count"))
    if layers is None:
        return f"architecture {arch!r} without {arch}.block_count"

    heads = _per_layer(meta.get(f"{arch}.attention.head_count"), layers)
    raw_kv_heads = meta.get(f"{arch}.attention.head_count_kv")
    kv_heads = heads if raw_kv_heads is None else _per_layer(raw_kv_heads, layers)
    if heads is None or kv_heads is None:
        return f"architecture {arch!r} without usable attention head counts"
    embedding = _count(meta.get(f"{arch}.embedding_length"))
    key_length = _count(meta.get(f"{arch}.attention.key_length"))
    value_length = _count(meta.get(f"{arch}.attention.value_length"))

    # Per layer: KV heads x (key + value dims); a head's dims default to embedding / heads.
    k_values = v_values = 0
    dims: set[tuple[int, int]] = set()
    for n_heads, n_kv in zip(heads, kv_heads, strict=True):
        if n_kv == 0:
            continue  # a layer without attention (recurrent, or a hybrid's SSM block) caches nothing here
        default = embedding // n_heads if embedding is not None and n_heads > 0 else None
        k = key_length or default
        v = value_length or default
        if k is None or v is None:
            return f"architecture {arch!r} without {arch}.embedding_length or key/value lengths"
        k_values += n_kv * k
        v_values += n_kv * v
        dims.add((k, v))

    if len(set(kv_heads)) == 1 and len(dims) == 1:
        (k, v) = next(iter(dims))
        described = f"{kv_heads[0]} KV heads x {k if k == v else f'{k}+{v}'} dims"
    else:
        described = f"{k_values + v_values} K+V values per token over the layers"
    return KvShape(
        layers=layers,
        k_values=k_values,
        v_values=v_values,
        key_sizes=frozenset(k for k, _ in dims),
        value_sizes=frozenset(v for _, v in dims),
        heads=described,
        trained_context=_count(meta.get(f"{arch}.context_length")),
        trained_context_source=f"{arch}.context_length",
    )


def _per_layer(value: Any, layers: int) -> list[int] | None:
    """A GGUF count that is one number for every layer, or an array with one per layer."""
    if (count := _count(value)) is not None:
        return [count] * layers
    if isinstance(value, list) and len(value) == layers and all(isinstance(v, int) and v >= 0 for v in value):
        return [int(v) for v in value]
    return None


# --- safetensors ------------------------------------------------------------------------------------


def _estimate_safetensors(
    directory: Path, context: int | None, kv: KvCacheSettings
) -> tuple[int, str] | None:
    # stat() follows links: a Hugging Face cache snapshot is a directory of symlinks to blobs.
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    size = sum(p.stat().st_size for p in files)
    weights = f"safetensors {_human(size)} in {len(files)} files x {_overhead(SAFETENSORS_OVERHEAD)}"
    if kv.exact_bytes is not None:
        kv_bytes, kv_detail = kv.exact_bytes, "kv_cache_memory_bytes"
    else:
        found = _kv_cache(directory, context, kv)
        if isinstance(found, str):
            return _mib(size, SAFETENSORS_OVERHEAD, 0), f"{weights}; KV cache not counted: {found}"
        kv_bytes, kv_detail = found
    return (
        _mib(size, SAFETENSORS_OVERHEAD, kv_bytes),
        f"{weights} + KV cache {_human(kv_bytes)} ({kv_detail})",
    )


def _hf_kv_shape(config_path: Path) -> KvShape | str:
    """The KV cache shape a Hugging Face config.json gives, or why it cannot tell."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no config.json"
    except (OSError, ValueError) as exc:
        return f"config.json unreadable: {exc}"
    if not isinstance(config, dict):
        return "config.json is not an object"
    # Multimodal configs keep the language model's shape under text_config.
    text = config.get("text_config")
    section: dict[str, Any] = text if "num_hidden_layers" not in config and isinstance(text, dict) else config

    layers = _count(section.get("num_hidden_layers"))
    heads = _count(section.get("num_attention_heads"))
    kv_heads = _count(section.get("num_key_value_heads")) or heads
    hidden = _count(section.get("hidden_size"))
    head_dim = _count(section.get("head_dim")) or (hidden // heads if hidden and heads else None)
    if layers is None or kv_heads is None or not head_dim:
        return "config.json lacks num_hidden_layers, attention heads or head size"

    # transformers renamed torch_dtype to dtype; either may sit at the top or in text_config.
    dtype = next(
        (d for s in (section, config) for d in (s.get("torch_dtype"), s.get("dtype")) if isinstance(d, str)),
        None,
    )
    values = layers * kv_heads * head_dim
    return KvShape(
        layers=layers,
        k_values=values,
        v_values=values,
        key_sizes=frozenset({head_dim}),
        value_sizes=frozenset({head_dim}),
        heads=f"{kv_heads} KV heads x {head_dim} dims",
        trained_context=_count(section.get("max_position_embeddings")),
        trained_context_source="max_position_embeddings in config.json",
        dtype=dtype,
    )
