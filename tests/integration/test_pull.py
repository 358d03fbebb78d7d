"""Pull and delete through the real daemon, from a fake Hugging Face hub, served by a real llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import pytest
import yaml

from supervisor import pulls
from supervisor.store import Store
from tests.fakehub import FakeHub, point_daemons_at, point_this_process_at
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually

REPO = "test-org/demo-GGUF"
Q4 = f"hf.co/{REPO}:Q4_K_M"  # the demo model: llama-server can serve it
Q8 = f"hf.co/{REPO}:Q8_0"  # 6 MiB of filler: for slow pulls, never served
Q8_FILE = "demo-Q8_0.gguf"
Q8_SIZE = 6 * 2**20


@pytest.fixture
async def hub(demo_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHub]:
    """A fake hub, and the environment that points the daemons started after it at it."""
    fake = FakeHub()
    fake.add(REPO, repo_files(demo_gguf))
    point_daemons_at(monkeypatch, await fake.start(), tmp_path / "hf")
    yield fake
    await fake.close()


def repo_files(demo_gguf: Path) -> dict[str, bytes]:
    return {
        "demo-Q4_K_M.gguf": demo_gguf.read_bytes(),
        Q8_FILE: bytes(range(256)) * (Q8_SIZE // 256),
        "README.md": b"# demo\n",
    }


def cache_files(tmp_path: Path) -> list[str]:
    root = tmp_path / "hf" / "hub"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


async def pull_lines(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    client = ollama.AsyncClient(host=daemon.url)
    return [dict(part) async for part in await client.pull(model, stream=True)]


async def model_ids(daemon: Daemon) -> list[str]:
    return [m["id"] for m in (await daemon.get("/v1/models"))[1]["data"]]


async def test_pull_then_chat_with_the_pulled_model(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    daemon = await make_daemon()
    lines = await pull_lines(daemon, Q4)
    statuses = [line["status"] for line in lines]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    file_lines = [line for line in lines if line.get("digest")]
    size = len(hub.repos[REPO]["demo-Q4_K_M.gguf"])
    assert all(line["digest"].startswith("sha256:") and line["total"] == size for line in file_lines)
    assert file_lines[-1]["status"] == "pulling " + file_lines[-1]["digest"][7:19]
    assert file_lines[-1]["completed"] == size
    assert Q4 in await model_ids(daemon)
    # Served at once, under the pulled name and without the hf.co/ prefix.
    assert await daemon.chat(Q4)
    assert await daemon.chat(f"{REPO}:Q4_K_M")
    # In any case, as Ollama finds names (the hub's repo ids are case-insensitive; REPO has capitals).
    assert await daemon.chat(Q4.lower())
    assert await daemon.chat(f"{REPO}:Q4_K_M".upper())
    status = (await daemon.get("/api/status"))[1]
    assert status["models"][Q4]["state"] == "ready"
    assert status["models"][Q4]["unloads_in_s"] > 0
    assert [(p["name"], p["state"]) for p in status["pulls"]["recent"]] == [(Q4, "success")]
    assert status["pulls"]["running"] == []
    assert status["store"]["bytes"] == size


async def test_two_pulls_of_one_model_share_one_download(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    daemon = await make_daemon()
    hub.held = asyncio.Event()
    first = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: hub.sent[Q8_FILE] > 0, 10, "the download to start")
    second = asyncio.create_task(pull_lines(daemon, f"{REPO}:Q8_0"))  # another spelling of the same model
    # Inference on another model goes on while the download is held mid-body.
    assert await daemon.chat("demo")
    assert not first.done()
    hub.held.set()
    results = await asyncio.gather(first, second)
    for lines in results:
        assert lines[-1]["status"] == "success"
        assert any(line.get("completed") for line in lines)
    assert hub.gets[f"{REPO}/{Q8_FILE}"] == 1


async def test_reconnect_to_a_running_pull_streams_the_rest(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    daemon = await make_daemon()
    hub.delay_per_chunk_s = 0.02
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{daemon.url}/api/pull", json={"model": Q8}) as response:
            assert response.status == 200
            assert json.loads(await response.content.readline())["status"] == "pulling manifest"
        # The client went away; the pull goes on and can be watched again.
        async with http.get(f"{daemon.url}/api/pull/status/{Q8}") as response:
            lines = [json.loads(line) async for line in response.content if line.strip()]
        assert lines[-1] == {"status": "success"}
        assert any(line.get("completed") for line in lines)
        async with http.get(f"{daemon.url}/api/pull/status/{Q8}") as response:
            assert [json.loads(line) async for line in response.content if line.strip()] == [
                {"status": "success"}
            ]
    assert hub.gets[f"{REPO}/{Q8_FILE}"] == 1
    assert not daemon.events("handler_error")  # the client that went away ended only its stream


async def test_cancel_stops_the_transfer_and_removes_partial_files(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    daemon = await make_daemon()
    hub.delay_per_chunk_s = 0.05
    pulling = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: hub.sent[Q8_FILE] > 0, 10, "bytes to flow")
    assert daemon.http is not None
    async with daemon.http.delete(f"{daemon.url}/api/pull/{Q8}") as response:
        assert response.status == 200, await response.text()
    with pytest.raises(ollama.ResponseError, match="cancelled"):
        await pulling
    await eventually(lambda: Q8_FILE in hub.finished, 10, "the hub to see the transfer end")
    assert hub.sent[Q8_FILE] < Q8_SIZE
    assert not [f for f in cache_files(tmp_path) if "incomplete" in f or f.endswith(Q8_FILE)]
    assert not any("Q8" in m for m in await model_ids(daemon))
    async with daemon.http.delete(f"{daemon.url}/api/pull/{Q8}") as response:
        assert response.status == 404


@pytest.mark.parametrize("failure", ["server error", "truncated body"])
async def test_failed_download_registers_nothing(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path, failure: str
) -> None:
    daemon = await make_daemon()
    (hub.fail_files if failure == "server error" else hub.truncate_files).add(Q8_FILE)
    with pytest.raises(ollama.ResponseError) as caught:
        await pull_lines(daemon, Q8)
    assert "hf.co/test-org/demo-GGUF" in str(caught.value)
    assert not [f for f in cache_files(tmp_path) if "incomplete" in f or f.endswith(Q8_FILE)]
    assert not any("Q8" in m for m in await model_ids(daemon))
    status, body = await daemon.get("/api/pull/status/" + Q8)
    assert status == 200
    assert "error" in body


async def test_a_safetensors_repo_becomes_a_vllm_model(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    hub.add("test-org/tiny", {"config.json": b"{}", "model.safetensors": b"\0" * 1024})
    daemon = await make_daemon()
    # `stream: false`: one answer at the end.
    done = await ollama.AsyncClient(host=daemon.url).pull("test-org/tiny", stream=False)
    assert done.status == "success"
    [entry] = [m for m in (await daemon.get("/v1/models"))[1]["data"] if m["id"] == "hf.co/test-org/tiny"]
    assert entry["engine"] == "vllm"


async def test_unknown_quant_is_an_error_listing_the_available_ones(
    make_daemon: MakeDaemon, hub: FakeHub
) -> None:
    daemon = await make_daemon()
    with pytest.raises(ollama.ResponseError) as caught:
        await pull_lines(daemon, f"hf.co/{REPO}:Q2_K")
    assert caught.value.status_code == 404
    assert "Q4_K_M" in str(caught.value)
    assert "Q8_0" in str(caught.value)


async def test_delete_refused_while_loaded_then_removes_the_model(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    daemon = await make_daemon()
    await pull_lines(daemon, Q4)
    assert await daemon.chat(Q4)
    status, body, _ = await delete(daemon, Q4)
    assert status == 409
    assert "loaded" in body["error"]
    await daemon.chat(Q4, keep_alive=0)
    await daemon.wait_state(Q4, "unloaded")
    status, body, _ = await delete(daemon, Q4)
    assert status == 200, body
    assert Q4 not in await model_ids(daemon)
    assert not [f for f in cache_files(tmp_path) if f.endswith(".gguf")]
    status, body, _ = await delete(daemon, Q4)
    assert status == 404
    assert "error" in body


async def test_delete_is_refused_while_a_pull_from_the_same_repo_runs(
    make_daemon: MakeDaemon, hub: FakeHub
) -> None:
    daemon = await make_daemon()
    await pull_lines(daemon, Q4)
    hub.held = asyncio.Event()
    pulling = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: hub.sent[Q8_FILE] > 0, 10, "the download to start")
    status, body, _ = await delete(daemon, Q4)
    assert status == 409
    assert "pull" in body["error"]
    hub.held.set()
    assert (await pulling)[-1]["status"] == "success"
    status, body, _ = await delete(daemon, Q4)
    assert status == 200, body
    assert Q4 not in await model_ids(daemon)
    assert Q8 in await model_ids(daemon)


async def test_a_manifest_wins_over_a_stored_model_of_the_same_name(
    make_daemon: MakeDaemon, hub: FakeHub, demo_gguf: Path
) -> None:
    daemon = await make_daemon()
    await pull_lines(daemon, Q4)
    manifest = daemon.manifests / "mine.yaml"
    manifest.write_text(
        yaml.safe_dump({"name": Q4, "engine": "llama-server", "model": str(demo_gguf), "vram_mib": 512})
    )
    reloads = len(daemon.events("reload_applied"))  # the pull's own refresh logged one already
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: len(daemon.events("reload_applied")) > reloads, 10, "the reload")
    status, body, _ = await delete(daemon, Q4)
    assert status == 409
    assert str(manifest) in body["error"]
    assert await daemon.chat(Q4)


async def delete(daemon: Daemon, model: str) -> tuple[int, Any, Any]:
    assert daemon.http is not None
    async with daemon.http.delete(f"{daemon.url}/api/delete", json={"model": model}) as response:
        return response.status, await response.json(content_type=None), response.headers


async def test_the_ollama_client_pulls_lists_shows_chats_with_and_deletes_a_model(
    make_daemon: MakeDaemon, hub: FakeHub
) -> None:
    """The issue's acceptance, end to end, with no change to the client."""
    daemon = await make_daemon()
    client = ollama.AsyncClient(host=daemon.url)
    assert (await client.pull(Q4)).status == "success"
    details = {m.model: m.details for m in (await client.list()).models}[Q4]
    assert details is not None
    assert details.format == "gguf"
    shown = (await client.show(Q4)).modelinfo
    assert shown is not None
    assert shown["general.architecture"] == "llama"
    answer = await client.chat(
        model=Q4, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3}
    )
    assert answer.message.content
    assert [m.model for m in (await client.ps()).models] == [Q4]
    await client.generate(model=Q4, prompt="", keep_alive=0)  # Ollama's way to unload
    await daemon.wait_state(Q4, "unloaded")
    assert (await client.delete(Q4)).status == "success"
    assert Q4 not in {m.model for m in (await client.list()).models}


# --- the store owns only what it downloaded; pulls are bounded ---

VICTIM = "victim/model"
VICTIM_FILE = "victim-Q4_K_M.gguf"


async def another_tool_downloads(repo: str, filename: str) -> Path:
    """Another program on the machine fills the shared HF cache: huggingface_hub's own download, by branch
    (so it writes `refs/main`), in a process of its own with the test's HF_HOME and HF_ENDPOINT."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from huggingface_hub import hf_hub_download; print(hf_hub_download(*sys.argv[1:]))",
        repo,
        filename,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return Path(out.decode().strip())


def tree(root: Path) -> dict[str, tuple[str, int]]:
    """Each file and link under `root`: a link's target or a file's size, and its inode (a rewrite shows)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(root))] = (os.readlink(path), path.lstat().st_ino)
        elif path.is_file():
            found[str(path.relative_to(root))] = (str(path.stat().st_size), path.stat().st_ino)
    return found


def records(daemon: Daemon) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((daemon.state_dir / "store").glob("*.json"))]


async def test_deleting_a_pull_of_another_tools_files_leaves_them_and_the_model_that_serves_them(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path, demo_gguf: Path
) -> None:
    """The attack of issue 11: pull a repo another tool cached and a manifest model serves, then delete."""
    hub.add(VICTIM, {VICTIM_FILE: repo_files(demo_gguf)["demo-Q4_K_M.gguf"]})
    theirs = await another_tool_downloads(VICTIM, VICTIM_FILE)
    repo_dir = tmp_path / "hf" / "hub" / "models--victim--model"
    before = tree(repo_dir)
    assert "refs/main" in before
    daemon = await make_daemon(models={"victim": {"model": str(theirs)}})
    assert await daemon.chat("victim")
    assert await daemon.state("victim") == "ready"

    lines = await pull_lines(daemon, "hf.co/Victim/Model:q4_k_m")  # any case: the hub's spelling wins
    assert lines[-1]["status"] == "success"
    assert hub.gets[f"{VICTIM}/{VICTIM_FILE}"] == 1  # the other tool's download; the daemon adopted it
    [record] = records(daemon)
    assert record["name"] == "hf.co/victim/model:Q4_K_M"
    assert [(f["path"], f["downloaded"]) for f in record["files"]] == [(VICTIM_FILE, False)]
    assert tree(repo_dir) == before  # refs/main not rewritten either

    status, body, _ = await delete(daemon, "hf.co/victim/model:Q4_K_M")
    assert status == 200, body
    assert "hf.co/victim/model:Q4_K_M" not in await model_ids(daemon)
    assert tree(repo_dir) == before
    assert await daemon.state("victim") == "ready"
    assert await daemon.chat("victim")


async def _one_running_one_waiting(
    make_daemon: MakeDaemon, hub: FakeHub
) -> tuple[Daemon, asyncio.Event, asyncio.Task[list[dict[str, Any]]], asyncio.Task[list[dict[str, Any]]]]:
    """A daemon allowed one pull at a time, pulling Q8 (held mid-download by the hub until the returned
    event is set) with Q4 asked for after it; the tasks end with each pull's lines."""
    daemon = await make_daemon(config={"max_parallel_pulls": 1})
    hub.held = held = asyncio.Event()
    first = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: hub.sent[Q8_FILE] > 0, 10, "the download to start")
    return daemon, held, first, asyncio.create_task(pull_lines(daemon, Q4))


async def test_pulls_beyond_max_parallel_pulls_wait_queued_and_say_so(
    make_daemon: MakeDaemon, hub: FakeHub
) -> None:
    daemon, held, first, second = await _one_running_one_waiting(make_daemon, hub)

    async def queued() -> bool:
        running = (await daemon.get("/api/status"))[1]["pulls"]["running"]
        return [(p["name"], p["state"], p["status"]) for p in running if p["name"] == Q4] == [
            (Q4, "queued", "queued")
        ]

    await eventually(queued, 10, "the second pull to be queued")
    assert await daemon.chat("demo")  # serving goes on
    assert hub.gets[f"{REPO}/demo-Q4_K_M.gguf"] == 0
    assert daemon.http is not None
    async with daemon.http.get(f"{daemon.url}/api/pull/status/{Q4}") as response:
        assert json.loads(await response.content.readline()) == {"status": "queued"}
    held.set()
    first_lines, second_lines = await asyncio.gather(first, second)
    assert first_lines[-1]["status"] == second_lines[-1]["status"] == "success"
    assert "queued" in [line["status"] for line in second_lines]
    assert "queued" not in [line["status"] for line in first_lines]


async def test_a_pull_that_would_leave_too_little_disk_is_refused_up_front(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    daemon = await make_daemon(config={"min_free_disk_mib": 2**40})
    status, body, _ = await daemon.post("/api/pull", {"model": Q8})
    assert status == 507
    assert set(body) == {"error"}
    assert "min_free_disk_mib" in body["error"]
    status, body, _ = await daemon.post("/api/pull", {"model": Q4, "stream": False})
    assert status == 507
    with pytest.raises(ollama.ResponseError) as caught:
        await pull_lines(daemon, Q4)
    assert caught.value.status_code == 507
    assert not [f for f in cache_files(tmp_path) if f.endswith(".gguf") or "incomplete" in f]
    assert not hub.gets
    assert [(p["name"], p["state"]) for p in (await daemon.get("/api/status"))[1]["pulls"]["running"]] == []


async def test_every_bad_store_request_is_a_4xx(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    daemon = await make_daemon()
    assert daemon.http is not None
    answers: list[tuple[str, int, Any]] = []

    async def call(method: str, path: str, body: Any = None, raw: bytes | None = None) -> None:
        assert daemon.http is not None
        data = raw if raw is not None else json.dumps(body).encode()
        async with daemon.http.request(method, daemon.url + path, data=data) as response:
            answers.append((f"{method} {path} {data[:40]!r}", response.status, await response.json()))

    for raw in (b"[]", b"{", b"", b'"x"', b"\xff\xfe"):
        await call("POST", "/api/pull", raw=raw)
        await call("DELETE", "/api/delete", raw=raw)
    for model in (
        5, "", " ", ["x"], None, "x" * 5000, "org/a..b", "org--a/b", "hf.co/org", "a/b/c", "nosuch/repo",
        f"{REPO}:Q2_K", f"{REPO}:" + "Q" * 300, "../../etc/passwd", "org/repo\x00", "hf.co/org/repo:a:b",
    ):  # fmt: skip
        await call("POST", "/api/pull", {"model": model})
        await call("POST", "/api/pull", {"model": model, "stream": False})
        await call("DELETE", "/api/delete", {"model": model})
    not_booleans: list[Any] = ["false", 0, 1, "no", [], {}]
    for stream in not_booleans:  # as on /api/chat: a 400 (they streamed NDJSON)
        await call("POST", "/api/pull", {"model": Q4, "stream": stream})
        assert answers[-1][1:] == (400, {"error": f"stream must be true or false, not {stream!r}"})
    for path in ("never/pulled", "..%2F..%2Fetc", "x" * 3000, "org/a..b:Q4"):
        await call("GET", f"/api/pull/status/{path}")
        await call("DELETE", f"/api/pull/{path}")
    bad = [(what, status) for what, status, body in answers if not 400 <= status < 500 or "error" not in body]
    assert bad == []
    assert not daemon.events("handler_error")


async def test_sigterm_during_a_pull_stops_accepting_at_once(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    """The pull manager's close used to be awaited first, so /health said 200 and loads went on."""
    daemon = await make_daemon()
    hub.held = asyncio.Event()  # the download hangs mid-body until the test lets it go
    pulling = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: hub.sent[Q8_FILE] > 0, 10, "the download to start")
    daemon.signal(signal.SIGTERM)

    async def refusing() -> bool:
        health = (await daemon.get("/health"))[0]
        chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
        status, body, _ = await daemon.post("/v1/chat/completions", chat)
        return health == 503 and (status, body["error"]["code"]) == (503, "shutting_down")

    await eventually(refusing, 10, "/health 503 and new requests refused while the pull is held")
    assert not daemon.children()  # no load was started
    hub.held.set()
    assert await daemon.wait_exit() == 0
    pulling.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await pulling


async def test_a_pull_killed_with_the_daemon_is_undone_at_the_next_start(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    """SIGKILL mid-download runs no clean-up: the partial file, the lock file and the journal entry stay
    until the restarted daemon's start-up removes them."""
    daemon = await make_daemon(models={})
    hub.held = asyncio.Event()
    pulling = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: any("incomplete" in f for f in cache_files(tmp_path)), 10, "a partial file")
    daemon.expect_exit.add(-signal.SIGKILL)
    daemon.signal(signal.SIGKILL)
    await daemon.wait_exit()
    with contextlib.suppress(Exception):
        await pulling
    hub.held.set()
    assert list((daemon.state_dir / "store" / "pulling").glob("*.json"))

    await daemon.start()

    [recovered] = daemon.events("pull_recovered")
    assert (recovered["repo"], recovered["files"], recovered["partials"]) == (REPO, 1, 1)
    assert not [f for f in cache_files(tmp_path) if "incomplete" in f or f.endswith((".lock", Q8_FILE))]
    assert not list((daemon.state_dir / "store" / "pulling").glob("*.json"))


async def pull_status(daemon: Daemon, model: str, query: str = "?stream=false") -> tuple[int, Any]:
    return await daemon.get(f"/api/pull/status/{model}{query}")


async def test_pull_status_without_streaming_is_one_object_totalled_over_all_files(
    make_daemon: MakeDaemon, hub: FakeHub
) -> None:
    daemon, held, first, second = await _one_running_one_waiting(make_daemon, hub)

    async def queued() -> bool:
        return bool((await pull_status(daemon, Q4))[1].get("state") == "queued")

    await eventually(queued, 10, "the second pull to be queued")
    status, running = await pull_status(daemon, Q8)
    assert status == 200
    assert running["model"] == Q8
    assert running["state"] == "running"
    assert (running["total"], running["files_done"], running["files_total"]) == (Q8_SIZE, 0, 1)
    assert 0 <= running["completed"] < Q8_SIZE
    assert running["error"] is None
    assert (await pull_status(daemon, Q8, "?stream=0"))[1]["state"] == "running"

    held.set()
    assert (await first)[-1]["status"] == (await second)[-1]["status"] == "success"
    q4_size = len(hub.repos[REPO]["demo-Q4_K_M.gguf"])
    assert (await pull_status(daemon, f"{REPO}:Q4_K_M"))[1] == {  # any spelling of the model
        "model": Q4,
        "state": "success",
        "completed": q4_size,
        "total": q4_size,
        "files_done": 1,
        "files_total": 1,
        "error": None,
    }
    done = (await pull_status(daemon, Q8))[1]
    assert (done["state"], done["completed"], done["total"], done["files_done"]) == (
        "success",
        Q8_SIZE,
        Q8_SIZE,
        1,
    )

    # Several files: a safetensors model's config and weights.
    hub.add("test-org/tiny", {"config.json": b"{}", "model.safetensors": b"\0" * 1024})
    assert (await pull_lines(daemon, "test-org/tiny"))[-1]["status"] == "success"
    done = (await pull_status(daemon, "hf.co/test-org/tiny"))[1]
    assert (done["state"], done["completed"], done["total"]) == ("success", 1026, 1026)
    assert (done["files_done"], done["files_total"]) == (2, 2)

    # Cancelled, and failed (each alone: no other pull of its repo runs meanwhile).
    hub.add("test-org/slow-GGUF", {"slow-Q4_K_M.gguf": b"\1" * Q8_SIZE})
    hub.add("test-org/broken-GGUF", {"broken-Q4_K_M.gguf": b"\2" * 1000})
    hub.fail_files.add("broken-Q4_K_M.gguf")
    hub.delay_per_chunk_s = 0.05
    slow = asyncio.create_task(pull_lines(daemon, "test-org/slow-GGUF"))

    async def under_way() -> bool:
        return bool((await pull_status(daemon, "test-org/slow-GGUF"))[1].get("completed"))

    await eventually(under_way, 10, "the slow download to report bytes")
    assert daemon.http is not None
    async with daemon.http.delete(f"{daemon.url}/api/pull/test-org/slow-GGUF") as response:
        assert response.status == 200, await response.text()
    with pytest.raises(ollama.ResponseError, match="cancelled"):
        await slow
    cancelled = (await pull_status(daemon, "test-org/slow-GGUF"))[1]
    assert (cancelled["state"], cancelled["error"]) == ("cancelled", "pull cancelled")
    assert 0 < cancelled["completed"] < cancelled["total"] == Q8_SIZE
    with pytest.raises(ollama.ResponseError):
        await pull_lines(daemon, "test-org/broken-GGUF")
    failed = (await pull_status(daemon, "test-org/broken-GGUF"))[1]
    assert (failed["state"], failed["files_done"], failed["files_total"]) == ("failed", 0, 1)
    assert "hf.co/test-org/broken-GGUF" in failed["error"]

    for model, query, expected in [
        ("never/pulled", "?stream=false", 404),
        ("hf.co/test-org/never:Q4_K_M", "?stream=false", 404),
        ("..%2F..%2Fetc", "?stream=false", 404),
        (Q8, "?stream=maybe", 400),
    ]:
        status, body = await pull_status(daemon, model, query)
        assert status == expected, (model, query, body)
        assert isinstance(body["error"], str)  # Ollama's error shape
    assert not daemon.events("handler_error")


async def test_a_pull_waiting_on_the_hub_repeats_its_progress_line(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process, with the heartbeat shortened: a watcher of a stalled transfer still hears from it."""
    point_this_process_at(monkeypatch, hub.url)
    monkeypatch.setattr(pulls, "HEARTBEAT_S", 0.05)

    async def refreshed() -> None:
        return None

    manager = pulls.Pulls(Store(tmp_path / "hf" / "hub", tmp_path / "store"), on_stored=refreshed)
    hub.held = asyncio.Event()
    job = manager.start(Q8)
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(60), contextlib.aclosing(job.events()) as events:
        async for event in events:
            seen.append(event)
            if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3] and "digest" in event:
                hub.held.set()  # three times the same line while the body was held: let it go on
    assert hub.held.is_set()
    assert seen[-1] == {"status": "success"}
    await manager.close()


async def test_a_pull_asked_for_while_shutting_down_is_refused_and_writes_nothing(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    """After SIGTERM, POST /api/pull started a download that the pulls' close (already run) never
    cancelled: the exit abandoned it mid-file."""
    daemon = await make_daemon()
    hub.held = asyncio.Event()  # the first download hangs mid-body: the shutdown waits on it
    pulling = asyncio.create_task(pull_lines(daemon, Q8))
    await eventually(lambda: hub.sent[Q8_FILE] > 0, 10, "the first download to start")
    daemon.signal(signal.SIGTERM)
    await eventually(lambda: _health_is_503(daemon), 10, "the daemon to stop accepting")
    for stream in (True, False):
        status, body, _ = await daemon.post("/api/pull", {"model": Q4, "stream": stream})
        assert (status, body) == (503, {"error": "the supervisor is shutting down"})
    hub.held.set()
    assert await daemon.wait_exit() == 0
    assert hub.gets[f"{REPO}/demo-Q4_K_M.gguf"] == 0
    assert not [f for f in cache_files(tmp_path) if "Q4" in f]
    pulling.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await pulling


async def _health_is_503(daemon: Daemon) -> bool:
    return (await daemon.get("/health"))[0] == 503


async def test_a_pulled_model_with_a_file_gone_can_still_be_deleted(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    """One file of a pulled model is gone (a cache clean-up, an `rm`): the store no longer lists the model,
    and DELETE /api/delete answered 404, so what the daemon downloaded for it and its record stayed."""
    hub.add("test-org/tiny", {"config.json": b"{}", "model.safetensors": b"\0" * 2**20})
    daemon = await make_daemon()
    assert (await pull_lines(daemon, "test-org/tiny"))[-1]["status"] == "success"
    snapshot = next((tmp_path / "hf" / "hub" / "models--test-org--tiny" / "snapshots").iterdir())
    (snapshot / "config.json").unlink()
    status, body, _ = await delete(daemon, "hf.co/test-org/tiny")
    assert (status, body) == (200, {"status": "success"})
    assert not [f for f in cache_files(tmp_path) if "tiny" in f]
    assert records(daemon) == []
    status, body, _ = await delete(daemon, "hf.co/test-org/tiny")
    assert status == 404
    assert isinstance(body["error"], str)


async def test_a_pull_during_a_delete_waits_for_it_and_keeps_what_it_downloaded(
    make_daemon: MakeDaemon, hub: FakeHub, tmp_path: Path
) -> None:
    """DELETE /api/delete checked for pulls under catalog.lock, but a pull started without it: one that came
    while the delete's thread ran (slowed here by a configured model whose argument names a big directory,
    walked before anything is removed) saved its record and said success, and then the delete removed that
    record and the files. The pull waits for the delete now, then downloads afresh."""
    big = tmp_path / "lots"
    big.mkdir()
    for i in range(40000):
        (big / str(i)).touch()
    daemon = await make_daemon(models={"demo": {}, "other": {"args": ["--lora", str(big)]}})
    assert (await pull_lines(daemon, Q4))[-1]["status"] == "success"

    async def pull_meanwhile() -> tuple[int, Any, Any]:
        await asyncio.sleep(0.1)  # the delete is under way
        return await daemon.post("/api/pull", {"model": Q4, "stream": False})

    deleted, pulled = await asyncio.gather(delete(daemon, Q4), pull_meanwhile())
    assert deleted[:2] == (200, {"status": "success"})
    assert pulled[:2] == (200, {"status": "success"})
    assert Q4 in await model_ids(daemon)
    assert [[(f["path"], f["downloaded"]) for f in r["files"]] for r in records(daemon)] == [
        [("demo-Q4_K_M.gguf", True)]
    ]
    status, body, _ = await delete(daemon, Q4)
    assert status == 200, body
    assert not [f for f in cache_files(tmp_path) if "blobs" in f]


async def test_sighup_applies_min_free_disk_mib_to_pulls(make_daemon: MakeDaemon, hub: FakeHub) -> None:
    """The pulls kept the settings they were made with: after a SIGHUP lowered it, still 507."""
    daemon = await make_daemon(config={"min_free_disk_mib": 2**40})
    status, _, _ = await daemon.post("/api/pull", {"model": Q4, "stream": False})
    assert status == 507
    daemon.write_config(min_free_disk_mib=0)
    before = len(daemon.events("reload_applied"))
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: len(daemon.events("reload_applied")) > before, what="the reload")
    status, body, _ = await daemon.post("/api/pull", {"model": Q4, "stream": False})
    assert (status, body) == (200, {"status": "success"})
