"""The store deletes only what it owns, pulls are bounded (queue, disk), and a repo in any case is one
pull: against the fake hub, in-process (no daemon)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download

from supervisor.config import Settings
from supervisor.manifests import LlamaServerManifest, Registry, VllmManifest
from supervisor.pulls import Pull, Pulls, PullState
from supervisor.store import Catalog, Store, StoredModel, _slug
from tests.fakehub import COMMIT, FakeHub, tree
from tests.integration.harness import eventually

NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
Q8 = b"GGUF" * 2**19  # 2 MiB


async def refreshed() -> None:
    """A stand-in for the catalog's refresh."""


@pytest.fixture
def hub_repos() -> dict[str, dict[str, bytes]]:
    return {
        "o/r": {"r-Q4_K_M.gguf": b"GGUF" * 1000, "r-Q8_0.gguf": Q8},
        "o/st": {"config.json": b"{}", "model.safetensors": b"\0" * 1000, "README.md": b"hi"},
        "victim/model": {"victim-Q4_K_M.gguf": b"GGUF" * 1000},
    }


def catalog_with(store: Store, *manifests: LlamaServerManifest | VllmManifest) -> Catalog:
    registry = Registry(models={m.name: m for m in manifests})
    return Catalog(store, registry, Settings())


async def another_tool_downloads(store: Store, repo: str, filename: str) -> Path:
    """What another program does: huggingface_hub's download by branch, which writes `refs/main`."""
    path = await asyncio.to_thread(hf_hub_download, repo, filename, cache_dir=store.cache_dir)
    return Path(path)


async def pulled(pulls: Pulls, requested: str) -> Pull:
    job = pulls.start(requested)
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.SUCCESS, job.error
    return job


# --- adopted files ---


async def test_a_pull_of_files_another_tool_cached_adopts_them_and_delete_leaves_them(
    hub: FakeHub, store: Store
) -> None:
    """The issue's attack: another tool's file, served by a manifest model, pulled then deleted."""
    theirs = await another_tool_downloads(store, "victim/model", "victim-Q4_K_M.gguf")
    repo_dir = store.repo_dir("victim/model")
    ref = repo_dir / "refs" / "main"
    ref_inode = ref.stat().st_ino
    before = tree(repo_dir)
    manifest = LlamaServerManifest(name="victim", engine="llama-server", model=theirs)
    catalog = catalog_with(store, manifest)
    pulls = Pulls(store, on_stored=refreshed, files_in_use=catalog.files_in_use)

    await pulled(pulls, "hf.co/victim/model:Q4_K_M")

    assert hub.gets["victim/model/victim-Q4_K_M.gguf"] == 1  # the other tool's download only
    [model] = store.models()
    assert [(f.path, f.downloaded) for f in model.files] == [("victim-Q4_K_M.gguf", False)]
    assert model.downloaded == []
    record = json.loads(next(store.records_dir.glob("*.json")).read_text())
    assert record["files"][0]["downloaded"] is False
    assert ref.stat().st_ino == ref_inode  # refs/main is another tool's: not rewritten

    catalog.delete(model)

    assert store.models() == []
    assert not list(store.records_dir.glob("*.json"))
    assert not list(store.records_dir.glob("*.yaml"))
    assert tree(repo_dir) == before
    assert theirs.read_bytes() == b"GGUF" * 1000
    assert ref.stat().st_ino == ref_inode


async def test_a_record_from_before_ownership_was_recorded_counts_as_adopted(
    hub: FakeHub, store: Store
) -> None:
    await pulled(Pulls(store, on_stored=refreshed), "o/r:Q4_K_M")
    [record_path] = store.records_dir.glob("*.json")
    record = json.loads(record_path.read_text())
    for f in record["files"]:
        del f["downloaded"]
    record_path.write_text(json.dumps(record))
    [model] = store.models()
    assert model.downloaded == []
    before = tree(store.repo_dir("o/r"))
    store.delete(model)
    assert tree(store.repo_dir("o/r")) == before


async def test_a_file_the_daemon_downloaded_goes_unless_a_configured_model_uses_it(
    hub: FakeHub, store: Store
) -> None:
    pulls = Pulls(store, on_stored=refreshed)
    await pulled(pulls, "o/r:Q4_K_M")
    [model] = store.models()
    assert model.downloaded == ["r-Q4_K_M.gguf"]
    blob = Path(os.path.realpath(store.weights_path(model)))  # noqa: ASYNC240 (a test's tmp dir)
    before = tree(store.repo_dir("o/r"))
    # A manifest file's model names the blob itself: compared by real path, it is the same file.
    catalog_with(store, LlamaServerManifest(name="mine", engine="llama-server", model=blob)).delete(model)
    assert store.models() == []
    assert tree(store.repo_dir("o/r")) == before
    # Pulled again (the file is the daemon's: its record is gone, but it is found in the cache, so
    # adopted now) and deleted with no model using it: still not the daemon's to remove.
    await pulled(pulls, "o/r:Q4_K_M")
    [model] = store.models()
    assert model.downloaded == []
    catalog_with(store).delete(model)
    assert tree(store.repo_dir("o/r")) == before


@pytest.mark.parametrize("how", ["snapshot directory", "repo id", "engine argument"])
async def test_files_a_vllm_model_or_an_argument_uses_are_kept(hub: FakeHub, store: Store, how: str) -> None:
    await pulled(Pulls(store, on_stored=refreshed), "o/st")
    [model] = store.models()
    assert sorted(model.downloaded) == ["config.json", "model.safetensors"]
    snapshot = store.snapshot_dir(model)
    if how == "snapshot directory":
        mine: LlamaServerManifest | VllmManifest = VllmManifest(
            name="mine", engine="vllm", model=str(snapshot)
        )
    elif how == "repo id":
        mine = VllmManifest(name="mine", engine="vllm", model="O/ST")  # vLLM reads it from the cache
    else:
        mine = LlamaServerManifest(
            name="mine", engine="llama-server", model=Path("/nonexistent.gguf"),
            args=(f"--mmproj={snapshot / 'model.safetensors'}",),
        )  # fmt: skip
    before = tree(store.repo_dir("o/st"))
    catalog_with(store, mine).delete(model)
    assert store.models() == []
    if how == "engine argument":
        assert (snapshot / "model.safetensors").read_bytes() == b"\0" * 1000
        assert not (snapshot / "config.json").exists()  # used by nothing: the daemon's, so it goes
    else:
        assert tree(store.repo_dir("o/st")) == before


async def test_a_re_pull_keeps_owning_the_files_it_downloaded(hub: FakeHub, store: Store) -> None:
    pulls = Pulls(store, on_stored=refreshed)
    await pulled(pulls, "o/st")
    await pulled(pulls, "hf.co/o/st")  # the same commit: everything found in the cache
    [model] = store.models()
    assert sorted(model.downloaded) == ["config.json", "model.safetensors"]
    hub.commit = NEW_COMMIT
    hub.add("o/st", {"model.safetensors": b"\1" * 1000})
    await pulled(pulls, "o/st")  # config.json is the same blob: found, and still the daemon's
    [model] = store.models()
    assert model.commit == NEW_COMMIT
    assert sorted(model.downloaded) == ["config.json", "model.safetensors"]
    store.delete(model)
    assert not store.repo_dir("o/st").exists()


# --- refs ---


async def test_refs_main_is_written_only_where_the_daemon_owns_it(hub: FakeHub, store: Store) -> None:
    await another_tool_downloads(store, "victim/model", "victim-Q4_K_M.gguf")
    ref = store.repo_dir("victim/model") / "refs" / "main"
    assert ref.read_text() == COMMIT
    hub.commit = NEW_COMMIT  # pushed since the other tool's download
    pulls = Pulls(store, on_stored=refreshed)
    await pulled(pulls, "victim/model")
    [model] = store.models()
    assert model.commit == NEW_COMMIT
    assert ref.read_text() == COMMIT  # theirs: left as it was
    store.delete(model)
    assert ref.read_text() == COMMIT
    assert (store.repo_dir("victim/model") / "snapshots" / COMMIT / "victim-Q4_K_M.gguf").exists()


async def test_a_ref_the_daemon_wrote_goes_with_its_model_unless_another_tool_moved_it(
    hub: FakeHub, store: Store
) -> None:
    pulls = Pulls(store, on_stored=refreshed)
    await pulled(pulls, "o/r:Q4_K_M")
    await pulled(pulls, "o/r:Q8_0")
    ref = store.repo_dir("o/r") / "refs" / "main"
    assert ref.read_text() == COMMIT
    q4, q8 = sorted(store.models(), key=lambda m: m.name)
    store.delete(q4)
    assert ref.read_text() == COMMIT  # the Q8 record still uses that commit
    store.delete(q8)
    assert not store.repo_dir("o/r").exists()  # all of it was the daemon's

    await pulled(pulls, "o/r:Q4_K_M")
    ref.write_text(NEW_COMMIT)  # another tool moved main since
    [model] = store.models()
    store.delete(model)
    assert ref.read_text() == NEW_COMMIT
    assert store.set_ref("o/r", "main", COMMIT) is False  # no longer the daemon's to move
    assert ref.read_text() == NEW_COMMIT


# --- one repo in any case ---


async def test_one_repo_in_any_spelling_or_case_is_one_pull_and_one_record(
    hub: FakeHub, store: Store
) -> None:
    hub.add("Org/Mixed-GGUF", {"Mixed-Q4_K_M.gguf": b"GGUF" * 100, "Mixed-Q8_0.gguf": b"GGUF" * 200})
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    first = pulls.start("hf.co/org/mixed-gguf:q4_k_m")
    assert pulls.start("ORG/MIXED-GGUF:Q4_K_M") is first
    assert pulls.start("huggingface.co/Org/Mixed-GGUF:Q4_K_M") is first
    joined = pulls.start("hf.co/Org/Mixed-GGUF")  # no tag: Q4_K_M, the same model once planned
    hub.held.set()
    for job in (first, joined):
        await asyncio.wait_for(job.done.wait(), 20)
        assert job.state == PullState.SUCCESS, job.error
    await pulled(pulls, "org/MIXED-gguf:Q4_K_M")  # again, later: the same record
    [model] = store.models()
    assert model.name == "hf.co/Org/Mixed-GGUF:Q4_K_M"  # the hub's spelling
    assert model.repo == "Org/Mixed-GGUF"
    assert hub.gets["Org/Mixed-GGUF/Mixed-Q4_K_M.gguf"] == 1
    assert [p.name for p in store.cache_dir.iterdir() if p.name.startswith("models--")] == [
        "models--Org--Mixed-GGUF"
    ]
    assert len(list(store.records_dir.glob("*.json"))) == 1
    assert store.find("hf.co/org/mixed-gguf:q4_k_m") == model
    assert pulls.find("ORG/Mixed-GGUF:Q4_K_M") is not None


# --- bounds: a queue of pulls, and the disk ---


async def test_pulls_beyond_the_limit_wait_queued_and_say_so(hub: FakeHub, store: Store) -> None:
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed, settings=Settings(max_parallel_pulls=1))
    first = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes to flow")
    second = pulls.start("o/st")
    lines = []

    async def watch() -> None:
        async for event in second.events():
            lines.append(event)

    watching = asyncio.create_task(watch())
    await eventually(lambda: second.state == PullState.QUEUED, 10, "the second pull to queue")
    assert {"status": "queued"} in lines or second.last == {"status": "queued"}
    running = {p["model"]: (p["state"], p["status"]) for p in pulls.describe()["running"]}
    assert running == {"hf.co/o/r:Q8_0": ("running", "pulling " + hashlib.sha256(Q8).hexdigest()[:12]),
                       "hf.co/o/st": ("queued", "queued")}  # fmt: skip
    assert not any(key.startswith("o/st/") for key in hub.gets)  # nothing of it downloads yet
    third = pulls.start("o/r:Q4_K_M")
    await eventually(lambda: third.state == PullState.QUEUED, 10, "the third pull to queue")
    # A queued pull is cancelled at once, having written nothing.
    assert await pulls.cancel("o/r:Q4_K_M", wait_s=10) is third
    assert third.state == PullState.CANCELLED
    hub.held.set()
    await asyncio.wait_for(watching, 20)
    assert lines[-1] == {"status": "success"}
    assert {"status": "queued"} in lines
    assert first.state == second.state == PullState.SUCCESS
    assert sorted(m.name for m in store.models()) == ["hf.co/o/r:Q8_0", "hf.co/o/st"]
    assert hub.gets["o/r/r-Q4_K_M.gguf"] == 0


async def test_a_pull_that_would_fill_the_disk_is_refused_before_anything_is_written(
    hub: FakeHub, store: Store
) -> None:
    pulls = Pulls(store, on_stored=refreshed, settings=Settings(min_free_disk_mib=2**40))
    job = pulls.start("o/r:Q8_0")
    await asyncio.wait_for(job.done.wait(), 10)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert (job.error.code, job.error.status) == ("insufficient_storage", 507)
    assert "min_free_disk_mib" in job.error.message
    assert job.name is None  # refused before it was planned: the route answers the HTTP error
    assert not store.cache_dir.exists() or not any(store.cache_dir.rglob("*"))
    assert hub.gets == {}


async def test_the_disk_check_counts_what_admitted_pulls_will_still_write(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add("o/mid", {"config.json": b"{}", "model.safetensors": b"\0" * 8192})
    free = 2**20 + len(Q8) + 4096  # min_free_disk_mib 1, the Q8 pull, and a little more
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("supervisor.pulls.shutil.disk_usage", lambda path: usage(free, 0, free))
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed, settings=Settings(min_free_disk_mib=1))
    first = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes to flow")
    second = pulls.start("o/mid")
    await asyncio.wait_for(second.done.wait(), 10)
    assert second.error is not None
    assert second.error.code == "insufficient_storage"
    assert "for other pulls" in second.error.message
    hub.held.set()
    await asyncio.wait_for(first.done.wait(), 20)
    await pulled(pulls, "o/mid")  # the first is done: its bytes are (in this fake) no longer counted


async def test_a_pull_of_files_already_cached_needs_no_free_space(hub: FakeHub, store: Store) -> None:
    await another_tool_downloads(store, "victim/model", "victim-Q4_K_M.gguf")
    pulls = Pulls(store, on_stored=refreshed, settings=Settings(min_free_disk_mib=2**40))
    await pulled(pulls, "victim/model")


def test_stored_model_json_round_trips_ownership(store: Store) -> None:
    data = {
        "name": "hf.co/o/r", "repo": "o/r", "commit": "c0ffee", "format": "gguf", "quant": None,
        "weights": "a.gguf", "pulled_at": 0,
        "files": [{"path": "a.gguf", "size": 1, "sha256": "ab", "downloaded": True},
                  {"path": "b.gguf", "size": 1, "sha256": "cd"}],
    }  # fmt: skip
    model = StoredModel.from_json(data)
    assert model.downloaded == ["a.gguf"]
    assert StoredModel.from_json(model.to_json()) == model


def test_a_record_under_its_case_sensitive_file_name_is_replaced_not_doubled(store: Store) -> None:
    model = StoredModel("hf.co/Org/Repo", "Org/Repo", "c0ffee", "safetensors", None, "", (), 0.0)
    store.records_dir.mkdir(parents=True)
    legacy = store.records_dir / f"{_slug(model.name, folded=False)}.json"
    legacy.write_text(json.dumps({**model.to_json(), "requested": ["org/repo"]}))
    assert store.save(model) is not None
    [record] = store.records_dir.glob("*.json")
    assert record != legacy
    assert json.loads(record.read_text())["requested"] == ["org/repo"]
    store.forget(model)
    assert not list(store.records_dir.glob("*.json"))
