"""Replicas: several children of one model behind one name, on two simulated GPUs (standing in for two
real ones), with load-aware and sticky dispatch, failure of one alone, and scale-up under queue pressure."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually, gated_engine

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TWO_GPUS = {"gpus": [{"index": 0, "total_mib": 1024}, {"index": 1, "total_mib": 1024}]}
# One request at a time per replica, so that concurrent clients need both.
TWO_REPLICAS: dict[str, Any] = {"demo": {"vram_mib": 700, "parallel": 1, "replicas": 2}}


async def _doc(daemon: Daemon) -> dict[str, Any]:
    status, document = await daemon.get("/v1/admin/models/demo")
    assert status == 200, document
    return document  # type: ignore[no-any-return]


def _served_by(daemon: Daemon) -> Counter[int]:
    """Requests per child pid, from the daemon's access log."""
    return Counter(e["pid"] for e in daemon.events("request") if e.get("model") == "demo" and "pid" in e)


async def _chat(daemon: Daemon, session: str | None = None, max_tokens: int = 24) -> int:
    assert daemon.http is not None
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    async with daemon.http.post(daemon.url + "/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status


async def test_two_replicas_on_two_gpus_share_concurrent_clients(make_daemon: MakeDaemon) -> None:
    # Twelve clients on two one-slot replicas queue: on a loaded machine 15 s might not see them through.
    daemon = await make_daemon(models=TWO_REPLICAS, config={**TWO_GPUS, "queue_timeout_s": 90})
    status, _, _ = await daemon.post("/v1/admin/models/demo/load", {})
    assert status == 200
    document = await _doc(daemon)
    replicas = document["replicas"]
    assert [r["state"] for r in replicas] == ["ready", "ready"]
    assert sorted(g for r in replicas for g in r["gpus"]) == [0, 1]  # spread: one per GPU
    pids = {r["pid"] for r in replicas}
    assert len(pids) == 2

    statuses = await asyncio.gather(*(_chat(daemon) for _ in range(12)))
    assert statuses == [200] * 12, daemon.events("request", status=503)
    served = _served_by(daemon)
    assert set(served) == pids, served  # both children took a share of the load
    assert sum(served.values()) == 12

    status, ps = await daemon.get("/api/ps")
    [row] = ps["models"]
    assert row["replicas"] == 2
    assert row["size_vram"] == 0  # simulated GPUs: the model runs on the CPU, as `ps` says
    metrics = await daemon.http.get(daemon.url + "/metrics")  # type: ignore[union-attr]
    text = await metrics.text()
    assert 'llm_supervisor_slot_state{model="demo",replica="1",state="ready"} 1.0' in text


async def test_a_session_sticks_to_one_replica(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=TWO_REPLICAS, config=TWO_GPUS)
    assert (await daemon.post("/v1/admin/models/demo/load", {}))[0] == 200

    async def session(name: str) -> None:
        for _ in range(4):
            assert await _chat(daemon, session=name) == 200

    await asyncio.gather(session("alice"), session("bob"))
    by_session: dict[str, set[int]] = {}
    for event in daemon.events("request", path="/v1/chat/completions"):
        by_session.setdefault(event["session"], set()).add(event["pid"])
    assert set(by_session) == {"alice", "bob"}
    assert all(len(pids) == 1 for pids in by_session.values()), by_session


async def test_a_killed_replica_fails_alone_and_the_next_busy_moment_starts_it_again(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(models=TWO_REPLICAS, config=TWO_GPUS)
    assert (await daemon.post("/v1/admin/models/demo/load", {}))[0] == 200
    first, second = (await _doc(daemon))["replicas"]
    os.kill(second["pid"], signal.SIGKILL)

    async def second_failed() -> bool:
        return (await _doc(daemon))["replicas"][1]["state"] in ("failed", "unloaded")

    await eventually(second_failed, 20, "replica 1 to be seen dead")
    assert (await _doc(daemon))["state"] == "ready"  # the model still serves, on replica 0
    assert await _chat(daemon) == 200
    assert (await _doc(daemon))["replicas"][0]["pid"] == first["pid"]

    # Two at once: one must wait, and the model's missing replica is started again.
    async def both_up() -> bool:
        await asyncio.gather(_chat(daemon), _chat(daemon))
        replicas = (await _doc(daemon))["replicas"]
        return [r["state"] for r in replicas] == ["ready", "ready"]

    await eventually(both_up, 30, "replica 1 to be started again")
    assert (await _doc(daemon))["replicas"][1]["pid"] != second["pid"]
    crash = daemon.events("slot_transition", model="demo", to="failed")
    assert [e["replica"] for e in crash] == [1]


async def test_queue_pressure_starts_a_replica_which_idles_out_back_to_replicas(
    make_daemon: MakeDaemon,
) -> None:
    model = {"vram_mib": 700, "parallel": 1, "max_replicas": 2, "scale_up_wait_s": 0.5, "keep_alive": "3s"}
    daemon = await make_daemon(models={"demo": {**model, "pinned": True}}, config=TWO_GPUS)
    await daemon.wait_state("demo", "ready", 30)
    stream = await daemon.start_stream()  # holds replica 0's only slot
    try:
        # It waits 0.5 s, then a second replica is started for it. Which replica answers it depends on
        # whether the stream ends before that replica is up, so only the scale-up itself is asserted.
        chat = asyncio.create_task(_chat(daemon))

        async def second_up() -> bool:
            replicas = (await _doc(daemon))["replicas"]
            return len(replicas) == 2 and replicas[1]["state"] == "ready"

        await eventually(second_up, 60, "a second replica to be started under queue pressure")
        assert await chat == 200
        assert [e["replica"] for e in daemon.events("scale_up")] == [1]
    finally:
        await stream.close()

    async def back_to_one() -> bool:
        return len((await _doc(daemon))["replicas"]) == 1

    await eventually(back_to_one, 30, "the extra replica to idle out")
    document = await _doc(daemon)
    assert document["replicas"][0]["state"] == "ready"  # the pinned model itself stays


async def test_load_with_replicas_and_the_limit(make_daemon: MakeDaemon) -> None:
    model = {"vram_mib": 700, "parallel": 1, "max_replicas": 2}
    daemon = await make_daemon(models={"demo": model}, config=TWO_GPUS)
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 3})
    assert status == 400
    assert body["error"]["code"] == "invalid_load_request"
    assert "replicas" in body["error"]["message"]
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 2})
    assert status == 200, body
    assert [r["state"] for r in body["replicas"]] == ["ready", "ready"]
    # A target, not a minimum: 1 while 2 run answered 200 and left both (an operator freeing a GPU).
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 1})
    assert status == 200, body
    assert [r["state"] for r in body["replicas"]] == ["ready"]
    assert len(daemon.children()) == 1
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 2})
    assert [r["state"] for r in body["replicas"]] == ["ready", "ready"]
    # An Ollama load request (nothing to generate) of the model is answered at once and stops no
    # replica: only an operator's count is a target.
    status, answer, _ = await daemon.post("/api/generate", {"model": "demo"})
    assert (status, answer["done_reason"]) == (200, "load")
    assert [r["state"] for r in (await _doc(daemon))["replicas"]] == ["ready", "ready"]
    # Each replica's log (only replica 0's could be read: ?replica=1 was ignored).
    pids = [r["pid"] for r in body["replicas"]]
    for replica, pid in enumerate(pids):
        status, log = await daemon.get(f"/v1/admin/models/demo/logs?tail=1&replica={replica}")
        assert (status, log["pid"]) == (200, pid)
    status, refused = await daemon.get("/v1/admin/models/demo/logs?replica=7")
    assert (status, refused["error"]["code"]) == (400, "invalid_request")
    status, body, _ = await daemon.post("/v1/admin/models/demo/unload", {})
    assert status == 200
    assert body["state"] == "unloaded"
    assert len(body["replicas"]) == 1  # the extra one is forgotten once down


async def test_a_pinned_model_is_not_scaled_below_its_manifests_replicas(make_daemon: MakeDaemon) -> None:
    """A pin keeps each of the manifest's replicas up, and an unload of it is refused 409. A scale-down
    below them answered 200 and stopped one, which the pin's keeper then started again."""
    model = {"vram_mib": 700, "parallel": 1, "replicas": 2, "max_replicas": 2, "pinned": True}
    daemon = await make_daemon(models={"demo": model}, config=TWO_GPUS)

    async def both_ready() -> bool:
        return [r["state"] for r in (await _doc(daemon))["replicas"]] == ["ready", "ready"]

    await eventually(both_ready, 60, "both pinned replicas to be up")
    pids = [r["pid"] for r in (await _doc(daemon))["replicas"]]
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 1})
    assert (status, body["error"]["code"]) == (409, "model_pinned"), body
    assert "unpin" in body["error"]["message"]
    assert [r["pid"] for r in (await _doc(daemon))["replicas"]] == pids
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 2})
    assert status == 200, body


async def test_a_request_for_a_model_with_two_replicas_starts_both(make_daemon: MakeDaemon) -> None:
    """`replicas: 2` runs two children behind the name. A request started replica 1 beside it and then
    waited on that one, as the first one loading: replica 0 was never loaded, and the model ran one
    child however busy it was."""
    daemon = await make_daemon(
        models={"demo": {"vram_mib": 700, "parallel": 1, "replicas": 2}}, config=TWO_GPUS
    )
    assert await _chat(daemon) == 200

    async def both_ready() -> bool:
        return [r["state"] for r in (await _doc(daemon))["replicas"]] == ["ready", "ready"]

    await eventually(both_ready, 30, "both replicas to be ready")


async def test_max_loaded_models_counts_a_models_replicas_as_one(make_daemon: MakeDaemon) -> None:
    """max_loaded_models counts models, as OLLAMA_MAX_LOADED_MODELS does. Each replica's lease counted as
    one: with a limit of 1 a model of two replicas evicted its own replica 0 to start replica 1, and
    back. A second model still evicts the whole of the first."""
    models = {"demo": {"vram_mib": 700, "parallel": 1, "replicas": 2}, "other": {"vram_mib": 300}}
    daemon = await make_daemon(models=models, config={**TWO_GPUS, "max_loaded_models": 1})
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {})
    assert status == 200, body
    assert [r["state"] for r in body["replicas"]] == ["ready", "ready"]
    for _ in range(3):
        assert await _chat(daemon) == 200
    assert [r["state"] for r in (await _doc(daemon))["replicas"]] == ["ready", "ready"]
    assert not [
        e for e in daemon.events("slot_transition", model="demo") if "evicted" in str(e.get("reason"))
    ]

    status, body, _ = await daemon.post("/v1/admin/models/other/load", {})
    assert status == 200, body
    assert {r["state"] for r in (await _doc(daemon))["replicas"]} == {"unloaded"}


async def test_session_header_is_bounded(daemon: Daemon) -> None:
    assert daemon.http is not None
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with daemon.http.post(
        daemon.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "x" * 201}
    ) as response:
        assert response.status == 400
        assert "X-Session-Id" in (await response.json())["error"]["message"]


async def test_a_request_queued_on_a_busy_replica_is_served_by_a_sibling_that_comes_back(
    make_daemon: MakeDaemon,
) -> None:
    """Replica 1 crashed; the next busy moment starts it again, and the request queued on busy replica 0
    stayed there when replica 1 was up and idle, until its queue_timeout_s (a review helper): only a
    scale-up woke the siblings' queues."""
    model = {"parallel": 1, "max_inflight": 1, "replicas": 2}
    daemon = await make_daemon(models={"demo": model}, config={"queue_timeout_s": 10})
    assert (await daemon.post("/v1/admin/models/demo/load", {}))[0] == 200
    _, document = await daemon.get("/v1/admin/models/demo")
    first, second = document["replicas"]
    os.kill(second["pid"], signal.SIGKILL)
    await eventually(
        lambda: bool(daemon.events("slot_transition", model="demo", replica=1, to="failed")),
        what="replica 1 seen dead",
    )
    stream = await daemon.start_stream()  # replica 0's one place
    os.kill(first["pid"], signal.SIGSTOP)  # and it stays taken
    try:
        status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "demo"})
        _, document = await daemon.get("/v1/admin/models/demo")
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    await stream.close()
    states = [(r["id"], r["state"], r["inflight"]) for r in document["replicas"]]
    assert status == 200, (body, states)


async def test_a_replica_in_back_off_does_not_let_the_model_run_past_its_replica_limit(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """replicas: 2 (so at most 2). Replica 1's start failed, and it waits out its back-off; a scale-up
    counted only the replicas in use and started replica 2; then the back-off ended and the next busy
    moment started replica 1 again: three engines (a review helper)."""
    engine, gate = gated_engine(tmp_path)
    model = {"parallel": 1, "max_inflight": 1, "replicas": 2, "scale_up_wait_s": 0.3, **engine}
    daemon = await make_daemon(models={"demo": model}, config={"failure_backoff_s": 6, "queue_timeout_s": 60})

    async def replicas() -> list[dict[str, Any]]:
        status, document = await daemon.get("/v1/admin/models/demo")
        assert status == 200, document
        return list(document.get("replicas") or [document])

    async def both_loading() -> bool:
        found = await replicas()
        return len(found) == 2 and all(r["state"] == "loading" and r.get("pid") for r in found)

    async def ready(index: int) -> bool:
        found = await replicas()
        return len(found) > index and found[index]["state"] == "ready"

    loading = asyncio.create_task(daemon.post("/v1/admin/models/demo/load", {}))
    await eventually(both_loading, what="both replicas to be loading")
    os.kill((await replicas())[1]["pid"], signal.SIGKILL)  # replica 1's start fails: back-off 6 s
    await eventually(
        lambda: bool(daemon.events("slot_transition", model="demo", replica=1, to="failed")),
        what="replica 1 to fail",
    )
    gate.touch()
    await loading
    await eventually(lambda: ready(0), what="replica 0 ready")

    first = await daemon.start_stream()  # replica 0's one place
    second = await daemon.start_stream()  # waits 0.3 s; a scale-up may start a replica for it
    busy = [r["pid"] for r in await replicas() if r["state"] == "ready"]
    for pid in busy:
        os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(6.5)  # replica 1's back-off ends
        third = asyncio.create_task(daemon.chat("demo"))  # queues: the running replicas are busy
        await asyncio.sleep(3)
        running = [(r["id"], r["state"]) for r in await replicas() if r["state"] in ("loading", "ready")]
        engines = len(daemon.children())
    finally:
        for pid in busy:
            os.kill(pid, signal.SIGCONT)
    await first.close()
    await second.close()
    await third
    assert (len(running), engines) == (2, 2), running


async def test_a_scale_down_while_the_scale_up_still_loads_ends_with_the_count_asked_last(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Asked for 3 replicas (wait: false), then for 1 while those still loaded: the scale-down unloaded
    only replicas that were up, the two loading were left alone, and 3 ran."""
    engine = gated_engine(tmp_path)
    daemon = await make_daemon(
        models={"demo": {"vram_mib": 100, "parallel": 1, "ctx_size": 512, "max_replicas": 3, **engine.fields}}
    )
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 3, "wait": False})
    assert status == 202, body

    async def all_loading() -> bool:
        return [r["state"] for r in (await _doc(daemon))["replicas"]] == ["loading"] * 3

    await eventually(all_loading, 20, "three replicas loading")
    engine.gate.touch()  # they come up; the scale-down below waits for each to stop it
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"replicas": 1})
    assert status == 200, body
    running = [r["id"] for r in (await _doc(daemon))["replicas"] if r["state"] != "unloaded"]
    assert running == ["demo#0"]
