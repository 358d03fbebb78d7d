"""Background pulls from the Hugging Face hub into the store, with Ollama-style progress.

A pull is a task of its own: clients subscribe to its progress and may go away without stopping it. Two
pulls of one model share one download; a cancelled or failed pull leaves no partial file and registers
nothing. Downloads run in threads (huggingface_hub is synchronous), so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import hashlib
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, cast

import huggingface_hub
import structlog
from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from supervisor.errors import SupervisorError
from supervisor.store import ModelRef, PullPlan, RepoFile, Store, new_stored_model, plan_pull

log = structlog.get_logger("pulls")

# huggingface_hub reads the body in 10 MiB pieces; 1 MiB ones give progress (and a cancel) every MiB.
constants.DOWNLOAD_CHUNK_SIZE = 2**20
_PROGRESS_EVERY_S = 0.1  # at most this often per file, besides its last update
_HISTORY = 20


class PullState(enum.StrEnum):
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PullCancelled(Exception):
    """Raised inside the download thread (from the progress callback) to stop the transfer."""


Event = dict[str, Any]


class Pull:
    """One model being pulled: its latest progress, its outcome, and the queues of who is watching."""

    def __init__(self, ref: ModelRef, requested: str) -> None:
        self.ref = ref
        self.requested = requested
        self.state = PullState.RUNNING
        self.name: str | None = None  # the model's name, once its files are chosen
        self.error: SupervisorError | None = None
        self.last: Event | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.cancel_requested = threading.Event()  # read by the download thread
        self.planned = asyncio.Event()  # files chosen, or the pull ended before
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Queue[Event | None]] = set()
        self.loop = asyncio.get_running_loop()  # the download thread reports progress through it

    def publish(self, event: Event) -> None:
        self.last = event
        for queue in self._watchers:
            queue.put_nowait(event)

    def final_event(self) -> Event:
        if self.state == PullState.SUCCESS:
            return {"status": "success"}
        return {"error": self.error.message if self.error else "pull failed"}

    def finish(self, state: PullState, error: SupervisorError | None = None) -> None:
        self.state = state
        self.error = error
        self.finished_at = time.time()
        self.publish(self.final_event())
        for queue in self._watchers:
            queue.put_nowait(None)
        self.planned.set()
        self.done.set()

    async def events(self) -> AsyncGenerator[Event, None]:
        """Progress from now on (starting with where it is), ending with success or an error."""
        if self.done.is_set():
            yield self.final_event()
            return
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            if self.last is not None:
                yield self.last
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.discard(queue)

    def describe(self) -> dict[str, Any]:
        last = self.last or {}
        return {
            "model": self.ref.key,
            "requested": self.requested,
            "name": self.name,
            "state": str(self.state),
            "status": last.get("status", "error" if "error" in last else None),
            "digest": last.get("digest"),
            "total": last.get("total"),
            "completed": last.get("completed"),
            "error": self.error.message if self.error else None,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


class Pulls:
    """Every pull: running ones by model, and a short history of finished ones."""

    def __init__(self, store: Store, on_stored: Callable[[], None]) -> None:
        self.store = store
        self.on_stored = on_stored  # rebuilds the registry after a pull added a model
        self.running: dict[str, Pull] = {}
        self.history: deque[Pull] = deque(maxlen=_HISTORY)

    def start(self, requested: str) -> Pull:
        """Start pulling `requested`, or join the pull of it that is already running."""
        ref = ModelRef.parse(requested)
        pull = self.running.get(ref.key)
        if pull is not None:
            return pull
        pull = Pull(ref, requested)
        self.running[ref.key] = pull
        pull.task = asyncio.get_running_loop().create_task(self._run(pull), name=f"pull {ref.key}")
        log.info("pull_started", model=ref.key)
        return pull

    def find(self, requested: str) -> Pull | None:
        """The running pull of a model, else its most recent finished one."""
        try:
            key = ModelRef.parse(requested).key
        except SupervisorError:
            key = requested
        if key in self.running:
            return self.running[key]
        for pull in self.running.values():
            if pull.name == key:
                return pull
        return next((p for p in reversed(self.history) if key in (p.ref.key, p.name)), None)

    def pulling(self, name: str) -> bool:
        """True while a pull that will produce (or replace) the model `name` runs."""
        return any(name in (p.name, p.ref.key) for p in self.running.values())

    async def cancel(self, requested: str) -> Pull | None:
        """Stop a running pull and wait until its partial files are gone; None if none runs."""
        pull = self.find(requested)
        if pull is None or pull.done.is_set():
            return None
        pull.cancel_requested.set()
        await pull.done.wait()
        return pull

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        """Running and recent pulls, newest last, as JSON-able dicts."""
        return {
            "running": [p.describe() for p in self.running.values()],
            "recent": [p.describe() for p in self.history],
        }

    async def close(self) -> None:
        """Cancel every running pull (at shutdown) and wait for their clean-up."""
        pulls = list(self.running.values())
        for pull in pulls:
            pull.cancel_requested.set()
        for pull in pulls:
            if pull.task is not None:
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(pull.task), 15)

    # --- the pull itself ---

    async def _run(self, pull: Pull) -> None:
        placed: list[RepoFile] = []  # files this pull put into the cache (not there before)
        plan: PullPlan | None = None
        commit: str | None = None
        try:
            pull.publish({"status": "pulling manifest"})
            files = await asyncio.to_thread(_list_files, pull.ref.repo)
            plan = plan_pull(pull.ref, files)
            pull.name = plan.name
            pull.planned.set()
            local: dict[str, Path] = {}
            for f in plan.files:
                _check_cancel(pull)
                digest = f.sha256 or f.blob_id
                progress = {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": f.size}
                pull.publish({**progress, "completed": 0})
                cached = try_to_load_from_cache(plan.ref.repo, f.path, cache_dir=self.store.cache_dir)
                if not isinstance(cached, str):
                    placed.append(f)
                path = await asyncio.to_thread(self._download, pull, plan, f, progress)
                local[f.path] = path
                commit = _commit_of(path)
                pull.publish({**progress, "completed": f.size})
            _check_cancel(pull)
            pull.publish({"status": "verifying sha256 digest"})
            digests: dict[str, str] = {}
            for f in plan.files:
                actual = await asyncio.to_thread(_sha256, local[f.path])
                if f.sha256 is not None and actual != f.sha256:
                    raise SupervisorError(
                        "digest_mismatch",
                        f"{f.path} of hf.co/{plan.ref.repo} has sha256 {actual}, the hub says {f.sha256}",
                        502,
                    )
                digests[f.path] = actual
            _check_cancel(pull)
            pull.publish({"status": "writing manifest"})
            assert commit is not None
            model = new_stored_model(plan, commit, digests, pull.requested)
            await asyncio.to_thread(self.store.save, model)
            placed = []  # from here on the files belong to the store
            self.on_stored()
            pull.finish(PullState.SUCCESS)
            log.info("pull_succeeded", model=pull.ref.key, name=model.name, size=model.size)
        except (PullCancelled, asyncio.CancelledError):
            await self._clean_up(plan, commit, placed)
            pull.finish(PullState.CANCELLED, SupervisorError("pull_cancelled", "pull cancelled", 499))
            log.info("pull_cancelled", model=pull.ref.key)
        except Exception as exc:
            error = exc if isinstance(exc, SupervisorError) else _explain(pull.ref, exc)
            await self._clean_up(plan, commit, placed)
            pull.finish(PullState.FAILED, error)
            log.warning("pull_failed", model=pull.ref.key, error=error.message)
        finally:
            self.running.pop(pull.ref.key, None)
            self.history.append(pull)

    def _download(self, pull: Pull, plan: PullPlan, f: RepoFile, progress: Event) -> Path:
        """In a thread: one file into the cache; the progress callback raises once the pull is cancelled."""
        bar = _progress_bar(pull, progress)
        return Path(
            hf_hub_download(plan.ref.repo, f.path, cache_dir=self.store.cache_dir, tqdm_class=cast(Any, bar))
        )

    async def _clean_up(self, plan: PullPlan | None, commit: str | None, placed: list[RepoFile]) -> None:
        if plan is None:
            return
        repo = plan.ref.repo
        etags = [f.sha256 or f.blob_id for f in plan.files]

        def remove() -> None:
            self.store.remove_incomplete(repo, etags)
            if commit is not None and placed:
                self.store.remove_files(repo, commit, [f.path for f in placed])

        try:
            await asyncio.to_thread(remove)
        except OSError as exc:
            log.warning("pull_clean_up_failed", model=repo, error=str(exc))


def _progress_bar(pull: Pull, progress: Event) -> type:
    """A tqdm stand-in for huggingface_hub: reports bytes to the pull, and stops the transfer on cancel."""

    class Progress:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = int(kwargs.get("initial") or 0)
            self.total = kwargs.get("total")
            self._sent_at = 0.0

        def __enter__(self) -> Progress:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            if pull.cancel_requested.is_set():
                raise PullCancelled
            self.n += int(n or 0)
            now = time.monotonic()
            if now - self._sent_at >= _PROGRESS_EVERY_S or self.n >= progress["total"]:
                self._sent_at = now
                pull.loop.call_soon_threadsafe(pull.publish, {**progress, "completed": self.n})

        def close(self) -> None:
            return None

        def __getattr__(self, name: str) -> Any:
            # Other tqdm methods huggingface_hub may call (set_description, refresh, ...): nothing to do.
            return lambda *args, **kwargs: None

    return Progress


def _check_cancel(pull: Pull) -> None:
    if pull.cancel_requested.is_set():
        raise PullCancelled


def _list_files(repo: str) -> list[RepoFile]:
    entries = HfApi().list_repo_tree(repo, recursive=True)
    return [
        RepoFile(e.path, e.size, e.lfs.sha256 if e.lfs is not None else None, e.blob_id)
        for e in entries
        if isinstance(e, huggingface_hub.hf_api.RepoFile)
    ]


def _commit_of(path: Path) -> str:
    parts = path.parts
    return parts[len(parts) - 1 - parts[::-1].index("snapshots") + 1]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def _explain(ref: ModelRef, exc: Exception) -> SupervisorError:
    """A failure from the hub, the network or the disk, as an error a user can act on."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, GatedRepoError):
        return SupervisorError(
            "model_gated", f"hf.co/{ref.repo} is gated: accept its terms on the hub and set HF_TOKEN", 403
        )
    if isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError):
        return SupervisorError(
            "model_not_found",
            f"hf.co/{ref.repo} was not found on the hub (a private repo needs HF_TOKEN)",
            404,
        )
    if isinstance(exc, EntryNotFoundError):
        return SupervisorError("model_not_found", f"hf.co/{ref.repo}: {first_line}", 404)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return SupervisorError(
            "disk_full", f"pull of hf.co/{ref.repo} failed: no space left on the device of the HF cache", 507
        )
    if isinstance(exc, HfHubHTTPError):
        return SupervisorError(
            "hub_error", f"pull of hf.co/{ref.repo} failed: the hub said {first_line}", 502
        )
    return SupervisorError(
        "pull_failed", f"pull of hf.co/{ref.repo} failed: {type(exc).__name__}: {first_line}", 502
    )
