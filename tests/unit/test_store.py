"""The model store: references, choosing files, generated manifests, the registry union, and pulls
against the fake hub in-process (no daemon)."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor.errors import SupervisorError
from supervisor.manifests import LlamaServerManifest, Registry, VllmManifest, load_files, with_stored
from supervisor.pulls import Pulls, PullState, _explain
from supervisor.store import ModelRef, RepoFile, Store, StoredFile, StoredModel, plan_pull, quant_of
from tests.fakehub import FakeHub
from tests.integration.harness import eventually


@pytest.mark.parametrize(
    ("text", "repo", "tag"),
    [
        ("hf.co/org/repo:Q4_K_M", "org/repo", "Q4_K_M"),
        ("hf.co/org/repo", "org/repo", None),
        ("huggingface.co/org/repo:latest", "org/repo", None),
        ("https://huggingface.co/org/Repo-GGUF", "org/Repo-GGUF", None),
        ("org/repo:Q8_0", "org/repo", "Q8_0"),
        ("org/my_repo.v2", "org/my_repo.v2", None),
    ],
)
def test_references_in_ollamas_hf_syntax_parse(text: str, repo: str, tag: str | None) -> None:
    ref = ModelRef.parse(text)
    assert (ref.repo, ref.tag) == (repo, tag)
    assert ref.key == f"hf.co/{repo}" + (f":{tag}" if tag else "")


@pytest.mark.parametrize(
    "text", ["llama3", "hf.co/org", "org/repo/extra", "org/repo:bad tag", "", "hf.co/:x"]
)
def test_a_bad_reference_is_a_400(text: str) -> None:
    with pytest.raises(SupervisorError) as caught:
        ModelRef.parse(text)
    assert caught.value.status == 400


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


def stored(store: Store, name: str = "hf.co/o/r:Q4_K_M", weights: str = "r-Q4_K_M.gguf") -> StoredModel:
    """A stored model with its file in the cache layout (snapshot symlink to blob)."""
    model = StoredModel(
        name=name,
        repo="o/r",
        commit="c0ffee",
        format="gguf",
        quant="Q4_K_M",
        weights=weights,
        files=(StoredFile(weights, 4, "ab" * 32),),
        pulled_at=0.0,
        requested=("hf.co/o/r",),
    )
    blob = store.repo_dir("o/r") / "blobs" / weights
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"GGUF")
    link = store.snapshot_dir(model) / weights
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    store.save(model)
    return model


def test_a_stored_gguf_gets_a_llama_server_manifest_and_its_names(tmp_path: Path) -> None:
    store = Store(tmp_path / "hub", tmp_path / "store")
    model = stored(store)
    [(manifest, source, names)] = store.manifests()
    assert isinstance(manifest, LlamaServerManifest)
    assert manifest.model == store.snapshot_dir(model) / "r-Q4_K_M.gguf"
    assert source.parent == tmp_path / "store"
    assert names == ["hf.co/o/r:Q4_K_M", "o/r:Q4_K_M", "hf.co/o/r"]
    # The generated file is an ordinary manifest.
    assert load_files([source]).models[manifest.name] == manifest
    assert store.find("o/r:Q4_K_M") == model
    assert store.describe(model)["digest"] == "sha256:" + "ab" * 32
    assert store.disk_usage() == 4


def test_a_stored_safetensors_model_gets_a_vllm_manifest(tmp_path: Path) -> None:
    store = Store(tmp_path / "hub", tmp_path / "store")
    model = StoredModel("hf.co/o/r", "o/r", "c0ffee", "safetensors", None, "", (), 0.0)
    store.save(model)
    [(manifest, _, names)] = store.manifests()
    assert isinstance(manifest, VllmManifest)
    assert manifest.model == str(store.snapshot_dir(model))
    assert names[0] == "hf.co/o/r"


def test_a_model_whose_files_are_gone_is_not_listed(tmp_path: Path) -> None:
    store = Store(tmp_path / "hub", tmp_path / "store")
    model = stored(store)
    (store.snapshot_dir(model) / model.weights).unlink()
    assert store.models() == []


def test_a_manifest_file_wins_over_a_stored_model_of_the_same_name(tmp_path: Path, demo_gguf: Path) -> None:
    store = Store(tmp_path / "hub", tmp_path / "store")
    model = stored(store)
    mine = LlamaServerManifest(name=model.manifest_name, engine="llama-server", model=demo_gguf)
    registry = with_stored(
        Registry(models={mine.name: mine}, sources={mine.name: tmp_path / "mine.yaml"}), store.manifests()
    )
    assert registry.models == {mine.name: mine}
    union = with_stored(Registry(), store.manifests())
    assert union.resolve("o/r:Q4_K_M") == union.models[model.manifest_name]
    assert union.resolve("hf.co/o/r:latest") == union.models[model.manifest_name]


def test_deleting_keeps_blobs_another_snapshot_uses(tmp_path: Path) -> None:
    store = Store(tmp_path / "hub", tmp_path / "store")
    q4 = stored(store)
    q8 = stored(store, "hf.co/o/r:Q8_0", "r-Q8_0.gguf")
    store.delete(q4)
    assert [m.name for m in store.models()] == [q8.name]
    assert not (store.repo_dir("o/r") / "blobs" / "r-Q4_K_M.gguf").exists()
    store.delete(q8)
    assert store.models() == []
    assert not store.repo_dir("o/r").exists()


# --- pulls against the fake hub, in-process ---


@pytest.fixture
async def hub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHub]:
    fake = FakeHub()
    fake.add("o/r", {"r-Q4_K_M.gguf": b"GGUF" * 1000, "r-Q8_0.gguf": b"GGUF" * 2**19})
    fake.add("o/st", {"config.json": b"{}", "model.safetensors": b"\0" * 1000, "README.md": b"hi"})
    url = await fake.start()
    # huggingface_hub read its endpoint at import: point its constant at the fake hub.
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", url)
    monkeypatch.setattr(
        "huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
        url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    yield fake
    await fake.close()


async def test_pulls_dedup_describe_and_store(hub: FakeHub, tmp_path: Path) -> None:
    store = Store(tmp_path / "hub", tmp_path / "store")
    stored_calls: list[int] = []
    pulls = Pulls(store, on_stored=lambda: stored_calls.append(1))
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


async def test_a_cancelled_pull_leaves_nothing(hub: FakeHub, tmp_path: Path) -> None:
    hub.delay_per_chunk_s = 0.02
    store = Store(tmp_path / "hub", tmp_path / "store")
    pulls = Pulls(store, on_stored=lambda: None)
    job = pulls.start("o/r:Q8_0")
    await eventually(lambda: hub.sent["r-Q8_0.gguf"] > 0, 10, "bytes to flow")
    assert await pulls.cancel("hf.co/o/r:Q8_0") is job
    assert job.state == PullState.CANCELLED
    assert store.models() == []
    assert [p.name for p in (tmp_path / "hub").rglob("*") if p.is_file()] == ["CACHEDIR.TAG"]
    assert pulls.describe()["recent"][0]["state"] == "cancelled"


def test_a_full_disk_is_named_as_such() -> None:
    error = _explain(ModelRef("o/r"), OSError(errno.ENOSPC, "No space left on device"))
    assert (error.code, error.status) == ("disk_full", 507)
    assert "no space left" in error.message
