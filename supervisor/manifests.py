"""Model manifests: the pydantic models, loading a directory of YAML files, and the diff between two loads.

A file holds one model (a mapping) or several (a list of mappings). Every error names the file, the line,
the model and the field, so that `llm-supervisor check` and a refused SIGHUP reload say exactly what to fix.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from supervisor import config_files
from supervisor.cpus import CpuList
from supervisor.durations import parse_keep_alive

KeepAlive = Annotated[
    float,
    BeforeValidator(parse_keep_alive),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"type": "string"}],
            "description": "seconds, or a duration like '5m'; -1 keeps forever, 0 unloads at once",
        }
    ),
]
MODEL_NAME_MAX = 200
ModelName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]*$", max_length=MODEL_NAME_MAX)]
# What a model can do (supervisor/capabilities.py detects it; a manifest may say it instead).
Capability = Literal["completion", "chat", "embedding", "rerank", "vision", "tools", "thinking"]
# A vLLM tool-call or reasoning parser name (`none` turns detection off); vLLM checks that it exists.
ParserName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)]


# Each child gets its own random key from the daemon, which sends it upstream itself; a manifest that set
# one would lock the daemon out (or let in whoever knows it).
_DAEMON_OWNS_THE_KEY = "the daemon gives each child its own key and sends it on every request"
# Where engines read a key from the environment.
ENGINE_KEY_VARIABLES = ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "VLLM_API_KEY")


class ManifestBase(BaseModel):
    """What every engine's manifest has."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Fields that a reload may change on a running model without restarting its child.
    LIVE_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "aliases",
            "description",
            "keep_alive",
            "priority",
            "pinned",
            "max_inflight",
            "max_output_tokens",
            "request_timeout_s",
            "replicas",
            "max_replicas",
            "scale_up_wait_s",
            "capabilities",
            "prompt_cache",
        }
    )

    name: ModelName
    aliases: tuple[ModelName, ...] = ()
    description: str = ""
    args: tuple[str, ...] = Field(default=(), description="extra engine argv, appended last")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the child")
    vram_mib: int | None = Field(default=None, gt=0, description="GPU memory budget; estimated if absent")
    keep_alive: KeepAlive | None = Field(default=None, description="default: the daemon's default_keep_alive")
    start_timeout_s: float = Field(default=120.0, gt=0, description="deadline for the child to become ready")
    priority: int = Field(default=0, description="higher survives eviction longer")
    pinned: bool = Field(default=False, description="never evicted or unloaded for idleness")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs the model is split across, evenly")
    gpus: tuple[int, ...] | None = Field(default=None, description="GPU indices it may be placed on")
    max_inflight: int | None = Field(
        default=None,
        ge=1,
        description="requests passed to the engine at once; more wait in the daemon's priority queue "
        "(default: llama-server's parallel slots and half as many again, vLLM's max_num_seqs)",
    )
    max_output_tokens: int | None = Field(
        default=None,
        ge=1,
        description="caps max_tokens / max_completion_tokens / num_predict, and sets it when absent",
    )
    request_timeout_s: float | None = Field(
        default=None, gt=0, description="a generation running longer is cancelled upstream"
    )
    replicas: int = Field(default=1, ge=1, le=64, description="children started on load, each its own lease")
    max_replicas: int | None = Field(
        default=None, ge=1, le=64, description="started under queue pressure up to this (default: replicas)"
    )
    scale_up_wait_s: float = Field(
        default=2.0, gt=0, description="a request queued this long for a busy model starts one more replica"
    )
    listen: Literal["unix", "tcp"] = Field(
        default="unix",
        description="how the daemon reaches the child: a Unix socket only the daemon's user can open, "
        "cheaper per connection (vLLM checks its key on /v1 routes only: on a port its others, "
        "/invocations among them, are open to any local user); or a loopback port, for an engine built "
        "without Unix sockets (llama-server) or --uds (vLLM)",
    )
    cpus: CpuList | None = Field(
        default=None,
        description='CPUs the engine\'s processes may run on, e.g. "1-7"; default: those the daemon was '
        "started with. Give the engine's own thread count to match (llama-server --threads)",
    )
    capabilities: tuple[Capability, ...] | None = Field(
        default=None,
        min_length=1,
        description="what the model can do, instead of what its weights and flags say; requests that "
        "need another are refused with 400",
    )

    @field_validator("capabilities")
    @classmethod
    def _distinct_capabilities(cls, found: tuple[Capability, ...] | None) -> tuple[Capability, ...] | None:
        return None if found is None else tuple(dict.fromkeys(found))

    @field_validator("env")
    @classmethod
    def _no_engine_key(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            # `A=B` is variable A to exec: LLAMA_API_KEY=k as a name got past the check below.
            if not name or "=" in name:
                raise ValueError(f"env name {name!r} cannot be: a name is not empty and holds no '='")
            _no_nul(name)
            _no_nul(value)
        for name in ENGINE_KEY_VARIABLES:
            if name in env:
                raise ValueError(f"env must not set {name}; {_DAEMON_OWNS_THE_KEY}")
        return env

    @field_validator("args")
    @classmethod
    def _execable_args(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        for arg in args:
            _no_nul(arg)
        return args

    @property
    def replica_limit(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    @model_validator(mode="after")
    def _placement_is_possible(self) -> ManifestBase:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        if self.gpus is not None:
            if len(set(self.gpus)) != len(self.gpus) or any(g < 0 for g in self.gpus):
                raise ValueError(f"gpus must be distinct GPU indices, not {list(self.gpus)}")
            if len(self.gpus) < self.tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size {self.tensor_parallel_size} needs at least that many gpus, "
                    f"but gpus lists {len(self.gpus)}"
                )
        return self

    @property
    def served_name(self) -> str:
        """The name the child knows the model by: vLLM refuses a request's `model` if it is another
        (llama-server ignores it)."""
        return self.name

    def inflight_limit(self) -> int:
        """Requests passed to the engine at once; the rest wait in our priority queue, not the engine's."""
        return self.max_inflight or 1

    def local_weights(self) -> Path | None:
        """Where the weights are on this machine; None when the engine fetches them (a hub repo id)."""
        return None

    def needs_restart_for(self, new: ManifestBase) -> bool:
        """True when `new` changes how the child is launched, not just how it is scheduled."""
        skip = set(self.LIVE_FIELDS)
        return type(self) is not type(new) or self.model_dump(exclude=skip) != new.model_dump(exclude=skip)


def _no_nul(text: str) -> None:
    """exec() takes C strings: an argument, a path or a variable is cut at a NUL byte, so `--api-key\0`
    reached the engine as the `--api-key` the checks here refuse."""
    if "\0" in text:
        raise ValueError("must not hold a NUL byte (exec cuts a string there)")


def _resolve_path(value: Any, info: ValidationInfo) -> Any:
    """Relative paths are relative to the manifest file, as in docker-compose; `~` and $VARS expand."""
    if value is None:
        return None
    if not isinstance(value, str | Path):
        raise ValueError(f"must be a path (a string), not {type(value).__name__}")
    _no_nul(str(value))
    path = Path(os.path.expandvars(os.path.expanduser(str(value))))
    base = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base is not None:
        path = Path(os.path.normpath(Path(base).absolute() / path))
    return path


# Flags the supervisor sets for every llama-server; in `args` they would contradict it.
_LLAMA_OWN_FLAGS = {
    "--api-key": _DAEMON_OWNS_THE_KEY,
    "--api-key-file": _DAEMON_OWNS_THE_KEY,
    "--host": "the supervisor picks where the child listens (see `listen`)",
    "--port": "the supervisor picks where the child listens (see `listen`)",
}


def llama_server_inflight(slots: int) -> int:
    """llama-server's default max_inflight: its slots, and half as many again to wait in its own queue, so
    that a freed slot starts its next request at once, not after a round trip through the daemon's
    queue: at concurrency 32 through 8 slots, 0.72-0.92 of the direct throughput at one request per slot,
    0.87-1.07 at two (README, Performance). A model of one slot keeps strict turns."""
    return slots + slots // 2


class LlamaServerManifest(ManifestBase):
    """A GGUF model served by `llama-server`."""

    engine: Literal["llama-server"]
    model: Path = Field(description="path to the GGUF file")
    ctx_size: int | None = Field(default=None, ge=0, description="total context (-c); shared by the slots")
    parallel: int | None = Field(default=None, ge=1, description="server slots (-np)")
    binary: Path | None = Field(default=None, description="llama-server to run; default: the bundled one")
    library_path: tuple[Path, ...] = Field(default=(), description="prepended to LD_LIBRARY_PATH")
    prompt_cache: bool = Field(
        default=True,
        description="false: no request reuses the prompts others left in llama-server's cache "
        "(`cache_prompt: false` on every request, whatever the client sent), so that callers cannot "
        "learn each other's prompts from it; every prompt is then computed whole",
    )

    def inflight_limit(self) -> int:
        # llama-server's `--parallel -1` (auto) gives 4 slots.
        return self.max_inflight or llama_server_inflight(self.slots() or 4)

    def slots(self) -> int | None:
        """The slots llama-server is told to run: `-np` in `args` (after the field's flag in argv, so it
        wins), the `parallel` field, or LLAMA_ARG_N_PARALLEL; None for its default (auto: 4 slots sharing
        one unified cache)."""
        given: object = flag_value_in(self.args, ("--parallel", "-np"))
        if given is None:
            given = self.parallel if self.parallel is not None else self.env.get("LLAMA_ARG_N_PARALLEL")
        try:
            slots = int(str(given)) if given is not None else 0
        except ValueError:
            return None
        return slots if slots > 0 else None

    def local_weights(self) -> Path:
        return self.model

    @field_validator("model", "binary", mode="before")
    @classmethod
    def _paths(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve_path(value, info)

    @field_validator("args")
    @classmethod
    def _no_own_flags(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        for arg in args:
            flag = flag_name(arg)  # `--api_key` is llama-server's `--api-key` too
            if flag in _LLAMA_OWN_FLAGS:
                raise ValueError(f"args must not set {arg.split('=', 1)[0]}; {_LLAMA_OWN_FLAGS[flag]}")
        return args

    @field_validator("library_path", mode="before")
    @classmethod
    def _library_paths(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str | Path):
            value = [value]
        return [_resolve_path(v, info) for v in value] if isinstance(value, list | tuple) else value


# Flags the supervisor sets from the lease or from a field; in `args` they would contradict it.
_VLLM_OWN_FLAGS = {
    "--host": "the supervisor picks where the child listens (see `listen`)",
    "--port": "the supervisor picks where the child listens (see `listen`)",
    "--uds": "the supervisor picks where the child listens (see `listen`)",
    "--model": "set `model`",
    "--served-model-name": "set `served_model_name`",
    "--gpu-memory-utilization": "it is computed from the model's lease (set `vram_mib`)",
    "--tensor-parallel-size": "set `tensor_parallel_size`",
    "-tp": "set `tensor_parallel_size`",
    "--max-model-len": "set `max_model_len`",
    "--dtype": "set `dtype`",
    "--quantization": "set `quantization`",
    "-q": "set `quantization`",
    "--kv-cache-dtype": "set `kv_cache_dtype`",
    "--kv-cache-memory-bytes": "set `kv_cache_memory_bytes`",
    "--enforce-eager": "set `enforce_eager`",
    "--max-num-seqs": "set `max_num_seqs`",
    "--speculative-config": "set `speculative`",
    "-sc": "set `speculative`",
    "--device-memory-utilization": "it is computed from the model's lease (set `vram_mib`)",
    "--config": "a config file could set any of the flags the supervisor owns; use the manifest's fields",
    "--api-key": _DAEMON_OWNS_THE_KEY,
    "--enable-auto-tool-choice": "set `tool_call_parser` (detected from the model when absent)",
    "--tool-call-parser": "set `tool_call_parser` (detected from the model when absent)",
    "--reasoning-parser": "set `reasoning_parser` (detected from the model when absent)",
}
# Quantized kernels that cannot run in float32 (vLLM 0.32 takes float16 or bfloat16 for them).
_NO_FLOAT32_QUANTIZATION = {"awq", "awq_marlin", "gptq", "gptq_marlin"}


def flag_name(arg: str) -> str:
    """The flag an argument names as both engines' parsers read it: in a long flag `_` is `-`
    (`--api_key` is llama-server's `--api-key`, as `--gpu_memory_utilization` is vLLM's), and a value
    after `=` is not part of it."""
    flag = arg.split("=", 1)[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def flag_value_in(args: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value the last of `flags` in `args` is given (the one llama-server takes), or None. Each takes
    the next argument as its value (llama-server reads no `--flag=value`)."""
    found: str | None = None
    for flag, value in itertools.pairwise(args):
        if flag_name(flag) in flags:
            found = value
    return found


def _vllm_flag(arg: str) -> str:
    """The flag an argument sets as vLLM's parser reads it: `--gpu_memory_utilization=0.9` and
    `--speculative-config.method` both name the flag before the `=` or `.`, with `_` read as `-`."""
    return flag_name(arg).split(".", 1)[0]


def _abbreviated_own_flag(flag: str) -> str | None:
    """The flag of ours that `flag` abbreviates, if any: vLLM's parser (argparse) takes a unique prefix
    of a long option for it, so `--hos 0.0.0.0` set --host."""
    if not flag.startswith("--") or len(flag) < 4:
        return None
    return next((own for own in _VLLM_OWN_FLAGS if own.startswith(flag) and own != flag), None)


class VllmManifest(ManifestBase):
    """A Hugging Face model (a local snapshot directory or a hub repo id) served by `vllm serve`."""

    engine: Literal["vllm"]
    model: str = Field(description="local model directory, or a Hugging Face repo id such as org/name")
    # vLLM's cold start (imports, weights, compile, CUDA graph capture) often takes minutes.
    start_timeout_s: float = Field(default=600.0, gt=0, description="deadline for the child to become ready")
    served_model_name: str | None = Field(default=None, description="the name vLLM serves; default: name")
    max_model_len: int | None = Field(default=None, ge=16, description="context length (--max-model-len)")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = None
    quantization: str | None = Field(default=None, description="e.g. awq, gptq, fp8 (--quantization)")
    kv_cache_dtype: str | None = Field(default=None, description="e.g. fp8, bfloat16 (--kv-cache-dtype)")
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0, description="KV cache size, exactly")
    enforce_eager: bool = Field(default=False, description="no CUDA graphs: slower, starts faster")
    max_num_seqs: int | None = Field(default=None, ge=1, description="sequences batched at once")
    speculative: dict[str, Any] | None = Field(default=None, description="--speculative-config, as a mapping")
    tool_call_parser: ParserName | None = Field(
        default=None,
        description="--tool-call-parser, with --enable-auto-tool-choice; default: detected from the model; "
        "none: no tool calling",
    )
    reasoning_parser: ParserName | None = Field(
        default=None, description="--reasoning-parser; default: detected from the model; none: no parser"
    )
    command: tuple[str, ...] = Field(
        default=("vllm", "serve"),
        min_length=1,
        description="how to start vLLM, e.g. [.venv-vllm/bin/python, -m, vllm.entrypoints.openai.api_server]",
    )

    @field_validator("model", mode="before")
    @classmethod
    def _local_model(cls, value: Any, info: ValidationInfo) -> Any:
        """A path (starting with / . ~ $, or found beside the manifest) becomes absolute; a repo id stays."""
        if not isinstance(value, str):
            return value
        _no_nul(value)
        base = (info.context or {}).get("base_dir")
        beside = Path(base) / value if base is not None else None
        if value.startswith(("/", ".", "~", "$")) or (beside is not None and beside.exists()):
            return str(_resolve_path(value, info))
        return value

    @field_validator("served_model_name", "quantization", "kv_cache_dtype")
    @classmethod
    def _flag_value(cls, value: str | None) -> str | None:
        """Each becomes a flag's value on vLLM's command line."""
        if value is not None:
            _no_nul(value)
        return value

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, value: Any, info: ValidationInfo) -> Any:
        """A relative program path with a slash (`.venv-vllm/bin/python`) is relative to the manifest."""
        if isinstance(value, str):
            value = value.split()
        if isinstance(value, list | tuple):
            for part in value:
                if isinstance(part, str):
                    _no_nul(part)
            if value and isinstance(value[0], str) and "/" in value[0]:
                value = [str(_resolve_path(value[0], info)), *value[1:]]
        return value

    @model_validator(mode="after")
    def _consistent(self) -> VllmManifest:
        for arg in self.args:
            flag = _vllm_flag(arg)
            owned = flag if flag in _VLLM_OWN_FLAGS else _abbreviated_own_flag(flag)
            if owned is not None:
                named = arg.split("=", 1)[0]
                named = named if owned == flag else f"{named} (vLLM reads it as {owned})"
                raise ValueError(f"args must not set {named}; {_VLLM_OWN_FLAGS[owned]}")
        if self.quantization in _NO_FLOAT32_QUANTIZATION and self.dtype in ("float", "float32"):
            raise ValueError(
                f"quantization {self.quantization} runs in float16 or bfloat16, not dtype {self.dtype}; "
                "drop dtype or set it to half or bfloat16"
            )
        if self.speculative is not None and not ({"method", "model"} & self.speculative.keys()):
            raise ValueError("speculative needs a `method` (e.g. ngram, eagle, mtp) or a draft `model`")
        return self

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.name

    def local_weights(self) -> Path | None:
        return Path(self.model) if Path(self.model).is_absolute() else None

    def inflight_limit(self) -> int:
        # vLLM batches up to --max-num-seqs (256 by default) sequences; more wait in its own queue.
        return self.max_inflight or self.max_num_seqs or 256


Manifest = LlamaServerManifest | VllmManifest
ENGINES: dict[str, type[Manifest]] = {"llama-server": LlamaServerManifest, "vllm": VllmManifest}


@dataclass(frozen=True)
class ManifestError:
    """One problem in one manifest file, located as precisely as the YAML allows."""

    file: Path
    line: int | None
    model: str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else str(self.file)
        what = "".join(
            [f" model '{self.model}'" if self.model else "", f" field '{self.field}'" if self.field else ""]
        )
        return f"{where}:{what}: {self.message}" if what else f"{where}: {self.message}"


class ManifestLoadError(Exception):
    def __init__(self, errors: list[ManifestError]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


@dataclass(frozen=True)
class Registry:
    """The models the daemon serves, by name, and the aliases that point at them."""

    models: Mapping[str, Manifest] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    sources: Mapping[str, Path] = field(default_factory=dict)

    def resolve(self, requested: str) -> Manifest | None:
        """The manifest a client's `model` field names, by name or alias (Ollama's `:latest` tag optional),
        in any case when no name matches exactly (as Ollama matches names: `hf.co/Org/Repo` is often
        retyped in lower case)."""
        found = self._exactly(requested)
        if found is None:
            key = requested.casefold()
            name = self._folded.get(key) or self._folded.get(key.removesuffix(":latest"))
            found = None if name is None else self._exactly(name)
        return found

    def _exactly(self, requested: str) -> Manifest | None:
        found = self.models.get(self.aliases.get(requested, requested))
        if found is None and requested.endswith(":latest"):
            bare = requested.removesuffix(":latest")
            found = self.models.get(self.aliases.get(bare, bare))
        return found

    @cached_property
    def _folded(self) -> dict[str, str]:
        """Every name and alias by its case-folded form; a form that names two models matches neither.
        Names of one model may share a form (a pulled `hf.co/Org/Repo` also answers to the lower-case
        name it was pulled by)."""
        folded: dict[str, str] = {}
        shared: set[str] = set()
        for name in (*self.models, *self.aliases):
            key = name.casefold()
            if key in folded and self.aliases.get(folded[key], folded[key]) != self.aliases.get(name, name):
                shared.add(key)
            folded[key] = name
        return {key: name for key, name in folded.items() if key not in shared}


def ollama_name(name: str) -> str:
    """A model's name as Ollama lists it, always with a tag: `demo` is `demo:latest`. Clients such as
    Open WebUI add `:latest` to a name without a tag before they look it up in the list."""
    return name if ":" in name else f"{name}:latest"


def _owner(name: str, models: Mapping[str, Manifest], aliases: Mapping[str, str]) -> str | None:
    """The model that already holds `name`, in any of its spellings: `foo` and `foo:latest` are one name
    to Ollama's clients (/api/tags listed `foo:latest` twice, both served by one of the two)."""
    for form in (name, name.removesuffix(":latest"), ollama_name(name)):
        if form in models:
            return form
        if form in aliases:
            return aliases[form]
    return None


def with_stored(registry: Registry, stored: Iterable[tuple[Manifest, Path, Sequence[str]]]) -> Registry:
    """`registry` (the manifest files) plus models from the model store, each with the names it answers to
    (its canonical name first). A manifest file wins: a stored model whose name or canonical name a
    manifest file already uses is left out, and so is any other name of it that is taken."""
    models, aliases, sources = dict(registry.models), dict(registry.aliases), dict(registry.sources)
    for manifest, source, names in stored:
        if any(_owner(n, models, aliases) is not None for n in (manifest.name, *names[:1])):
            continue
        models[manifest.name] = manifest
        sources[manifest.name] = source
        for alias in names:
            if alias != manifest.name and _owner(alias, models, aliases) is None:
                aliases[alias] = manifest.name
    return Registry(models=models, aliases=aliases, sources=sources)


@dataclass(frozen=True)
class ManifestDiff:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    restarted: tuple[str, ...]  # launch config changed: drain, stop, start again on next use
    updated: tuple[str, ...]  # only live fields changed: applied in place


def diff(old: Registry, new: Registry) -> ManifestDiff:
    kept = old.models.keys() & new.models.keys()
    changed = [n for n in sorted(kept) if old.models[n] != new.models[n]]
    return ManifestDiff(
        added=tuple(sorted(new.models.keys() - old.models.keys())),
        removed=tuple(sorted(old.models.keys() - new.models.keys())),
        restarted=tuple(n for n in changed if old.models[n].needs_restart_for(new.models[n])),
        updated=tuple(n for n in changed if not old.models[n].needs_restart_for(new.models[n])),
    )


def load_directory(directory: Path) -> Registry:
    """Load every `*.yaml` / `*.yml` file in `directory`. Raises ManifestLoadError listing every problem."""
    if not directory.is_dir():
        # `check` takes one file too; `serve` said "not found" of a file that was there.
        why = (
            "is a file, not a directory of manifests"
            if directory.exists()
            else "manifest directory not found"
        )
        raise ManifestLoadError([ManifestError(directory, None, None, None, why)])
    # A link whose target is gone is listed too: read, it is an error naming the file, where leaving it
    # out made a reload remove its models.
    files = sorted(p for p in directory.iterdir() if is_manifest_name(p.name) and not p.is_dir())
    return load_files(files)


def is_manifest_name(name: str) -> bool:
    """A file of the manifests directory that is read as one (and watched): `*.yaml` or `*.yml`, not
    hidden. An editor's lock (Emacs' `.#demo.yaml`, a dangling link) refused every reload while a
    buffer had unsaved changes."""
    return name.endswith((".yaml", ".yml")) and not name.startswith(".")


def load_files(files: Iterable[Path]) -> Registry:
    errors: list[ManifestError] = []
    models: dict[str, Manifest] = {}
    sources: dict[str, Path] = {}
    aliases: dict[str, str] = {}
    for path in files:
        for manifest, node in _load_file(path, errors):
            _register(manifest, path, node, models, sources, aliases, errors)
    if errors:
        raise ManifestLoadError(errors)
    return Registry(models=models, aliases=aliases, sources=sources)


def _register(
    manifest: Manifest,
    path: Path,
    node: yaml.Node | None,
    models: dict[str, Manifest],
    sources: dict[str, Path],
    aliases: dict[str, str],
    errors: list[ManifestError],
) -> None:
    for taken in (manifest.name, *manifest.aliases):
        owner = _owner(taken, models, aliases)
        if owner is not None:
            field = "name" if taken == manifest.name else "aliases"
            errors.append(
                ManifestError(
                    path,
                    _line_of(node, (field,)),
                    manifest.name,
                    None,
                    f"name '{taken}' is already used by model '{owner}' in {sources[owner]}",
                )
            )
            return
    models[manifest.name] = manifest
    sources[manifest.name] = path
    for alias in manifest.aliases:
        aliases[alias] = manifest.name


def _load_file(path: Path, errors: list[ManifestError]) -> list[tuple[Manifest, yaml.Node | None]]:
    """The file's valid manifests, each with its YAML node (for the lines of later errors)."""
    try:
        text = config_files.read_text(path)
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            # Before the document is built: PyYAML's merge keys (`<<: *base`) put the merged fields into
            # the node itself, and a field the entry overrides then looked given twice.
            twice = {id(node): _keys_given_twice(node) for node in _entry_nodes(root)}
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        errors.append(ManifestError(path, line, None, None, f"invalid YAML: {exc.problem or exc}"))
        return []
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:  # see keys.read_keys_file
        errors.append(ManifestError(path, None, None, None, f"cannot read: {exc}"))
        return []

    if data is None:
        return []  # an empty file, or one that is all comments
    entries: list[tuple[Any, yaml.Node | None]]
    if isinstance(data, list) and isinstance(root, yaml.SequenceNode):
        entries = list(zip(data, root.value, strict=True))
    else:
        entries = [(data, root)]

    manifests: list[tuple[Manifest, yaml.Node | None]] = []
    for entry, node in entries:
        line = node.start_mark.line + 1 if node is not None else None
        if not isinstance(entry, dict):
            errors.append(ManifestError(path, line, None, None, "a manifest must be a mapping of fields"))
            continue
        name = entry.get("name") if isinstance(entry.get("name"), str) else None
        if node is not None and (repeated := twice.get(id(node))):
            # YAML keeps the last of two equal keys without a word: `name` or `ctx_size` silently changed.
            for field, at in repeated:
                errors.append(ManifestError(path, at, name, field, "given twice; give each field once"))
            continue
        engine = entry.get("engine")
        cls = ENGINES.get(engine) if isinstance(engine, str) else None
        if cls is None:
            known = ", ".join(sorted(ENGINES))
            errors.append(
                ManifestError(
                    path,
                    _line_of(node, ("engine",)) or line,
                    name,
                    "engine",
                    f"unknown engine {engine!r}; known engines: {known}"
                    if engine is not None
                    else f"`engine` is missing; known engines: {known}",
                )
            )
            continue
        try:
            manifests.append((cls.model_validate(entry, context={"base_dir": path.parent}), node))
        except ValidationError as exc:
            for err in exc.errors():
                loc = tuple(err["loc"])
                errors.append(
                    ManifestError(
                        path,
                        _line_of(node, loc) or line,
                        name,
                        ".".join(str(p) for p in loc) or None,
                        err["msg"],
                    )
                )
    return manifests


def _entry_nodes(root: yaml.Node | None) -> list[yaml.Node]:
    """The nodes of a file's manifests: its items when it is a list, else the file's one node."""
    if isinstance(root, yaml.SequenceNode):
        return list(root.value)
    return [] if root is None else [root]


def _keys_given_twice(node: yaml.Node, path: str = "") -> list[tuple[str, int]]:
    """Each key that a mapping in `node` gives again (its dotted path, the 1-based line of the repeat)."""
    found: list[tuple[str, int]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue  # a complex key (no field of a manifest), or a merge: its fields may be overridden
            field = f"{path}.{key.value}" if path else str(key.value)
            if key.value in seen:
                found.append((field, key.start_mark.line + 1))
            seen.add(key.value)
            found += _keys_given_twice(value, field)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found += _keys_given_twice(item, f"{path}.{index}")
    return found


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at `loc` (a pydantic error location), or of its nearest parent."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == part:
                    # For an unknown key, point at the key; for a bad value, at the value.
                    node = value
                    line = key.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def json_schema() -> dict[str, Any]:
    """JSON schema of one manifest, for editors (a file may also hold a list of them)."""
    one = {"oneOf": [cls.model_json_schema() for cls in ENGINES.values()]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "llm-supervisor manifest",
        "anyOf": [one, {"type": "array", "items": one}],
    }
