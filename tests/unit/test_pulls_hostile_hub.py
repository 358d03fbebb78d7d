"""Pulls from a hub that lies, stalls or sends too much: against the fake hub, in-process (no daemon).
Each must fail with a hub_error that leaves nothing behind, or be stoppable, never hang or write outside
the cache."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from supervisor import pulls as pulls_module
from supervisor.api import ollama_store
from supervisor.api.context import CATALOG, PULLS, SCHEDULER, STORE
from supervisor.api.middleware import errors_and_access_log
from supervisor.config import Settings
from supervisor.manifests import Registry
from supervisor.pulls import Pulls, PullState
from supervisor.scheduler import Scheduler
from supervisor.store import Catalog, Store
from tests.fakehub import FakeHub
from tests.local_app import serving as serving_app

Q4 = b"GGUF" * 2**18  # 1 MiB
FILE = "r-Q4_K_M.gguf"


async def refreshed() -> None:
    """A stand-in for the catalog's refresh."""


@pytest.fixture
def hub_repos() -> dict[str, dict[str, bytes]]:
    return {"o/r": {FILE: Q4}}


def cache_files(store: Store) -> list[str]:
    if not store.cache_dir.exists():
        return []
    return sorted(str(p.relative_to(store.cache_dir)) for p in store.cache_dir.rglob("*") if not p.is_dir())


def escaped(root: Path) -> list[Path]:
    return list(root.rglob("ESCAPED*"))


@contextlib.asynccontextmanager
async def serving(store: Store, pulls: Pulls) -> AsyncIterator[str]:
    """The store routes on a port of their own, with a scheduler that has nothing loaded."""
    app = web.Application(middlewares=[errors_and_access_log])
    app.add_routes(ollama_store.routes)
    app[STORE] = store
    app[PULLS] = pulls
    app[CATALOG] = Catalog(store, Registry(), Settings())
    app[SCHEDULER] = cast(Scheduler, SimpleNamespace(registry=Registry(), resolve=lambda name: None))
    async with serving_app(app) as url:
        yield url


async def pull_once(url: str, model: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/api/pull", json={"model": model, "stream": False}) as response,
    ):
        return response.status, await response.json()


# --- 1. the hub's headers name no path ---


@pytest.mark.parametrize(
    "etag",
    [
        '"../../../ESCAPED"',  # would be tmp/ESCAPED (blob), tmp/ESCAPED.lock (its lock)
        f'"{hashlib.sha256(b"another file").hexdigest()}"',  # a hash, but not of the file listed
    ],
)
async def test_a_hub_naming_a_file_by_anything_but_its_listed_hash_is_refused(
    hub: FakeHub, store: Store, tmp_path: Path, etag: str
) -> None:
    """huggingface_hub made blobs/<ETag> of the HEAD's header as it came: a `..` ETag wrote the file (and
    its lock) outside the cache, the pull succeeded, and a delete left them there."""
    hub.etags[FILE] = etag
    pulls = Pulls(store, on_stored=refreshed)
    async with serving(store, pulls) as url:
        status, body = await pull_once(url, "hf.co/o/r:Q4_K_M")
    assert status == 502, body
    assert set(body) == {"error"}
    assert "the hub named" in body["error"]
    assert escaped(tmp_path) == []
    assert cache_files(store) == []
    assert store.models() == []
    assert not hub.gets  # refused at the HEAD: nothing downloaded


async def test_a_commit_header_that_is_no_commit_id_is_refused(hub: FakeHub, store: Store) -> None:
    """huggingface_hub makes .no_exist/<X-Repo-Commit>/<file> and snapshots/<X-Repo-Commit> of it."""
    original = hub._commit
    hub._commit = lambda request: "../../../x" if "/resolve/" in request.path else original(request)  # type: ignore[method-assign]
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("hub_error", 502)
    assert cache_files(store) == []


# --- 2. a hub that stops answering ---


async def test_a_commit_in_the_model_info_that_is_no_commit_id_writes_nothing_outside_the_cache(
    hub: FakeHub, store: Store, tmp_path: Path
) -> None:
    """The model info's `sha` (GET /api/models/{repo}/revision/main) was the downloads' revision unchecked;
    huggingface_hub writes `refs/<revision>`, so `../../../victim.txt` replaced a file outside the cache
    (here tmp_path/victim.txt, beside it) with a commit id, before any byte was downloaded."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious operator data\n")
    original = hub._commit
    hub._commit = (  # type: ignore[method-assign]
        lambda request: "../../../victim.txt" if "/revision/" in request.path else original(request)
    )
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 20)
    assert victim.read_text() == "precious operator data\n"
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("hub_error", 502)


async def test_a_file_served_at_another_commit_than_listed_leaves_nothing_behind(
    hub: FakeHub, store: Store
) -> None:
    """The listing says one commit, the file's HEAD another (valid) one: huggingface_hub downloaded the
    blob and linked it under snapshots/<other>. The pull failed, but its clean-up looked for the link
    only at the listed commit and kept the blob as one a snapshot uses: named by no record and no
    journal entry, it was never removed. The answer is now refused before anything is written."""
    other = "f" * 40
    original = hub._commit
    hub._commit = (  # type: ignore[method-assign]
        lambda request: other if "/resolve/" in request.path else original(request)
    )
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("hub_error", 502)
    assert store.models() == []
    assert cache_files(store) == []
    assert not list((store.records_dir / "pulling").glob("*.json"))


async def test_a_hub_that_stops_answering_fails_the_pull(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub's client waits forever for the model's info: the pull stayed `running` for good."""
    monkeypatch.setitem(pulls_module.HUB_TIMEOUTS, "read", 0.5)
    hub.listing_held = asyncio.Event()
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 10)
    hub.listing_held.set()
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("hub_error", 502)
    assert "did not answer in time" in job.error.message
    assert cache_files(store) == []


async def test_a_pull_waiting_on_the_hub_for_its_files_can_be_cancelled(hub: FakeHub, store: Store) -> None:
    """A cancel only set a flag the download thread reads: a pull still listing the repo ignored it."""
    hub.listing_held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/r")
    await asyncio.sleep(0.5)
    assert await pulls.cancel("o/r", wait_s=5) is job
    assert job.state == PullState.CANCELLED
    assert pulls.running == {}
    hub.listing_held.set()  # the abandoned listing ends; nothing comes of it
    await asyncio.sleep(0.5)
    assert cache_files(store) == []
    assert store.models() == []


@contextlib.asynccontextmanager
async def streamed_pull_held_at_listing(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch, model: str
) -> AsyncIterator[tuple[aiohttp.ClientResponse, asyncio.Event]]:
    """A streamed `POST /api/pull` of `model` while the hub holds the repo's listing: the answer, begun
    0.2 s in (PLAN_WAIT_S), its status checked, and the event that lets the listing go."""
    monkeypatch.setattr(ollama_store, "PLAN_WAIT_S", 0.2)
    hub.listing_held = listing = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    async with (
        serving(store, pulls) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/api/pull", json={"model": model}) as response,
    ):
        assert response.status == 200
        yield response, listing


async def test_a_streamed_pull_says_something_while_the_hub_lists_the_repo(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer waited for the files to be chosen before it began: a client got nothing, not even
    headers, while the hub took its time."""
    monkeypatch.setattr(pulls_module, "HEARTBEAT_S", 0.2)
    async with streamed_pull_held_at_listing(hub, store, monkeypatch, "hf.co/o/r:Q4_K_M") as (
        response,
        listing,
    ):
        first = json.loads(await asyncio.wait_for(response.content.readline(), 5))
        again = json.loads(await asyncio.wait_for(response.content.readline(), 5))
        assert first == again == {"status": "pulling manifest"}
        listing.set()
        lines = [json.loads(line) for line in (await response.text()).splitlines()]
    assert lines[-1] == {"status": "success"}


async def test_a_slow_listing_that_fails_ends_the_stream_with_an_error_line(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with streamed_pull_held_at_listing(hub, store, monkeypatch, "hf.co/o/r:Q2_K") as (
        response,
        listing,
    ):
        assert json.loads(await response.content.readline()) == {"status": "pulling manifest"}
        listing.set()
        lines = [json.loads(line) for line in (await response.text()).splitlines()]
    assert "no GGUF file for 'Q2_K'" in lines[-1]["error"]


# --- 3. a tagged pull is found by its tag in any case ---


@pytest.mark.parametrize("asked", ["o/r:Q4_K_M", "hf.co/O/R:q4_k_m"])
async def test_a_tagged_pull_is_found_in_any_case_before_its_files_are_chosen(
    hub: FakeHub, store: Store, asked: str
) -> None:
    """The lookup folded the tag to lower case, the pulls are keyed by it upper-case: until the files were
    chosen, status and cancel of a tagged pull answered 404."""
    hub.listing_held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/r:Q4_K_M")
    await asyncio.sleep(0.2)
    assert pulls.find(asked) is job
    assert await pulls.cancel(asked, wait_s=5) is job
    assert job.state == PullState.CANCELLED
    assert pulls.find(asked) is job  # and in the history
    hub.listing_held.set()


# --- 4. a file of another size than listed ---

BIG = bytes(range(256)) * (16 * 2**20 // 256)  # 16 MiB


async def test_a_file_larger_than_listed_is_stopped_at_the_listed_size(hub: FakeHub, store: Store) -> None:
    """The disk check counts the listed size; the whole body was written anyway (and, with its true
    sha256 in the listing, stored)."""
    hub.add("o/big", {FILE: BIG})
    hub.sizes[FILE] = 1000
    hub.delay_per_chunk_s = 0.01
    job = Pulls(store, on_stored=refreshed).start("o/big:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 30)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("hub_error", 502)
    assert "than the 1000 bytes it listed" in job.error.message
    assert hub.sent[FILE] < len(BIG) // 2
    assert store.models() == []
    assert [f for f in cache_files(store) if "/blobs/" in f or "/snapshots/" in f] == []


async def test_a_file_smaller_than_listed_is_refused(hub: FakeHub, store: Store) -> None:
    hub.sizes[FILE] = len(Q4) + 10
    job = Pulls(store, on_stored=refreshed).start("o/r:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 30)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("hub_error", 502)
    assert f"the hub sent {len(Q4)} bytes" in job.error.message
    assert store.models() == []
    assert [f for f in cache_files(store) if "/blobs/" in f or "/snapshots/" in f] == []


# --- 7. files outside LFS are checked too ---

CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'


@pytest.mark.parametrize("corrupted", [False, True])
async def test_a_file_outside_lfs_is_checked_by_its_git_blob_id(
    hub: FakeHub, store: Store, corrupted: bool
) -> None:
    """The hub gives no sha256 of a file outside LFS (config.json, tokenizer.json): one that came
    corrupted was stored unchecked."""
    hub.add("o/st", {"config.json": CONFIG, "model.safetensors": b"weights" * 1000})
    hub.plain_files.add("config.json")
    if corrupted:
        hub.bodies["config.json"] = CONFIG.replace(b"Llama", b"Evil!")
    job = Pulls(store, on_stored=refreshed).start("o/st")
    await asyncio.wait_for(job.done.wait(), 20)
    if not corrupted:
        assert job.state == PullState.SUCCESS, job.error
        return
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("digest_mismatch", 502)
    assert "config.json of hf.co/o/st has git blob id" in job.error.message
    assert store.models() == []


async def test_a_connection_error_of_one_pull_leaves_the_others_downloads_running(hub: FakeHub) -> None:
    """huggingface_hub closes its shared client whenever a call fails to connect (close_session), and
    with it the sockets other pulls' threads were reading: another pull's download failed with EBADF."""
    from huggingface_hub.utils._http import close_session, get_session

    hub.delay_per_chunk_s = 0.01
    pulls_module._prepare_hub_client()

    def download() -> int:
        url = f"{hub.url}/o/r/resolve/main/{FILE}"
        with get_session().stream("GET", url) as response:
            pieces = response.iter_bytes(2**16)
            received = len(next(pieces))
            close_session()  # what another pull's connection error does, mid-download
            return received + sum(len(piece) for piece in pieces)

    assert await asyncio.to_thread(download) == len(Q4)


def test_xets_chunk_cache_is_off_unless_the_operator_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """hf_xet's chunk cache would hold a second copy of a pull's bytes beside the disk check's count."""
    monkeypatch.setattr(pulls_module, "_hub_client_set", False)
    monkeypatch.delenv("HF_XET_CHUNK_CACHE_SIZE_BYTES", raising=False)
    pulls_module._prepare_hub_client()
    assert os.environ["HF_XET_CHUNK_CACHE_SIZE_BYTES"] == "0"

    monkeypatch.setattr(pulls_module, "_hub_client_set", False)
    monkeypatch.setenv("HF_XET_CHUNK_CACHE_SIZE_BYTES", str(2**30))
    pulls_module._prepare_hub_client()
    assert os.environ["HF_XET_CHUNK_CACHE_SIZE_BYTES"] == str(2**30)
