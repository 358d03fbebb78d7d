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

import gguf
import structlog

from supervisor.manifests import Manifest

log = structlog.get_logger("estimates")

MIB = 1 << 20

# Engines allocate compute buffers, CUDA context and scratch space beyond the weights; vLLM more so.
GGUF_OVERHEAD = Fraction(11, 10)
SAFETENSORS_OVERHEAD = Fraction(13, 10)
GGUF_KV_BYTES = 2  # llama-server's default cache type is f16

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


def estimate_from_artifacts(path: Path, context_tokens: int | None) -> tuple[int, str] | None:
    """(MiB, detail) from the weights at `path` with a KV cache for `context_tokens`, or None.

    A GGUF file (the first shard of a split one counts all shards) is sized x 1.1 and its KV cache is read
    from the GGUF metadata at f16; a directory of *.safetensors is sized x 1.3 and its KV cache comes from
    config.json. `context_tokens` None or 0 means the model's own trained context, as `-c 0` does for
    llama-server. Weights whose architecture cannot be read give the size-only figure, said so in detail.
    """
    context = context_tokens or None
    if path.is_file():
        return _estimate_gguf(path, context) if is_gguf(path) else None
    if path.is_dir():
        return _estimate_safetensors(path, context)
    return None


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
    context = _context_tokens(manifest)
    found = estimate_from_artifacts(weights, context)
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


def _context_tokens(manifest: Manifest) -> int | None:
    for name in ("ctx_size", "max_model_len"):
        value = _count(getattr(manifest, name, None))
        if value is not None:
            return value
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
    try:
        reader = gguf.GGUFReader(path)
        return {key: field.contents() for key, field in reader.fields.items()}
    except Exception as exc:  # the parser meets arbitrary bytes and has no single error type
        log.warning("gguf_metadata_unreadable", path=str(path), error=str(exc))
        return None


def _estimate_gguf(path: Path, context: int | None) -> tuple[int, str]:
    files = gguf_files(path)
    size = sum(p.stat().st_size for p in files)
    what = f"GGUF {_human(size)}" if len(files) == 1 else f"GGUF {_human(size)} in {len(files)} shards"
    weights = f"{what} x {_overhead(GGUF_OVERHEAD)}"

    meta = _gguf_metadata(path)
    kv = _gguf_kv_cache(meta, context) if meta is not None else "metadata unreadable"
    if isinstance(kv, str):
        return _mib(size, GGUF_OVERHEAD, 0), f"{weights}; KV cache not counted: {kv}"
    kv_bytes, kv_detail = kv
    return _mib(size, GGUF_OVERHEAD, kv_bytes), f"{weights} + KV cache {_human(kv_bytes)} ({kv_detail})"


def _gguf_kv_cache(meta: Mapping[str, Any], context: int | None) -> tuple[int, str] | str:
    """(bytes, detail) of an f16 KV cache for `context` tokens, or why the metadata cannot tell."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        return "no general.architecture"
    layers = _count(meta.get(f"{arch}.block_count"))
    if layers is None:
        return f"architecture {arch!r} without {arch}.block_count"
    context = context or _count(meta.get(f"{arch}.context_length"))
    if context is None:
        return f"no context size, and no {arch}.context_length"

    heads = _per_layer(meta.get(f"{arch}.attention.head_count"), layers)
    raw_kv_heads = meta.get(f"{arch}.attention.head_count_kv")
    kv_heads = heads if raw_kv_heads is None else _per_layer(raw_kv_heads, layers)
    if heads is None or kv_heads is None:
        return f"architecture {arch!r} without usable attention head counts"
    embedding = _count(meta.get(f"{arch}.embedding_length"))
    key_length = _count(meta.get(f"{arch}.attention.key_length"))
    value_length = _count(meta.get(f"{arch}.attention.value_length"))

    # Per layer: KV heads x (key + value dims); a head's dims default to embedding / heads.
    per_token = 0
    dims: set[tuple[int, int]] = set()
    for n_heads, n_kv in zip(heads, kv_heads, strict=True):
        if n_kv == 0:
            continue  # a layer without attention (recurrent, or a hybrid's SSM block) caches nothing here
        default = embedding // n_heads if embedding is not None and n_heads > 0 else None
        k = key_length or default
        v = value_length or default
        if k is None or v is None:
            return f"architecture {arch!r} without {arch}.embedding_length or key/value lengths"
        per_token += n_kv * (k + v)
        dims.add((k, v))

    kv_bytes = context * per_token * GGUF_KV_BYTES
    if len(set(kv_heads)) == 1 and len(dims) == 1:
        (k, v) = dims.pop()
        shape = f"{kv_heads[0]} KV heads x {k if k == v else f'{k}+{v}'} dims"
    else:
        shape = f"{per_token} K+V values per token over the layers"
    return kv_bytes, f"ctx {context}, {layers} layers, {shape}, f16"


def _per_layer(value: Any, layers: int) -> list[int] | None:
    """A GGUF count that is one number for every layer, or an array with one per layer."""
    if (count := _count(value)) is not None:
        return [count] * layers
    if isinstance(value, list) and len(value) == layers and all(isinstance(v, int) and v >= 0 for v in value):
        return [int(v) for v in value]
    return None


# --- safetensors ------------------------------------------------------------------------------------


def _estimate_safetensors(directory: Path, context: int | None) -> tuple[int, str] | None:
    # stat() follows links: a Hugging Face cache snapshot is a directory of symlinks to blobs.
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    size = sum(p.stat().st_size for p in files)
    weights = f"safetensors {_human(size)} in {len(files)} files x {_overhead(SAFETENSORS_OVERHEAD)}"
    kv = _hf_kv_cache(directory / "config.json", context)
    if isinstance(kv, str):
        return _mib(size, SAFETENSORS_OVERHEAD, 0), f"{weights}; KV cache not counted: {kv}"
    kv_bytes, kv_detail = kv
    return (
        _mib(size, SAFETENSORS_OVERHEAD, kv_bytes),
        f"{weights} + KV cache {_human(kv_bytes)} ({kv_detail})",
    )


def _hf_kv_cache(config_path: Path, context: int | None) -> tuple[int, str] | str:
    """(bytes, detail) of the KV cache a Hugging Face config.json implies, or why it cannot tell."""
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
    context = context or _count(section.get("max_position_embeddings"))
    if context is None:
        return "no context size, and no max_position_embeddings in config.json"

    # transformers renamed torch_dtype to dtype; either may sit at the top or in text_config.
    dtype = next(
        (d for s in (section, config) for d in (s.get("torch_dtype"), s.get("dtype")) if isinstance(d, str)),
        None,
    )
    dtype_bytes = _HF_DTYPE_BYTES.get(dtype or "", 2)
    dtype_name = dtype if dtype in _HF_DTYPE_BYTES else f"{dtype or 'no dtype'}, taken as 2 bytes"

    kv_bytes = context * layers * kv_heads * head_dim * 2 * dtype_bytes
    return kv_bytes, f"ctx {context}, {layers} layers, {kv_heads} KV heads x {head_dim} dims, {dtype_name}"
