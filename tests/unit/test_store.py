"""The model store: references, choosing files, generated manifests, the registry union, and pulls
against the fake hub in-process (no daemon)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from huggingface_hub.utils._xet_progress_reporting import XetDownloadProgressReporter

from supervisor.api import ollama_store
from supervisor.api.context import PULLS
from supervisor.api.middleware import Handler, errors_and_access_log
from supervisor.errors import SupervisorError
from supervisor.manifests import LlamaServerManifest, Registry, VllmManifest, load_files, with_stored
from supervisor.pulls import (
    Event,
    Pull,
    PullCancelled,
    Pulls,
    PullState,
    _digests,
    _explain,
    _progress_bar,
    _verifying,
)
from supervisor.store import ModelRef, RepoFile, Store, StoredFile, StoredModel, plan_pull, quant_of
from tests.fakehub import COMMIT, FakeHub
from tests.integration.harness import eventually
from tests.local_app import serving as serving_app

NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.mark.parametrize(
    ("text", "repo", "tag"),
    [
        ("hf.co/org/repo:Q4_K_M", "org/repo", "Q4_K_M"),
        ("hf.co/org/repo", "org/repo", None),
        ("huggingface.co/org/repo:latest", "org/repo", None),
        ("https://huggingface.co/org/Repo-GGUF", "org/Repo-GGUF", None),
        ("org/repo:Q8_0", "org/repo", "Q8_0"),
        ("org/my_repo.v2", "org/my_repo.v2", None),
        ("HF.CO/Org/Repo:LATEST", "Org/Repo", None),
    ],
)
def test_references_in_ollamas_hf_syntax_parse(text: str, repo: str, tag: str | None) -> None:
    ref = ModelRef.parse(text)
    assert (ref.repo, ref.tag) == (repo, tag)
    # The hub's repo ids are case-insensitive: the key that dedups pulls is case-folded.
    assert ref.key == f"hf.co/{repo.lower()}" + (f":{tag}" if tag else "")


def test_a_repo_in_any_spelling_or_case_is_one_key() -> None:
    spellings = ["hf.co/Org/Repo:Q4_K_M", "huggingface.co/org/repo:q4_k_m", "org/REPO:Q4_K_M"]
    assert {ModelRef.parse(s).key for s in spellings} == {"hf.co/org/repo:Q4_K_M"}


@pytest.mark.parametrize(
    "text",
    [
        "llama3",
        "hf.co/org",
        "org/repo/extra",
        "org/repo:bad tag",
        "",
        "hf.co/:x",
        "org/re..po",  # the hub's own rules: refused up front, not as a 502 from huggingface_hub
        "org--x/repo",
        "org/repo.",
        "org/" + "r" * 200,
        "org/repo:" + "Q" * 200,
        "org/repo\x00",
        # Ids the hub allows (96 + 96 characters), but a model name has at most 200: such a pull said
        # `success` of a model that was never served.
        "o" * 96 + "/" + "r" * 96 + ":Q4_K_M",
    ],
)
def test_a_bad_reference_is_a_400(text: str) -> None:
    with pytest.raises(SupervisorError) as caught:
        ModelRef.parse(text)
    assert caught.value.status == 400


def test_a_model_named_past_200_characters_by_its_chosen_quant_is_refused_before_downloading() -> None:
    ref = ModelRef.parse("o" * 96 + "/" + "r" * 96)  # no tag yet: 199 characters
    gguf = RepoFile("r-Q4_K_M.gguf", 1, "a" * 64, "b" * 40)
    with pytest.raises(SupervisorError) as caught:
        plan_pull(ref, [gguf])
    assert caught.value.status == 400
    assert "at most 200" in caught.value.message


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("model.q8_0.gguf", "Q8_0"),
        ("Qwen2.5-7B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
        ("big-Q5_K_M-00001-of-00003.gguf", "Q5_K_M"),
        ("phi-3-f16.gguf", "F16"),
        ("model.gguf", None),
    ],
)
def test_quant_comes_from_the_file_name(name: str, quant: str | None) -> None:
    assert quant_of(name) == quant


def test_a_quant_tag_names_one_model_in_any_case() -> None:
    assert ModelRef.parse("o/r:q4_k_m").key == ModelRef.parse("hf.co/o/r:Q4_K_M").key == "hf.co/o/r:Q4_K_M"


def files(*paths: str) -> list[RepoFile]:
    return [RepoFile(p, 100, "ab" * 32) for p in paths]


def test_a_tag_picks_the_gguf_of_that_quant() -> None:
    plan = plan_pull(ModelRef("o/r", "q8_0"), files("r-Q4_K_M.gguf", "r-Q8_0.gguf", "README.md"))
    assert plan.format == "gguf"
    assert [f.path for f in plan.files] == ["r-Q8_0.gguf"]
    assert plan.name == "hf.co/o/r:Q8_0"


def test_without_a_tag_q4_k_m_is_preferred_else_the_first_gguf() -> None:
    assert plan_pull(ModelRef("o/r"), files("r-Q8_0.gguf", "r-Q4_K_M.gguf")).weights == "r-Q4_K_M.gguf"
    assert plan_pull(ModelRef("o/r"), files("b-F16.gguf", "a-BF16.gguf")).weights == "a-BF16.gguf"
    assert plan_pull(ModelRef("o/r"), files("r-F16.gguf", "mmproj-r-F16.gguf")).weights == "r-F16.gguf"


def test_an_unknown_quant_lists_the_available_ones() -> None:
    with pytest.raises(SupervisorError) as caught:
        plan_pull(ModelRef("o/r", "Q2_K"), files("r-Q4_K_M.gguf", "r-Q8_0.gguf"))
    assert caught.value.status == 404
    assert "Q4_K_M, Q8_0" in caught.value.message


def test_a_split_gguf_brings_all_its_shards() -> None:
    plan = plan_pull(
        ModelRef("o/r", "Q4_K_M"),
        files("r-Q4_K_M-00002-of-00002.gguf", "r-Q4_K_M-00001-of-00002.gguf", "r-Q8_0.gguf"),
    )
    assert plan.weights == "r-Q4_K_M-00001-of-00002.gguf"
    assert [f.path for f in plan.files] == ["r-Q4_K_M-00001-of-00002.gguf", "r-Q4_K_M-00002-of-00002.gguf"]


def test_a_split_quant_brings_only_its_own_shards() -> None:
    """Q4_0 and Q4_0_4_4 (ARM quants) split in one repo: Q4_0's name is a prefix of the other's, and a
    prefix match planned all four shards."""
    repo = files(
        "m-Q4_0-00001-of-00002.gguf",
        "m-Q4_0-00002-of-00002.gguf",
        "m-Q4_0_4_4-00001-of-00002.gguf",
        "m-Q4_0_4_4-00002-of-00002.gguf",
        "m-Q4_0-00001-of-00003.gguf",  # another split of the same name: not this model's
    )
    plan = plan_pull(ModelRef("o/r", "Q4_0"), repo)
    assert [f.path for f in plan.files] == ["m-Q4_0-00001-of-00002.gguf", "m-Q4_0-00002-of-00002.gguf"]
    plan = plan_pull(ModelRef("o/r", "Q4_0_4_4"), repo)
    assert [f.path for f in plan.files] == [
        "m-Q4_0_4_4-00001-of-00002.gguf",
        "m-Q4_0_4_4-00002-of-00002.gguf",
    ]


def test_a_safetensors_repo_brings_weights_config_and_tokenizer() -> None:
    repo = files(
        "config.json", "model.safetensors", "tokenizer.json", "README.md", "original/consolidated.safetensors"
    )
    plan = plan_pull(ModelRef("o/r"), repo)
    assert plan.format == "safetensors"
    assert [f.path for f in plan.files] == ["config.json", "model.safetensors", "tokenizer.json"]
    with pytest.raises(SupervisorError, match="no GGUF"):
        plan_pull(ModelRef("o/r", "Q4_K_M"), repo)


def test_a_repo_without_weights_is_refused() -> None:
    with pytest.raises(SupervisorError, match="neither GGUF"):
        plan_pull(ModelRef("o/r"), files("README.md", "model.safetensors"))


@pytest.mark.parametrize(
    "path", ["../r-Q4_K_M.gguf", "/tmp/r-Q4_K_M.gguf", "sub\\r-Q4_K_M.gguf", "a/../../r-Q4_K_M.gguf"]
)
def test_a_file_with_an_unsafe_path_is_never_planned(path: str) -> None:
    with pytest.raises(SupervisorError) as caught:
        plan_pull(ModelRef("o/r"), files(path))
    assert caught.value.status == 502
    assert "unsafe" in caught.value.message


def test_a_split_gguf_with_a_shard_missing_is_never_planned() -> None:
    """It was stored as a servable model that llama-server could not load."""
    with pytest.raises(SupervisorError) as caught:
        plan_pull(ModelRef("o/r"), files("m-Q4_K_M-00001-of-00003.gguf", "m-Q4_K_M-00003-of-00003.gguf"))
    assert (caught.value.code, caught.value.status) == ("hub_error", 502)
    assert "split into 3 files, but the hub lists none numbered 2" in caught.value.message
    whole = files(*(f"m-Q4_K_M-0000{n}-of-00003.gguf" for n in (1, 2, 3)))
    assert len(plan_pull(ModelRef("o/r"), whole).files) == 3


@pytest.mark.parametrize(
    ("sha256", "blob_id"),
    [("../../x", ""), ("AB" * 32, ""), ("ab" * 32, "../x"), (None, "../../" + "a" * 34), (None, "")],
)
def test_a_file_the_hub_gives_no_hex_id_is_never_planned(sha256: str | None, blob_id: str) -> None:
    """The cache names a blob by its id (blobs/<id>): an id with a `..` names a path outside it."""
    with pytest.raises(SupervisorError) as caught:
        plan_pull(ModelRef("o/r"), [RepoFile("r-Q4_K_M.gguf", 100, sha256, blob_id)])
    assert (caught.value.code, caught.value.status) == ("hub_error", 502)
    assert "valid hash" in caught.value.message


def stored(
    store: Store, name: str = "hf.co/o/r:Q4_K_M", weights: str = "r-Q4_K_M.gguf", downloaded: bool = True
) -> StoredModel:
    """A stored model with its file in the cache layout (snapshot symlink to blob), by default one the
    daemon downloaded."""
    model = StoredModel(
        name=name,
        repo="o/r",
        commit="c0ffee",
        format="gguf",
        quant="Q4_K_M",
        weights=weights,
        files=(StoredFile(weights, 4, "ab" * 32, downloaded),),
        pulled_at=0.0,
        requested=("hf.co/o/r",),
    )
    put_file(store, model, weights, weights, b"GGUF")
    store.save(model)
    return model


def put_file(store: Store, model: StoredModel, path: str, blob_name: str, data: bytes) -> None:
    """A file of `model` in the cache as huggingface_hub lays it out: a blob, and a link in the snapshot."""
    blob = store.repo_dir(model.repo) / "blobs" / blob_name
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = store.snapshot_dir(model) / path
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))


def test_a_stored_gguf_gets_a_llama_server_manifest_and_its_names(store: Store, tmp_path: Path) -> None:
    model = stored(store)
    [(manifest, source, names)] = store.manifests()
    assert isinstance(manifest, LlamaServerManifest)
    assert manifest.model == store.snapshot_dir(model) / "r-Q4_K_M.gguf"
    assert source.parent == tmp_path / "store"
    assert names == ["hf.co/o/r:Q4_K_M", "o/r:Q4_K_M", "hf.co/o/r"]
    # The generated file is an ordinary manifest.
    assert load_files([source]).models[manifest.name] == manifest
    assert store.find("o/r:Q4_K_M") == model
    assert model.digest == "sha256:" + "ab" * 32
    assert store.disk_usage() == 4


def test_a_stored_safetensors_model_gets_a_vllm_manifest(store: Store) -> None:
    model = StoredModel("hf.co/o/r", "o/r", "c0ffee", "safetensors", None, "", (), 0.0)
    store.save(model)
    [(manifest, _, names)] = store.manifests()
    assert isinstance(manifest, VllmManifest)
    assert manifest.model == str(store.snapshot_dir(model))
    assert names[0] == "hf.co/o/r"


def test_a_model_whose_files_are_gone_is_not_listed(store: Store) -> None:
    model = stored(store)
    (store.snapshot_dir(model) / model.weights).unlink()
    assert store.models() == []


def test_a_model_with_a_file_gone_is_still_found_and_deleted(store: Store) -> None:
    """A file of a pulled model went (a cache clean-up, an `rm` of its link): the model is not listed,
    but a delete finds its record and removes what the daemon downloaded, the gone file's blob too."""
    digests = {"config.json": "cf" * 32, "model.safetensors": "ab" * 32}
    model = StoredModel(
        "hf.co/o/st", "o/st", "c0ffee", "safetensors", None, "",
        tuple(StoredFile(path, 4, sha, downloaded=True) for path, sha in digests.items()), 0.0,
    )  # fmt: skip
    for path, sha in digests.items():
        put_file(store, model, path, sha, b"data")
    store.save(model)
    (store.snapshot_dir(model) / "config.json").unlink()
    assert store.models() == []
    assert store.find("hf.co/o/st") == model
    store.delete(model)
    assert not store.repo_dir("o/st").exists()
    assert list(store.records_dir.glob("*.json")) == []


def test_a_manifest_file_wins_over_a_stored_model_of_the_same_name(
    store: Store, tmp_path: Path, demo_gguf: Path
) -> None:
    model = stored(store)
    mine = LlamaServerManifest(name=model.manifest_name, engine="llama-server", model=demo_gguf)
    registry = with_stored(
        Registry(models={mine.name: mine}, sources={mine.name: tmp_path / "mine.yaml"}), store.manifests()
    )
    assert registry.models == {mine.name: mine}
    union = with_stored(Registry(), store.manifests())
    assert union.resolve("o/r:Q4_K_M") == union.models[model.manifest_name]
    assert union.resolve("hf.co/o/r:latest") == union.models[model.manifest_name]


def test_deleting_keeps_blobs_another_snapshot_uses(store: Store) -> None:
    q4 = stored(store)
    q8 = stored(store, "hf.co/o/r:Q8_0", "r-Q8_0.gguf")
    store.delete(q4)
    assert [m.name for m in store.models()] == [q8.name]
    assert not (store.repo_dir("o/r") / "blobs" / "r-Q4_K_M.gguf").exists()
    store.delete(q8)
    assert store.models() == []
    assert not store.repo_dir("o/r").exists()


def test_removing_files_never_reaches_outside_the_repo(store: Store, tmp_path: Path) -> None:
    model = stored(store)
    victim = tmp_path / "hub" / "victim"
    victim.write_bytes(b"mine")
    store.remove_files("o/r", model.commit, ["../../../victim", "/" + str(victim)])
    assert victim.read_bytes() == b"mine"
    assert store.models() == [model]


def test_deleting_under_xet_keeps_the_shared_blob_another_repo_uses(store: Store, tmp_path: Path) -> None:
    """Xet's cache-wide store: `<cache>/blobs/<xx>/<hash>`, and each repo's `blobs/<etag>` a symlink to it."""
    xet_hash = "cd" * 32
    shared = tmp_path / "hub" / "blobs" / xet_hash[:2] / xet_hash
    shared.parent.mkdir(parents=True)
    shared.write_bytes(b"GGUF")
    models = []
    for repo in ("o/r", "o/copy"):
        model = StoredModel(
            f"hf.co/{repo}:Q4_K_M", repo, "c0ffee", "gguf", "Q4_K_M", "r-Q4_K_M.gguf",
            (StoredFile("r-Q4_K_M.gguf", 4, "ab" * 32, downloaded=True),), 0.0,
        )  # fmt: skip
        blob = store.repo_dir(repo) / "blobs" / ("ab" * 32)
        blob.parent.mkdir(parents=True)
        blob.symlink_to(os.path.relpath(shared, blob.parent))
        link = store.snapshot_dir(model) / model.weights
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        store.save(model)
        models.append(model)
    store.delete(models[0])
    assert shared.read_bytes() == b"GGUF"
    assert not store.repo_dir("o/r").exists()
    assert [m.name for m in store.models()] == ["hf.co/o/copy:Q4_K_M"]
    assert (store.snapshot_dir(models[1]) / "r-Q4_K_M.gguf").read_bytes() == b"GGUF"


def test_files_a_record_names_are_not_removed_as_unreferenced(store: Store) -> None:
    model = stored(store)
    store.remove_unreferenced("o/r", model.commit, [model.weights])
    assert store.models() == [model]


# --- pulls against the fake hub, in-process ---


async def refreshed() -> None:
    """A stand-in for the catalog's refresh."""


@pytest.fixture
def hub_repos() -> dict[str, dict[str, bytes]]:
    return {
        "o/r": {"r-Q4_K_M.gguf": b"GGUF" * 1000, "r-Q8_0.gguf": b"GGUF" * 2**19},
        "o/st": {"config.json": b"{}", "model.safetensors": b"\0" * 1000, "README.md": b"hi"},
    }


async def test_pulls_dedup_describe_and_store(hub: FakeHub, store: Store) -> None:
    stored_calls: list[int] = []

    async def on_stored() -> None:
        stored_calls.append(1)

    pulls = Pulls(store, on_stored=on_stored)
    first = pulls.start("hf.co/o/st")
    assert pulls.start("o/st") is first
    assert pulls.describe()["running"][0]["model"] == "hf.co/o/st"
    lines = [event async for event in first.events()]
    assert lines[-1] == {"status": "success"}
    assert first.state == PullState.SUCCESS
    assert stored_calls == [1]
    [model] = store.models()
    assert (model.format, sorted(f.path for f in model.files)) == (
        "safetensors",
        ["config.json", "model.safetensors"],
    )
    assert pulls.describe()["recent"][0]["state"] == "success"
    assert hub.gets["o/st/model.safetensors"] == 1


async def test_a_cancelled_pull_leaves_nothing(hub: FakeHub, store: Store, tmp_path: Path) -> None:
    hub.delay_per_chunk_s = 0.02
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes to flow")
    assert await pulls.cancel("hf.co/o/r:Q8_0") is job
    assert job.state == PullState.CANCELLED
    assert store.models() == []
    assert [p.name for p in (tmp_path / "hub").rglob("*") if p.is_file()] == ["CACHEDIR.TAG"]
    assert pulls.describe()["recent"][0]["state"] == "cancelled"


async def test_a_cancel_answers_by_its_deadline_while_the_transfer_stalls(hub: FakeHub, store: Store) -> None:
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes to flow")
    assert await pulls.cancel("o/r:q8_0", wait_s=0.2) is job
    assert job.describe()["state"] == "running"  # no bytes come that could notice the cancel
    hub.held.set()
    await asyncio.wait_for(job.done.wait(), 10)
    assert job.state == PullState.CANCELLED
    assert store.models() == []


async def test_shutdown_does_not_wait_for_a_stalled_transfer(hub: FakeHub, store: Store) -> None:
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes to flow")
    started = time.monotonic()
    await pulls.close(wait_s=0.2)
    assert time.monotonic() - started < 5
    assert job.state == PullState.CANCELLED
    hub.held.set()  # the abandoned thread stops at its next bytes
    await eventually(lambda: "r-Q8_0.gguf" in hub.finished, 10, "the transfer to end")


async def test_verifying_a_digest_stops_at_a_cancel(tmp_path: Path) -> None:
    big = tmp_path / "big.gguf"
    big.write_bytes(b"\0" * 9 * 2**20)
    pull = Pull(ModelRef("o/r"), "o/r")
    data = big.read_bytes()
    git_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert _digests(big, _verifying(pull), True) == (hashlib.sha256(data).hexdigest(), git_id)
    pull.cancel_requested.set()
    with pytest.raises(PullCancelled):
        _digests(big, _verifying(pull), True)


class RecordedPull(Pull):
    def __init__(self) -> None:
        super().__init__(ModelRef("o/r"), "o/r")
        self.completed: list[int] = []

    def publish(self, event: Event) -> None:
        self.completed.append(event["completed"])
        super().publish(event)


async def test_under_xet_the_progress_of_a_file_never_goes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's Xet reporter counts bytes received (ahead) and bytes written: one must be shown."""
    monkeypatch.setattr("supervisor.pulls._PROGRESS_EVERY_S", 0.0)
    pull = RecordedPull()
    bar = _progress_bar(pull, {"status": "pulling abc", "digest": "sha256:abc", "total": 100}, "f")
    with XetDownloadProgressReporter(
        reconstruction_desc="f", total=100, log_level=logging.WARNING, tqdm_class=bar
    ) as reporter:
        for written, received in ((10, 60), (50, 100), (100, 100)):
            reporter.update_progress(
                SimpleNamespace(
                    total_bytes_completed=written,
                    total_transfer_bytes_completed=received,
                    total_bytes=100,
                    total_bytes_completion_rate=None,
                    total_transfer_bytes_completion_rate=None,
                )
            )
    await asyncio.sleep(0)
    assert pull.completed == sorted(pull.completed)
    assert pull.completed[-1] == 100


async def test_a_pull_that_turns_out_to_be_a_running_one_joins_it(hub: FakeHub, store: Store) -> None:
    hub.add("o/one", {"one-Q4_K_M.gguf": b"GGUF" * 2**19})
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    first = pulls.start("o/one:Q4_K_M")
    await eventually(lambda: hub.sent["one-Q4_K_M.gguf"] > 0, 10, "bytes to flow")
    second = pulls.start("o/one")  # no tag: the default quant, so the same model
    await asyncio.wait_for(second.planned.wait(), 10)
    assert second is not first
    assert second.name == first.name == "hf.co/o/one:Q4_K_M"
    cancelling = asyncio.create_task(pulls.cancel("o/one"))
    await eventually(first.cancel_requested.is_set, 5, "the cancel to reach the one download")
    hub.held.set()
    assert await cancelling is second
    assert (first.state, second.state) == (PullState.CANCELLED, PullState.CANCELLED)
    assert hub.gets["o/one/one-Q4_K_M.gguf"] == 1
    assert store.models() == []


async def test_a_commit_pushed_mid_pull_does_not_split_the_model(hub: FakeHub, store: Store) -> None:
    hub.add("o/two", {"A.safetensors": b"\0" * 2**21, "config.json": b"{}"})
    hub.held = asyncio.Event()
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/two")
    await eventually(lambda: hub.sent["A.safetensors"] > 0, 10, "bytes to flow")
    hub.commit = NEW_COMMIT
    hub.held.set()
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.SUCCESS, job.error
    [model] = store.models()
    assert model.commit == COMMIT
    assert [p.name for p in (store.repo_dir("o/two") / "snapshots").iterdir()] == [COMMIT]
    assert (store.repo_dir("o/two") / "refs" / "main").read_text() == COMMIT


async def test_a_re_pull_at_a_new_commit_removes_the_old_snapshot(hub: FakeHub, store: Store) -> None:
    pulls = Pulls(store, on_stored=refreshed)
    await pulls.start("o/st").done.wait()
    blobs = store.repo_dir("o/st") / "blobs"
    old_weights = blobs / hashlib.sha256(hub.repos["o/st"]["model.safetensors"]).hexdigest()
    config = blobs / hashlib.sha256(hub.repos["o/st"]["config.json"]).hexdigest()
    assert old_weights.exists()
    hub.commit = NEW_COMMIT
    hub.add("o/st", {"model.safetensors": b"\1" * 1000})
    again = pulls.start("o/st")
    await again.done.wait()
    assert again.state == PullState.SUCCESS, again.error
    [model] = store.models()
    assert model.commit == NEW_COMMIT
    assert [p.name for p in (store.repo_dir("o/st") / "snapshots").iterdir()] == [NEW_COMMIT]
    assert not old_weights.exists()
    assert config.exists()  # unchanged: the new snapshot uses the same blob


async def test_a_repo_with_a_folder_named_snapshots_can_be_pulled(hub: FakeHub, store: Store) -> None:
    """The commit of a downloaded file is its directory under the repo's own `snapshots`, not under the
    last path part of that name (here the repo's folder)."""
    hub.add("o/snap", {"snapshots/snap-Q4_K_M.gguf": b"GGUF" * 1000})
    job = Pulls(store, on_stored=refreshed).start("o/snap:Q4_K_M")
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.SUCCESS, job.error
    [model] = store.models()
    assert (model.commit, model.weights) == (COMMIT, "snapshots/snap-Q4_K_M.gguf")


async def test_a_failed_pull_leaves_another_downloads_partial_file_alone(
    hub: FakeHub, store: Store, tmp_path: Path
) -> None:
    hub.fail_files.add("r-Q8_0.gguf")
    etag = hashlib.sha256(hub.repos["o/r"]["r-Q8_0.gguf"]).hexdigest()
    theirs = store.repo_dir("o/r") / "blobs" / f"{etag}.0badc0de.incomplete"  # huggingface_hub 2.4's naming
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"GG")
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/r:Q8_0")
    await job.done.wait()
    assert job.state == PullState.FAILED
    assert theirs.read_bytes() == b"GG"
    assert not list((tmp_path / "hub").rglob("*.lock"))


# --- the store routes, in-process ---


@contextlib.asynccontextmanager
async def serving(pulls: Pulls, outcomes: list[BaseException | None]) -> AsyncIterator[str]:
    """The store routes on a port of their own; `outcomes` gets how each handler ended."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except BaseException as exc:
            outcomes.append(exc)
            raise
        outcomes.append(None)
        return response

    app = web.Application(middlewares=[errors_and_access_log, record])
    app.add_routes(ollama_store.routes)
    app[PULLS] = pulls
    async with serving_app(app) as url:
        yield url


async def test_a_client_that_goes_away_ends_its_stream_quietly_and_the_pull_goes_on(
    hub: FakeHub, store: Store
) -> None:
    hub.delay_per_chunk_s = 0.01
    pulls = Pulls(store, on_stored=refreshed)
    outcomes: list[BaseException | None] = []
    async with serving(pulls, outcomes) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = b'{"model": "o/r:Q8_0"}'
        head = f"POST /api/pull HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        assert b" 200 " in await reader.readline()
        await reader.readuntil(b"pulling manifest")
        writer.close()  # gone, mid-pull
        await writer.wait_closed()
        job = pulls.find("o/r:Q8_0")
        assert job is not None
        await asyncio.wait_for(job.done.wait(), 20)
        await eventually(lambda: bool(outcomes), 10, "the handler to end")
    assert job.state == PullState.SUCCESS
    assert outcomes == [None]


class SlowSavingStore(Store):
    def __init__(self, cache_dir: Path, records_dir: Path) -> None:
        super().__init__(cache_dir, records_dir)
        self.saving = threading.Event()
        self.go_on = threading.Event()

    def save(self, model: StoredModel) -> StoredModel | None:
        self.saving.set()
        self.go_on.wait(10)
        return super().save(model)


async def test_a_cancel_that_comes_while_the_model_is_saved_is_told_it_finished(
    hub: FakeHub, tmp_path: Path
) -> None:
    store = SlowSavingStore(tmp_path / "hub", tmp_path / "store")
    pulls = Pulls(store, on_stored=refreshed)
    job = pulls.start("o/st")
    async with serving(pulls, []) as url, aiohttp.ClientSession() as http:
        await eventually(store.saving.is_set, 10, "the model to be saved")

        async def cancel() -> tuple[int, Any]:
            async with http.delete(f"{url}/api/pull/o/st") as response:
                return response.status, await response.json()

        cancelling = asyncio.create_task(cancel())
        await eventually(job.cancel_requested.is_set, 5, "the cancel to arrive")
        store.go_on.set()
        status, body = await cancelling
    assert status == 409
    assert "finished" in body["error"]
    assert job.state == PullState.SUCCESS
    assert [m.name for m in store.models()] == ["hf.co/o/st"]


def test_a_full_disk_is_named_as_such() -> None:
    error = _explain(ModelRef("o/r"), OSError(errno.ENOSPC, "No space left on device"))
    assert (error.code, error.status) == ("disk_full", 507)
    assert "no space left" in error.message
