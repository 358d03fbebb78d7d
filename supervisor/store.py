"""The local model store: models pulled from the Hugging Face hub into the Hugging Face cache.

The weights live in the ordinary HF cache (`models--org--name/snapshots/<commit>/...`), so other tools
share them. What the daemon pulled is recorded in its own directory (default `<state_dir>/store`): per
model a JSON record (which files, digests, when, and which of them the daemon downloaded itself rather
than adopted from the cache) and a generated manifest YAML that the registry loads next to the manifest
files (a manifest file's model of the same name wins), plus a ledger of the refs the daemon wrote.

The daemon owns only what it put there: deleting a model removes its record and manifest, and of its
files only those it downloaded that no configured model, no other record and no other snapshot uses.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog
import yaml
from filelock import FileLock, Timeout
from pydantic import TypeAdapter, ValidationError

from supervisor import errors
from supervisor.errors import SupervisorError
from supervisor.manifests import (
    MODEL_NAME_MAX,
    Manifest,
    ManifestLoadError,
    ModelName,
    Registry,
    VllmManifest,
    load_files,
    with_stored,
)

if TYPE_CHECKING:
    from supervisor.config import Settings
    from supervisor.scheduler import Scheduler

log = structlog.get_logger("store")

Format = Literal["gguf", "safetensors"]
# Tried in order when a GGUF pull names no quant (Ollama's default is Q4_K_M).
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q8_0", "Q6_K", "Q5_0")
# Context given to a pulled GGUF's llama-server: the model's own (often 128k) would take a lot of memory.
PULLED_CTX_SIZE = 4096

_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=[-_.]|$)")
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# What follows the blob's id in the name of huggingface_hub's partial download of it.
_PARTIAL = re.compile(r"(?:\.[0-9a-f]+)?\.incomplete")
# What vLLM needs of a safetensors repo, besides the weights; only files at the repo's root.
_SAFETENSORS_EXTRAS = re.compile(
    r"^(?:[^/]+\.json|tokenizer\.model|[^/]+\.tiktoken|merges\.txt|vocab\.txt|[^/]+\.jinja)$"
)
_MODEL_NAME: TypeAdapter[str] = TypeAdapter(ModelName)
_REFS_LEDGER = "refs.ledger"  # in the records directory: which refs of the cache the daemon wrote


@dataclass(frozen=True)
class ModelRef:
    """What a client asked to pull: a hub repo and an optional tag (a GGUF quant such as Q4_K_M)."""

    repo: str
    tag: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        """Accepts `hf.co/org/repo:TAG`, `huggingface.co/org/repo`, `org/repo:TAG`, `org/repo` (any case)."""
        raw = text.strip()
        rest = re.sub(r"(?i)^(?:https?://)?(?:hf\.co|huggingface\.co)/", "", raw)
        repo, _, tag = rest.partition(":")
        bad = errors.bad_request(
            f"'{text[:200]}' is not a Hugging Face model reference; "
            "use hf.co/org/repo or hf.co/org/repo:QUANT"
        )
        if not _REPO.match(repo) or (tag and (not _TAG.match(tag) or len(tag) > 100)):
            raise bad
        # Imported here: huggingface_hub.utils costs ~14 MB that a daemon which never pulls does not need.
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils._validators import validate_repo_id

        try:
            validate_repo_id(repo)  # the hub's own rules (length, `--`, `..`): refused here, not as a 502
        except HFValidationError:
            raise bad from None
        ref = cls(repo=repo, tag=None if tag.lower() in ("", "latest") else tag)
        _refuse_long_name(canonical_name(ref.repo, ref.tag))
        return ref

    @property
    def key(self) -> str:
        """One spelling per model, so that two pulls of it share one download: the hub's repo ids are
        case-insensitive (so the key is case-folded) and quant tags are upper-case."""
        return fold(f"hf.co/{self.repo}") + (f":{self.tag.upper()}" if self.tag else "")


def fold(name: str) -> str:
    """A model or repo name as compared: the hub matches repo ids in any case."""
    return name.casefold()


def is_repo_id(text: str) -> bool:
    """`text` is a hub repo id as such (`org/repo`: no prefix, no tag)."""
    try:
        return ModelRef.parse(text).repo == text
    except SupervisorError:
        return False


def is_commit(text: str) -> bool:
    """`text` is a commit id as the cache names a snapshot: 40 hex digits."""
    return _HEX40.fullmatch(text) is not None


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str | None  # the LFS oid, when the hub gave one
    blob_id: str = ""  # the git oid: the cache's name for a file that is not in LFS

    @property
    def etag(self) -> str:
        """The cache's name for the file's blob (`blobs/<etag>`): its LFS sha256, else its git blob id."""
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class PullPlan:
    """Which files of a repo make the model, and what it will be called."""

    ref: ModelRef
    format: Format
    quant: str | None
    files: tuple[RepoFile, ...]
    weights: str  # the file llama-server is given (first shard), or "" for a safetensors directory

    @property
    def name(self) -> str:
        return canonical_name(self.ref.repo, self.quant)


def canonical_name(repo: str, quant: str | None) -> str:
    return f"hf.co/{repo}" + (f":{quant}" if quant else "")


def _refuse_long_name(name: str) -> None:
    """A 400 for a pull whose model would be named past what a model name may be: the hub allows repo
    ids of 96 + 96 characters, and such a pull said `success` of a model never served."""
    if len(name) > MODEL_NAME_MAX:
        raise errors.bad_request(
            f"'{name[:60]}...' would name a model of {len(name)} characters; "
            f"a name has at most {MODEL_NAME_MAX}"
        )


def quant_of(filename: str) -> str | None:
    """The quant tag in a GGUF file name (`Llama-3.2-1B-Instruct-Q4_K_M.gguf` -> `Q4_K_M`), upper-case."""
    stem = _SHARD.sub("", Path(filename).name)
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def safe_repo_path(path: str) -> bool:
    """A relative path inside a repo: not absolute, no `..` (or empty, `.`) part, no backslash."""
    parts = path.split("/")
    return bool(path) and "\\" not in path and not path.startswith("/") and not ({"", ".", ".."} & set(parts))


def _ggufs(files: Sequence[RepoFile]) -> list[RepoFile]:
    """The GGUF files a model can start from: no vision projectors, and of a split model its first shard."""
    found = []
    for f in files:
        lower = f.path.lower()
        if not lower.endswith(".gguf") or "mmproj" in lower:
            continue
        shard = _SHARD.search(f.path)
        if shard is None or int(shard.group(1)) == 1:
            found.append(f)
    return found


def plan_pull(ref: ModelRef, files: Sequence[RepoFile]) -> PullPlan:
    """Choose the files to download: a GGUF matching the tag (default Q4_K_M, else the only/first), or a
    safetensors model (config.json and *.safetensors at the repo's root). Raises a SupervisorError that
    lists the quants there are when none matches, and one when a chosen file's path is not a safe relative
    path (nothing is downloaded then)."""
    plan = _choose(ref, files)
    _refuse_long_name(plan.name)  # with the quant chosen from the files
    unsafe = [f.path for f in plan.files if not safe_repo_path(f.path)]
    if unsafe:
        raise SupervisorError(
            "hub_error", f"hf.co/{ref.repo}: the hub listed files with unsafe paths: {unsafe}", 502
        )
    # The cache names a blob by its id (blobs/<id>): anything but a hex id could name another path.
    unnamed = [f.path for f in plan.files if not valid_ids(f)]
    if unnamed:
        raise SupervisorError(
            "hub_error", f"hf.co/{ref.repo}: the hub listed files without a valid hash: {unnamed}", 502
        )
    # The disk check counts the listed sizes, one per blob: a size below zero, or one blob listed with
    # two sizes (the smaller counted), let a pull write past min_free_disk_mib before anything failed.
    sizes: dict[str, int] = {}
    for f in plan.files:
        if f.size < 0 or sizes.setdefault(f.etag, f.size) != f.size:
            raise SupervisorError(
                "hub_error", f"hf.co/{ref.repo}: the hub listed {f.path} with a size that cannot be", 502
            )
    return plan


def valid_ids(f: RepoFile) -> bool:
    """An LFS file has a sha256 of 64 hex digits, any other a git blob id of 40."""
    blob_id_ok = _HEX40.fullmatch(f.blob_id) is not None
    if f.sha256 is not None:
        return _HEX64.fullmatch(f.sha256) is not None and (blob_id_ok or not f.blob_id)
    return blob_id_ok


def _choose(ref: ModelRef, files: Sequence[RepoFile]) -> PullPlan:
    candidates = sorted(_ggufs(files), key=lambda f: f.path)
    if candidates:
        by_quant: dict[str, RepoFile] = {}
        for f in candidates:
            by_quant.setdefault(quant_of(f.path) or "", f)
        available = sorted(q for q in by_quant if q)
        chosen: RepoFile | None = None
        if ref.tag is not None:
            chosen = by_quant.get(ref.tag.upper()) or next(
                (f for f in candidates if ref.tag.lower() in Path(f.path).name.lower()), None
            )
            if chosen is None:
                raise SupervisorError(
                    "quant_not_found",
                    f"hf.co/{ref.repo} has no GGUF file for '{ref.tag}'; available quants: "
                    + (", ".join(available) or "none named"),
                    404,
                )
        else:
            chosen = next((by_quant[q] for q in DEFAULT_QUANTS if q in by_quant), candidates[0])
        shards = [chosen]
        if (split := _SHARD.search(chosen.path)) is not None:
            shards = sorted((f for f in files if _same_split(f.path, chosen.path)), key=lambda f: f.path)
            _check_shards(ref, chosen.path, int(split.group(2)), shards)
        return PullPlan(ref, "gguf", quant_of(chosen.path), tuple(shards), chosen.path)
    weights = [f for f in files if "/" not in f.path and f.path.endswith(".safetensors")]
    if weights and any(f.path == "config.json" for f in files):
        if ref.tag is not None:
            raise SupervisorError(
                "quant_not_found",
                f"hf.co/{ref.repo} has no GGUF files, so no quant '{ref.tag}'; "
                f"pull hf.co/{ref.repo} for its safetensors weights",
                404,
            )
        extras = [f for f in files if _SAFETENSORS_EXTRAS.match(f.path)]
        chosen_files = tuple(sorted({*weights, *extras}, key=lambda f: f.path))
        return PullPlan(ref, "safetensors", None, chosen_files, "")
    raise SupervisorError(
        "no_weights",
        f"hf.co/{ref.repo} has neither GGUF files nor safetensors weights with a config.json",
        404,
    )


def _check_shards(ref: ModelRef, first: str, count: int, shards: Sequence[RepoFile]) -> None:
    """llama-server cannot load a split GGUF with a shard missing: refuse it before downloading."""
    have = {int(m.group(1)) for f in shards if (m := _SHARD.search(f.path)) is not None}
    missing = [n for n in range(1, count + 1) if n not in have]
    if missing:
        raise SupervisorError(
            "hub_error",
            f"hf.co/{ref.repo}: {first} is split into {count} files, but the hub lists none numbered "
            + ", ".join(str(n) for n in missing),
            502,
        )


def _same_split(path: str, first: str) -> bool:
    """`path` is a shard of the split GGUF whose first shard is `first`: the same name before the shard
    suffix (not merely a prefix of it: Q4_0 is not Q4_0_4_4) and the same shard count."""
    mine, theirs = _SHARD.search(path), _SHARD.search(first)
    return (
        mine is not None
        and theirs is not None
        and path[: mine.start()] == first[: theirs.start()]
        and mine.group(2) == theirs.group(2)
    )


@dataclass(frozen=True)
class StoredFile:
    path: str  # in the repo
    size: int
    sha256: str
    # The daemon put it into the cache (else it was there already: adopted, never removed by the daemon).
    # Records written before this field existed say nothing: adopted, to be safe.
    downloaded: bool = False


@dataclass(frozen=True)
class StoredModel:
    """One pulled model, as recorded in the store directory."""

    name: str  # canonical: hf.co/org/repo[:QUANT]
    repo: str
    commit: str
    format: Format
    quant: str | None
    weights: str  # GGUF file (first shard) in the repo, "" for a safetensors directory
    files: tuple[StoredFile, ...]
    pulled_at: float
    requested: tuple[str, ...] = field(default=())  # the spellings clients pulled it by

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        if len(self.files) == 1:
            return f"sha256:{self.files[0].sha256}"
        joined = "".join(f"{f.path}:{f.sha256}\n" for f in self.files)
        return f"sha256:{hashlib.sha256(joined.encode()).hexdigest()}"

    @property
    def downloaded(self) -> list[str]:
        """The paths of the files the daemon downloaded itself: the only ones a delete may remove."""
        return [f.path for f in self.files if f.downloaded]

    def names(self) -> list[str]:
        """Every name it answers to, canonical first: also `org/repo:QUANT` and what clients pulled."""
        names = [self.name, self.name.removeprefix("hf.co/"), *self.requested]
        return list(dict.fromkeys(names))

    @property
    def manifest_name(self) -> str:
        """The canonical name where ModelName allows it; else the same with `_` and others made `-`."""
        try:
            return _MODEL_NAME.validate_python(self.name)
        except ValidationError:
            return re.sub(r"[^A-Za-z0-9._:/@+-]", "-", self.name)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoredModel:
        return cls(
            name=data["name"],
            repo=data["repo"],
            commit=data["commit"],
            format=data["format"],
            quant=data.get("quant"),
            weights=data["weights"],
            files=tuple(StoredFile(**f) for f in data["files"]),
            pulled_at=float(data["pulled_at"]),
            requested=tuple(data.get("requested", ())),
        )


def _slug(name: str, folded: bool = True) -> str:
    """The record's file name: one per model in any case (`folded=False`: the name before it was)."""
    key = fold(name) if folded else name
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", key.removeprefix("hf.co/"))[:100]
    return f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def default_hf_cache() -> Path:
    """The Hugging Face cache that huggingface_hub itself uses (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub), as huggingface_hub.constants read them when first imported."""
    # huggingface_hub.constants alone is cheap (<1 MB, no huggingface_hub.utils), unlike the hub client.
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


class Store:
    """Pulled models on the HF cache. Methods do file I/O: call the slow ones (delete) in a thread."""

    def __init__(self, cache_dir: Path, records_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.records_dir = records_dir
        self._refs_lock = threading.Lock()  # two pulls may save (and write refs) in two threads at once

    def repo_dir(self, repo: str) -> Path:
        return self.cache_dir / ("models--" + repo.replace("/", "--"))

    def snapshot_dir(self, model: StoredModel) -> Path:
        return self.repo_dir(model.repo) / "snapshots" / model.commit

    def weights_path(self, model: StoredModel) -> Path:
        snapshot = self.snapshot_dir(model)
        return snapshot / model.weights if model.weights else snapshot

    def _record_paths(self, name: str, folded: bool = True) -> tuple[Path, Path]:
        slug = _slug(name, folded)
        return self.records_dir / f"{slug}.json", self.records_dir / f"{slug}.yaml"

    # --- reading ---

    def models(self) -> list[StoredModel]:
        """Every recorded model whose files are all still in the cache, by name."""
        found: list[StoredModel] = []
        for model in self._valid_records():
            missing = [f.path for f in model.files if not (self.snapshot_dir(model) / f.path).exists()]
            if missing:
                log.warning("store_files_missing", model=model.name, missing=missing)
                continue
            found.append(model)
        return sorted(found, key=lambda m: m.name)

    def find(self, requested: str) -> StoredModel | None:
        """A recorded model by any of its names (`hf.co/` prefix and `:latest` optional), its files present
        or not: a model one of whose files went (a cache clean-up, an `rm`) is not listed, but a delete
        must still find it to remove the rest."""
        wanted = {fold(requested), fold(requested).removesuffix(":latest")}
        wanted |= {"hf.co/" + w for w in wanted}
        for model in sorted(self._valid_records(), key=lambda m: m.name):
            if wanted & {fold(n) for n in (*model.names(), model.manifest_name)}:
                return model
        return None

    def _valid_records(self) -> list[StoredModel]:
        """Every record that can be read, its files present or not; an unreadable one is logged."""
        found: list[StoredModel] = []
        if not self.records_dir.is_dir():
            return found
        for record in sorted(self.records_dir.glob("*.json")):
            try:
                found.append(StoredModel.from_json(json.loads(record.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("store_record_invalid", file=str(record), error=str(exc))
        return found

    def manifests(self) -> list[tuple[Manifest, Path, list[str]]]:
        """The generated manifest of every stored model, its file, and the names it answers to."""
        entries: list[tuple[Manifest, Path, list[str]]] = []
        for model in self.models():
            _, yaml_path = self._record_paths(model.name)
            try:
                if not yaml_path.exists():
                    self._write_manifest(model, yaml_path)
                manifest = load_files([yaml_path]).models[model.manifest_name]
            except (OSError, KeyError, ManifestLoadError) as exc:
                log.warning("store_manifest_invalid", model=model.name, error=str(exc))
                continue
            entries.append((manifest, yaml_path, model.names()))
        return entries

    def disk_usage(self) -> int:
        """Bytes the stored models take in the cache (each blob counted once)."""
        seen: set[Path] = set()
        total = 0
        for model in self.models():
            for f in model.files:
                blob = (self.snapshot_dir(model) / f.path).resolve()
                if blob not in seen:
                    seen.add(blob)
                    total += blob.stat().st_size if blob.exists() else 0
        return total

    # --- writing ---

    def save(self, model: StoredModel) -> StoredModel | None:
        """Record a pulled model and write its generated manifest; returns the record it replaced, if any
        (a re-pull at a new commit leaves the old snapshot to `remove_unreferenced`)."""
        self.records_dir.mkdir(parents=True, exist_ok=True)
        json_path, yaml_path = self._record_paths(model.name)
        legacy = [p for p in self._record_paths(model.name, folded=False) if p not in (json_path, yaml_path)]
        previous = self._read(json_path) or (self._read(legacy[0]) if legacy else None)
        if previous is not None:  # pulled again: keep every spelling it was pulled by
            model = StoredModel.from_json(
                {**model.to_json(), "requested": list(dict.fromkeys([*previous.requested, *model.requested]))}
            )
        self._write_manifest(model, yaml_path)
        atomic_write(json_path, json.dumps(model.to_json(), indent=2))
        for path in legacy:  # its record under the name's case-sensitive file name, from before
            path.unlink(missing_ok=True)
        return previous

    def set_ref(self, repo: str, revision: str, commit: str) -> bool:
        """Point `refs/<revision>` at `commit`, as huggingface_hub does when it downloads by branch name
        (a download pinned to a commit writes no ref): other tools find the snapshot through it. Only a
        ref the daemon created, and that still says what the daemon wrote, is moved; another tool's ref
        is left as it is. Returns whether the ref was written."""
        ref = self.repo_dir(repo) / "refs" / revision
        _check_inside(ref, self.repo_dir(repo) / "refs")
        with self._refs_lock:
            ledger = self._ref_ledger()
            key = f"{self.repo_dir(repo).name}/{revision}"
            current = _read_ref(ref)
            if current is not None and current != ledger.get(key):
                if ledger.pop(key, None) is not None:  # rewritten since by another tool: theirs now
                    self._write_ref_ledger(ledger)
                log.info("store_ref_kept", repo=repo, ref=revision, points_at=current, pulled=commit)
                return False
            ref.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(ref, commit)
            ledger[key] = commit
            self._write_ref_ledger(ledger)
            return True

    def _drop_refs(self, repo: str, commit: str) -> None:
        """Remove the refs of `repo` the daemon wrote at `commit` that still say `commit`; forget the
        daemon's claim on those another tool has rewritten since."""
        repo_dir = self.repo_dir(repo)
        with self._refs_lock:
            ledger = self._ref_ledger()
            changed = False
            for key, written in list(ledger.items()):
                dir_name, _, revision = key.partition("/")
                if dir_name != repo_dir.name or written != commit:
                    continue
                ref = repo_dir / "refs" / revision
                _check_inside(ref, repo_dir / "refs")
                if _read_ref(ref) == commit:
                    ref.unlink()
                    log.info("store_ref_removed", repo=repo, ref=revision, commit=commit)
                del ledger[key]
                changed = True
            if changed:
                self._write_ref_ledger(ledger)

    def _ref_ledger(self) -> dict[str, str]:
        """`<repo dir>/<revision>` -> the commit the daemon wrote there."""
        try:
            data = json.loads((self.records_dir / _REFS_LEDGER).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("store_ref_ledger_invalid", error=str(exc))  # then no ref counts as the daemon's
            return {}
        if not isinstance(data, dict):
            return {}
        return {str(k): str(v) for k, v in data.items()}

    def _write_ref_ledger(self, ledger: dict[str, str]) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.records_dir / _REFS_LEDGER, json.dumps(ledger, indent=2, sort_keys=True))

    def _read(self, path: Path) -> StoredModel | None:
        try:
            return StoredModel.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_manifest(self, model: StoredModel, path: Path) -> None:
        fields: dict[str, Any] = {
            "name": model.manifest_name,
            "description": f"pulled from hf.co/{model.repo} ({model.format}); generated, do not edit",
        }
        if model.format == "gguf":
            fields |= {"engine": "llama-server", "model": str(self.weights_path(model))}
            fields["ctx_size"] = PULLED_CTX_SIZE
        else:
            fields |= {"engine": "vllm", "model": str(self.weights_path(model))}
        header = "# Generated by llm-supervisor's model store. A manifest file of the same name wins.\n"
        atomic_write(path, header + yaml.safe_dump(fields, sort_keys=False))

    def forget(self, model: StoredModel) -> None:
        """Remove the record and the generated manifest (fast; the files go with `remove_files`)."""
        for path in (*self._record_paths(model.name), *self._record_paths(model.name, folded=False)):
            path.unlink(missing_ok=True)

    def owned_blobs(self, repo: str) -> set[str]:
        """Real paths of the files of `repo` that a record says the daemon downloaded: a re-pull that
        finds one of them in the cache keeps it as its own."""
        found: set[str] = set()
        for model in self.models():
            if fold(model.repo) == fold(repo):
                found |= {os.path.realpath(self.snapshot_dir(model) / p) for p in model.downloaded}
        return found

    def referenced(self, repo: str) -> set[tuple[str, str]]:
        """(commit, path) of every file of `repo` that a record names, its files present or not."""
        found: set[tuple[str, str]] = set()
        for record in self.records_dir.glob("*.json") if self.records_dir.is_dir() else ():
            model = self._read(record)
            if model is not None and model.repo == repo:
                found |= {(model.commit, f.path) for f in model.files}
        return found

    def remove_unreferenced(
        self,
        repo: str,
        commit: str,
        paths: Iterable[str],
        keep: Collection[str] = frozenset(),
        prune: bool = True,
    ) -> None:
        """`remove_files` for those of `paths` that no record names at `commit`: what a failed pull placed,
        or the snapshot a re-pull at a new commit replaced (only files the daemon downloaded)."""
        kept = self.referenced(repo)
        self.remove_files(repo, commit, [p for p in paths if (commit, p) not in kept], keep, prune)

    def remove_files(
        self,
        repo: str,
        commit: str,
        paths: Iterable[str],
        keep: Collection[str] = frozenset(),
        prune: bool = True,
    ) -> None:
        """Remove these files of a snapshot from the cache (callers pass only files the daemon downloaded),
        and their blobs unless another snapshot (another record's, or another tool's) uses them. A file
        whose real path (symlinks resolved into blobs) is in `keep` (what configured models use) stays,
        link and blob. Then, if that empties the snapshot and no record is left at `commit`, the refs the
        daemon wrote there go, and the directories that leaves empty. Nothing outside the repo's directory
        goes (but huggingface_hub's lock files of its blobs): a blob that is a symlink into the cache-wide
        Xet store loses only its link. `prune=False` leaves every directory (and so the refs): another
        download of the repo may be using them (see `prune_after_pull`)."""
        repo_dir = self.repo_dir(repo)
        if not safe_repo_path(commit) or "/" in commit:
            raise ValueError(f"not a commit: {commit!r}")
        snapshot = repo_dir / "snapshots" / commit
        for path in paths:
            if not safe_repo_path(path):
                log.warning("store_path_unsafe", repo=repo, path=path)
                continue
            link = snapshot / path
            _check_inside(link, repo_dir)
            if os.path.realpath(link) in keep:  # a manifest may name this very link: both stay
                log.info("store_file_kept", repo=repo, commit=commit, path=path, reason="a model uses it")
                continue
            blob = _blob_entry(repo_dir, link)
            if link.is_symlink() or link.exists():
                link.unlink()
            if blob is not None and not self._blob_in_use(repo_dir, blob):
                _check_inside(blob, repo_dir)
                blob.unlink(missing_ok=True)
                _remove_lock(self._lock_path(repo_dir, blob.name))
            if prune:
                _prune_empty(link.parent, stop=snapshot.parent)
        if not prune:
            return
        # A snapshot that stays (another tool's files, or a model's) keeps its ref: other tools find it so.
        if not snapshot.exists() and not any(model.commit == commit for model in self._records_of(repo)):
            self._drop_refs(repo, commit)
        _prune_repo(repo_dir, snapshot)
        _prune_empty(self.cache_dir / ".locks" / repo_dir.name, stop=self.cache_dir)

    def _records_of(self, repo: str) -> list[StoredModel]:
        """Every record of `repo`, its files present or not."""
        found = []
        for record in self.records_dir.glob("*.json") if self.records_dir.is_dir() else ():
            model = self._read(record)
            if model is not None and model.repo == repo:
                found.append(model)
        return found

    def remove_links(
        self, repo: str, commit: str, paths: Iterable[str], keep: Collection[str] = frozenset()
    ) -> None:
        """The links at `commit` that a failed or cancelled pull made to blobs already in the cache (the
        blobs stay: another tool's, or another snapshot's), unless a record names the file at `commit` or a
        configured model uses it (`keep`). Only a symlink goes; the directories stay (`prune_after_pull`)."""
        if not safe_repo_path(commit) or "/" in commit:
            raise ValueError(f"not a commit: {commit!r}")
        repo_dir = self.repo_dir(repo)
        named = self.referenced(repo)
        for path in paths:
            if not safe_repo_path(path) or (commit, path) in named:
                continue
            link = repo_dir / "snapshots" / commit / path
            _check_inside(link, repo_dir)
            if link.is_symlink() and os.path.realpath(link) not in keep:
                link.unlink()
                log.info("store_link_removed", repo=repo, commit=commit, path=path)

    def remove_blobs(self, repo: str, etags: Iterable[str], keep: Collection[str] = frozenset()) -> None:
        """Remove these blobs of the repo (callers pass only blobs the daemon put there) that no snapshot
        links to and whose real path is not in `keep`, with their lock files: what a download that failed
        before it made its link left, or a deleted model's file whose link was removed by hand."""
        repo_dir = self.repo_dir(repo)
        for etag in etags:
            if not safe_repo_path(etag) or "/" in etag:
                log.warning("store_path_unsafe", repo=repo, path=etag)
                continue
            blob = repo_dir / "blobs" / etag
            _check_inside(blob, repo_dir)
            if (
                not os.path.lexists(blob)
                or os.path.realpath(blob) in keep
                or self._blob_in_use(repo_dir, blob)
            ):
                continue
            blob.unlink()
            _remove_lock(self._lock_path(repo_dir, etag))
            log.info("store_blob_removed", repo=repo, blob=etag)

    def remove_leftovers(self, repo: str, etags: Iterable[str], partials: bool = False) -> int:
        """huggingface_hub's lock files of a failed or cancelled pull's blobs (unless a download still holds
        one). huggingface_hub removes its own partial downloads (`blobs/<etag>.<random>.incomplete`, one
        per download); another download's are left alone. With `partials` (a pull that crashed, which
        removed none) also the partial downloads of these blobs, old-style `<etag>.incomplete` too, while
        no download holds the blob's lock. Returns how many partial downloads went."""
        repo_dir = self.repo_dir(repo)
        removed = 0
        for etag in etags:
            if not (_HEX40.fullmatch(etag) or _HEX64.fullmatch(etag)):
                log.warning("store_path_unsafe", repo=repo, path=etag)
                continue
            found: list[Path] = []
            if partials and (repo_dir / "blobs").is_dir():
                found = [
                    path
                    for path in (repo_dir / "blobs").glob(f"{etag}.*")
                    if _PARTIAL.fullmatch(path.name.removeprefix(etag))
                ]
            for path in found:
                _check_inside(path, repo_dir)
            removed += _remove_lock(self._lock_path(repo_dir, etag), found)
        return removed

    def remove_crashed_pull(
        self,
        repo: str,
        commit: str,
        files: Sequence[RepoFile],
        keep: Collection[str] = frozenset(),
        unclaimed: Collection[str] = frozenset(),
    ) -> dict[str, int]:
        """What a pull that crashed left of `files` (its journal's: those whose blobs it was to download), as
        a failed pull's clean-up removes it: their links at `commit` and blobs that no record, other
        snapshot or configured model (`keep`) uses, their partial downloads and lock files, and the
        directories that leaves empty. The link and blob of a file whose etag is in `unclaimed` (its blob
        is not the one the pull downloaded) stay. Call it with no pull of the repo running. Returns counts
        of the blobs removed, kept (something uses them) and unclaimed, and of the partial downloads
        removed."""
        blobs = self.repo_dir(repo) / "blobs"
        ours = [f for f in files if f.etag not in unclaimed]
        etags = [f.etag for f in ours]
        there = [etag for etag in etags if os.path.lexists(blobs / etag)]
        self.remove_unreferenced(repo, commit, [f.path for f in ours], keep, prune=False)
        self.remove_blobs(repo, etags, keep)
        partials = self.remove_leftovers(repo, [f.etag for f in files], partials=True)
        self.prune_after_pull(repo, commit, [f.path for f in files])
        kept = sum(1 for etag in there if os.path.lexists(blobs / etag))
        return {
            "removed": len(there) - kept,
            "kept": kept,
            "unclaimed": len(files) - len(ours),
            "partials": partials,
        }

    def prune_after_pull(self, repo: str, commit: str, paths: Iterable[str]) -> None:
        """The directories a failed or cancelled pull of these files at `commit` used, where that left them
        empty: each file's directories in the snapshot, `snapshots`, `blobs`, the repo's lock directory,
        then the repo's directory. Any other empty directory of the repo (another tool's) stays. Callers
        make sure no other download of the repo runs meanwhile: huggingface_hub makes a download's
        directories before it starts, and needs them when it ends."""
        repo_dir = self.repo_dir(repo)
        snapshots = repo_dir / "snapshots"
        if not safe_repo_path(commit) or "/" in commit:
            raise ValueError(f"not a commit: {commit!r}")
        for path in paths:
            if safe_repo_path(path):
                _prune_empty((snapshots / commit / path).parent, stop=repo_dir)
        _prune_empty(repo_dir / "blobs", stop=repo_dir)
        _prune_empty(repo_dir, stop=self.cache_dir)
        _prune_empty(self.cache_dir / ".locks" / repo_dir.name, stop=self.cache_dir)

    def lock_path(self, repo: str, etag: str) -> Path:
        """huggingface_hub's lock file of a blob's download."""
        return self._lock_path(self.repo_dir(repo), etag)

    def _lock_path(self, repo_dir: Path, etag: str) -> Path:
        lock = self.cache_dir / ".locks" / repo_dir.name / f"{etag}.lock"
        _check_inside(lock, self.cache_dir / ".locks" / repo_dir.name)
        return lock

    def _blob_in_use(self, repo_dir: Path, blob: Path) -> bool:
        for root, _, names in os.walk(repo_dir / "snapshots"):
            for name in names:
                if _blob_entry(repo_dir, Path(root) / name) == blob:
                    return True
        return False

    def delete(self, model: StoredModel, keep: Collection[str] = frozenset()) -> None:
        """Remove a stored model: its record and generated manifest, and of its files those the daemon
        downloaded that nothing else uses (see `remove_files`; `keep`: real paths configured models use).
        Files it adopted from the cache stay; so does the blob of a non-LFS file whose link is gone (its
        name is not its sha256)."""
        self.forget(model)
        self.remove_blobs(model.repo, self._unlinked_blobs(model), keep)
        self.remove_unreferenced(model.repo, model.commit, model.downloaded, keep)

    def _unlinked_blobs(self, model: StoredModel) -> list[str]:
        """The blob names (sha256) of the files the daemon downloaded for `model` whose link is gone and
        that no other record names."""
        snapshot = self.snapshot_dir(model)
        kept = self.referenced(model.repo)
        return [
            f.sha256
            for f in model.files
            if f.downloaded
            and (model.commit, f.path) not in kept
            and safe_repo_path(f.path)
            and not os.path.lexists(snapshot / f.path)
        ]


class Catalog:
    """What the scheduler serves: the manifest files as last loaded (SIGHUP), plus the stored models.

    Reading the store is file I/O, so a registry is built in a thread and applied on the loop; `lock`
    keeps one change at a time, so that a slow build never overwrites a newer one.
    """

    def __init__(self, store: Store, manifests: Registry, settings: Settings) -> None:
        self.store = store
        self.manifests = manifests
        self.settings = settings
        self.scheduler: Scheduler | None = None
        self.lock = asyncio.Lock()

    def files_in_use(self) -> set[str]:
        """Real paths of the files the manifest files' models use (stored models' files are kept by
        `Store.remove_files` as files of other records or snapshots). Walks directories: call it in a
        thread."""
        return files_used_by(self.manifests.models.values(), self.store.cache_dir)

    def delete(self, model: StoredModel) -> None:
        """`Store.delete` keeping every file a configured model uses; in a thread, with `lock` held."""
        self.store.delete(model, keep=self.files_in_use())

    def registry(self, manifests: Registry | None = None, leaving_out: str | None = None) -> Registry:
        """The manifest files' models (these, else the last loaded) plus the stored ones, less the stored
        model named `leaving_out`. Reads the store: call it in a thread once the loop runs."""
        stored = [
            entry for entry in self.store.manifests() if leaving_out is None or entry[2][0] != leaving_out
        ]
        return with_stored(self.manifests if manifests is None else manifests, stored)

    def apply(
        self, registry: Registry, manifests: Registry | None = None, settings: Settings | None = None
    ) -> None:
        """Serve `registry` (built by `registry()` while `lock` was held), with new manifests and settings
        if given."""
        self.manifests = self.manifests if manifests is None else manifests
        self.settings = self.settings if settings is None else settings
        if self.scheduler is not None:
            self.scheduler.reload(registry, self.settings)

    async def refresh(self, manifests: Registry | None = None, settings: Settings | None = None) -> None:
        """Apply the union to the scheduler: after a pull, or with a SIGHUP's new manifests and settings."""
        async with self.lock:
            registry = await asyncio.to_thread(self.registry, manifests)
            self.apply(registry, manifests, settings)


def new_stored_model(
    plan: PullPlan, commit: str, digests: dict[str, str], requested: str, downloaded: Collection[str] = ()
) -> StoredModel:
    """The record of a finished pull; `downloaded`: the paths the daemon put into the cache itself."""
    return StoredModel(
        name=plan.name,
        repo=plan.ref.repo,
        commit=commit,
        format=plan.format,
        quant=plan.quant,
        weights=plan.weights,
        files=tuple(StoredFile(f.path, f.size, digests[f.path], f.path in downloaded) for f in plan.files),
        pulled_at=time.time(),
        requested=tuple(dict.fromkeys(n for n in (requested, plan.ref.key) if n != plan.name)),
    )


def files_used_by(manifests: Iterable[Manifest], cache_dir: Path) -> set[str]:
    """Real paths of every file these models use: their weights (a file, or each file of a directory),
    absolute paths among their args, and for a vLLM model named by hub repo id each file of that repo in
    the cache (vLLM loads it from there)."""
    found: set[str] = set()
    for manifest in manifests:
        paths = [manifest.local_weights()] + [Path(a) for arg in manifest.args for a in _path_args(arg)]
        if isinstance(manifest, VllmManifest):
            if (
                isinstance(model := (manifest.speculative or {}).get("model"), str)
                and Path(model).is_absolute()
            ):
                paths.append(Path(model))
            if manifest.local_weights() is None and _REPO.match(manifest.model):
                paths += _cached_repo_dirs(cache_dir, manifest.model)
        for path in paths:
            if path is not None:
                found |= _real_files(path)
    return found


def _path_args(arg: str) -> list[str]:
    """The absolute paths an engine argument may name: itself, or the value of a `--flag=value`."""
    return [a for a in (arg, arg.partition("=")[2]) if a.startswith("/")]


def _cached_repo_dirs(cache_dir: Path, repo: str) -> list[Path]:
    """The cache's directories of `repo`, in any case (the hub is case-insensitive, the cache is not)."""
    wanted = fold("models--" + repo.replace("/", "--"))
    try:
        return [p for p in cache_dir.iterdir() if fold(p.name) == wanted]
    except OSError:
        return []


def _real_files(path: Path) -> set[str]:
    """The real path of a file, or of each file under a directory (not following directory links)."""
    if path.is_dir():
        return {os.path.realpath(Path(root) / name) for root, _, names in os.walk(path) for name in names}
    return {os.path.realpath(path)} if path.exists() else set()


def _read_ref(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _prune_empty(directory: Path, stop: Path) -> None:
    while directory != stop and directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
        directory = directory.parent


def _prune_repo(repo_dir: Path, snapshot: Path) -> None:
    """Remove `snapshot`'s empty directories, then `snapshots`, `refs`, `blobs` and the repo's directory
    where that leaves them empty; anything else (another tool's files) keeps its directory."""
    if snapshot.is_dir() and not snapshot.is_symlink():
        _prune_empty_dirs(snapshot)
        _prune_empty(snapshot, stop=repo_dir)
    for part in ("snapshots", "refs", "blobs"):
        _prune_empty(repo_dir / part, stop=repo_dir)
    _prune_empty(repo_dir, stop=repo_dir.parent)


def _check_inside(path: Path, root: Path) -> None:
    """Refuse to touch `path` unless it lies under `root` (its directories resolved, not its last part)."""
    where = Path(os.path.realpath(path.parent)) / path.name
    if not where.is_relative_to(os.path.realpath(root)):
        raise ValueError(f"{path} is outside {root}")


def _blob_entry(repo_dir: Path, link: Path) -> Path | None:
    """The repo's own `blobs/<etag>` entry a snapshot symlink points at, following one level only: under
    Xet that entry may itself be a symlink into the cache-wide shared store, which other repos use."""
    if not link.is_symlink():
        return None
    target = link.parent / os.readlink(link)
    blobs = repo_dir / "blobs"
    if os.path.realpath(target.parent) != os.path.realpath(blobs):
        return None
    return blobs / target.name


def _remove_lock(path: Path, partials: Sequence[Path] = ()) -> int:
    """Remove huggingface_hub's lock file, and `partials` (its blob's partial downloads), unless a download
    holds it (filelock copes with an unlinked one); a download holds it from before its partial file
    exists until after that is gone. Returns how many of `partials` went."""
    if not path.exists():  # no download of the blob runs
        return _unlink_all(partials)
    try:
        with FileLock(path, blocking=False):
            removed = _unlink_all(partials)
            path.unlink(missing_ok=True)
            return removed
    except Timeout:
        return 0


def _unlink_all(paths: Sequence[Path]) -> int:
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def _prune_empty_dirs(directory: Path) -> None:
    """Remove the empty directories under `directory` (not it), deepest first; files stay."""
    for root, dirs, _ in os.walk(directory, topdown=False):
        for name in dirs:
            path = Path(root) / name
            if not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
