"""A pull the daemon did not live to end (SIGKILL, power loss) leaves a journal entry: at the next start-up
what it downloaded goes, and a re-pull that meets the entry keeps those files as the daemon's. Against
the fake hub, in-process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import structlog
from huggingface_hub import hf_hub_download

from supervisor.pulls import Pull, Pulls, PullState
from supervisor.store import Store
from tests.fakehub import COMMIT, FakeHub, tree
from tests.integration.harness import eventually

REPO = "o/split"
SHARDS = [f"s-Q4_K_M-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
CONTENTS = [b"GGUF1" * 1000, b"GGUF2" * 1000, b"GGUF3" * 2**19]  # the last one 32 chunks of the hub's


async def refreshed() -> None:
    """A stand-in for the catalog's refresh."""


@pytest.fixture
def hub_repos() -> dict[str, dict[str, bytes]]:
    return {REPO: dict(zip(SHARDS, CONTENTS, strict=True))}


def blob(store: Store, n: int) -> Path:
    return store.repo_dir(REPO) / "blobs" / hashlib.sha256(CONTENTS[n]).hexdigest()


def link(store: Store, n: int) -> Path:
    return store.repo_dir(REPO) / "snapshots" / COMMIT / SHARDS[n]


def partials(store: Store) -> list[Path]:
    return [p for p in (store.repo_dir(REPO) / "blobs").glob("*") if p.name.endswith(".incomplete")]


def snapshot_files(store: Store) -> dict[str, bytes]:
    """The files of the snapshot, by path, with what they hold."""
    snapshot = store.repo_dir(REPO) / "snapshots" / COMMIT
    return {str(p.relative_to(snapshot)): p.read_bytes() for p in snapshot.rglob("*") if p.is_file()}


def journal(store: Store) -> list[Path]:
    return sorted((store.records_dir / "pulling").glob("*"))


async def pulled(pulls: Pulls, requested: str) -> Pull:
    job = pulls.start(requested)
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.SUCCESS, job.error
    return job


async def copied_while_shard_3_is_written(hub: FakeHub, live: Store, pulls: Pulls, tmp_path: Path) -> Store:
    """A pull of REPO into `live`, copied (`tmp_path/crashed`) while it writes shard 3, then cancelled."""
    hub.delay_per_chunk_s = 0.05
    job = pulls.start(REPO)
    await eventually(lambda: hub.sent[SHARDS[2]] > 0 and bool(partials(live)), 10, "shard 3 to be written")
    await asyncio.to_thread(shutil.copytree, tmp_path / "live", tmp_path / "crashed", symlinks=True)
    hub.delay_per_chunk_s = 0
    await pulls.cancel(REPO)
    assert job.state == PullState.CANCELLED
    return Store(tmp_path / "crashed" / "hub", tmp_path / "crashed" / "store")


async def crashed_mid_pull(hub: FakeHub, tmp_path: Path) -> Store:
    """The cache and the store as a daemon killed mid-pull leaves them: the operator had shard 1 before
    the pull (another tool downloaded it), the pull downloaded shard 2 and was writing shard 3. They are a
    copy of a real pull's directories taken while it writes shard 3: a SIGKILL leaves the files as they
    were at that instant, as no clean-up runs. The pull itself is then cancelled, in the original."""
    live = Store(tmp_path / "live" / "hub", tmp_path / "live" / "store")
    await asyncio.to_thread(hf_hub_download, REPO, SHARDS[0], cache_dir=live.cache_dir)
    store = await copied_while_shard_3_is_written(hub, live, Pulls(live, on_stored=refreshed), tmp_path)
    assert link(store, 1).resolve() == blob(store, 1)
    assert partials(store)
    assert not blob(store, 2).exists()
    return store


async def test_a_pull_journals_the_files_it_downloads_until_it_ends(hub: FakeHub, store: Store) -> None:
    await asyncio.to_thread(hf_hub_download, REPO, SHARDS[0], cache_dir=store.cache_dir)
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start(REPO)
    await eventually(lambda: bool(journal(store)), 10, "the pull to write its journal entry")
    [entry] = journal(store)
    written = json.loads(entry.read_text())
    assert (written["repo"], written["commit"]) == (REPO, COMMIT)
    assert [f["path"] for f in written["files"]] == SHARDS[1:]  # shard 1 was in the cache
    assert pulls.journal.left_behind() == {}  # a running pull's entry is no crashed pull's
    hub.held.set()
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.SUCCESS, job.error
    assert journal(store) == []

    hub.fail_files.add(SHARDS[2])
    store.delete(store.models()[0])
    failed = pulls.start(REPO)
    await asyncio.wait_for(failed.done.wait(), 20)
    assert failed.state == PullState.FAILED
    assert journal(store) == []


async def test_a_pull_abandoned_at_shutdown_leaves_its_entry_for_the_next_start_up(
    hub: FakeHub, store: Store
) -> None:
    """At shutdown a pull whose download does not stop in time is abandoned: its thread may still be
    writing a partial file, which its clean-up cannot remove. Its entry was removed all the same, and the
    partial file stayed for ever; the entry now stays, and the next start-up removes what is left."""
    # The body stops after its first chunk, small enough to come in one read: the download thread waits
    # in its next read, where it cannot see the stop flag, for longer than close() waits. (A slow hub
    # was not enough: a chunk's remaining reads could return at once, and the thread stop in time.)
    hub.chunk_bytes = 1024
    hub.held = asyncio.Event()
    earlier = set(threading.enumerate())  # another test's pull may still be ending: not waited for here
    pulls = Pulls(store, on_stored=refreshed)
    pulls.start(REPO)
    await eventually(lambda: bool(partials(store)), 10, "a partial download")
    await pulls.close(wait_s=0.1)
    assert len(journal(store)) == 1
    hub.held.set()  # the abandoned thread ends, as the process's exit would end it
    await eventually(
        lambda: not any(t.name.startswith("pull-") for t in set(threading.enumerate()) - earlier),
        10,
        "its thread to end",
    )
    await Pulls(store, on_stored=refreshed).recover()  # the next start-up
    assert partials(store) == []
    assert journal(store) == []
    assert not any((store.repo_dir(REPO) / "blobs").glob("*"))


async def test_a_re_pull_that_meets_a_crashed_pulls_entry_keeps_its_files_as_the_daemons(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The entry outlived start-up (as when its clean-up failed; here no start-up ran): the shard the
    crashed pull completed is in the cache, and the re-pull records it as downloaded, so a delete removes
    it; the operator's shard stays adopted."""
    store = await crashed_mid_pull(hub, tmp_path)

    await pulled(Pulls(store, on_stored=refreshed), REPO)

    [model] = store.models()
    assert [(f.path, f.downloaded) for f in model.files] == [
        (SHARDS[0], False),
        (SHARDS[1], True),
        (SHARDS[2], True),
    ]
    store.delete(model)
    assert not blob(store, 1).exists()
    assert not blob(store, 2).exists()
    assert snapshot_files(store) == {SHARDS[0]: CONTENTS[0]}


async def test_start_up_after_a_crash_removes_what_the_crashed_pull_left_and_nothing_else(
    hub: FakeHub, tmp_path: Path
) -> None:
    store = await crashed_mid_pull(hub, tmp_path)
    locks = store.cache_dir / ".locks" / store.repo_dir(REPO).name
    assert (locks / f"{blob(store, 2).name}.lock").exists()
    assert (locks / f"{blob(store, 0).name}.lock").exists()  # the other tool's download's
    refs = tree(store.repo_dir(REPO) / "refs")
    pulls = Pulls(store, on_stored=refreshed)

    with structlog.testing.capture_logs() as logged:
        await pulls.recover()

    assert partials(store) == []
    assert not (locks / f"{blob(store, 2).name}.lock").exists()
    assert (locks / f"{blob(store, 0).name}.lock").exists()
    assert not blob(store, 1).exists()
    assert not link(store, 1).is_symlink()
    assert snapshot_files(store) == {SHARDS[0]: CONTENTS[0]}
    assert tree(store.repo_dir(REPO) / "refs") == refs
    assert journal(store) == []
    [recovered] = [e for e in logged if e["event"] == "pull_recovered"]
    assert (recovered["repo"], recovered["files"]) == (REPO, 2)
    assert (recovered["removed"], recovered["kept"], recovered["partials"]) == (1, 0, 1)

    # A re-pull then downloads afresh what the crashed pull had, and owns it.
    await pulled(pulls, REPO)
    [model] = store.models()
    assert model.downloaded == SHARDS[1:]


async def test_a_blob_another_tool_completed_after_the_crash_is_left_with_its_link(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The crashed pull was writing shard 3; before the next start-up another tool (the hub's own client,
    as `hf download` would) downloads shard 3 into the same cache. Its blob has the name the entry
    names, but not the stamp the pull's own download would have left: it stays, with its link, and a
    re-pull adopts it. Shard 2, which the pull completed and stamped, still goes."""
    store = await crashed_mid_pull(hub, tmp_path)
    [entry] = journal(store)
    stamps = json.loads(entry.read_text())["downloaded"]
    assert list(stamps) == [blob(store, 1).name]  # shard 2's, written as its download ended
    await asyncio.to_thread(hf_hub_download, REPO, SHARDS[2], cache_dir=store.cache_dir)
    pulls = Pulls(store, on_stored=refreshed)

    with structlog.testing.capture_logs() as logged:
        await pulls.recover()

    [recovered] = [e for e in logged if e["event"] == "pull_recovered"]
    assert (recovered["removed"], recovered["unclaimed"], recovered["partials"]) == (1, 1, 1)
    assert not blob(store, 1).exists()
    assert link(store, 2).resolve() == blob(store, 2)
    assert snapshot_files(store) == {SHARDS[0]: CONTENTS[0], SHARDS[2]: CONTENTS[2]}
    assert partials(store) == []  # the crashed pull's partial download of shard 3 went all the same

    await pulled(pulls, REPO)
    [model] = store.models()
    assert [(f.path, f.downloaded) for f in model.files] == [
        (SHARDS[0], False),
        (SHARDS[1], True),
        (SHARDS[2], False),
    ]


NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


async def crashed_mid_re_pull(hub: FakeHub, tmp_path: Path) -> Store:
    """As `crashed_mid_pull`, for a re-pull at a new commit: the daemon had pulled the model at COMMIT,
    the hub moved to NEW_COMMIT with a new shard 3, and the re-pull had linked shards 1 and 2 (their
    blobs were there) into NEW_COMMIT and was writing shard 3."""
    live = Store(tmp_path / "live" / "hub", tmp_path / "live" / "store")
    pulls = Pulls(live, on_stored=refreshed)
    await pulled(pulls, REPO)
    hub.commit = NEW_COMMIT
    hub.add(REPO, {SHARDS[2]: b"GGUF4" * 2**19})
    store = await copied_while_shard_3_is_written(hub, live, pulls, tmp_path)
    new = store.repo_dir(REPO) / "snapshots" / NEW_COMMIT
    assert [(new / shard).resolve() for shard in SHARDS[:2]] == [blob(store, 0), blob(store, 1)]
    return store


async def test_start_up_after_a_crashed_re_pull_removes_the_links_it_made_to_blobs_already_there(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The journal named only the blobs a pull downloads: the links a crashed re-pull had made to the
    model's blobs stayed in the new commit's folder, and kept those blobs in use after the model was
    deleted, for ever. They now go at start-up, as a failed pull's clean-up removes them."""
    store = await crashed_mid_re_pull(hub, tmp_path)
    pulls = Pulls(store, on_stored=refreshed)

    with structlog.testing.capture_logs() as logged:
        await pulls.recover()

    [recovered] = [e for e in logged if e["event"] == "pull_recovered"]
    assert (recovered["files"], recovered["links"], recovered["partials"]) == (1, 2, 1)
    assert not (store.repo_dir(REPO) / "snapshots" / NEW_COMMIT).exists()
    assert snapshot_files(store) == dict(zip(SHARDS, CONTENTS, strict=True))  # the model at COMMIT
    store.delete(store.models()[0])
    assert not store.repo_dir(REPO).exists(), sorted(tree(store.cache_dir))


async def test_a_link_made_again_by_another_tool_after_the_crash_stays(hub: FakeHub, tmp_path: Path) -> None:
    """After the crash another tool made shard 1's link at the new commit anew (`hf download` at that
    commit): it is not the link the pull made (its stamp differs), and it stays; shard 2's goes."""
    store = await crashed_mid_re_pull(hub, tmp_path)
    new = store.repo_dir(REPO) / "snapshots" / NEW_COMMIT
    target = os.readlink(new / SHARDS[0])
    (new / SHARDS[0]).unlink()
    (new / SHARDS[0]).symlink_to(target)
    os.utime(new / SHARDS[0], ns=(0, 0), follow_symlinks=False)  # made at another instant than the pull's

    await Pulls(store, on_stored=refreshed).recover()

    assert (new / SHARDS[0]).resolve() == blob(store, 0)
    assert not (new / SHARDS[1]).is_symlink()


async def test_a_re_pull_adopts_a_blob_whose_stamp_changed_since_the_crash(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The crashed pull completed shard 2; then it was written again (another tool replaced it): a re-pull
    that meets the entry adopts it instead of counting it as the daemon's, and a delete leaves it."""
    store = await crashed_mid_pull(hub, tmp_path)
    info = blob(store, 1).stat()
    os.utime(blob(store, 1), ns=(info.st_atime_ns, info.st_mtime_ns + 1))

    await pulled(Pulls(store, on_stored=refreshed), REPO)

    [model] = store.models()
    assert [f.downloaded for f in model.files] == [False, False, True]
    store.delete(model)
    assert blob(store, 1).exists()


async def test_a_broken_or_hostile_journal_removes_nothing_and_start_up_goes_on(
    hub: FakeHub, store: Store, tmp_path: Path
) -> None:
    await asyncio.to_thread(hf_hub_download, REPO, SHARDS[0], cache_dir=store.cache_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep me")
    etag = blob(store, 0).name
    good = {"path": SHARDS[0], "size": len(CONTENTS[0]), "sha256": etag, "blob_id": ""}
    entries: dict[str, object] = {
        "not-json": "{{{ not json",
        "a-list": [],
        "repo-climbs": {"repo": "../../outside", "commit": COMMIT, "files": [good]},
        "repo-with-tag": {"repo": "o/split:Q4_K_M", "commit": COMMIT, "files": [good]},
        "commit-climbs": {"repo": REPO, "commit": "../../../../outside", "files": [good]},
        "path-climbs": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [{**good, "path": "../../../../outside/victim"}],
        },
        "absolute-path": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [{**good, "path": str(outside / "victim")}],
        },
        "blob-climbs": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [{**good, "sha256": "../../../outside/victim"}],
        },
        "git-id-climbs": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [{**good, "sha256": None, "blob_id": "../../../outside/victim"}],
        },
        "size-a-string": {"repo": REPO, "commit": COMMIT, "files": [{**good, "size": "1"}]},
        "link-climbs": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [],
            "links": [{**good, "path": "../../../../outside/victim"}],
        },
        "stamp-of-another-link": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [],
            "links": [good],
            "linked": {"other.gguf": {"size": 1, "mtime_ns": 1}},
        },
        "stamp-of-another-blob": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [good],
            "downloaded": {"0" * 64: {"size": 1, "mtime_ns": 1}},
        },
        "stamp-not-numbers": {
            "repo": REPO,
            "commit": COMMIT,
            "files": [good],
            "downloaded": {etag: {"size": "1", "mtime_ns": 1}},
        },
    }
    folder = store.records_dir / "pulling"
    folder.mkdir(parents=True)
    for name, content in entries.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / f"{name}.json").write_text(text)
    (folder / "a-folder.json").mkdir()
    before = tree(tmp_path)

    with structlog.testing.capture_logs() as logged:
        await Pulls(store, on_stored=refreshed).recover()

    # Nothing outside the journal changed; in it, each broken entry was set aside under a new name, with
    # its content, so that it is reported once (the folder stays as it is, and is reported again).
    invalid = [e for e in logged if e["event"] == "pull_journal_invalid"]
    assert len(invalid) == len(entries) + 1
    assert all(e["log_level"] == "warning" for e in invalid)
    assert not [e for e in logged if e["event"] == "pull_recovered"]
    renamed = {e["journal"]: e["kept_as"] for e in invalid}
    assert renamed.pop(str(folder / "a-folder.json")) is None
    after = tree(tmp_path)
    for journal, kept_as in renamed.items():
        assert kept_as.endswith(".invalid")
        moved = str((folder / kept_as).relative_to(tmp_path))
        assert after.pop(moved) == before.pop(str(Path(journal).relative_to(tmp_path)))
    assert after == before

    with structlog.testing.capture_logs() as again:
        await Pulls(store, on_stored=refreshed).recover()
    assert [e["journal"] for e in again if e["event"] == "pull_journal_invalid"] == [
        str(folder / "a-folder.json")
    ]
