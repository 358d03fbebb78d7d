"""Watch the manifests directory and ask for a reload when its files change (`watch_manifests: true`).

Polling, not inotify: a Kubernetes ConfigMap update writes a new hidden directory and swaps the `..data`
symlink that every `name.yaml -> ..data/name.yaml` link goes through, so the visible entries never change.
Each look records, per `*.yaml` / `*.yml`, the file its link resolves to and that file's identity and
mtime; any difference is a change. A change must hold still for one more look before the reload is asked
for (debounce: an editor's write-then-rename, a ConfigMap's several files). The scan runs in a thread.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import structlog

from supervisor.manifests import is_manifest_name

log = structlog.get_logger("watch")

POLL_INTERVAL_S = 2.0

# name -> (resolved path, device, inode, mtime ns, size), or None for a link that leads nowhere right now.
FileState = tuple[str, int, int, int, int] | None
Snapshot = dict[str, FileState]


def snapshot(directory: Path) -> Snapshot:
    """What the manifest files in `directory` are right now; an absent directory is an empty snapshot."""
    files: Snapshot = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return files
    for entry in entries:
        if not is_manifest_name(entry.name):
            continue
        try:
            target = os.path.realpath(entry.path)
            stat = os.stat(target)
        except OSError:
            files[entry.name] = None  # mid-swap, or a dangling link: still a state to compare
            continue
        if os.path.isdir(target):
            continue
        files[entry.name] = (target, stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return files


def changed_names(before: Snapshot, after: Snapshot) -> list[str]:
    """The manifest files added, removed or changed between two snapshots."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


class ManifestWatcher:
    """Polls the manifests directory while `enabled()` and calls `on_change` once per settled change.

    `directory` and `enabled` are asked on every look, so a reload that moves the directory or turns
    watching on or off takes effect without a restart. Turning it on takes a fresh baseline: what changed
    while it was off is not a change.
    """

    def __init__(
        self,
        directory: Callable[[], Path],
        enabled: Callable[[], bool],
        on_change: Callable[[list[str]], None],
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self._directory = directory
        self._enabled = enabled
        self._on_change = on_change
        self.interval_s = interval_s

    async def run(self) -> None:
        """Poll until cancelled."""
        baseline: Snapshot | None = None  # what the last reload (or the start) saw
        watched: Path | None = None
        pending: Snapshot | None = None  # a change seen once, waiting to hold still
        while True:
            if not self._enabled():
                baseline = pending = watched = None
            else:
                directory = self._directory()
                current = await asyncio.to_thread(snapshot, directory)
                if baseline is None or directory != watched:
                    if baseline is None:
                        log.info("manifest_watch_started", directory=str(directory), files=len(current))
                    baseline, watched, pending = current, directory, None
                elif current == baseline:
                    pending = None  # changed and changed back
                elif current != pending:
                    pending = current  # new, or still moving: look once more
                else:
                    names = changed_names(baseline, current)
                    baseline, pending = current, None
                    log.info("manifests_changed", directory=str(directory), files=names)
                    self._on_change(names)
            await asyncio.sleep(self.interval_s)
