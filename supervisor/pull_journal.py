"""The journal of pulls in progress: what a pull is about to put into the cache, written before it does.

A pull writes its record only when it ends, so a daemon killed mid-pull (SIGKILL, power loss) would leave
files that nothing says are the daemon's: a re-pull would adopt them as the operator's, and a partial
download (`blobs/<etag>.incomplete`, `blobs/<etag>.<random>.incomplete`) would stay forever. So before
it downloads, a pull writes an entry in `<store_dir>/pulling/` (atomically, like the records): the repo,
the commit, the files of the plan whose blobs were not in the cache (those it would record as
downloaded), and those whose blobs were there but not their links at the commit (the pull only links
them). As each of those downloads ends, the entry gets the blob's stamp (its size and modification
time, to the nanosecond), and as each of those links is made, the link's: the file is the daemon's only
while it still has that stamp. The entry goes
when the pull ends: after its record is written, or after a failure's or a cancel's clean-up. One that no
running pull of this process wrote is a crashed pull's (or one whose clean-up failed).

At start-up, before any pull can begin, `Pulls.recover` undoes each crashed pull as a failed pull's
clean-up would: of the files its entry names, the snapshot links and blobs that no record, other snapshot
or configured model uses go, with the partial downloads and lock files of their blobs (not while a
download holds the lock), and the links it made to blobs already there (a link left would keep the blob in
use for ever), then the entry. A blob or link that is there without the stamp the pull left stays (a blob
with its link): another tool completed or made it after the crash (or the daemon did, in the instant
between the download's end and the stamp's write, and then the file is left to the operator, as an adopted
one is). A re-pull downloads afresh what that removed (the huggingface_hub the daemon uses names each
download's partial file anew: it resumes none). A pull that meets an entry left over all the same (its
clean-up failed) counts the files it names whose blobs have their stamps as the daemon's, as it does those
a record says the daemon downloaded. An entry is read as untrusted: it must hold a repo id, a commit id
and per file a safe relative path and hex blob ids, or it is logged, ignored and renamed out of the
journal (`<name>.<random>.invalid`, so that it is reported once), and nothing it names is touched.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import structlog
from pydantic import TypeAdapter

from supervisor.store import RepoFile, atomic_write, is_commit, is_repo_id, safe_repo_path, valid_ids

log = structlog.get_logger("pulls")


@dataclass(frozen=True)
class BlobStamp:
    """What a blob's download left, to tell the file apart from one another tool writes later under the
    same name (the blob's sha256): its size and its modification time to the nanosecond. An inode number
    would say more, but a copy of the cache (a backup restored) keeps the daemon's files its own."""

    size: int
    mtime_ns: int

    @classmethod
    def of(cls, blob: Path) -> BlobStamp | None:
        """The stamp of the file at `blob` (not followed if a link), None if none is there."""
        return cls._of(blob, stat.S_ISREG)

    @classmethod
    def of_link(cls, link: Path) -> BlobStamp | None:
        """The stamp of the symlink at `link` itself, None if there is none."""
        return cls._of(link, stat.S_ISLNK)

    @classmethod
    def _of(cls, path: Path, is_kind: Callable[[int], bool]) -> BlobStamp | None:
        try:
            info = path.lstat()
        except FileNotFoundError:
            return None
        return cls(info.st_size, info.st_mtime_ns) if is_kind(info.st_mode) else None


@dataclass(frozen=True)
class JournalEntry:
    """A pull that is downloading: the files of `repo` at `commit` whose blobs were not in the cache, and
    the stamps of the blobs of those it has downloaded, by etag; the files it links to blobs that were
    there (`links`), and the stamps of the links it has made, by path. (An entry written before `links`
    was has none: it is read as one with none.)"""

    repo: str
    commit: str
    files: tuple[RepoFile, ...]
    downloaded: dict[str, BlobStamp] = field(default_factory=dict)
    links: tuple[RepoFile, ...] = ()
    linked: dict[str, BlobStamp] = field(default_factory=dict)

    def links_made(self, snapshot: Path) -> list[str]:
        """The paths of the links under `snapshot` (the commit's folder) that still have the stamp this
        pull's making of them left: the daemon's to remove."""
        return [
            f.path
            for f in self.links
            if f.path in self.linked and BlobStamp.of_link(snapshot / f.path) == self.linked[f.path]
        ]

    def unclaimed(self, blobs: Path) -> set[str]:
        """The etags of the files whose blob is in `blobs` without the stamp this pull's download left:
        not the daemon's to remove."""
        return {
            f.etag
            for f in self.files
            if os.path.lexists(blobs / f.etag) and BlobStamp.of(blobs / f.etag) != self.downloaded.get(f.etag)
        }


_ENTRY = TypeAdapter(JournalEntry)


class PullJournal:
    """The entries under `directory`, one file each, and which of them this process's pulls own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._mine: dict[str, JournalEntry] = {}  # the entries this process wrote and has not ended

    def begin(
        self, repo: str, commit: str, files: tuple[RepoFile, ...], links: tuple[RepoFile, ...] = ()
    ) -> Path:
        """Write a pull's entry before it downloads `files` and links `links` (in a thread); returns its
        file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{secrets.token_hex(8)}.json"
        entry = JournalEntry(repo, commit, files, links=links)
        self._mine[path.name] = entry  # before it exists: another pull must never take it for a crashed one
        _write(path, entry)
        return path

    def stamp(self, path: Path, etag: str, blob: Path) -> None:
        """Add the stamp of `blob`, which the entry's pull has just downloaded, to its entry (in a thread).
        Not for a blob the entry does not name (it was in the cache when the entry was written)."""
        stamp = BlobStamp.of(blob)
        if stamp is not None:
            self._update(
                path,
                lambda e: etag in {f.etag for f in e.files},
                lambda e: replace(e, downloaded={**e.downloaded, etag: stamp}),
            )

    def stamp_link(self, path: Path, file: str, link: Path) -> None:
        """Add the stamp of `link`, which the entry's pull has just made to a blob already there, to its
        entry (in a thread). Not for a file the entry does not name among its links."""
        stamp = BlobStamp.of_link(link)
        if stamp is not None:
            self._update(
                path,
                lambda e: file in {f.path for f in e.links},
                lambda e: replace(e, linked={**e.linked, file: stamp}),
            )

    def _update(
        self,
        path: Path,
        names: Callable[[JournalEntry], bool],
        changed: Callable[[JournalEntry], JournalEntry],
    ) -> None:
        """Write the entry at `path` `changed`, if it is one of this process's and it `names` the file."""
        entry = self._mine.get(path.name)
        if entry is None or not names(entry):
            return
        entry = changed(entry)
        self._mine[path.name] = entry
        _write(path, entry)

    def end(self, path: Path | None) -> None:
        """Remove an entry: its pull has a record, or left nothing behind. One that cannot be removed
        stays, for the next start-up (which finds nothing of it left to remove)."""
        if path is None:
            return
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("pull_journal_kept", journal=str(path), error=str(exc))
        self._mine.pop(path.name, None)

    def disown(self, path: Path | None) -> None:
        """Leave an entry as a crashed pull's: its pull ended, but its clean-up could not finish."""
        if path is not None:
            self._mine.pop(path.name, None)

    def left_behind(self) -> dict[Path, JournalEntry]:
        """The entries that no running pull of this process owns (crashed pulls', or ones whose clean-up
        failed), each checked; one that is not what a pull writes is logged and left out."""
        try:
            files = sorted(self.directory.glob("*.json")) if self.directory.is_dir() else []
        except OSError as exc:
            log.warning("pull_journal_unreadable", directory=str(self.directory), error=str(exc))
            return {}
        found: dict[Path, JournalEntry] = {}
        for path in files:
            if path.name in self._mine:
                continue
            try:
                entry = _ENTRY.validate_json(path.read_bytes(), strict=True)
                _check(entry)
            except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
                kept = _set_aside(path)
                log.warning("pull_journal_invalid", journal=str(path), error=str(exc)[:300], kept_as=kept)
                continue
            found[path] = entry
        return found


def _write(path: Path, entry: JournalEntry) -> None:
    atomic_write(path, json.dumps(asdict(entry), indent=2))


def _set_aside(path: Path) -> str | None:
    """An entry that is not what a pull writes, renamed out of the journal's `*.json` (kept, for whoever
    wants to know how it came there), so that it is reported once, not at every start and every pull.
    Only a file is moved; the new name, or None when it stays (a folder, or a rename that failed)."""
    if path.is_symlink() or not path.is_file():
        return None
    target = path.with_name(f"{path.stem}.{secrets.token_hex(4)}.invalid")
    try:
        path.rename(target)
    except OSError:
        return None
    return target.name


def _check(entry: JournalEntry) -> None:
    """Raise ValueError unless every name in the entry is one the cache may have: nothing it names may
    lead out of the repo's directory."""
    if not is_repo_id(entry.repo):
        raise ValueError(f"not a repo id: {entry.repo[:100]!r}")
    if not is_commit(entry.commit):
        raise ValueError(f"not a commit id: {entry.commit[:100]!r}")
    for f in (*entry.files, *entry.links):
        if not safe_repo_path(f.path) or not valid_ids(f):
            raise ValueError(f"not a file of a repo: {f.path[:100]!r}")
    if not entry.downloaded.keys() <= {f.etag for f in entry.files}:
        raise ValueError("a stamp of a blob that is not one of the entry's files")
    if not entry.linked.keys() <= {f.path for f in entry.links}:
        raise ValueError("a stamp of a link that is not one of the entry's links")
