"""What happens when children fail: at start, while hung, mid-stream; and when clients go away."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from tests.integration.conftest import TAKING_TURNS, MakeDaemon
from tests.integration.harness import Daemon, eventually

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


async def test_broken_gguf_gives_a_clear_503_and_leaves_no_process(
    make_daemon: MakeDaemon, broken_gguf: Path
) -> None:
    daemon = await make_daemon(models={"demo": {"model": str(broken_gguf)}})
    status, body, headers = await daemon.post("/v1/chat/completions", CHAT)
    assert status == 503
    assert body["error"]["code"] == "model_failed"
    assert "exited with code 1 during start-up" in body["error"]["message"]
    assert not daemon.children()
    last_error = (await daemon.health())["models"]["demo"]["last_error"]
    assert last_error["exit_code"] == 1
    assert any("failed to load model" in line for line in last_error["stderr_tail"])
    # Straight away again: the back-off answers without another start, and says when to retry.
    status, body, headers = await daemon.post("/v1/chat/completions", CHAT)
    assert (status, body["error"]["code"]) == (503, "model_failed")
    assert int(headers["Retry-After"]) >= 1
    assert len(daemon.events("child_started")) == 1
    # A log at `warning` shows it: a line of its own, with what the operator needs.
    (failed,) = daemon.events("load_failed", model="demo")
    assert failed["level"] == "warning"
    assert failed["exit_code"] == 1
    assert "during start-up" in failed["reason"]
    assert any("failed to load model" in line for line in failed["stderr_tail"])


async def test_repeated_failures_back_off_exponentially(make_daemon: MakeDaemon, broken_gguf: Path) -> None:
    daemon = await make_daemon(
        models={"demo": {"model": str(broken_gguf)}}, config={"failure_backoff_s": 0.2}
    )

    async def failed_three_times() -> bool:
        await daemon.post("/v1/chat/completions", CHAT)  # refused at once while backing off
        return len(daemon.events("slot_transition", model="demo", to="failed")) >= 3

    await eventually(failed_three_times, what="three failed starts")
    delays = [e["retry_in_s"] for e in daemon.events("slot_transition", model="demo", to="failed")]
    assert delays[:3] == [0.2, 0.4, 0.8]


async def test_missing_model_file_fails_without_starting_anything(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    daemon = await make_daemon(models={"demo": {"model": str(tmp_path / "nowhere.gguf")}})
    status, body, _ = await daemon.post("/v1/chat/completions", CHAT)
    assert status == 503
    assert "nowhere.gguf not found" in body["error"]["message"]
    assert not daemon.events("child_started")
    assert (await daemon.health())["gpus"][0]["leased_mib"] == 0


async def test_hung_child_is_killed_at_the_deadline(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    # Stands in for an engine that never becomes ready and ignores SIGTERM (the GGML-assert hang seen
    # with llama-server): a script that ignores TERM and keeps a helper process in its group.
    hung = tmp_path / "hung-engine"
    hung.write_text("#!/bin/sh\ntrap '' TERM\nsleep 300 &\nwait\n")
    hung.chmod(0o755)
    daemon = await make_daemon(
        models={"demo": {"binary": str(hung), "start_timeout_s": 1}}, config={"stop_grace_s": 1}
    )
    status, body, _ = await daemon.post("/v1/chat/completions", CHAT)
    assert status == 503
    assert "not ready after 1s" in body["error"]["message"]
    kills = daemon.events("child_kill", model="demo")
    assert kills
    assert len(kills[0]["pids"]) == 2
    assert not daemon.children()
    assert (await daemon.health())["gpus"][0]["leased_mib"] == 0


async def test_an_unload_that_cancels_a_failed_load_answers_once_its_lease_is_released(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    # The hung engine above (it ignores SIGTERM), so the stop of its failed load takes stop_grace_s. An
    # admin unload with `cancel` that lands during that stop cancels the load's task; it used to answer
    # 200 at once, with the lease still held and the child still running.
    hung = tmp_path / "hung-engine"
    hung.write_text("#!/bin/sh\ntrap '' TERM\nsleep 300 &\nwait\n")
    hung.chmod(0o755)
    daemon = await make_daemon(
        models={"demo": {"binary": str(hung), "start_timeout_s": 1}}, config={"stop_grace_s": 3}
    )
    request = asyncio.create_task(daemon.post("/v1/chat/completions", CHAT))
    await eventually(
        lambda: bool(daemon.events("slot_transition", model="demo", to="failed")), what="the load to fail"
    )
    status, document, _ = await daemon.post("/v1/admin/models/demo/unload", {"queued": "cancel"})
    assert status == 200, document
    assert not daemon.children()
    assert (await daemon.health())["gpus"][0]["leased_mib"] == 0
    assert (await request)[0] == 503


async def test_killing_the_child_mid_stream_errors_the_client_then_recovers(make_daemon: MakeDaemon) -> None:
    # One slot: the whole context for the stream (a slot of 512 tokens ends in tens of milliseconds).
    daemon = await make_daemon(models={"demo": {"parallel": 1}})
    pid = await _signalled_mid_stream(daemon, signal.SIGKILL, "stopped while serving")
    await daemon.wait_state("demo", "failed")
    failure = (await daemon.health())["models"]["demo"]["last_error"]
    assert failure["exit_code"] == -signal.SIGKILL
    await eventually(lambda: _lease_released(daemon), 30, "the crashed child's lease to be released")
    assert (await daemon.chat()).strip()  # the next request starts it again
    assert (await daemon.health())["models"]["demo"]["pid"] != pid


async def test_a_hung_child_is_stopped_its_stream_ended_and_it_starts_again(make_daemon: MakeDaemon) -> None:
    # SIGSTOP stands in for an engine that stopped responding (a deadlock, a GPU driver that never
    # returns): its requests wait, and it uses no CPU. Before hang_timeout_s the stream waited for good.
    daemon = await make_daemon(models={"demo": {"parallel": 1}}, config={"hang_timeout_s": 1.5})
    pid = await _signalled_mid_stream(
        daemon, signal.SIGSTOP, "stopped while serving: the stream was cut short"
    )
    (crashed,) = daemon.events("child_crashed", model="demo")
    assert crashed["level"] == "warning"
    assert "stopped responding: 1 request(s) in flight and no CPU used" in crashed["reason"]
    assert "(process stopped)" in crashed["reason"]
    await eventually(lambda: _lease_released(daemon), 30, "the hung child's lease to be released")
    assert not psutil.pid_exists(pid)  # stopped as a crashed child is: the tree, SIGCONT with SIGTERM
    assert (await daemon.chat()).strip()  # the next request starts it again
    pid = (await daemon.health())["models"]["demo"]["pid"]
    # The Ollama API's request, to a child already stopped. Its connection, lost after the hang, was
    # sent again to the stopping child, and the client read "Cannot connect to host <socket path>",
    # aiohttp's words. Now: if the child read it (it may, woken to stop), a 503 in Ollama's shape, in
    # plain words; if it never did (reset with the bytes unread), it is sent to the restarted child.
    os.kill(pid, signal.SIGSTOP)
    status, body, _ = await daemon.post("/api/chat", {**CHAT, "stream": False})
    if status != 200:
        assert (status, body) == (
            503,
            {
                "error": "model 'demo' stopped while serving: it closed the connection before answering: "
                "the connection was closed"
            },
        )
    assert (await daemon.chat()).strip()


async def _signalled_mid_stream(daemon: Daemon, sig: signal.Signals, error: str) -> int:
    """The demo model's engine sent `sig` while it streams (a slot of the whole context, `parallel: 1`:
    one of 512 tokens ends in tens of milliseconds); the stream must end with `error`. Its pid."""
    stream = await daemon.start_stream("demo", max_tokens=2000)
    pid = int((await daemon.health())["models"]["demo"]["pid"])
    os.kill(pid, sig)
    with pytest.raises(openai.APIError, match=error):
        async for _ in stream:
            pass
    return pid


async def _lease_released(daemon: Daemon) -> bool:
    """FAILED comes first; the lease goes once the tree is gone."""
    return bool((await daemon.health())["gpus"][0]["leased_mib"] == 0)


async def test_a_busy_child_or_an_idle_stopped_one_is_not_taken_for_hung(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"demo": {"ctx_size": 8192, "parallel": 1}}, config={"hang_timeout_s": 1}
    )
    await daemon.chat()  # loaded, so that the long one below is all generation
    # A generation longer than the timeout (about 6 s here): the child computes all along, its CPU
    # time moves.
    started = asyncio.get_running_loop().time()
    assert await daemon.chat(max_tokens=8000, ignore_eos=True)
    assert asyncio.get_running_loop().time() - started > 2, "too fast to say anything: make it longer"
    # Stopped with no request in flight: nothing waits on it, so nothing is decided (a request would).
    pid = (await daemon.health())["models"]["demo"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(2.5)
        assert await daemon.state("demo") == "ready"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (await daemon.chat()).strip()
    assert not daemon.events("child_crashed")


async def test_killing_the_child_between_requests_is_noticed(daemon: Daemon) -> None:
    await daemon.chat()
    pid = (await daemon.health())["models"]["demo"]["pid"]
    os.kill(pid, signal.SIGKILL)
    await daemon.wait_state("demo", "failed")
    # A log at `warning` shows the crash: a line of its own, with the exit and the child's last words.
    (crashed,) = daemon.events("child_crashed", model="demo")
    assert crashed["level"] == "warning"
    assert crashed["exit_code"] == -signal.SIGKILL
    assert "while serving" in crashed["reason"]
    assert isinstance(crashed["stderr_tail"], list)
    assert (await daemon.chat()).strip()


async def test_client_disconnect_mid_stream_cancels_the_upstream_request(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"ctx_size": 4096, "parallel": 1}})
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{daemon.url}/v1/chat/completions", json={**CHAT, "max_tokens": 3000, "stream": True}
        )
        await response.content.readline()
        response.close()  # the client goes away mid-stream
    # llama-server logs the cancellation and stops its slot well short of 3000 tokens.
    await eventually(
        lambda: any("cancel task" in e["line"] for e in daemon.events("child_output")),
        what="llama-server to cancel the task",
    )
    # The slot's "stop processing" line may reach the daemon's log a read after "cancel task".
    await eventually(
        lambda: any("stop processing" in e["line"] for e in daemon.events("child_output")),
        what="llama-server to stop the slot",
    )
    stopped = [e["line"] for e in daemon.events("child_output") if "stop processing" in e["line"]]
    tokens = int(stopped[-1].split("n_tokens = ")[1].split(",")[0])
    assert tokens < 3000
    await eventually(lambda: _inflight(daemon, 0), what="the ticket to be released")


async def _inflight(daemon: Daemon, expected: int) -> bool:
    return bool((await daemon.health())["models"]["demo"]["inflight"] == expected)


async def test_client_disconnect_while_queued_leaves_the_queue(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(**TAKING_TURNS)
    stream = await daemon.start_stream("a")
    queued = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "b"}))
    await eventually(lambda: _queued(daemon, 1), what="b to be queued")
    queued.cancel()
    await eventually(lambda: _queued(daemon, 0), what="the queue to empty")
    await stream.close()


async def _queued(daemon: Daemon, expected: int) -> bool:
    return bool((await daemon.health())["queued"] == expected)


async def test_a_running_child_that_refuses_every_connection_is_restarted(make_daemon: MakeDaemon) -> None:
    """A ready child still running but accepting no connection (its socket file deleted, as a /tmp cleaner
    does; likewise an engine whose HTTP listener died) was never taken as failed: each request waited
    5 s for an exit that never came, then got 502 upstream_error, while /health said ready. A refusal
    that its readiness probe confirms now fails it, and the request loads it again."""
    daemon = await make_daemon()
    await daemon.chat()
    (engine,) = daemon.children()
    argv = engine.cmdline()
    os.unlink(argv[argv.index("--host") + 1])
    await asyncio.sleep(4)  # the front's pooled connections to it idle out (3 s)
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "max_tokens": 4})
    assert status == 200, body
    assert not engine.is_running()
    (crash,) = daemon.events("child_crashed")
    assert crash["reason"] == "stopped accepting connections while running"
