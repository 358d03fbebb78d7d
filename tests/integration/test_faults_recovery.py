"""Issue 12: a child that dies (idle, mid-request, with a request queued), a pinned model that fails or
crashes, and a shutdown with requests queued. Real daemons, real llama-server children."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _pid(daemon: Daemon, model: str = "demo") -> int:
    return int((await daemon.health())["models"][model]["pid"])


async def _queued(daemon: Daemon, expected: int, model: str = "demo") -> bool:
    return bool((await daemon.health())["models"][model].get("queued", 0) == expected)


def _processing(daemon: Daemon) -> int:
    """How many tasks llama-server has begun: it logs each as it takes it from its queue."""
    return sum("processing task" in e["line"] for e in daemon.events("child_output"))


async def test_a_child_killed_while_idle_is_restarted_for_the_next_request(daemon: Daemon) -> None:
    await daemon.chat()
    pid = await _pid(daemon)
    os.kill(pid, signal.SIGKILL)  # the OOM killer, say; nobody has noticed yet
    status, body, _ = await daemon.post("/v1/chat/completions", CHAT)
    assert status == 200, body
    assert await _pid(daemon) != pid
    assert len(daemon.events("child_started")) == 2


async def test_ollama_after_a_child_killed_while_idle_is_served_too(daemon: Daemon) -> None:
    await daemon.chat()
    os.kill(await _pid(daemon), signal.SIGKILL)
    status, body, _ = await daemon.post("/api/chat", {**CHAT, "stream": False})
    assert status == 200, body
    assert body["done"] is True


async def test_a_child_killed_during_a_non_streamed_request_is_503_model_crashed(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(models={"demo": {"ctx_size": 4096, "parallel": 1}})  # room for 3000 tokens
    await daemon.chat()
    pid = await _pid(daemon)
    begun = _processing(daemon)
    request = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "max_tokens": 3000}))
    await eventually(lambda: _processing(daemon) > begun, what="the engine to take the request")
    await asyncio.sleep(0.5)  # let it generate a while: a crash, not a connection closed under us
    os.kill(pid, signal.SIGKILL)
    status, body, headers = await request
    assert (status, body["error"]["code"]) == (503, "model_crashed"), body
    assert int(headers["Retry-After"]) >= 1
    assert len(daemon.events("child_started")) == 1  # a request that may have killed it is not re-sent
    assert (await daemon.chat()).strip()  # the next one starts it again


async def test_a_request_queued_when_the_child_dies_waits_for_the_restart(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"parallel": 1}})
    stream = await daemon.start_stream("demo", max_tokens=2000)
    pid = await _pid(daemon)
    queued = asyncio.create_task(daemon.post("/v1/chat/completions", CHAT))
    await eventually(lambda: _queued(daemon, 1), what="a request queued behind the stream")
    os.kill(pid, signal.SIGKILL)
    try:
        async for _ in stream:
            pass
    except Exception:  # the stream's own error is pinned in test_failures.py
        pass
    status, body, _ = await queued
    assert status == 200, body  # not a 500 from a ticket without a child
    assert await _pid(daemon) != pid


async def test_a_pinned_model_that_cannot_be_placed_is_logged_and_retried(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"demo": {"pinned": True, "vram_mib": 8192}}, config={"failure_backoff_s": 0.1}
    )
    await eventually(lambda: len(daemon.events("pinned_load_failed", model="demo")) >= 3, what="three tries")
    failed = daemon.events("pinned_load_failed", model="demo")
    assert {e["reason"] for e in failed} == {"insufficient_vram"}
    assert [e["retry_in_s"] for e in failed[:3]] == [0.1, 0.2, 0.4]


async def test_a_pinned_model_that_fails_to_start_is_retried_with_back_off(
    make_daemon: MakeDaemon, broken_gguf: Path
) -> None:
    daemon = await make_daemon(
        models={"demo": {"pinned": True, "model": str(broken_gguf)}}, config={"failure_backoff_s": 0.1}
    )
    await eventually(lambda: len(daemon.events("child_started")) >= 2, what="a second start")
    (first, *_) = daemon.events("pinned_load_failed", model="demo")
    assert first["reason"] == "model_failed"
    await eventually(lambda: not daemon.children(), what="the failed children to be stopped")


async def test_a_crashed_pinned_model_comes_back_without_a_request(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"pinned": True}}, config={"failure_backoff_s": 0.1})
    await daemon.wait_state("demo", "ready")
    pid = await _pid(daemon)
    os.kill(pid, signal.SIGKILL)
    await daemon.wait_state("demo", "failed")
    await daemon.wait_state("demo", "ready")
    assert await _pid(daemon) != pid
    assert daemon.events("pinned_restart_scheduled", model="demo")


async def test_shutdown_answers_queued_requests_at_once_and_drains_in_flight_ones(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(models={"demo": {"parallel": 1}}, config={"drain_timeout_s": 120})
    stream = await daemon.start_stream("demo", max_tokens=2000)
    queued = [asyncio.create_task(daemon.post("/v1/chat/completions", CHAT)) for _ in range(2)]
    await eventually(lambda: _queued(daemon, 2), what="two requests queued behind the stream")
    daemon.signal(signal.SIGTERM)
    for task in queued:  # answered while the stream is still in flight, not when it ends
        status, body, _ = await task
        assert (status, body["error"]["code"]) == (503, "shutting_down")
    assert daemon.proc is not None
    assert daemon.proc.returncode is None
    chunks = [chunk async for chunk in stream]  # the request in flight is still served to its end
    assert chunks
    assert await daemon.wait_exit() == 0
    assert not daemon.events("shutdown_drain_timeout")


async def test_shutdown_answers_requests_waiting_for_a_load_at_once(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    slow = tmp_path / "never-ready"
    slow.write_text("#!/bin/sh\nexec sleep 300\n")
    slow.chmod(0o755)
    daemon = await make_daemon(models={"demo": {"binary": str(slow), "start_timeout_s": 120}})
    waiting = asyncio.create_task(daemon.post("/v1/chat/completions", CHAT))
    await eventually(lambda: bool(daemon.children()), what="the child to start")
    daemon.signal(signal.SIGTERM)
    status, body, _ = await waiting
    assert (status, body["error"]["code"]) == (503, "shutting_down")
    assert await daemon.wait_exit() == 0
    assert not [p for p in daemon.children() if p.status() != psutil.STATUS_ZOMBIE]


async def test_a_huge_keep_alive_means_forever_and_ps_keeps_answering(daemon: Daemon) -> None:
    """keep_alive 1e20 (or 400 digits) used to overflow the expiry, and /api/ps was a 500 from then on."""
    for keep_alive in (1e20, 10**300):
        status, _, _ = await daemon.post("/v1/chat/completions", {**CHAT, "keep_alive": keep_alive})
        assert status == 200
        status, ps = await daemon.get("/api/ps")
        assert status == 200
        assert ps["models"][0]["expires_at"].startswith("2318-")  # Ollama's "never"
    # Beyond any JSON number a client could mean: refused, not a 500.
    status, body, _ = await daemon.post(
        "/v1/chat/completions", raw=b'{"model": "demo", "keep_alive": ' + b"9" * 400 + b"}"
    )
    assert status == 400
    assert "keep_alive" in body["error"]["message"]


async def test_an_ollama_request_refused_after_finding_its_child_gone_gives_its_ticket_back(
    make_daemon: MakeDaemon,
) -> None:
    """A child that did not take the request (gone, say): the request waits for the model again with a
    second ticket and is sent once more (openai.send_to_child). An Ollama request refused after that
    (here /api/embed of an input too long with truncate false: a 400) gave its first ticket back again
    and kept the second: `inflight` stayed 1 for good, so the model never idled out and a stop waited
    out its drain. The child's socket is moved away for the first send (a connect that fails is what a
    child gone gives) and put back while the daemon waits to see it exit, so the second send reaches
    it."""
    embedder = {"ctx_size": 512, "vram_mib": 256, "args": ["--embeddings", "--pooling", "mean"]}
    daemon = await make_daemon(models={"emb": embedder})
    status, _, _ = await daemon.post("/v1/admin/models/emb/load", {})
    assert status == 200
    [started] = daemon.events("child_started")
    socket_path = Path(started["listen"])
    assert await asyncio.to_thread(socket_path.is_socket)
    away = socket_path.with_name(socket_path.name + ".away")
    await asyncio.to_thread(socket_path.rename, away)
    try:
        refused = {"model": "emb", "input": "word " * 2000, "truncate": False}
        request = asyncio.create_task(daemon.post("/api/embed", refused))
        await eventually(lambda: bool(daemon.events("child_unreachable")), 10, "the first send to fail")
    finally:
        await asyncio.to_thread(away.rename, socket_path)
    status, body, _ = await request
    assert status == 400, body
    assert body["error"].startswith("input exceeds maximum context length")
    assert len(daemon.events("child_started")) == 1  # the same child took the second send
    assert (await daemon.health())["models"]["emb"]["inflight"] == 0


@pytest.mark.parametrize("api", ["openai", "ollama"])
async def test_a_stream_cut_by_an_operators_unload_says_so_not_that_the_model_crashed(
    make_daemon: MakeDaemon, api: str
) -> None:
    """An unload waits drain_timeout_s for the stream, then stops the engine under it. Nothing crashed,
    but the client was told model_crashed (and the access log said so too)."""
    daemon = await make_daemon(models={"demo": {"parallel": 1}}, config={"drain_timeout_s": 1})
    assert daemon.http is not None
    path = "/v1/chat/completions" if api == "openai" else "/api/chat"
    body = {**CHAT, "max_tokens": 3000, "stream": True, "options": {"num_predict": 3000}}
    async with daemon.http.post(daemon.url + path, json=body) as response:
        assert response.status == 200
        await response.content.readline()
        unload = asyncio.create_task(daemon.post("/v1/admin/models/demo/unload", {}))
        errors = [line async for line in response.content if b'"error"' in line]
    assert (await unload)[0] == 200
    [line] = errors
    error = json.loads(line.removeprefix(b"data: "))["error"]
    message = error if api == "ollama" else error["message"]
    assert "was stopped (unload" in message, error
    if api == "openai":
        assert error["code"] == "model_stopped"
    assert not daemon.events("child_crashed")
    [logged] = [e for e in daemon.events("request") if e["path"] == path]
    assert logged["error"] == "model_stopped"
