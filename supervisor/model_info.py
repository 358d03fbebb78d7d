"""What a model is, read from its weights: the facts Ollama's /api/tags, /api/ps and /api/show report.

A GGUF file's header (via the `gguf` package) or a Hugging Face directory's config.json and safetensors
headers give the format, family, parameter count, quantization, chat template and Ollama's `model_info`
keys. Nothing here reads tensor data except the digest, which hashes the whole file once: a file in a
Hugging Face cache is named by its sha256 already (blobs/<sha256>), so only other files are hashed, in a
background thread, and the result is kept by (path, size, mtime) in memory and in state_dir/digests.json.
Everything is cached by the files' (path, size, mtime), so a listing reads each file version once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from supervisor.estimates import gguf_files, is_gguf

log = structlog.get_logger("model_info")

# How long a listing waits for a file's first sha256 before it answers without the digest (the hash goes
# on in the background and the next listing has it).
HASH_WAIT_S = 2.0
_HASH_CHUNK = 4 * 1024 * 1024
# Hashing several multi-GB files at once would only make the disk seek between them.
_HASHING = threading.Semaphore(2)
# GGUF arrays longer than this (token lists, merges, scores) are shown as null, as Ollama's show does.
_MAX_ARRAY = 64
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_HF_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
# safetensors dtype -> bytes per element, for headers whose shape we count.
_ST_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"}

# (kind, size, mtime_ns) of every file that makes up a model: the cache key of what we read from it.
Signature = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ModelInfo:
    """What the weights say about a model; empty fields where they cannot tell."""

    format: str = ""  # "gguf" | "safetensors" | ""
    family: str = ""
    families: tuple[str, ...] = ()
    parameter_count: int | None = None
    quantization_level: str = ""
    model_info: Mapping[str, Any] = field(default_factory=dict)
    template: str = ""
    context_length: int | None = None  # what the model was trained for
    stop: tuple[str, ...] = ()  # end-of-turn tokens, for Ollama's `stop` parameters
    size: int = 0  # bytes on disk
    modified_at: float | None = None  # the weights' mtime, epoch seconds
    digest: str = ""  # sha256 hex; "" while unknown
    path: Path | None = None  # the weights read; None when they are not on this machine
    error: str = ""  # why the weights could not be read, if they could not

    @property
    def parameter_size(self) -> str:
        return human_parameters(self.parameter_count) if self.parameter_count else ""

    def details(self, parent_model: str = "") -> dict[str, Any]:
        """Ollama's `details` object."""
        return {
            "parent_model": parent_model,
            "format": self.format,
            "family": self.family,
            "families": list(self.families) if self.families else None,
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization_level,
        }


def human_parameters(count: int) -> str:
    """A parameter count as Ollama writes it: 7615616512 -> "7.6B", 1234567 -> "1.2M", 8000000000 -> "8B"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            text = f"{count / scale:.1f}"
            return f"{text.removesuffix('.0')}{unit}"
    return str(count)


# --- reading weights (blocking: call in a thread) ---------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The files that make up the model at `path`: a GGUF (every shard), or a directory's top-level files."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return gguf_files(path) if path.is_file() else []


def signature(path: Path) -> Signature | None:
    """(name, size, mtime_ns) of each file of the model at `path`; None when there is nothing there."""
    files = weight_files(path)
    if not files:
        return None
    stats = []
    for file in files:
        st = file.stat()  # follows symlinks: a Hugging Face snapshot links to its blobs
        stats.append((file.name, st.st_size, st.st_mtime_ns))
    return tuple(stats)


def read_weights(path: Path) -> ModelInfo:
    """All but the digest, from a GGUF file or a Hugging Face directory; raises on unreadable weights."""
    files = weight_files(path)
    size = sum(f.stat().st_size for f in files)
    modified = max((f.stat().st_mtime for f in files), default=None)
    if path.is_dir():
        info = _read_hf_directory(path)
    elif is_gguf(path):
        info = _read_gguf(files)
    else:
        raise ValueError(f"{path} is neither a GGUF file nor a directory of safetensors weights")
    return replace(info, size=size, modified_at=modified, path=path)


def _read_gguf(files: list[Path]) -> ModelInfo:
    import gguf  # here, not at the top: it pulls in numpy, ~20 MB that an idle daemon does not need

    reader = gguf.GGUFReader(files[0])
    meta: dict[str, Any] = {}
    arrays: dict[str, Any] = {}
    for key, value in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the container's own header fields, not the model's
        if value.types and value.types[0] == gguf.GGUFValueType.ARRAY:
            count = len(value.data)
            meta[key] = value.contents() if count <= _MAX_ARRAY else None
            arrays[key] = value
        elif value.types and value.types[0] == gguf.GGUFValueType.FLOAT32:
            meta[key] = float(f"{value.contents():.7g}")  # 1e-05, not float32's 9.999999747378752e-06
        else:
            meta[key] = value.contents()
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    for shard in files[1:]:  # split GGUFs: tensors are spread over the shards
        parameters += sum(int(t.n_elements) for t in gguf.GGUFReader(shard).tensors)
    meta["general.parameter_count"] = parameters

    arch = meta.get("general.architecture")
    family = arch if isinstance(arch, str) else ""
    context = meta.get(f"{family}.context_length")
    template = meta.get("tokenizer.chat_template")

    stop: list[str] = []
    tokens = arrays.get("tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = meta.get(key)
        if tokens is not None and isinstance(token_id, int) and 0 <= token_id < len(tokens.data):
            text = tokens.contents(token_id)
            if isinstance(text, str) and text not in stop:
                stop.append(text)
    return ModelInfo(
        format="gguf",
        family=family,
        families=(family,) if family else (),
        parameter_count=parameters or None,
        quantization_level=_gguf_file_type(meta.get("general.file_type")),
        model_info=meta,
        template=template if isinstance(template, str) else "",
        context_length=context if isinstance(context, int) and context > 0 else None,
        stop=tuple(stop),
    )


def _gguf_file_type(value: Any) -> str:
    """general.file_type as Ollama names it: 15 -> "Q4_K_M", 1 -> "F16", 0 -> "F32"."""
    if not isinstance(value, int):
        return ""
    import gguf  # here, not at the top: it pulls in numpy, ~20 MB that an idle daemon does not need

    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_") if name != "GUESSED" else ""


def _read_hf_directory(directory: Path) -> ModelInfo:
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    # Multimodal configs keep the language model's shape under text_config.
    text = config.get("text_config")
    section: dict[str, Any] = text if "num_hidden_layers" not in config and isinstance(text, dict) else config
    family = str(config.get("model_type") or section.get("model_type") or "")
    families = [family] if family else []
    vision = config.get("vision_config")
    if isinstance(vision, dict) and isinstance(vision.get("model_type"), str):
        families.append(vision["model_type"])

    parameters = 0
    dtypes: Counter[str] = Counter()
    for file in sorted(directory.glob("*.safetensors")):
        for dtype, count in _safetensors_counts(file).items():
            dtypes[dtype] += count
            parameters += count

    meta: dict[str, Any] = {"general.architecture": family, "general.parameter_count": parameters or None}
    if isinstance(config.get("architectures"), list):
        meta["general.architectures"] = config["architectures"]
    shape_keys = {
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
        "vocab_size": "vocab_size",
    }
    for ours, theirs in shape_keys.items():
        if section.get(theirs) is not None:
            meta[f"{family or 'model'}.{ours}"] = section[theirs]
    context = section.get("max_position_embeddings")

    tokenizer = _json_object(directory / "tokenizer_config.json")
    template = _hf_chat_template(directory, tokenizer)
    eos = tokenizer.get("eos_token")
    eos_text = eos.get("content") if isinstance(eos, dict) else eos
    return ModelInfo(
        format="safetensors",
        family=family,
        families=tuple(families),
        parameter_count=parameters or None,
        quantization_level=_hf_quantization(config, section, dtypes),
        model_info=meta,
        template=template,
        context_length=context if isinstance(context, int) and context > 0 else None,
        stop=(eos_text,) if isinstance(eos_text, str) and eos_text else (),
    )


def _safetensors_counts(file: Path) -> Counter[str]:
    """Elements per dtype from a safetensors header: 8-byte little-endian length, then a JSON object."""
    with file.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 2 <= length <= 100 * 1024 * 1024:
            raise ValueError(f"{file.name}: not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{file.name}: safetensors header is not a JSON object")
    counts: Counter[str] = Counter()
    for name, tensor in header.items():
        if name == "__metadata__" or not isinstance(tensor, dict):
            continue
        shape = tensor.get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            counts[str(tensor.get("dtype", "?"))] += math.prod(shape)
    return counts


def _hf_quantization(config: dict[str, Any], section: dict[str, Any], dtypes: Counter[str]) -> str:
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("quant_method"), str):
        bits = quant.get("bits") or quant.get("w_bit")
        method = quant["quant_method"].upper()
        return f"{method}-{bits}bit" if isinstance(bits, int) else method
    if dtypes:
        dtype = dtypes.most_common(1)[0][0]
        return dtype if dtype in _ST_DTYPES else ""
    for source in (section, config):
        for key in ("torch_dtype", "dtype"):
            if isinstance(source.get(key), str) and source[key] in _HF_DTYPES:
                return _HF_DTYPES[source[key]]
    return ""


def _hf_chat_template(directory: Path, tokenizer: dict[str, Any]) -> str:
    jinja = directory / "chat_template.jinja"  # where newer transformers keep it
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else ""


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def hf_cache_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a Hub repo in the Hugging Face cache, if it was downloaded; never downloads."""
    # Imported here: it is a large package that only repo-id manifests need.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None


# --- digests -----------------------------------------------------------------------------------------


def blob_digest(file: Path) -> str | None:
    """The sha256 a Hugging Face cache names a file's blob by (snapshots/<rev>/x -> blobs/<sha256>)."""
    target = file.resolve()
    if target.parent.name == "blobs" and _SHA256_HEX.match(target.name):
        return target.name
    return None


def sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with _HASHING, file.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class DigestCache:
    """sha256 of files by (resolved path, size, mtime_ns), in memory and in a JSON file under state_dir."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._known: dict[str, tuple[int, int, str]] = self._load()
        self._hashing: dict[tuple[str, int, int], asyncio.Future[str]] = {}
        self.hashed = 0  # files hashed by this process, for tests and logs

    def _load(self) -> dict[str, tuple[int, int, str]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("digest_cache_unreadable", path=str(self.path), error=str(exc))
            return {}
        known = {}
        for key, value in data.items() if isinstance(data, dict) else ():
            if (
                isinstance(value, list)
                and len(value) == 3
                and isinstance(value[0], int)
                and isinstance(value[1], int)
                and isinstance(value[2], str)
            ):
                known[key] = (value[0], value[1], value[2])
        return known

    async def digest(self, file: Path, wait_s: float) -> str:
        """The file's sha256 hex, or "" when it is still being hashed after `wait_s` seconds."""
        if (named := await asyncio.to_thread(blob_digest, file)) is not None:
            return named
        resolved, st = await asyncio.to_thread(lambda: (str(file.resolve()), file.stat()))
        key = (resolved, st.st_size, st.st_mtime_ns)
        known = self._known.get(resolved)
        if known is not None and known[:2] == key[1:]:
            return known[2]
        future = self._hashing.get(key)
        if future is None:
            future = self._hashing[key] = self._hash_in_background(Path(resolved))
            future.add_done_callback(lambda done: self._hashed(key, done))
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait_s)
        except TimeoutError:
            return ""

    def _hash_in_background(self, file: Path) -> asyncio.Future[str]:
        # A daemon thread, not the default executor: a half-done hash of a 40 GB file must neither hold up
        # the daemon's exit (asyncio.run joins executor threads) nor take an executor thread for minutes.
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()

        def settle(result: str | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                assert result is not None
                future.set_result(result)

        def work() -> None:
            try:
                result: str | None = sha256_file(file)
                error: BaseException | None = None
            except Exception as exc:  # an unreadable file: reported to whoever waits, logged below
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed while we hashed
                loop.call_soon_threadsafe(settle, result, error)

        threading.Thread(target=work, name=f"sha256:{file.name}", daemon=True).start()
        return future

    def _hashed(self, key: tuple[str, int, int], done: asyncio.Future[str]) -> None:
        self._hashing.pop(key, None)
        if done.cancelled():
            return
        if (error := done.exception()) is not None:
            log.warning("digest_failed", path=key[0], error=str(error))
            return
        self.hashed += 1
        self._known[key[0]] = (key[1], key[2], done.result())
        if self.path is not None:
            snapshot = {k: list(v) for k, v in self._known.items()}
            # Persisting is best effort: a lost file only costs hashing again after a restart.
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(_write_json, self.path, snapshot))
            _background.add(task)
            task.add_done_callback(_background.discard)


_background: set[asyncio.Future[Any]] = set()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` atomically (temp file + os.replace); a failure is logged, never raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        log.warning("digest_cache_write_failed", path=str(path), error=str(exc))
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1, sort_keys=True)
        os.replace(temp, path)
    except OSError as exc:
        log.warning("digest_cache_write_failed", path=str(path), error=str(exc))
        with contextlib.suppress(OSError):
            os.unlink(temp)


# --- the catalog ---------------------------------------------------------------------------------------


class ModelCatalog:
    """Reads and caches ModelInfo for weights on this machine; safe to call from many requests at once."""

    def __init__(self, state_dir: Path | None, hash_wait_s: float = HASH_WAIT_S) -> None:
        self.digests = DigestCache(state_dir / "digests.json" if state_dir is not None else None)
        self.hash_wait_s = hash_wait_s
        self._info: dict[Path, tuple[Signature, ModelInfo]] = {}
        self._reading: dict[tuple[Path, Signature], asyncio.Future[ModelInfo]] = {}
        self.reads = 0  # weights read by this catalog (cache misses), for tests

    async def describe(self, weights: Path | None, repo_id: str | None = None) -> ModelInfo:
        """What the weights at `weights` (or the cached snapshot of Hub repo `repo_id`) are.

        Never raises for bad weights: missing ones give an empty ModelInfo, unreadable ones one whose
        `error` says why (logged once per file version).
        """
        if weights is None and repo_id is not None:
            weights = await asyncio.to_thread(hf_cache_snapshot, repo_id)
        if weights is None:
            return ModelInfo()
        try:
            sig = await asyncio.to_thread(signature, weights)
        except OSError as exc:
            return ModelInfo(path=weights, error=str(exc))
        if sig is None:
            return ModelInfo()
        cached = self._info.get(weights)
        if cached is not None and cached[0] == sig:
            info = cached[1]
        else:
            info = await self._shared_read(weights, sig)
        if info.error or info.digest:
            return info
        digest = await self._digest(weights)
        if not digest:
            return info
        info = replace(info, digest=digest)
        if self._info.get(weights, (None,))[0] == sig:
            self._info[weights] = (sig, info)  # later listings answer without a thread hop
        return info

    async def _shared_read(self, weights: Path, sig: Signature) -> ModelInfo:
        """Read the weights once however many requests ask at the same time."""
        key = (weights, sig)
        future = self._reading.get(key)
        if future is None:
            future = asyncio.ensure_future(self._read(weights, sig))
            self._reading[key] = future
            future.add_done_callback(lambda _: self._reading.pop(key, None))
        return await asyncio.shield(future)

    async def _read(self, weights: Path, sig: Signature) -> ModelInfo:
        self.reads += 1
        try:
            info = await asyncio.to_thread(read_weights, weights)
        except Exception as exc:  # gguf and json meet arbitrary bytes and have no single error type
            log.warning("model_info_unreadable", path=str(weights), error=str(exc))
            size = sum(s for _, s, _ in sig)
            modified = max(m for _, _, m in sig) / 1e9
            info = ModelInfo(size=size, modified_at=modified, path=weights, error=str(exc))
        self._info[weights] = (sig, info)
        return info

    async def _digest(self, weights: Path) -> str:
        files, is_dir = await asyncio.to_thread(lambda: (weight_files(weights), weights.is_dir()))
        if len(files) == 1 and not is_dir:
            return await self.digests.digest(files[0], self.hash_wait_s)
        # Several files (a directory, a split GGUF): the digest of their names and digests, like a manifest.
        parts = await asyncio.gather(*(self.digests.digest(f, self.hash_wait_s) for f in files))
        if not all(parts):
            return ""
        lines = "".join(f"{f.name} {d}\n" for f, d in zip(files, parts, strict=True))
        return hashlib.sha256(lines.encode()).hexdigest()


_catalogs: dict[Path | None, ModelCatalog] = {}


def catalog_for(state_dir: Path | None) -> ModelCatalog:
    """The one catalog of a daemon (by its state_dir), so that its caches outlive a request."""
    catalog = _catalogs.get(state_dir)
    if catalog is None:
        catalog = _catalogs[state_dir] = ModelCatalog(state_dir)
    return catalog
