"""Daemon settings from a YAML file, then `LLM_SUPERVISOR_*` environment variables, then CLI flags.

Later sources win. The result is validated once and passed down; nothing reads the environment later.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from supervisor import config_files
from supervisor.cpus import CpuList
from supervisor.manifests import KeepAlive

# A DNS name (letters, digits, hyphens, underscores, dots), or empty: every address, as aiohttp takes it.
_HOST_NAME = re.compile(r"(?:[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?)?")
_LISTS_OF_NAMES = frozenset({"allowed_origins", "allowed_hosts"})  # from the environment: comma-separated
_CLIENT_ONLY = frozenset({"url"})  # LLM_SUPERVISOR_URL: where the client commands find the daemon
ENV_PREFIX = "LLM_SUPERVISOR_"


class DeclaredGpu(BaseModel):
    """A GPU named in the config; simulated where NVML is absent (tests, CPU hosts) so budgets still apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    total_mib: int = Field(gt=0)
    name: str = "simulated GPU"
    shared: bool = Field(
        default=False,
        description="its leases live in Redis (redis_url), shared with other supervisors and GPU services",
    )


MIN_KEY_LENGTH = 16


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=11435, ge=0, le=65535)
    manifests: Path = Path("manifests")
    watch_manifests: bool = Field(
        default=False,
        description="reload when a manifest file changes (polled every 2 s; a ConfigMap's symlink swap "
        "counts), with the same rules as SIGHUP",
    )
    state_dir: Path = Field(default=Path(".state"), description="pid files of children, for orphan reaping")
    gpus: tuple[DeclaredGpu, ...] | None = Field(
        default=None, description="declared GPUs; default: NVML's, else one simulated 24 GiB GPU"
    )
    gpu_margin_mib: int = Field(default=512, ge=0, description="never leased, per GPU")
    vram_release_timeout_s: float = Field(
        default=10.0,
        ge=0,
        description="with NVML, how long a stopped child's memory may take to come back before its lease "
        "is kept as `leaked:<model>` until NVML shows it free",
    )
    default_keep_alive: KeepAlive = 300.0
    max_queue: int = Field(
        default=64,
        ge=0,
        description="requests that may wait, for a load or for a free slot (OLLAMA_MAX_QUEUE)",
    )
    queue_timeout_s: float = Field(
        default=120.0, gt=0, description="longest a request waits before it is served, cold load included"
    )
    max_loaded_models: int | None = Field(
        default=None, ge=1, description="models loaded at once, over all GPUs (OLLAMA_MAX_LOADED_MODELS)"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, description="how long shutdown waits for requests")
    stop_grace_s: float = Field(default=10.0, ge=0, description="SIGTERM to SIGKILL for a child")
    hang_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="a serving child that has requests in flight and uses no CPU for this long is taken "
        "as hung (stopped, or stuck in its driver), stopped and its requests answered; 0: never",
    )
    failure_backoff_s: float = Field(default=1.0, ge=0, description="first retry delay after a failed load")
    failure_backoff_max_s: float = Field(default=60.0, ge=0)
    max_body_mib: int = Field(default=64, gt=0)
    hf_cache: Path | None = Field(
        default=None,
        description="the Hugging Face cache pulls go to; default: huggingface_hub's (HF_HUB_CACHE, HF_HOME)",
    )
    store_dir: Path | None = Field(
        default=None,
        description="records and generated manifests of pulled models; default <state_dir>/store",
    )
    cpus: CpuList | None = Field(
        default=None,
        description='CPUs the daemon\'s own threads run on (its event loop among them), e.g. "0" or '
        '"0-1"; engines keep the CPUs the daemon was started with unless their manifest names its own '
        "`cpus`. Default: not pinned",
    )
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Access control (supervisor/access.py): who may call which route, from where.
    api_keys_file: Path | None = Field(
        default=None,
        description="YAML list of {name, key | key_sha256, role, models, max_priority, max_concurrent}",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="one admin key given directly (env LLM_SUPERVISOR_API_KEY), at least 16 characters",
    )
    allow_unauthenticated: bool = Field(
        default=False, description="listen on a non-loopback address with no key configured"
    )
    metrics_public: bool = Field(default=False, description="any key (not only admin) may scrape /metrics")
    allowed_origins: tuple[str, ...] = Field(
        default=(),
        description="browser Origins allowed besides http://localhost, 127.0.0.1 and [::1]; globs",
    )
    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description="Host names allowed besides localhost, IP addresses and this machine's name, where "
        "Host is checked (a loopback listener, or one without keys); globs",
    )

    # Bounded work for any input.
    max_buffered_mib: int = Field(
        default=256, gt=0, description="request bodies held in memory at once, over all requests"
    )
    client_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="longest a client may take to send its headers or body, or stall reading an answer",
    )
    max_connections: int | None = Field(
        default=None,
        ge=8,
        description="client connections open at once; past it the longest-idle kept-alive one is closed, "
        "or a new one gets 503. Default: half the daemon's open-files limit (a stream needs a second "
        "descriptor for its child), so that its own files and children never run out",
    )
    max_parallel_pulls: int = Field(default=2, ge=1, description="pulls downloading at once; more queue")
    min_free_disk_mib: int = Field(
        default=1024, ge=0, description="a pull must leave this much free on the cache's disk"
    )
    max_images: int = Field(default=8, ge=0, description="images in one Ollama request")

    # The fleet (supervisor/fleet/): node records and shared GPU leases in Redis. No redis_url: none of it.
    redis_url: SecretStr | None = Field(
        default=None, description="redis://[user:password@]host:port/db; unset: a single host, no fleet"
    )
    node_id: str = Field(
        default_factory=socket.gethostname, min_length=1, description="this node's name in the fleet"
    )
    advertise_url: str | None = Field(
        default=None,
        pattern=r"^http://[^/?#\s]+(/[^?#\s]*)?$",
        description="where other nodes reach this one, an http:// URL (nodes talk plain HTTP on a private "
        "network); default http://<host>:<port>",
    )
    fleet_ttl_s: float = Field(
        default=10.0, ge=1.0, description="node records and shared leases expire after this; renewed at 1/3"
    )
    node_key: SecretStr | None = Field(
        default=None,
        description="the key nodes send each other when forwarding a request (with API keys configured), "
        "at least 16 characters",
    )
    external_priority: int | None = Field(
        default=None,
        description="an external lease request of this priority or more may evict idle models of lower "
        "priority from a shared GPU; unset: never",
    )
    shared_gpus: tuple[int, ...] = Field(
        default=(), description="indexes of NVML GPUs whose leases live in Redis (declared GPUs: `shared`)"
    )
    gpu_host: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="the machine a shared GPU is on: its key in Redis is <gpu_host>:<index>",
    )

    def advertised_url(self) -> str:
        """advertise_url, else this listener's address (the host name when it listens on every address)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def shared_gpu_indices(self) -> frozenset[int]:
        """The GPUs whose leases live in Redis: declared `shared: true`, or listed in shared_gpus."""
        declared = {g.index for g in self.gpus or () if g.shared}
        return frozenset(declared | set(self.shared_gpus))

    @field_validator("api_key", "node_key", "redis_url", mode="before")
    @classmethod
    def _without_surrounding_space(cls, value: object) -> object:
        """A key from a file keeps its newline (`openssl rand -hex 24 > api-key.txt`, then a Secret or an
        EnvironmentFile): no client can send one in a header, and every request was a 401. The CLI
        already strips it."""
        return value.strip() if isinstance(value, str) else value

    @field_validator("host")
    @classmethod
    def _host_only(cls, host: str) -> str:
        """An address or a host name, without a port: `0.0.0.0:11435` (written as OLLAMA_HOST is) or
        `[::1]` ended the daemon in a traceback."""
        host = host.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST_NAME.fullmatch(host):
                raise ValueError(
                    f"{host!r} is not an IP address or a host name (a port goes in `port`)"
                ) from None
        return host

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: SecretStr | None) -> SecretStr | None:
        """What redis-py can connect to: else the daemon ended in its traceback at start-up. The error
        names no part of the URL, which may hold the password."""
        if url is None:
            return None
        parts = urlsplit(url.get_secret_value())
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        try:
            parts.port  # noqa: B018 - read for its check: a port that is no number raises
        except ValueError:
            raise ValueError("its port must be a number from 0 to 65535") from None
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("names no host: redis://[user:password@]host:port/db")
        return url

    # Settings that only a restart can change; a SIGHUP reload keeps the old values and says so.
    @field_validator("api_key", "node_key")
    @classmethod
    def _long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        """As a keys file's `key`: a key short enough to guess is no key (and there is no limit on tries)."""
        if key is not None and len(key.get_secret_value()) < MIN_KEY_LENGTH:
            raise ValueError(f"must be at least {MIN_KEY_LENGTH} characters")
        return key

    RESTART_ONLY: ClassVar[tuple[str, ...]] = (
        "host",
        "port",
        "state_dir",
        "gpus",
        "gpu_margin_mib",  # the lease map's capacity is made from it once, with the GPU inventory
        "max_body_mib",
        "hf_cache",
        "store_dir",
        "allow_unauthenticated",
        "max_buffered_mib",
        "client_timeout_s",
        "redis_url",
        "node_id",
        "advertise_url",
        "fleet_ttl_s",
        "node_key",
        "shared_gpus",
        "gpu_host",
        "cpus",  # the daemon pins its threads once, at start
    )


class ConfigError(Exception):
    pass


def load_settings(
    config_file: Path | None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from the file (if any), the environment and explicit overrides, in that order."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}  # where each value came from, for an error: file:line, $VARIABLE
    if config_file is not None:
        try:
            text = config_files.read_text(config_file)
            loaded = yaml.safe_load(text)
            origins = _lines_of_keys(config_file, text)
        except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:  # see keys.read_keys_file
            raise ConfigError(f"{config_file}: {yaml_problem(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{config_file}: the config must be a mapping of settings")
        values.update(loaded or {})
        # Paths in the file are relative to the file, like manifest paths.
        for key in ("manifests", "state_dir", "hf_cache", "store_dir", "api_keys_file"):
            # (`null` is the setting's default, not a file called None beside the config; a value of
            # another type is refused by the validation below, naming its line). `~` and $VARS expand,
            # as in a manifest's paths.
            if isinstance(values.get(key), str):
                path = Path(os.path.expandvars(os.path.expanduser(values[key])))
                values[key] = path if path.is_absolute() else config_file.parent / path
    for key, raw in (os.environ if environ is None else environ).items():
        if key.startswith(ENV_PREFIX):
            name = key.removeprefix(ENV_PREFIX).lower()
            if name in _CLIENT_ONLY:
                continue  # the CLI's client commands read it; exported for them, it stopped `serve`
            # YAML parsing gives numbers, booleans and lists (`[{index: 0, total_mib: 8192}]`) for free.
            origins[name] = f"${key}"
            if name in _LISTS_OF_NAMES and not raw.lstrip().startswith("["):
                # `gpu-box.local,*.example.com`: as YAML, one name was no list and `*` an alias
                values[name] = [part.strip() for part in raw.split(",") if part.strip()]
                continue
            if name in (
                "host",
                "manifests",
                "state_dir",
                "hf_cache",
                "store_dir",
                "api_keys_file",
                "api_key",
                "redis_url",
                "node_id",
                "advertise_url",
                "node_key",
                "gpu_host",
            ):
                values[name] = raw
                continue
            try:
                values[name] = yaml.safe_load(raw)
            except (ValueError, RecursionError, yaml.YAMLError) as exc:
                raise ConfigError(f"{key}: not a valid YAML value: {yaml_problem(exc)}") from None
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    values.update(given)
    origins.update({k: f"--{k.replace('_', '-')}" for k in given})
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_where(origins, e['loc'])}{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc


def _lines_of_keys(config_file: Path, text: str) -> dict[str, str]:
    """Each top-level key of the config file, as `file:line` (a bad value's error names where it is)."""
    node = yaml.compose(text)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {
        str(key.value): f"{config_file}:{key.start_mark.line + 1}"
        for key, _ in node.value
        if isinstance(key, yaml.ScalarNode)
    }


def _where(origins: Mapping[str, str], loc: tuple[Any, ...]) -> str:
    origin = origins.get(str(loc[0])) if loc else None
    return f"{origin}: " if origin is not None else ""


def yaml_problem(exc: BaseException) -> str:
    """What a YAML error says, without the lines of the text that PyYAML quotes under it: a file of
    settings or keys may hold a secret on the very line it would quote. Where it is, and what is wrong."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = "; ".join(part for part in (exc.context, exc.problem) if part)
        return f"invalid YAML{where}: {what or type(exc).__name__}"
    return str(exc)
