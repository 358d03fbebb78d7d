"""Live events (GET /v1/admin/events) and child logs (GET /v1/admin/models/{name}/logs)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tests.integration.harness import Daemon

_READ_S = 30.0  # a deadline for the next event, not a performance threshold


async def _sse(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """(event, data) pairs of a server-sent event stream; comments (`: ping`) are skipped."""
    event, data = "message", list[str]()
    while True:
        raw = await asyncio.wait_for(response.content.readline(), _READ_S)
        if not raw:
            return
        line = raw.decode().rstrip("\n")
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", list[str]()
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)


async def test_a_late_subscriber_gets_the_snapshot_then_the_transitions_of_a_load(daemon: Daemon) -> None:
    await daemon.post("/v1/admin/models/demo/load")
    await daemon.post("/v1/admin/models/demo/unload")
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/events") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = _sse(response)
        kind, snapshot = await anext(events)
        assert kind == "snapshot"
        assert [(m["name"], m["state"]) for m in snapshot["models"]] == [("demo", "unloaded")]
        assert [gpu["index"] for gpu in snapshot["gpus"]] == [0]

        loading = asyncio.create_task(daemon.post("/v1/admin/models/demo/load"))
        seen: list[tuple[str, Any]] = []
        async for kind, data in events:
            seen.append((kind, data))
            if kind == "load":  # published once the load is READY
                break
        assert (await loading)[0] == 200
    transitions = [(d["from"], d["to"]) for k, d in seen if k == "slot_transition"]
    assert transitions == [("unloaded", "loading"), ("loading", "ready")]
    [load] = [d for k, d in seen if k == "load"]
    assert load["model"] == "demo"
    assert load["vram_mib"] == 512
    assert load["vram_source"] == "declared"
    assert load["gpus"] == [0]
    assert isinstance(load["at"], float)
    assert all(d["model"] == "demo" and d["reason"] for k, d in seen if k == "slot_transition")


async def test_a_crash_is_an_event_with_the_childs_exit(daemon: Daemon) -> None:
    await daemon.post("/v1/admin/models/demo/load")
    pid = (await daemon.get("/v1/admin/models/demo"))[1]["replicas"][0]["pid"]
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/events") as response:
        events = _sse(response)
        assert (await anext(events))[0] == "snapshot"
        [child] = [p for p in daemon.children() if p.pid == pid]
        child.kill()
        crash = await anext(data async for kind, data in events if kind == "crash")
    assert crash["model"] == "demo"
    assert crash["exit_code"] == -9
    assert crash["stage"] == "serving"
    assert "SIGKILL" in crash["reason"]
    assert isinstance(crash["stderr_tail"], list)


async def test_logs_show_the_ring_buffer_and_follow_streams_new_lines_until_the_child_exits(
    daemon: Daemon,
) -> None:
    status, body = await daemon.get("/v1/admin/models/demo/logs")
    assert (status, body) == (
        200,
        {"model": "demo", "pid": None, "running": False, "exit_code": None, "lines": []},
    )
    status, body = await daemon.get("/v1/admin/models/demo/logs?follow=1")
    assert (status, body["error"]["code"]) == (409, "model_not_running")

    await daemon.post("/v1/admin/models/demo/load")
    status, body = await daemon.get("/v1/admin/models/demo/logs")
    assert status == 200
    assert body["model"] == "demo"
    assert body["pid"]
    assert body["running"] is True
    assert body["exit_code"] is None
    assert body["lines"]
    assert all(isinstance(line, str) for line in body["lines"])
    status, body = await daemon.get("/v1/admin/models/demo/logs?tail=2")
    assert len(body["lines"]) == 2
    # `follow=0` and `follow=False` are the JSON document; a value that is neither is refused, not read
    # as false (a follower would get one document and take it for a log that stopped).
    for value in ("0", "False"):
        status, body = await daemon.get(f"/v1/admin/models/demo/logs?follow={value}&tail=1")
        assert (status, len(body["lines"])) == (200, 1)
    status, body = await daemon.get("/v1/admin/models/demo/logs?follow=on")
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    assert "follow" in body["error"]["message"]

    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/models/demo/logs?follow=1&tail=0") as response:
        assert response.status == 200
        # Unloading makes the child print as it stops; its exit then ends the stream.
        unloading = asyncio.create_task(daemon.post("/v1/admin/models/demo/unload"))
        lines = [data async for kind, data in _sse(response) if kind == "log"]
        assert (await unloading)[0] == 200
    assert lines, "the child printed nothing while it stopped"
    assert all(set(line) == {"line", "stream"} and line["stream"] in ("stdout", "stderr") for line in lines)
    # The unloaded child's lines stay readable, its last ones included.
    status, body = await daemon.get("/v1/admin/models/demo/logs")
    assert status == 200
    assert body["running"] is False
    assert body["lines"][-1] == lines[-1]["line"]


async def test_a_crashed_childs_log_stays_readable_until_the_next_child_starts(daemon: Daemon) -> None:
    """The ring buffer went with the process: right after a crash, /logs answered no lines and
    ?follow=1 a 409, exactly when the operator opens them."""
    await daemon.post("/v1/admin/models/demo/load")
    pid = (await daemon.health())["models"]["demo"]["pid"]
    before = (await daemon.get("/v1/admin/models/demo/logs"))[1]["lines"]
    os.kill(pid, signal.SIGKILL)
    await daemon.wait_state("demo", "failed")
    status, body = await daemon.get("/v1/admin/models/demo/logs")
    assert status == 200
    assert (body["pid"], body["running"], body["exit_code"]) == (pid, False, -signal.SIGKILL)
    assert body["lines"][: len(before)] == before
    assert (await daemon.get("/v1/admin/models/demo/logs?tail=1"))[1]["lines"] == body["lines"][-1:]
    # Followed, a stopped child's lines come, then the stream ends: there is nothing more to wait for.
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/models/demo/logs?follow=1") as response:
        assert response.status == 200
        followed = [data["line"] async for kind, data in _sse(response) if kind == "log"]
    assert followed == body["lines"]
    # The next child's output replaces it.
    await daemon.post("/v1/admin/models/demo/load")
    status, body = await daemon.get("/v1/admin/models/demo/logs")
    assert body["pid"] != pid
    assert body["running"] is True


async def test_event_stream_ends_when_the_daemon_shuts_down(daemon: Daemon) -> None:
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/events") as response:
        events = _sse(response)
        assert (await anext(events))[0] == "snapshot"
        daemon.signal(signal.SIGTERM)
        rest = [kind async for kind, _ in events]
    assert "snapshot" not in rest
    assert await daemon.wait_exit() == 0
