"""The manifests watcher: what counts as a change, the ConfigMap symlink swap, and the debounce."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from supervisor.watch import ManifestWatcher, changed_names, snapshot


def configmap(directory: Path, version: str, files: dict[str, str]) -> None:
    """Lay out `files` the way the kubelet does: `..<version>/`, `..data -> ..<version>`, and one
    `name -> ..data/name` link per key, with `..data` swapped atomically by a rename."""
    (directory / f"..{version}").mkdir()
    for name, text in files.items():
        (directory / f"..{version}" / name).write_text(text)
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    (directory / "..data_tmp").symlink_to(f"..{version}")
    os.replace(directory / "..data_tmp", directory / "..data")


def test_snapshot_sees_only_manifest_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\n")
    (tmp_path / "b.yml").write_text("name: b\n")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "examples.yaml.example").write_text("x")
    (tmp_path / "dir.yaml").mkdir()
    assert sorted(snapshot(tmp_path)) == ["a.yaml", "b.yml"]


def test_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert snapshot(tmp_path / "gone") == {}


def test_an_edit_a_new_file_and_a_removal_are_changes(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\n")
    (tmp_path / "b.yaml").write_text("name: b\n")
    before = snapshot(tmp_path)
    (tmp_path / "a.yaml").write_text("name: a\nctx_size: 4096\n")
    (tmp_path / "b.yaml").unlink()
    (tmp_path / "c.yaml").write_text("name: c\n")
    assert changed_names(before, snapshot(tmp_path)) == ["a.yaml", "b.yaml", "c.yaml"]


def test_an_untouched_directory_has_no_changes(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\n")
    assert changed_names(snapshot(tmp_path), snapshot(tmp_path)) == []


def test_a_configmap_swap_is_a_change_though_the_links_stay(tmp_path: Path) -> None:
    configmap(tmp_path, "v1", {"models.yaml": "name: a\n"})
    before = snapshot(tmp_path)
    link_before = os.readlink(tmp_path / "models.yaml")
    configmap(tmp_path, "v2", {"models.yaml": "name: a\n"})  # same text, same size: a new file all the same
    assert os.readlink(tmp_path / "models.yaml") == link_before
    assert changed_names(before, snapshot(tmp_path)) == ["models.yaml"]


def test_a_dangling_link_is_recorded_not_raised(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").symlink_to("nowhere.yaml")
    assert snapshot(tmp_path) == {"a.yaml": None}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.event = asyncio.Event()

    def __call__(self, names: list[str]) -> None:
        self.calls.append(names)
        self.event.set()

    async def next_call(self) -> list[str]:
        await asyncio.wait_for(self.event.wait(), 10)  # a deadline, not a threshold
        self.event.clear()
        return self.calls[-1]


async def _looks(watcher: ManifestWatcher, count: int) -> None:
    """Let the watcher look `count` more times (each look is one scan plus one sleep)."""
    for _ in range(count):
        await asyncio.sleep(watcher.interval_s * 2)


async def test_the_watcher_reports_one_settled_change(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\n")
    recorder = Recorder()
    watcher = ManifestWatcher(lambda: tmp_path, lambda: True, recorder, interval_s=0.01)
    task = asyncio.ensure_future(watcher.run())
    try:
        await _looks(watcher, 3)
        assert recorder.calls == []  # the first look is the baseline, not a change
        (tmp_path / "b.yaml").write_text("name: b\n")
        assert await recorder.next_call() == ["b.yaml"]
        await _looks(watcher, 3)
        assert recorder.calls == [["b.yaml"]]  # once, not on every look
        configmap(tmp_path, "v1", {"c.yaml": "name: c\n"})
        assert await recorder.next_call() == ["c.yaml"]
    finally:
        task.cancel()


async def test_a_disabled_watcher_reports_nothing_and_restarts_from_a_fresh_baseline(tmp_path: Path) -> None:
    enabled = False
    recorder = Recorder()
    watcher = ManifestWatcher(lambda: tmp_path, lambda: enabled, recorder, interval_s=0.01)
    task = asyncio.ensure_future(watcher.run())
    try:
        (tmp_path / "a.yaml").write_text("name: a\n")
        await _looks(watcher, 3)
        enabled = True
        await _looks(watcher, 3)
        assert recorder.calls == []  # what changed while off is the new baseline
        (tmp_path / "a.yaml").write_text("name: a\nctx_size: 8\n")
        assert await recorder.next_call() == ["a.yaml"]
    finally:
        task.cancel()
