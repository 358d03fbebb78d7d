"""The API keys: `api_keys_file` entries, `api_key` and the fleet's `node_key`, kept by their sha256.

supervisor/access.py decides what the caller a key proves may do; this module reads and checks the keys.
"""

from __future__ import annotations

import hashlib
import hmac
import stat
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from supervisor import config_files, secrets
from supervisor.access import Caller, Role
from supervisor.config import Settings, yaml_problem


class KeyEntry(BaseModel):
    """One entry of `api_keys_file`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100)
    key: str | None = Field(default=None, min_length=16, description="the key itself (at least 16 chars)")
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    role: Role = "inference"
    models: tuple[str, ...] = ("*",)
    max_priority: int | None = None
    max_concurrent: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_key(self) -> KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of `key` or `key_sha256`")
        return self

    def digest(self) -> bytes:
        if self.key_sha256 is not None:
            return bytes.fromhex(self.key_sha256)
        assert self.key is not None
        return hashlib.sha256(self.key.encode()).digest()


class KeysFileError(Exception):
    pass


def read_keys_file(path: Path) -> list[KeyEntry]:
    """The entries of an `api_keys_file`; KeysFileError names the file, the entry and the field."""
    try:
        data = yaml.safe_load(config_files.read_text(path))
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:
        # ValueError: also what PyYAML raises for a date that cannot be (2024-02-30); RecursionError:
        # nesting too deep. Neither may end the daemon on a reload.
        raise KeysFileError(f"{path}: cannot read the keys file: {yaml_problem(exc)}") from None
    if isinstance(data, dict) and isinstance(data.get("keys"), list):
        data = data["keys"]
    if not isinstance(data, list):
        raise KeysFileError(f"{path}: the keys file must be a list of {{name, key | key_sha256, role}}")
    entries: list[KeyEntry] = []
    for i, raw in enumerate(data):
        try:
            entries.append(KeyEntry.model_validate(raw))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'entry'}: {e['msg']}" for e in exc.errors()
            )
            raise KeysFileError(f"{path}: entry {i + 1}: {problems}") from None
    names = Counter(e.name for e in entries)
    if dupes := sorted(n for n, count in names.items() if count > 1):
        raise KeysFileError(f"{path}: key names must be unique; repeated: {', '.join(dupes)}")
    _warn_if_readable_by_others(path, entries)
    return entries


def _warn_if_readable_by_others(path: Path, entries: list[KeyEntry]) -> None:
    """Plain keys in a file other local users can read (0644, what an editor or cp gives under umask
    022) are theirs too: said once per read, with the way out."""
    plain = [e.name for e in entries if e.key is not None]
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if plain and mode & (stat.S_IRGRP | stat.S_IROTH):
        structlog.get_logger("access").warning(
            "keys_file_readable_by_others",
            path=str(path),
            mode=oct(stat.S_IMODE(mode)),
            plain_keys=plain,
            fix="chmod 600 the file, or give the keys as key_sha256",
        )


class KeyRing:
    """The configured keys by their sha256, and the callers they prove."""

    def __init__(
        self, entries: Iterable[KeyEntry], direct_admin_key: str | None = None, node_key: str | None = None
    ) -> None:
        self._callers: list[tuple[bytes, Caller]] = []
        for entry in entries:
            if entry.key is not None:
                secrets.remember(entry.key)  # masked should it ever reach a log line
            who = Caller(
                name=entry.name,
                role=entry.role,
                models=entry.models,
                max_priority=entry.max_priority,
                max_concurrent=entry.max_concurrent,
                keys_configured=True,
            )
            self._callers.append((entry.digest(), who))
        if direct_admin_key:
            secrets.remember(direct_admin_key)
            digest = hashlib.sha256(direct_admin_key.encode()).digest()
            self._callers.append((digest, Caller(name="api_key", role="admin", keys_configured=True)))
        if node_key and self._callers:
            # Another node of the fleet forwarding a request it has already checked the client's key for.
            secrets.remember(node_key)
            digest = hashlib.sha256(node_key.encode()).digest()
            node = Caller(name="node", role="inference", keys_configured=True, node=True)
            self._callers.append((digest, node))
        # Whether any key is configured: read on every request (access.py), an attribute for that.
        self.configured = bool(self._callers)

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """Raises KeysFileError when the keys file cannot be used."""
        entries = read_keys_file(settings.api_keys_file) if settings.api_keys_file is not None else []
        direct = settings.api_key.get_secret_value() if settings.api_key is not None else None
        node = settings.node_key.get_secret_value() if settings.node_key is not None else None
        return cls(entries, direct, node)

    def __len__(self) -> int:
        return len(self._callers)

    def identify(self, presented: str) -> Caller | None:
        """The caller whose key this is, comparing digests in constant time (every entry is compared)."""
        # A header's bytes that are not UTF-8 arrive as surrogates (aiohttp's and the front's reading).
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, who in self._callers:
            if hmac.compare_digest(known, digest):
                found = who
        return found
