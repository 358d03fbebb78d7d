"""Background pulls from the Hugging Face hub into the store, with Ollama-style progress.

A pull is a task of its own: clients subscribe to its progress and may go away without stopping it. Two
pulls of one model share one download (any spelling or case of a repo is one pull; a second spelling
joins the first once its files are chosen); a cancelled or failed pull leaves no partial file and
registers nothing. Every file is downloaded at the commit the repo was at when the pull began. At most
`max_parallel_pulls` download at once, the rest wait `queued`; a pull whose files would leave less than
`min_free_disk_mib` free on the cache's disk is refused (507) before anything is written. Files already
in the cache are adopted, not downloaded, and the record says so. Downloads and digests run in threads
(huggingface_hub is synchronous), so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import hashlib
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast
from urllib.parse import urlparse

import structlog

from supervisor import errors, secrets
from supervisor.config import Settings
from supervisor.errors import SupervisorError
from supervisor.events import EventBus
from supervisor.pull_journal import PullJournal
from supervisor.store import (
    ModelRef,
    PullPlan,
    RepoFile,
    Store,
    StoredModel,
    fold,
    is_repo_id,
    new_stored_model,
    plan_pull,
)

log = structlog.get_logger("pulls")

_PROGRESS_EVERY_S = 0.1  # at most this often per file, besides its last update
_VERIFYING_EVERY_S = 1.0  # a line this often while hashing, so that a client reading the stream sees life
_HASH_CHUNK = 4 * 2**20
_HISTORY = 20
CANCEL_WAIT_S = 10.0  # how long a cancel waits for the pull to stop before answering "cancelling"
CLOSE_WAIT_S = 15.0  # at shutdown: then the pull's task is cancelled and its thread abandoned
VERIFYING = "verifying sha256 digest"
_PULL_EVENT_S = 0.5
# A watcher's stream repeats the latest progress line after this long without one (while the pull waits
# on the hub, or for a download turn), so that clients and proxies do not take the silence for a hang.
HEARTBEAT_S = 10.0
# Seconds the hub may take to accept a connection or to send the next bytes (huggingface_hub waits forever
# on some calls): a hub that stops answering fails the pull instead of holding it.
HUB_TIMEOUTS = {"connect": 10.0, "read": 60.0, "write": 60.0, "pool": 60.0}
# What huggingface_hub names a blob by (`blobs/<etag>`): a git blob id or an LFS sha256, nothing else.
_HUB_ETAG = re.compile(r'(?:W/)?"?([0-9a-f]{40}|[0-9a-f]{64})"?')
_COMMIT = re.compile(r"[0-9a-f]{40}")
# The id of the file this download thread fetches: the hub must name it so.
_expected = threading.local()
T = TypeVar("T")


class PullState(enum.StrEnum):
    QUEUED = "queued"  # waiting for one of the `max_parallel_pulls` download turns
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PullCancelled(Exception):
    """Raised inside the download thread (from the progress callback) to stop the transfer."""


class HubRefused(SupervisorError):
    """An answer of the hub that the pull does not trust (raised in the download thread)."""

    def __init__(self, message: str) -> None:
        super().__init__("hub_error", message, 502)


Event = dict[str, Any]


class _Watcher:
    """What one follower of a pull has yet to read (None: the end). A file's byte count replaces the one
    before it that is still unread: a follower that stops reading (its socket full) held every line, ten
    a second per file, for as long as the pull ran, where only the latest count matters."""

    def __init__(self) -> None:
        self._unread: deque[Event | None] = deque()
        self._arrived = asyncio.Event()

    def put(self, event: Event | None) -> None:
        last = self._unread[-1] if self._unread else None
        digest = None if event is None else _progress_of(event)
        if digest is not None and last is not None and _progress_of(last) == digest:
            self._unread[-1] = event
        else:
            self._unread.append(event)
        self._arrived.set()

    async def get(self) -> Event | None:
        while not self._unread:
            self._arrived.clear()
            await self._arrived.wait()
        return self._unread.popleft()

    def __len__(self) -> int:
        return len(self._unread)


def _progress_of(event: Event) -> str | None:
    """The digest whose byte count `event` gives; None for any other line (a stage, the end)."""
    if "completed" not in event or not str(event.get("status", "")).startswith("pulling"):
        return None
    return event.get("digest")


class Pull:
    """One model being pulled: its latest progress, its outcome, and who is watching it."""

    def __init__(self, ref: ModelRef, requested: str, events: EventBus | None = None) -> None:
        self.ref = ref
        self._events = events
        self.requested = requested
        self.state = PullState.RUNNING
        self.name: str | None = None  # the model's name, once its files are chosen
        self.repo: str | None = None  # the hub's id of the repo, once listed (a renamed repo's new one)
        self.error: SupervisorError | None = None
        self.last: Event | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.cancel_requested = threading.Event()  # read by the download thread
        self.planned = asyncio.Event()  # files chosen, or the pull ended before
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.leader: Pull | None = None  # the running pull of the same model this one joined
        self.downloading = False  # in its download phase: another pull's clean-up must not prune the repo
        self.abandoned = False  # cancelled at shutdown with its download thread perhaps still writing
        self.needs: dict[str, int] = {}  # digest -> size of its files not yet in the cache
        self.sizes: dict[str, int] = {}  # digest -> size of every file of the model, once chosen
        self._completed: dict[str, int] = {}  # digest -> bytes downloaded so far
        self._watchers: set[_Watcher] = set()
        self.loop = asyncio.get_running_loop()  # the download thread reports progress through it

    def of_repo(self, repo: str) -> bool:
        """It pulls from `repo`: by the id asked for, or by the hub's id (files go under that one)."""
        return fold(repo) in (fold(self.ref.repo), fold(self.repo or ""))

    def publish(self, event: Event) -> None:
        if "digest" in event and "completed" in event:
            self._completed[event["digest"]] = int(event["completed"] or 0)
        if self._events is not None:
            status = event.get("status", "error" if "error" in event else None)
            previous = (self.last or {}).get("status")
            self._events.publish_throttled(
                "pull",
                f"pull:{self.ref.key}",
                _PULL_EVENT_S,
                force=status != previous,  # a new stage at once; byte counts at most twice a second
                model=self.name or self.ref.key,
                status=status,
                completed=event.get("completed"),
                total=event.get("total"),
                error=event.get("error"),
            )
        self.last = event
        for watcher in self._watchers:
            watcher.put(event)

    def final_event(self) -> Event:
        if self.state == PullState.SUCCESS:
            return {"status": "success"}
        return {"error": self.error.message if self.error else "pull failed"}

    def finish(self, state: PullState, error: SupervisorError | None = None) -> None:
        if error is not None:
            # What the hub or its client said goes to every follower of the pull, keyed or not: no
            # password in HF_ENDPOINT's URL, no token in an echoed header.
            error.message = secrets.scrub(error.message)
        self.state = state
        self.error = error
        self.finished_at = time.time()
        self.publish(self.final_event())
        for watcher in self._watchers:
            watcher.put(None)
        self.planned.set()
        self.done.set()

    async def events(self, heartbeats: bool = True) -> AsyncGenerator[Event, None]:
        """Progress from now on (starting with where it is), ending with success or an error; with
        `heartbeats`, the latest line again after each HEARTBEAT_S without a new one."""
        if self.done.is_set():
            yield self.final_event()
            return
        watcher = _Watcher()
        self._watchers.add(watcher)
        try:
            if self.last is not None:
                yield self.last
            while True:
                try:
                    async with asyncio.timeout(HEARTBEAT_S if heartbeats else None):
                        event = await watcher.get()
                except TimeoutError:
                    if self.last is not None:
                        yield self.last
                    continue
                if event is None:
                    return
                yield event
        finally:
            self._watchers.discard(watcher)

    @property
    def needed(self) -> int:
        """Bytes of disk its files take: those not in the cache when it was planned."""
        return sum(self.needs.values())

    def still_needs(self) -> int:
        """Bytes of disk it may yet take: what it needs less what it has written so far."""
        if self.done.is_set() or self.leader is not None:
            return 0
        return sum(max(0, size - self._completed.get(d, 0)) for d, size in self.needs.items())

    @property
    def shown_state(self) -> PullState:
        """Its state, or while it follows another pull of the same model, that one's."""
        if self.leader is not None and not self.done.is_set():
            return self.leader.state
        return self.state

    def describe(self) -> dict[str, Any]:
        last = self.last or {}
        return {
            "model": self.ref.key,
            "requested": self.requested,
            "name": self.name,
            "state": str(self.shown_state),
            "status": last.get("status", "error" if "error" in last else None),
            "digest": last.get("digest"),
            "total": last.get("total"),
            "completed": last.get("completed"),
            "error": self.error.message if self.error else None,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    def progress(self) -> dict[str, Any]:
        """Where it stands, totalled over all the model's files (0 of 0 until they are chosen)."""
        state = self.shown_state
        total = sum(self.sizes.values())
        if state == PullState.SUCCESS:
            completed, files_done = total, len(self.sizes)
        else:
            got = {d: min(self._completed.get(d, 0), size) for d, size in self.sizes.items()}
            completed = sum(got.values())
            files_done = sum(1 for d, size in self.sizes.items() if d in self._completed and got[d] >= size)
        return {
            "model": self.name or self.requested,
            "state": str(state),
            "completed": completed,
            "total": total,
            "files_done": files_done,
            "files_total": len(self.sizes),
            "error": self.error.message if self.error else None,
        }


class Pulls:
    """Every pull: running ones by model, and a short history of finished ones."""

    def __init__(
        self,
        store: Store,
        on_stored: Callable[[], Awaitable[None]],
        settings: Settings | None = None,
        files_in_use: Callable[[], set[str]] | None = None,
    ) -> None:
        self.store = store
        self.on_stored = on_stored  # rebuilds the registry after a pull added a model
        self.settings = settings or Settings()
        # Real paths the manifest files' models use: a replaced snapshot keeps them. Called in a thread.
        self.files_in_use = files_in_use or _no_files
        self.journal = PullJournal(store.records_dir / "pulling")  # what running pulls download
        self.running: dict[str, Pull] = {}
        self.history: deque[Pull] = deque(maxlen=_HISTORY)
        self._turns = _Turns(self.settings.max_parallel_pulls)
        self.events: EventBus | None = None  # where progress goes for GET /v1/admin/events
        self.closing = False  # set by close(): no pull starts after it, none would be cancelled
        # Folded repo -> set when the delete of one of its models ends (see `deleting`).
        self._deletes: dict[str, asyncio.Event] = {}

    def reload(self, settings: Settings) -> None:
        """SIGHUP: `min_free_disk_mib` holds for the pulls admitted from now on, `max_parallel_pulls` for
        the download turns from now on (a running download is not stopped when it shrinks)."""
        self.settings = settings
        self._turns.resize(settings.max_parallel_pulls)

    def start(self, requested: str) -> Pull:
        """Start pulling `requested`, or join the pull of it that is already running; refused
        (`shutting_down`) once close() began."""
        if self.closing:
            raise errors.shutting_down()
        ref = ModelRef.parse(requested)
        pull = self.running.get(ref.key)
        if pull is not None:
            return pull
        pull = Pull(ref, requested, self.events)
        self.running[ref.key] = pull
        pull.task = asyncio.get_running_loop().create_task(self._run(pull), name=f"pull {ref.key}")
        log.info("pull_started", model=ref.key)
        return pull

    def find(self, requested: str) -> Pull | None:
        """The running pull of a model, else its most recent finished one."""
        try:
            key = ModelRef.parse(requested).key  # the repo folded, the tag upper-case, as `running` is keyed
        except SupervisorError:
            key = requested
        if key in self.running:
            return self.running[key]
        name = fold(key)
        for pull in self.running.values():
            if pull.name is not None and fold(pull.name) == name:
                return pull
        ended = (p for p in reversed(self.history) if p.ref.key == key or fold(p.name or "") == name)
        return next(ended, None)

    @contextlib.contextmanager
    def deleting(self, repo: str) -> Iterator[None]:
        """Around the removal of a model of `repo` (entered with no pull of the repo running): a pull of it
        that starts meanwhile waits for the removal to end before it looks at the cache, as Ollama
        serializes a pull after a delete, so that it downloads afresh what the delete removed."""
        done = self._deletes[fold(repo)] = asyncio.Event()
        try:
            yield
        finally:
            del self._deletes[fold(repo)]
            done.set()

    def downloading(self, repo: str) -> bool:
        """True while a pull of `repo` downloads: huggingface_hub makes a download's folders before it
        starts and needs them when it ends, so no folder of the repo is pruned meanwhile."""
        return any(p.downloading for p in self.running.values() if p.of_repo(repo))

    def pulling(self, repo: str) -> bool:
        """True while a pull from the hub repo `repo` runs (planned or not: an unplanned one may yet
        produce, or replace, any model of the repo)."""
        return any(p.of_repo(repo) for p in self.running.values())

    async def cancel(self, requested: str, wait_s: float = CANCEL_WAIT_S) -> Pull | None:
        """Ask a running pull to stop, and wait up to `wait_s` for it to end (its partial files gone).

        Returns the pull, None if none runs. Its state tells what happened: CANCELLED; SUCCESS or FAILED
        when it ended before it could be stopped; RUNNING while it is still stopping (a transfer stalled
        on the network notices the cancel only with its next bytes). A pull that joined another is one
        download with it: both stop.
        """
        pull = self.find(requested)
        if pull is None or pull.done.is_set():
            return None
        _stop(pull)
        if pull.leader is not None:
            _stop(pull.leader)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await pull.done.wait()
        return pull

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        """Running and recent pulls, newest last, as JSON-able dicts."""
        return {
            "running": [p.describe() for p in self.running.values()],
            "recent": [p.describe() for p in self.history],
        }

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Cancel every running pull (at shutdown) and wait up to `wait_s` for their clean-up; a pull
        still running then has its task cancelled (which cleans up) and its download thread abandoned
        (a daemon thread: it does not hold up the exit). No pull starts after it began."""
        self.closing = True
        pulls = [p for p in self.running.values() if p.task is not None]
        for pull in pulls:
            _stop(pull)
        tasks = {cast(asyncio.Task[None], p.task): p for p in pulls}
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=wait_s)
        for task in pending:
            log.warning("pull_abandoned", model=tasks[task].ref.key, waited_s=wait_s)
            tasks[task].abandoned = True
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=wait_s)

    async def recover(self) -> None:
        """At start-up, before any pull begins: undo each pull that the journal says was downloading when
        the daemon stopped without ending it (killed, power lost). What it left goes as a failed pull's
        clean-up would remove it (see `Store.remove_crashed_pull`), then its entry; an entry whose
        clean-up fails stays for the next start-up, and a broken one is logged and left alone."""

        def recover_all() -> None:
            for path, entry in self.journal.left_behind().items():
                try:
                    keep = self.files_in_use()
                    repo_dir = self.store.repo_dir(entry.repo)
                    links = entry.links_made(repo_dir / "snapshots" / entry.commit)
                    self.store.remove_links(entry.repo, entry.commit, links, keep)
                    unclaimed = entry.unclaimed(repo_dir / "blobs")
                    counts = self.store.remove_crashed_pull(
                        entry.repo, entry.commit, entry.files, keep, unclaimed
                    )
                except (OSError, ValueError) as exc:
                    log.warning("pull_recovery_failed", repo=entry.repo, journal=str(path), error=str(exc))
                    continue
                self.journal.end(path)
                log.info(
                    "pull_recovered",
                    repo=entry.repo,
                    commit=entry.commit,
                    files=len(entry.files),
                    links=len(links),
                    **counts,
                )

        await asyncio.to_thread(recover_all)

    # --- the pull itself ---

    async def _run(self, pull: Pull) -> None:
        made = Made()  # what this pull's downloads put into the cache
        plan: PullPlan | None = None  # set once this pull may have written to the cache: to clean up
        commit: str | None = None
        entry: Path | None = None  # its journal entry, while its downloads may leave files behind
        try:
            pull.publish({"status": "pulling manifest"})
            repo, pinned, files = await _in_thread(_list_files, pull.ref.repo)
            pull.repo = repo
            commit = pinned
            chosen = plan_pull(ModelRef(repo, pull.ref.tag), files)  # the hub's spelling of the repo
            while (deleting := self._deletes.get(fold(repo))) is not None:
                await deleting.wait()
            present, free = await asyncio.to_thread(self._look_at_cache, chosen, pinned)
            # No await from here to `planned`: a pull of the same model that comes meanwhile joins this one.
            leader = next(
                (
                    p
                    for p in self.running.values()
                    if p.name is not None and fold(p.name) == fold(chosen.name) and p.leader is None
                ),
                None,
            )
            if leader is None:
                pull.needs = {f"sha256:{f.etag}": f.size for f in chosen.files if f.path not in present}
                self._check_space(pull, chosen, free)
            pull.sizes = {f"sha256:{f.etag}": f.size for f in chosen.files}
            pull.name = chosen.name
            pull.planned.set()
            if leader is not None:
                await self._follow(pull, leader)
                return
            async with self._turn(pull):
                plan = chosen
                entry = await asyncio.to_thread(self._begin_journal, plan, pinned)
                pull.downloading = True
                try:
                    downloaded, local = await self._download_all(pull, plan, pinned, made, entry)
                finally:
                    pull.downloading = False
            _check_cancel(pull)
            digests: dict[str, str] = {}
            for f in plan.files:
                pull.publish({"status": VERIFYING})
                # A file outside LFS has no sha256 on the hub: it is checked by its git blob id.
                git_id = f.sha256 is None
                actual, blob_id = await _in_thread(_digests, local[f.path], _verifying(pull), git_id)
                if f.sha256 is not None and actual != f.sha256:
                    raise SupervisorError(
                        "digest_mismatch",
                        f"{f.path} of hf.co/{plan.ref.repo} has sha256 {actual}, the hub says {f.sha256}",
                        502,
                    )
                if f.sha256 is None and blob_id != f.blob_id:
                    raise SupervisorError(
                        "digest_mismatch",
                        f"{f.path} of hf.co/{plan.ref.repo} has git blob id {blob_id}, "
                        f"the hub says {f.blob_id}",
                        502,
                    )
                digests[f.path] = actual
            _check_cancel(pull)
            pull.publish({"status": "writing manifest"})
            model, previous = await asyncio.to_thread(
                self._save, plan, pinned, digests, pull.requested, downloaded, local
            )
            made = Made()  # from here on the files belong to the store; a cancel comes too late
            await asyncio.to_thread(self.journal.end, entry)
            try:
                await self.on_stored()
            except Exception as exc:
                log.warning("store_refresh_failed", model=model.name, error=str(exc))
            if previous is not None and previous.commit != model.commit:
                await self._remove_old_snapshot(previous.repo, previous.commit, previous.downloaded)
            pull.finish(PullState.SUCCESS)
            log.info(
                "pull_succeeded",
                model=pull.ref.key,
                name=model.name,
                size=model.size,
                commit=pinned,
                adopted=[f.path for f in model.files if not f.downloaded],
            )
        except (PullCancelled, asyncio.CancelledError):
            await self._clean_up(pull, plan, commit, made, entry)
            pull.finish(PullState.CANCELLED, SupervisorError("pull_cancelled", "pull cancelled", 499))
            log.info("pull_cancelled", model=pull.ref.key)
        except Exception as exc:
            error = exc if isinstance(exc, SupervisorError) else _explain(pull.ref, exc)
            await self._clean_up(pull, plan, commit, made, entry)
            pull.finish(PullState.FAILED, error)
            log.warning("pull_failed", model=pull.ref.key, error=error.message)
        finally:
            self.running.pop(pull.ref.key, None)
            self.history.append(pull)

    async def _download_all(
        self,
        pull: Pull,
        plan: PullPlan,
        pinned: str,
        made: Made,
        entry: Path | None,
    ) -> tuple[set[str], dict[str, Path]]:
        """Each file of the plan into the cache at `pinned`: the paths this pull transferred, and where
        each file is. `made` gets what each download is to put there (see Made; a file whose blob was not
        there before its download stays `placed` only if this pull transferred it). The journal's `entry`
        gets the stamp of each blob this pull transferred as its download ends."""
        downloaded: set[str] = set()
        local: dict[str, Path] = {}
        # huggingface_hub names its files under the cache directory resolved (not the repo's directory).
        cache = await asyncio.to_thread(self.store.cache_dir.expanduser().resolve)
        snapshots = cache / self.store.repo_dir(plan.ref.repo).name / "snapshots"
        for f in plan.files:
            _check_cancel(pull)
            digest = f.etag
            progress = {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": f.size}
            pull.publish({**progress, "completed": 0})
            blob = self.store.repo_dir(plan.ref.repo) / "blobs" / digest
            link, lock = snapshots / pinned / f.path, self.store.lock_path(plan.ref.repo, digest)
            there = await asyncio.to_thread(_there, blob, link, lock)  # one thread hop for the three
            fresh = not there[0]
            if fresh:
                made.placed.append(f)
            elif not there[1]:
                made.linked.append(f)
            if not there[2]:
                made.locked.append(digest)
            path, transferred = await _in_thread(self._download, pull, plan, pinned, f, progress)
            if transferred:
                downloaded.add(f.path)
                if entry is not None:
                    await asyncio.to_thread(self.journal.stamp, entry, f.etag, blob)
            elif fresh:  # another pull of the repo put the blob there meanwhile: not this pull's
                made.placed.remove(f)
            elif entry is not None and not there[1]:
                await asyncio.to_thread(self.journal.stamp_link, entry, f.path, link)
            if _commit_of(path, snapshots) != pinned:
                raise SupervisorError(
                    "hub_error", f"hf.co/{plan.ref.repo}: the hub served {f.path} of another commit", 502
                )
            local[f.path] = path
            pull.publish({**progress, "completed": f.size})
        return downloaded, local

    @contextlib.asynccontextmanager
    async def _turn(self, pull: Pull) -> AsyncIterator[None]:
        """One of the `max_parallel_pulls` download turns; while it waits the pull is queued and says so
        (a cancel then cancels its task: nothing was written)."""
        if self._turns.locked():
            pull.state = PullState.QUEUED
            waiting = sum(1 for p in self.running.values() if p.state == PullState.QUEUED)
            pull.publish({"status": "queued"})
            log.info("pull_queued", model=pull.ref.key, name=pull.name, queued=waiting)
        await self._turns.acquire()
        try:
            pull.state = PullState.RUNNING
            _check_cancel(pull)
            yield
        finally:
            self._turns.release()

    def _look_at_cache(self, plan: PullPlan, commit: str) -> tuple[set[str], int]:
        """In a thread: the plan's files already in the cache at `commit`, and the bytes free on the
        cache's disk."""
        snapshot = self.store.repo_dir(plan.ref.repo) / "snapshots" / commit
        present = {f.path for f in plan.files if (snapshot / f.path).exists()}
        where = self.store.cache_dir
        while not where.exists() and where != where.parent:  # not made yet: its disk is its parent's
            where = where.parent
        return present, shutil.disk_usage(where).free

    def _begin_journal(self, plan: PullPlan, commit: str) -> Path | None:
        """In a thread, before the downloads: the journal's entry of the files whose blobs are not in the
        cache, and of those whose blobs are but not their links at `commit` (none written when all are
        there)."""
        repo_dir = self.store.repo_dir(plan.ref.repo)
        blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / commit
        fresh = tuple(f for f in plan.files if not os.path.lexists(blobs / f.etag))
        links = tuple(f for f in plan.files if f not in fresh and not os.path.lexists(snapshot / f.path))
        return self.journal.begin(plan.ref.repo, commit, fresh, links) if fresh or links else None

    def _check_space(self, pull: Pull, plan: PullPlan, free: int) -> None:
        """Refuse (507) a pull whose files would leave less than `min_free_disk_mib` free, counting what
        the pulls already admitted may still write."""
        keep = self.settings.min_free_disk_mib * 2**20
        others = sum(p.still_needs() for p in self.running.values() if p is not pull)
        available = free - keep - others
        if pull.needed and pull.needed > available:
            raise SupervisorError(
                "insufficient_storage",
                f"pull of {plan.name} needs {_mib(pull.needed)} MiB but only {_mib(max(0, available))} MiB "
                f"can be used on the disk of the HF cache ({_mib(free)} MiB free, "
                f"min_free_disk_mib {self.settings.min_free_disk_mib}"
                + (f", {_mib(others)} MiB for other pulls" if others else "")
                + "); free some space or delete models",
                507,
            )

    async def _follow(self, pull: Pull, leader: Pull) -> None:
        """Another spelling of a model being pulled: relay the leader's progress, and end as it ends."""
        pull.leader = leader
        log.info("pull_joined", model=pull.ref.key, name=leader.name, leader=leader.ref.key)
        async with contextlib.aclosing(leader.events(heartbeats=False)) as events:
            async for event in events:
                if event.get("status") != "success" and "error" not in event:
                    pull.publish(event)
        pull.finish(leader.state, leader.error)

    def _save(
        self,
        plan: PullPlan,
        commit: str,
        digests: dict[str, str],
        requested: str,
        downloaded: set[str],
        local: dict[str, Path],
    ) -> Saved:
        """In a thread: record the model (a file found in the cache is the daemon's if a record says the
        daemon downloaded it or a crashed pull's journal entry names it with its blob's stamp, else
        adopted), and the commit as the repo's `main` for other tools unless another tool's `main` is
        there."""
        owned = self.store.owned_blobs(plan.ref.repo)
        for crashed in self.journal.left_behind().values():
            if fold(crashed.repo) == fold(plan.ref.repo):
                blobs = self.store.repo_dir(crashed.repo) / "blobs"
                unclaimed = crashed.unclaimed(blobs)
                owned |= {os.path.realpath(blobs / f.etag) for f in crashed.files if f.etag not in unclaimed}
        downloaded = downloaded | {p for p, path in local.items() if os.path.realpath(path) in owned}
        model = new_stored_model(plan, commit, digests, requested, downloaded)
        previous = self.store.save(model)
        self.store.set_ref(model.repo, "main", model.commit)
        return Saved(model, previous)

    def _download(
        self, pull: Pull, plan: PullPlan, commit: str, f: RepoFile, progress: Event
    ) -> tuple[Path, bool]:
        """In a thread: one file of `commit` into the cache; the progress callback raises once the pull is
        cancelled. Also says whether the file was transferred (huggingface_hub opens a progress bar only
        then), that is whether this pull put it into the cache."""
        from huggingface_hub import hf_hub_download

        _prepare_hub_client()
        bar = _progress_bar(pull, progress, f.path)
        _expected.etag, _expected.commit = f.etag, commit
        try:
            path = hf_hub_download(
                plan.ref.repo,
                f.path,
                revision=commit,
                cache_dir=self.store.cache_dir,
                tqdm_class=cast(Any, bar),
            )
        finally:
            _expected.etag = _expected.commit = None
        if (size := os.path.getsize(path)) != f.size:  # sent now, or found in the cache under its hash
            got = f"the hub sent {size} bytes of {f.path}" if bar.opened else f"{f.path} has {size} bytes"
            raise HubRefused(f"{got}, its listing says {f.size}")
        return Path(path), bar.opened

    async def _clean_up(
        self,
        pull: Pull,
        plan: PullPlan | None,
        commit: str | None,
        made: Made,
        entry: Path | None,
    ) -> None:
        """After a failure or a cancel: what the pull `made` (the links it made to blobs already there, the
        files and blobs it put into the cache, not a blob that another running pull of the repo is to use,
        and the lock files its downloads made), then its journal
        `entry`, and the directories the pull used that are left empty, unless another pull of the repo
        is downloading. An entry whose files could not be removed stays, as a crashed pull's, and so
        does an abandoned pull's: its download thread may still be writing a partial file (the next
        start-up removes it)."""
        if plan is None or commit is None:
            return
        repo = plan.ref.repo
        others = [p for p in self.running.values() if p is not pull and p.of_repo(repo)]
        theirs = {digest.removeprefix("sha256:") for p in others for digest in p.sizes}

        def remove() -> None:
            keep = self.files_in_use()
            mine = [f.path for f in made.linked if f.etag not in theirs]  # not a link another pull is to use
            if mine:
                self.store.remove_links(repo, commit, mine, keep)
            if made.placed:
                paths = [f.path for f in made.placed]
                self.store.remove_unreferenced(repo, commit, paths, keep, prune=False)
                ours = [f.etag for f in made.placed]
                self.store.remove_blobs(repo, [etag for etag in ours if etag not in theirs], keep)
            self.store.remove_leftovers(repo, made.locked)  # another tool's lock file stays
            if pull.abandoned:
                self.journal.disown(entry)
            else:
                self.journal.end(entry)

        try:
            await asyncio.to_thread(remove)
            # On the loop, a few rmdirs: no download of the repo can begin while they run.
            if not self.downloading(repo):
                self.store.prune_after_pull(repo, commit, [f.path for f in plan.files])
        except (OSError, ValueError) as exc:
            self.journal.disown(entry)  # what it names is the daemon's, as a crashed pull's is
            log.warning("pull_clean_up_failed", model=repo, error=str(exc))

    async def _remove_old_snapshot(self, repo: str, commit: str, paths: list[str]) -> None:
        """A re-pull at a new commit: the replaced snapshot's files the daemon downloaded go, unless a
        record or a configured model uses them. The folders that leaves empty go too, unless another pull
        of the repo is downloading (huggingface_hub makes a download's folders before it starts, and
        needs them when it ends: another quant of the same commit, say)."""

        def remove() -> None:
            self.store.remove_unreferenced(repo, commit, paths, keep=self.files_in_use(), prune=False)

        try:
            await asyncio.to_thread(remove)
            # On the loop, a few rmdirs: no download of the repo can begin while they run.
            if not self.downloading(repo):
                self.store.prune_after_pull(repo, commit, paths)
            log.info("store_old_snapshot_removed", repo=repo, commit=commit)
        except (OSError, ValueError) as exc:
            log.warning("store_old_snapshot_kept", repo=repo, commit=commit, error=str(exc))


class _Turns:
    """A semaphore whose count a reload may change: at most `limit` held at once, handed out in order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        return self.held >= self.limit

    async def acquire(self) -> None:
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # set by _wake, which counted the turn as held for it
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a turn, but cancelled: pass it on
                self.release()
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.held -= 1
        self._wake()

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        while self.held < self.limit and self._waiters:
            self.held += 1
            self._waiters.popleft().set_result(None)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking `fn` in a daemon thread of its own: a download stuck on the network must not hold up
    the process's exit (asyncio.run joins the loop's default executor, without a deadline)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled: nobody wants it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(cast(T, result))

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name=f"pull-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return await future


def _progress_bar(pull: Pull, progress: Event, path: str) -> Any:
    """A tqdm stand-in for huggingface_hub: reports bytes to the pull, and stops the transfer on cancel.

    Under Xet huggingface_hub makes one bar for bytes written and one for bytes received unless the
    class has `update_transfer` (then it feeds both to one bar); and only the first bar of a file
    reports, so that two bars never make the progress of one digest go back and forth.
    """

    class Progress:
        opened = False  # huggingface_hub made a bar: it transferred the file, the cache had none

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = int(kwargs.get("initial") or 0)
            self.total = kwargs.get("total")
            self._sent_at = 0.0
            self._reports = not Progress.opened
            Progress.opened = True

        def __enter__(self) -> Progress:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            _check_cancel(pull)
            self.n += int(n or 0)
            if self.n > progress["total"]:  # the disk check counted the listed size: not a byte more
                raise HubRefused(f"the hub sent more of {path} than the {progress['total']} bytes it listed")
            if not self._reports:
                return
            now = time.monotonic()
            if now - self._sent_at >= _PROGRESS_EVERY_S or self.n >= progress["total"]:
                self._sent_at = now
                pull.loop.call_soon_threadsafe(pull.publish, {**progress, "completed": self.n})

        def update_transfer(self, n: float | None = 1) -> None:
            _check_cancel(pull)  # bytes received, ahead of those written: only a chance to stop

        def close(self) -> None:
            return None

        def __getattr__(self, name: str) -> Any:
            # Other tqdm methods huggingface_hub may call (set_description, refresh, ...): nothing to do.
            return lambda *args, **kwargs: None

    return Progress


def _check_cancel(pull: Pull) -> None:
    if pull.cancel_requested.is_set():
        raise PullCancelled


def _stop(pull: Pull) -> None:
    """Ask a pull to stop: its download thread sees the flag. One that has written nothing yet (queued,
    or still choosing its files, maybe waiting on a hub that does not answer) has its task cancelled: a
    thread it waits on only reads, and is left to end on its own."""
    pull.cancel_requested.set()
    if (pull.state == PullState.QUEUED or not pull.planned.is_set()) and pull.task is not None:
        pull.task.cancel()


def _no_files() -> set[str]:
    return set()


def _there(*paths: Path) -> list[bool]:
    return [os.path.lexists(path) for path in paths]


def _mib(size: int) -> int:
    return -(-size // 2**20)


@dataclass
class Made:
    """What a pull's downloads put into the cache, for the clean-up of a failure or a cancel: the files
    whose blobs were not there (`placed`), the links it made at its commit to blobs that were (`linked`),
    and the etags of the blobs whose lock files its downloads made (`locked`)."""

    placed: list[RepoFile] = field(default_factory=list)
    linked: list[RepoFile] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)


class Saved(NamedTuple):
    model: StoredModel
    previous: StoredModel | None  # the record it replaced


def _list_files(repo: str) -> tuple[str, str, list[RepoFile]]:
    """The hub's spelling of the repo id (the hub matches ids in any case), the commit its `main` is
    at, and the files of that commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile as HubFile

    _prepare_hub_client()
    api = HfApi()
    info = api.model_info(repo, revision="main", timeout=HUB_TIMEOUTS["read"])
    commit = info.sha
    if not commit:
        raise SupervisorError("hub_error", f"hf.co/{repo}: the hub named no commit for its main branch", 502)
    if not _COMMIT.fullmatch(commit):  # the downloads' revision: huggingface_hub makes paths of it
        raise HubRefused(
            f"hf.co/{repo}: the hub named its main branch's commit {commit[:100]!r}, not a commit id"
        )
    canonical = info.id if isinstance(info.id, str) and is_repo_id(info.id) else repo
    entries = api.list_repo_tree(canonical, recursive=True, revision=commit)
    return (
        canonical,
        commit,
        [
            RepoFile(e.path, e.size, e.lfs.sha256 if e.lfs is not None else None, e.blob_id)
            for e in entries
            if isinstance(e, HubFile)
        ],
    )


_hub_client_lock = threading.Lock()
_hub_client_set = False


def _prepare_hub_client() -> None:
    """Once, before the first call to the hub (not at import: huggingface_hub is loaded when first used).
    Once, under a lock, as two pulls' threads may come at the same moment: set_client_factory closes the
    shared client, under any download running on it (functools.cache ran it twice, and a download
    failed with EBADF)."""
    global _hub_client_set
    with _hub_client_lock:
        if _hub_client_set:
            return
        # Xet's chunk cache (hf_xet; up to 10 GB by default in some builds, in HF_HOME/xet) would keep a
        # second copy of what a pull downloads, which the disk check does not count; a pull fetches each
        # file once. An operator who wants it sets the variable.
        os.environ.setdefault("HF_XET_CHUNK_CACHE_SIZE_BYTES", "0")
        from huggingface_hub import constants, set_client_factory

        # huggingface_hub reads the body in 10 MiB pieces; 1 MiB ones give progress (a cancel) every MiB.
        constants.DOWNLOAD_CHUNK_SIZE = 2**20
        set_client_factory(_hub_client)
        _hub_client_set = True


def _hub_client() -> Any:
    """huggingface_hub's own client, with timeouts where it has none and the hub's answers checked."""
    from huggingface_hub.utils._http import default_client_factory

    client = default_client_factory()
    hooks = client.event_hooks
    client.event_hooks = {
        "request": [*hooks.get("request", []), _bound_timeouts],
        "response": [*hooks.get("response", []), _check_hub_answer],
    }
    # huggingface_hub closes its shared client on any connection error of any call (close_session), under
    # the downloads other pulls' threads run on it: they failed with EBADF mid-read. Not closed, the old
    # client serves what runs on it to the end and is collected then; new calls get a new one.
    client.close = _left_open  # type: ignore[method-assign]
    return client


def _left_open() -> None:
    """The hub client's close: nothing (see _hub_client)."""


def _bound_timeouts(request: Any) -> None:
    """huggingface_hub passes timeout=None on many calls (a listing, the model's info): fill them in."""
    given = request.extensions.get("timeout") or {}
    filled = {k: default if given.get(k) is None else given[k] for k, default in HUB_TIMEOUTS.items()}
    request.extensions = {**request.extensions, "timeout": filled}


def _check_hub_answer(response: Any) -> None:
    """Refuse an answer whose headers huggingface_hub would make a path of: `blobs/<ETag>`, its lock and
    partial file, `snapshots/<X-Repo-Commit>`, `.no_exist/<X-Repo-Commit>`. A hub that names a file by
    anything but a hex id, or by another id than the listing gave it, could write outside the cache."""
    commit = response.headers.get("X-Repo-Commit")
    if commit is not None and not _COMMIT.fullmatch(commit):
        raise HubRefused(f"the hub answered with the commit {commit[:100]!r}, not a commit id")
    # A download asked for the listed commit: served at another, huggingface_hub linked the file under
    # that one, where the failed pull's clean-up did not look (the blob stayed, named by nothing).
    pinned = getattr(_expected, "commit", None)
    if pinned and commit is not None and commit != pinned:
        raise HubRefused(f"the hub served a file of the commit {commit}, its listing {pinned}")
    request = response.request
    if request.method != "HEAD" or "/resolve/" not in request.url.path or response.status_code >= 400:
        return  # huggingface_hub takes a file's etag only from a successful HEAD of it
    location = response.headers.get("Location")
    if response.is_redirect and location and not urlparse(location).netloc:
        return  # a relative redirect, which huggingface_hub follows: the next answer names the file
    etag = response.headers.get("X-Linked-Etag") or response.headers.get("ETag")
    if etag is None:
        return  # huggingface_hub refuses it
    named = _HUB_ETAG.fullmatch(etag.strip())
    if named is None:
        raise HubRefused(f"the hub named a file by {etag[:100]!r}, not by its hash")
    expected = getattr(_expected, "etag", None)
    if expected and named.group(1) != expected:
        raise HubRefused(
            f"the hub named {request.url.path.rpartition('/resolve/')[2][:200]} by {named.group(1)}, "
            f"its listing by {expected}"
        )


def _commit_of(path: Path, snapshots: Path) -> str | None:
    """The commit of a file huggingface_hub put under the repo's `snapshots` directory (a folder of the
    repo may be named `snapshots` too); None if it is not under it."""
    try:
        return path.relative_to(snapshots).parts[0]
    except (ValueError, IndexError):
        return None


def _verifying(pull: Pull) -> Callable[[int], None]:
    """Called per chunk hashed: stops on cancel, and says "verifying" now and then (a multi-GB file takes
    a while) so that a client waiting on the stream does not time out."""
    sent_at = time.monotonic()

    def on_chunk(size: int) -> None:
        nonlocal sent_at
        _check_cancel(pull)
        if (now := time.monotonic()) - sent_at >= _VERIFYING_EVERY_S:
            sent_at = now
            pull.loop.call_soon_threadsafe(pull.publish, {"status": VERIFYING})

    return on_chunk


def _digests(path: Path, on_chunk: Callable[[int], None], git_id: bool) -> tuple[str, str | None]:
    """The file's sha256, and with `git_id` its git blob id (the sha1 of `blob <size>\\0` and the
    content); `on_chunk` may raise to stop (model_info.sha256_file cannot be stopped)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        blob = hashlib.sha1(b"blob %d\0" % os.fstat(f.fileno()).st_size) if git_id else None
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            if blob is not None:
                blob.update(chunk)
            on_chunk(len(chunk))
    return digest.hexdigest(), blob.hexdigest() if blob is not None else None


def _explain(ref: ModelRef, exc: Exception) -> SupervisorError:
    """A failure from the hub, the network or the disk, as an error a user can act on."""
    # Imported here, as everywhere in this module: the hub client loads when a pull first needs it.
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

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
    if isinstance(exc, httpx2.TimeoutException):
        return SupervisorError(
            "hub_error",
            f"pull of hf.co/{ref.repo} failed: the hub did not answer in time ({first_line})",
            502,
        )
    if isinstance(exc, HfHubHTTPError):
        return SupervisorError(
            "hub_error", f"pull of hf.co/{ref.repo} failed: the hub said {first_line}", 502
        )
    if isinstance(exc, httpx2.TransportError):  # no route, no DNS, refused: the hub was never reached
        from huggingface_hub import constants

        where = constants.ENDPOINT
        return SupervisorError(
            "hub_error",
            f"pull of hf.co/{ref.repo} failed: could not reach the hub at {where} ({first_line})",
            502,
        )
    return SupervisorError(
        "pull_failed", f"pull of hf.co/{ref.repo} failed: {type(exc).__name__}: {first_line}", 502
    )
