"""What a pull that fails, is cancelled, or meets a lying hub leaves in the cache: nothing it did not
make, and nothing another tool made goes. Against the fake hub (tests/fakehub.py, standing in for the
Hugging Face hub's download API), in-process. Each case was found by a review that read the pull's
clean-up against "nothing deleted that the daemon did not create"."""

from __future__ import annotations

import asyncio
import threading
from collections import namedtuple

import huggingface_hub.file_download as hf_file_download
import pytest
from huggingface_hub import hf_hub_download

from supervisor.config import Settings
from supervisor.pulls import Pulls, PullState
from supervisor.store import Store
from tests.fakehub import COMMIT, FakeHub, point_this_process_at, tree
from tests.integration.harness import eventually
from tests.launch import free_port

NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
BIG = b"\7" * 2**21  # 2 MiB


async def refreshed() -> None:
    """A stand-in for the catalog's refresh."""


@pytest.fixture
def hub_repos() -> dict[str, dict[str, bytes]]:
    return {"o/st": {"config.json": b"{}", "model.safetensors": b"\0" * 1000}}


async def failed(pulls: Pulls, requested: str) -> None:
    job = pulls.start(requested)
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.FAILED


async def test_a_failed_pull_leaves_another_tools_lock_file(hub: FakeHub, store: Store) -> None:
    """`hf download` of config.json leaves huggingface_hub's lock file; a pull of the repo that failed
    on the weights removed it, and the folder it was in, as if the pull had made it."""
    await asyncio.to_thread(
        hf_hub_download, "o/st", "config.json", revision=COMMIT, cache_dir=store.cache_dir
    )
    before = tree(store.cache_dir)
    assert any(path.startswith(".locks/") for path in before)
    hub.fail_files.add("model.safetensors")
    await failed(Pulls(store, on_stored=refreshed), "o/st")
    assert tree(store.cache_dir) == before


async def test_a_failed_pull_leaves_no_link_it_made_to_a_blob_already_there(
    hub: FakeHub, store: Store
) -> None:
    """Another tool had config.json at COMMIT; the hub is at NEW_COMMIT now, and the weights fail. The
    pull's download of config.json found its blob and only linked it into snapshots/NEW_COMMIT: that
    link stayed, which nothing would remove."""
    await asyncio.to_thread(
        hf_hub_download, "o/st", "config.json", revision=COMMIT, cache_dir=store.cache_dir
    )
    before = tree(store.cache_dir)
    hub.commit = NEW_COMMIT
    hub.fail_files.add("model.safetensors")
    await failed(Pulls(store, on_stored=refreshed), "o/st")
    after = tree(store.cache_dir)
    assert after == before, sorted(set(after) - set(before))


async def test_a_failed_re_pull_leaves_nothing_that_keeps_the_models_files(
    hub: FakeHub, store: Store
) -> None:
    """The same with the daemon's own pull at COMMIT: the stray link kept its config.json blob in use, so
    deleting the model left the blob and the link for ever."""
    pulls = Pulls(store, on_stored=refreshed)
    first = pulls.start("o/st")
    await asyncio.wait_for(first.done.wait(), 20)
    assert first.state == PullState.SUCCESS
    hub.commit = NEW_COMMIT
    hub.add("o/st", {"model.safetensors": b"\1" * 1000})
    hub.fail_files.add("model.safetensors")
    await failed(pulls, "o/st")
    assert not (store.repo_dir("o/st") / "snapshots" / NEW_COMMIT).exists()
    store.delete(store.models()[0])
    assert not store.repo_dir("o/st").exists(), sorted(tree(store.cache_dir))


def tight_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB usable beyond min_free_disk_mib (1 MiB): a stand-in for a nearly full disk."""
    free = 2**20 + 2**16
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("supervisor.pulls.shutil.disk_usage", lambda path: usage(free, 0, free))


@pytest.mark.parametrize("lie", ["one-blob-two-sizes", "negative-size"])
async def test_sizes_a_hub_lists_cannot_take_a_pull_past_the_disk_check(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch, lie: str
) -> None:
    """The disk check counts the listed sizes, one per blob: a hub that listed one blob twice (the second
    time as 1 byte), or a size below zero, had 2 MiB written with 64 KiB to spare, and the first pull
    even succeeded. Refused (502 hub_error) before anything is written."""
    if lie == "one-blob-two-sizes":
        hub.add("o/lie", {"config.json": b"{}", "a.safetensors": BIG, "b.safetensors": BIG})
        hub.sizes["b.safetensors"] = 1
    else:
        hub.add("o/lie", {"config.json": b"{}", "a.safetensors": BIG, "tokenizer.json": b'{"x": 1}'})
        hub.sizes["tokenizer.json"] = -len(BIG)
    tight_disk(monkeypatch)
    job = Pulls(store, on_stored=refreshed, settings=Settings(min_free_disk_mib=1)).start("o/lie")
    await asyncio.wait_for(job.done.wait(), 20)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert job.error.code == "hub_error", job.error
    assert hub.sent["a.safetensors"] == 0


async def test_a_re_pull_at_a_new_commit_leaves_the_folder_another_pull_downloads_into(
    hub: FakeHub, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q8 is being pulled at COMMIT (its transfer done, its link not made yet) when a re-pull of Q4 at a
    new commit removes Q4's old file at COMMIT, and with it the snapshot folder it left empty: Q8's
    pull then failed (FileNotFoundError making its link)."""
    hub.add("o/r", {"r-Q4_K_M.gguf": b"GGUF" * 1000, "r-Q8_0.gguf": b"GGUF" * 2**19})
    pulls = Pulls(store, on_stored=refreshed)
    first = pulls.start("o/r:Q4_K_M")
    await asyncio.wait_for(first.done.wait(), 20)
    assert first.state == PullState.SUCCESS
    link = hf_file_download._create_symlink
    at_link, go_on = threading.Event(), threading.Event()

    def slow_link(src: str, dst: str, new_blob: bool = False) -> None:
        if dst.endswith("r-Q8_0.gguf"):
            at_link.set()
            go_on.wait(10)
        link(src, dst, new_blob)

    monkeypatch.setattr(hf_file_download, "_create_symlink", slow_link)
    q8 = pulls.start("o/r:Q8_0")
    await eventually(at_link.is_set, 10, "the Q8 transfer to end")
    hub.commit = NEW_COMMIT
    hub.add("o/r", {"r-Q4_K_M.gguf": b"GGUG" * 1000})
    again = pulls.start("o/r:Q4_K_M")
    await asyncio.wait_for(again.done.wait(), 20)
    assert again.state == PullState.SUCCESS, again.error
    go_on.set()
    await asyncio.wait_for(q8.done.wait(), 20)
    assert q8.state == PullState.SUCCESS, q8.error


async def test_a_hub_that_cannot_be_reached_is_a_hub_error_naming_where(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No DNS, no route, nothing listening: it was pull_failed "ConnectError: [Errno -2] ...", naming no
    host (a review helper following the README)."""
    port = free_port()  # nothing listens there
    point_this_process_at(monkeypatch, f"http://127.0.0.1:{port}")
    job = Pulls(store, on_stored=refreshed).start("o/st")
    await asyncio.wait_for(job.done.wait(), 30)
    assert job.state == PullState.FAILED
    assert job.error is not None
    assert job.error.code == "hub_error"
    assert f"could not reach the hub at http://127.0.0.1:{port}" in job.error.message


async def test_a_password_in_the_hubs_url_is_not_in_the_pulls_error(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_ENDPOINT behind a proxy with basic auth: the error every follower of the pull reads (keyed or
    not, streamed by /api/pull and /api/pull/status) named the URL with its password."""
    port = free_port()
    point_this_process_at(monkeypatch, f"http://proxyuser:s3cretpass@127.0.0.1:{port}")
    job = Pulls(store, on_stored=refreshed).start("o/st")
    await asyncio.wait_for(job.done.wait(), 30)
    assert job.error is not None
    assert "s3cretpass" not in job.error.message
    assert f"http://proxyuser:***@127.0.0.1:{port}" in job.error.message
