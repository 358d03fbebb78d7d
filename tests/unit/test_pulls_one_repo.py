"""Pulls that share a repo with another pull or a delete, a failure inside a download, and pulls asked for
at shutdown: against the fake hub, in-process (no daemon)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from supervisor.api import ollama_store
from supervisor.api.context import CATALOG, PULLS, SCHEDULER, STORE
from supervisor.api.middleware import errors_and_access_log
from supervisor.config import Settings
from supervisor.errors import SupervisorError
from supervisor.manifests import Registry
from supervisor.pulls import Pull, Pulls, PullState
from supervisor.scheduler import Scheduler
from supervisor.store import Catalog, ModelRef, Store, StoredModel
from tests.fakehub import COMMIT, FakeHub
from tests.integration.harness import eventually
from tests.local_app import serving as serving_app

Q4 = b"GGUF" * 2**18  # 1 MiB
Q8 = b"GGUF" * 2**19  # 2 MiB


async def refreshed() -> None:
    """A stand-in for the catalog's refresh."""


@pytest.fixture
def hub_repos() -> dict[str, dict[str, bytes]]:
    return {"o/r": {"r-Q4_K_M.gguf": Q4, "r-Q8_0.gguf": Q8}}


def cache_files(store: Store) -> list[str]:
    return sorted(str(p.relative_to(store.cache_dir)) for p in store.cache_dir.rglob("*") if p.is_file())


def blob(store: Store, data: bytes) -> Path:
    return store.repo_dir("o/r") / "blobs" / hashlib.sha256(data).hexdigest()


# --- another pull of the same repo ---


async def test_a_failed_pull_does_not_break_another_pull_of_the_same_repo(hub: FakeHub, store: Store) -> None:
    """The failed pull's clean-up pruned every empty directory of the repo, among them the snapshot
    directory huggingface_hub made for the other pull's running download: its link could not be made."""
    hub.fail_files.add("r-Q4_K_M.gguf")
    hub.delay_per_chunk_s = 0.02
    pulls = Pulls(store, on_stored=refreshed)
    big = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "Q8's bytes to flow")
    small = pulls.start("o/r:Q4_K_M")
    await asyncio.wait_for(small.done.wait(), 20)
    assert small.state == PullState.FAILED
    await asyncio.wait_for(big.done.wait(), 30)
    assert big.state == PullState.SUCCESS, big.error
    assert [m.name for m in store.models()] == ["hf.co/o/r:Q8_0"]
    assert not blob(store, Q4).exists()


async def test_a_cancelled_pull_does_not_break_another_pull_of_the_same_repo(
    hub: FakeHub, store: Store
) -> None:
    hub.delay_per_chunk_s = 0.02
    pulls = Pulls(store, on_stored=refreshed)
    big = pulls.start("o/r:Q8_0")
    small = pulls.start("o/r:Q4_K_M")
    await eventually(lambda: hub.sent["r-Q4_K_M.gguf"] > 0 and hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes")
    assert await pulls.cancel("o/r:Q4_K_M") is small
    assert small.state == PullState.CANCELLED
    await asyncio.wait_for(big.done.wait(), 30)
    assert big.state == PullState.SUCCESS, big.error
    assert [m.name for m in store.models()] == ["hf.co/o/r:Q8_0"]
    assert not blob(store, Q4).exists()


@pytest.mark.parametrize("blob_before", [False, True])
async def test_a_failure_inside_a_download_removes_only_the_blob_it_put_there(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch, blob_before: bool
) -> None:
    """huggingface_hub fails after the blob is in (here: making its link): the blob went unrecorded and
    stayed, as the pull counted only downloads that returned. One that was there before the pull (another
    tool's) stays."""

    def no_link(*args: Any, **kwargs: Any) -> None:
        raise OSError("cannot make the link")

    monkeypatch.setattr("huggingface_hub.file_download._create_symlink", no_link)
    theirs = blob(store, Q4)
    if blob_before:
        theirs.parent.mkdir(parents=True)
        theirs.write_bytes(Q4)
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.FAILED
    assert theirs.exists() == blob_before
    expected = [str(theirs.relative_to(store.cache_dir))] if blob_before else []
    assert cache_files(store) == ["CACHEDIR.TAG", *expected]


async def test_a_failed_pull_leaves_another_tools_empty_directories(hub: FakeHub, store: Store) -> None:
    hub.fail_files.add("r-Q4_K_M.gguf")
    theirs = [store.repo_dir("o/r") / "snapshots" / ("f" * 40), store.repo_dir("o/r") / "mine"]
    for directory in theirs:
        directory.mkdir(parents=True)
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.FAILED
    assert all(directory.is_dir() for directory in theirs)
    assert not (store.repo_dir("o/r") / "snapshots" / COMMIT).exists()
    assert not (store.repo_dir("o/r") / "blobs").exists()


# --- a delete of a model of the repo ---


class SlowCatalog(Catalog):
    """Its delete waits, once begun, until the test lets it go on."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, Registry(), Settings())
        self.deleting = threading.Event()
        self.go_on = threading.Event()

    def delete(self, model: StoredModel) -> None:
        self.deleting.set()
        self.go_on.wait(10)
        super().delete(model)


@contextlib.asynccontextmanager
async def serving(store: Store, pulls: Pulls, catalog: Catalog) -> AsyncIterator[str]:
    """The store routes on a port of their own, with a scheduler that has nothing loaded."""
    app = web.Application(middlewares=[errors_and_access_log])
    app.add_routes(ollama_store.routes)
    app[STORE] = store
    app[PULLS] = pulls
    app[CATALOG] = catalog
    app[SCHEDULER] = cast(Scheduler, SimpleNamespace(registry=Registry(), resolve=lambda name: None))
    async with serving_app(app) as url:
        yield url


async def test_a_pull_asked_for_during_a_delete_waits_for_it_then_downloads_afresh(
    hub: FakeHub, store: Store
) -> None:
    """The pull used to run while the delete's thread removed the model: it adopted the files still there,
    saved its record, said success, and then the delete removed that record and the files."""
    catalog = SlowCatalog(store)
    pulls = Pulls(store, on_stored=refreshed)
    first = pulls.start("o/r:Q4_K_M")
    await asyncio.wait_for(first.done.wait(), 20)
    assert first.state == PullState.SUCCESS, first.error
    async with serving(store, pulls, catalog) as url, aiohttp.ClientSession() as http:

        async def delete() -> tuple[int, Any]:
            async with http.delete(f"{url}/api/delete", json={"model": "hf.co/o/r:Q4_K_M"}) as response:
                return response.status, await response.json()

        deleting = asyncio.create_task(delete())
        await eventually(catalog.deleting.is_set, 10, "the delete to begin")
        again = pulls.start("o/r:Q4_K_M")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(again.done.wait()), 1)
        assert not again.done.is_set()  # it waits for the delete
        catalog.go_on.set()
        assert await deleting == (200, {"status": "success"})
        await asyncio.wait_for(again.done.wait(), 20)
    assert again.state == PullState.SUCCESS, again.error
    [model] = store.models()
    assert [(f.path, f.downloaded) for f in model.files] == [("r-Q4_K_M.gguf", True)]
    assert hub.gets["o/r/r-Q4_K_M.gguf"] == 2  # downloaded afresh: the delete removed the first
    records = [json.loads(p.read_text()) for p in store.records_dir.glob("*.json")]
    assert [r["name"] for r in records] == ["hf.co/o/r:Q4_K_M"]


# --- shutdown ---


async def test_no_pull_starts_once_close_began(hub: FakeHub, store: Store) -> None:
    """close() cancels the pulls it finds; one started after it would be abandoned mid-file at the exit."""
    pulls = Pulls(store, on_stored=refreshed)
    await pulls.close()
    with pytest.raises(SupervisorError) as caught:
        pulls.start("o/r:Q4_K_M")
    assert (caught.value.code, caught.value.status) == ("shutting_down", 503)
    assert pulls.running == {}
    assert not hub.gets


# --- settings a SIGHUP changes ---


async def test_a_reload_applies_max_parallel_pulls_to_queued_pulls(hub: FakeHub, store: Store) -> None:
    """The pulls' turns were made once from the settings at start-up: SIGHUP changed nothing."""
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed, settings=Settings(max_parallel_pulls=1))
    first = pulls.start("o/r:Q4_K_M")
    await eventually(lambda: hub.sent["r-Q4_K_M.gguf"] > 0, 10, "the first download")
    second = pulls.start("o/r:Q8_0")
    await eventually(lambda: second.state == PullState.QUEUED, 10, "the second pull to queue")
    pulls.reload(Settings(max_parallel_pulls=2))
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "the second download to begin")
    hub.held.set()
    await asyncio.wait_for(asyncio.gather(first.done.wait(), second.done.wait()), 30)
    assert (first.state, second.state) == (PullState.SUCCESS, PullState.SUCCESS)


async def test_a_reload_applies_min_free_disk_mib_to_later_pulls(hub: FakeHub, store: Store) -> None:
    pulls = Pulls(store, on_stored=refreshed, settings=Settings(min_free_disk_mib=2**40))
    refused = pulls.start("o/r:Q4_K_M")
    await asyncio.wait_for(refused.done.wait(), 20)
    assert refused.error is not None
    assert refused.error.status == 507
    pulls.reload(Settings(min_free_disk_mib=0))
    again = pulls.start("o/r:Q4_K_M")
    await asyncio.wait_for(again.done.wait(), 20)
    assert again.state == PullState.SUCCESS, again.error


# --- a renamed repo ---


async def test_a_pull_by_a_repos_old_name_counts_as_a_pull_of_the_repo(hub: FakeHub, store: Store) -> None:
    """Its files go under the hub's (new) id, but only the name asked for was compared: a delete of a
    model of the repo was not refused while the pull wrote there."""
    hub.renamed["o/old"] = "o/r"
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/old:Q4_K_M")
    await eventually(lambda: hub.sent["r-Q4_K_M.gguf"] > 0, 10, "the download")
    assert pulls.pulling("o/r")
    assert pulls.pulling("O/Old")
    hub.held.set()
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.SUCCESS, job.error
    assert not pulls.pulling("o/r")


async def test_a_watcher_that_stops_reading_holds_the_latest_count_not_every_line() -> None:
    """Each follower of a pull (/api/pull's stream, /api/pull/status/...) had an unbounded queue: one whose
    client stopped reading (its socket full) kept every progress line, ten a second per file, for as long
    as the pull ran. A file's count now replaces the unread one before it; stages are all kept."""
    pull = Pull(ModelRef("o/r", "Q4_K_M"), "o/r:Q4_K_M")
    pull.publish({"status": "pulling manifest"})
    watcher = pull.events(heartbeats=False)
    assert (await anext(watcher))["status"] == "pulling manifest"  # then the client stops reading
    progress = {"status": "pulling 0123456789ab", "digest": "sha256:" + "0" * 64, "total": 10**10}
    for n in range(100_000):  # under three hours of one file's progress lines
        pull.publish({**progress, "completed": n})
    pull.publish({**progress, "digest": "sha256:" + "1" * 64, "completed": 5})
    pull.publish({"status": "verifying sha256 digest"})
    pull.finish(PullState.SUCCESS)
    assert [len(w) for w in pull._watchers] == [5]  # not 100,004
    read = [event async for event in watcher]
    assert [e.get("completed", e.get("status")) for e in read] == [
        99_999,
        5,
        "verifying sha256 digest",
        "success",
    ]
