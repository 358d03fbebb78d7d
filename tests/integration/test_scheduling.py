"""The lease scheduler with real llama-server children on simulated GPUs (the stand-in for NVML here).

Models are the demo GGUF under different names; `vram_mib` and the declared GPUs make them compete.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import PATIENT, Daemon, eventually, gated_engine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TWO_GPUS = {"gpus": [{"index": 0, "total_mib": 1024}, {"index": 1, "total_mib": 1024}]}


async def gpu_memory(daemon: Daemon) -> list[dict[str, Any]]:
    status, body = await daemon.get("/v1/admin/gpu-memory")
    assert status == 200, body
    return body["gpus"]  # type: ignore[no-any-return]


def leased_models(gpus: list[dict[str, Any]]) -> set[str]:
    return {lease["model"] for gpu in gpus for lease in gpu["leases"]}


async def test_gpu_memory_shows_leases_and_used_memory_falls_when_the_child_exits(daemon: Daemon) -> None:
    await daemon.chat("demo")
    (gpu,) = await gpu_memory(daemon)
    assert (gpu["total_mib"], gpu["simulated"], gpu["leased_mib"], gpu["used_mib"]) == (4096, True, 512, 512)
    (lease,) = gpu["leases"]
    assert (lease["model"], lease["mib"], lease["state"]) == ("demo", 512, "ready")
    assert lease["pid"] == (await daemon.health())["models"]["demo"]["pid"]

    await daemon.chat("demo", keep_alive=0)
    await daemon.wait_state("demo", "unloaded")
    (gpu,) = await gpu_memory(daemon)
    assert (gpu["leased_mib"], gpu["used_mib"], gpu["free_mib"], gpu["leases"]) == (0, 0, 4096, [])


async def test_gpu_memory_without_nvml_or_declared_gpus_shows_the_assumed_gpu_and_why(
    make_daemon: MakeDaemon,
) -> None:
    """It was a 503 while /health, /metrics and the events showed the assumed GPU: the quick start's
    dashboard showed an error where its GPU bar should be."""
    daemon = await make_daemon(config={"gpus": None})
    status, body = await daemon.get("/v1/admin/gpu-memory")
    assert status == 200, body
    assert body["assumed"] is True
    assert "declare" in body["warning"].lower()
    (gpu,) = body["gpus"]
    assert (gpu["simulated"], gpu["total_mib"]) == (True, 24576)
    # The dashboard draws its GPU panel from the events' snapshot first: it lacked the warning there.
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/events") as events:
        event, data = (await events.content.readline()), (await events.content.readline())
    assert event == b"event: snapshot\n", event
    snapshot = json.loads(data.removeprefix(b"data: "))
    assert (snapshot["assumed"], snapshot["warning"], snapshot["gpus"]) == (
        True,
        body["warning"],
        body["gpus"],
    )


async def test_a_high_priority_model_evicts_an_idle_low_priority_one_but_not_the_reverse(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(
        models={"low": {"vram_mib": 700, "priority": 0}, "high": {"vram_mib": 700, "priority": 5}},
        config={"gpus": [{"index": 0, "total_mib": 1024}], "queue_timeout_s": 1.5},
    )
    await daemon.chat("low")
    await daemon.chat("high")
    assert leased_models(await gpu_memory(daemon)) == {"high"}
    # "low" may not push out the more important idle model: it waits, then gives up.
    status, body, headers = await daemon.post("/v1/chat/completions", {**CHAT, "model": "low"})
    assert (status, body["error"]["code"]) == (503, "queue_timeout")
    assert int(headers["Retry-After"]) > 0
    # Why, in words: it said it "waited for the model to load", which never began.
    assert "room on its GPUs" in body["error"]["message"]
    assert leased_models(await gpu_memory(daemon)) == {"high"}
    # A request may raise its own priority, and with it what it may evict.
    status, _, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "low", "x_priority": 5})
    assert status == 200
    assert leased_models(await gpu_memory(daemon)) == {"low"}


async def test_a_high_priority_request_waits_for_a_busy_low_priority_model(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"low": {"vram_mib": 700, "parallel": 1}, "high": {"vram_mib": 700, "priority": 9}},
        config={"gpus": [{"index": 0, "total_mib": 1024}], **PATIENT},
    )
    stream = await daemon.start_stream("low", max_tokens=1500)
    high = asyncio.create_task(daemon.chat("high"))
    await eventually(lambda: _queued(daemon, "high", 1), what="high to wait for room")
    assert await daemon.state("low") == "ready"  # busy: waited for, not killed
    async for _ in stream:
        pass
    assert await high
    assert leased_models(await gpu_memory(daemon)) == {"high"}


async def test_a_high_priority_request_is_not_starved_by_a_low_priority_models_steady_queue(
    make_daemon: MakeDaemon,
) -> None:
    """One GPU holds one of two models. "low" (priority 0, one request at a time) has a steady queue of
    clients; a request for "high" (priority 9) needs low's room. Busy models are waited for, not killed,
    but low was never idle: each ending request handed its place straight to the next queued one, and
    high waited out its whole queue_timeout_s, every time. Now low takes no new request while high's
    load waits for its room, as Ollama and llama-swap send nothing more to a model being swapped out."""
    daemon = await make_daemon(
        models={
            "low": {"vram_mib": 700, "parallel": 1, "max_inflight": 1, "priority": 0},
            "high": {"vram_mib": 700, "priority": 9},
        },
        config={"gpus": [{"index": 0, "total_mib": 1024}], "queue_timeout_s": 8},
    )
    stop = asyncio.Event()

    async def low_client() -> None:
        while not stop.is_set():
            status, body, _ = await daemon.post(
                "/v1/chat/completions", {**CHAT, "model": "low", "max_tokens": 32}
            )
            assert status in (200, 503), body

    clients = [asyncio.create_task(low_client()) for _ in range(3)]
    try:
        await eventually(lambda: _queued(daemon, "low", 2), what="low to have a queue")
        status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "high"})
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert status == 200, body
    [drained] = daemon.events("draining_for_load", model="high")
    assert drained["models"] == ["low"]


async def test_an_unload_decided_on_an_idle_model_is_not_carried_out_under_new_requests(
    make_daemon: MakeDaemon,
) -> None:
    """keep_alive 0 unloads a model once it is idle; the unload began a step later, and a request that
    took the model in between was served, then the model stopped under it (a third of the unloads in a
    reviewer's run of three clients, one of them sending keep_alive 0)."""
    daemon = await make_daemon(models={"demo": {}}, config={"queue_timeout_s": 20})
    end = asyncio.get_running_loop().time() + 6

    async def client(keep_alive: dict[str, Any]) -> None:
        while asyncio.get_running_loop().time() < end:
            status, body, _ = await daemon.post(
                "/v1/chat/completions", {**CHAT, "model": "demo", **keep_alive}
            )
            assert status == 200, body

    await asyncio.gather(client({"keep_alive": 0}), client({}), client({}))
    drains = [e for e in daemon.events("slot_transition", to="draining") if e.get("reason") == "keep_alive 0"]
    assert drains  # the run did unload
    assert [e["inflight"] for e in drains] == [0] * len(drains)


async def _top_waits_for_room_and_its_caller_leaves(
    make_daemon: MakeDaemon, path: str, body: dict[str, Any], then: Callable[[Daemon], Awaitable[None]]
) -> Daemon:
    """top's load, asked for at `path`, waits for room that busy high holds; its caller gives up; `then`
    runs while high is still busy; then high's stream ends."""
    daemon = await make_daemon(
        models={
            "high": {"vram_mib": 700, "priority": 5, "parallel": 1},
            "top": {"vram_mib": 700, "priority": 10},
        },
        config={"gpus": [{"index": 0, "total_mib": 1024}], **PATIENT},
    )
    stream = await daemon.start_stream("high", max_tokens=1500)
    (engine,) = daemon.children()
    os.kill(engine.pid, signal.SIGSTOP)  # high stays busy for as long as the test needs
    try:
        asking = asyncio.create_task(daemon.post(path, body))
        await eventually(lambda: bool(daemon.events("placement_waiting", model="top")), what="top to wait")
        asking.cancel()  # the client gives up
        await then(daemon)
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    await stream.close()
    return daemon


async def test_a_load_whose_every_request_left_is_called_off(make_daemon: MakeDaemon) -> None:
    """top's only request gives up while top's load waits for room that busy high holds. The load went
    on, and once high was idle it evicted high and started top, for nobody."""

    async def called_off(daemon: Daemon) -> None:
        await eventually(lambda: bool(daemon.events("load_called_off", model="top")), what="the call-off")

    daemon = await _top_waits_for_room_and_its_caller_leaves(
        make_daemon, "/v1/chat/completions", {**CHAT, "model": "top"}, called_off
    )
    assert (await daemon.post("/v1/chat/completions", {**CHAT, "model": "high"}))[0] == 200
    await asyncio.sleep(1)  # room for the old load to have evicted high, had it gone on
    assert not daemon.events("slot_transition", model="high", reason="evicted for top")
    assert (await daemon.health())["models"]["top"]["state"] == "unloaded"
    # A request for top now loads it as usual.
    assert (await daemon.post("/v1/chat/completions", {**CHAT, "model": "top"}))[0] == 200


async def test_an_operators_load_goes_on_when_its_client_leaves(make_daemon: MakeDaemon) -> None:
    """The same wait for room, asked for by the admin API: an operator's load is not the requests' to
    call off, yet an admin client that disconnected (a `curl` cut short) called it off, as a request's
    leaving would (a fault review)."""

    async def a_while(daemon: Daemon) -> None:
        await asyncio.sleep(0.5)  # room for a call-off to come (the operator still wants the model)

    daemon = await _top_waits_for_room_and_its_caller_leaves(
        make_daemon, "/v1/admin/models/top/load", {}, a_while
    )
    await daemon.wait_state("top", "ready", timeout_s=30)  # high evicted once idle, for top
    assert not daemon.events("load_called_off")


async def test_requests_waiting_for_a_load_are_served_by_priority(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Two requests wait for the same load of a one-at-a-time model, the low one first: the waiters of a
    load woke in the order they came, and the first took the place, low before high (a review helper)."""
    engine, gate = gated_engine(tmp_path)
    daemon = await make_daemon(
        models={"demo": {"parallel": 1, "max_inflight": 1, **engine}}, config={"queue_timeout_s": 60}
    )
    served: list[str] = []

    async def ask(client: str, priority: int) -> None:
        body = {**CHAT, "model": "demo", "x_priority": priority, "x_client_id": client}
        status, answer, _ = await daemon.post("/v1/chat/completions", body)
        assert status == 200, answer
        served.append(client)

    low = asyncio.create_task(ask("low", 0))
    await eventually(lambda: _queued(daemon, "demo", 1), what="low to wait for the load")
    high = asyncio.create_task(ask("high", 9))
    await eventually(lambda: _queued(daemon, "demo", 2), what="high to wait for the load")
    gate.touch()
    await asyncio.gather(low, high)
    assert served == ["high", "low"]


async def test_queued_requests_for_a_busy_model_are_served_by_priority(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"parallel": 1}})
    stream = await daemon.start_stream("demo", max_tokens=1500)
    served: list[str] = []

    async def ask(client: str, priority: int) -> None:
        body = {**CHAT, "model": "demo", "x_priority": priority, "x_client_id": client}
        status, _, _ = await daemon.post("/v1/chat/completions", body)
        assert status == 200
        served.append(client)

    tasks = []
    for n, (client, priority) in enumerate([("early-low", 0), ("late-low", 0), ("urgent", 7)], start=1):
        tasks.append(asyncio.create_task(ask(client, priority)))
        await eventually(lambda n=n: _queued(daemon, "demo", n), what=f"{n} requests queued")
    await stream.close()
    await asyncio.gather(*tasks)
    assert served == ["urgent", "early-low", "late-low"]
    clients = {e.get("client_id") for e in daemon.events("request", path="/v1/chat/completions")}
    assert {"urgent", "early-low", "late-low"} <= clients


async def test_a_full_queue_for_a_busy_model_is_503_with_retry_after(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"max_inflight": 1, "parallel": 1}}, config={"max_queue": 1})
    stream = await daemon.start_stream("demo", max_tokens=1500)
    waiting = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "demo"}))
    await eventually(lambda: _queued(daemon, "demo", 1), what="one request queued")
    status, body, headers = await daemon.post("/v1/chat/completions", {**CHAT, "model": "demo"})
    assert (status, body["error"]["code"]) == (503, "queue_full")
    assert int(headers["Retry-After"]) > 0
    await stream.close()
    assert (await waiting)[0] == 200


async def test_a_request_sent_after_an_unload_keeps_the_model_by_its_own_keep_alive(
    make_daemon: MakeDaemon,
) -> None:
    """As Ollama: the last request's keep_alive wins. An unload (keep_alive 0, nothing to generate) asked
    while the model was busy unloaded it when the busy request ended, whatever the requests sent after it
    asked (-1 included)."""
    daemon = await make_daemon(models={"demo": {"ctx_size": 8192, "parallel": 2}})
    stream = await daemon.start_stream("demo", max_tokens=4000)  # holds one slot for seconds
    status, body, _ = await daemon.post("/api/generate", {"model": "demo", "keep_alive": 0})
    assert (status, body["done_reason"]) == (200, "unload")
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "demo", "keep_alive": -1})
    assert status == 200, body
    await stream.close()

    async def idle() -> bool:
        return bool((await daemon.health())["models"]["demo"]["inflight"] == 0)

    await eventually(idle, what="the stream to end")
    await asyncio.sleep(0.5)  # an unload would have begun by now
    assert await daemon.state("demo") == "ready"
    assert not daemon.events("slot_transition", model="demo", reason="keep_alive 0")


async def test_a_load_whose_client_left_uses_its_own_keep_alive_not_a_previous_requests(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """A request with keep_alive -1 once kept the model loaded for good; an operator unloaded it. Later a
    request with the default keep-alive starts a load and its client leaves before the model is up. The
    load goes on (as in Ollama), and the model, wanted by nobody, kept the keep-alive the slot was last
    given: -1, loaded until evicted. Ollama's runner takes the keep-alive of the request that loaded it."""
    engine, gate = gated_engine(tmp_path)
    daemon = await make_daemon(models={"demo": {**engine}})
    gate.touch()
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "demo", "keep_alive": -1})
    assert status == 200, body
    status, body, _ = await daemon.post("/v1/admin/models/demo/unload", {})
    assert status == 200, body
    gate.unlink()  # the next start waits again
    asking = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "demo"}))
    await daemon.wait_state("demo", "loading")
    asking.cancel()
    await eventually(lambda: _queued(daemon, "demo", 0), what="the client to leave")
    gate.touch()
    await daemon.wait_state("demo", "ready")
    status, document = await daemon.get("/v1/admin/models/demo")
    assert status == 200, document
    assert document["keep_alive"] == 300, document["keep_alive"]  # the default, not the old -1 (null)


async def test_a_low_priority_request_waiting_for_a_load_is_not_queued_behind_a_high_one_with_free_slots(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Two requests wait for the load of a model that takes 4 at once: low first, then high. Once it is
    up both have a place. The low one, woken with a higher waiter beside it, yielded, then went straight
    to the admission queue without trying for a free place, and waited for the high request to end (or
    its queue_timeout_s) with 3 of the 4 places free. Every later request queued behind it too."""
    engine, gate = gated_engine(tmp_path)
    daemon = await make_daemon(
        models={"demo": {"parallel": 4, "max_inflight": 4, "ctx_size": 8192, **engine}},
        config={"queue_timeout_s": 4},
    )
    http = daemon.http
    assert http is not None
    high_body = {
        **CHAT,
        "model": "demo",
        "x_priority": 9,
        "x_client_id": "high",
        "max_tokens": 8000,
        "ignore_eos": True,
        "stream": True,
    }

    async def open_high() -> Any:
        response = await http.post(daemon.url + "/v1/chat/completions", json=high_body)
        assert response.status == 200
        await response.content.readline()  # the first event: then it is not read (a slow client)
        return response

    low = asyncio.create_task(
        daemon.post("/v1/chat/completions", {**CHAT, "model": "demo", "x_priority": 0, "x_client_id": "low"})
    )
    await eventually(lambda: _queued(daemon, "demo", 1), what="low to wait for the load")
    high = asyncio.create_task(open_high())
    await eventually(lambda: _queued(daemon, "demo", 2), what="high to wait for the load")
    gate.touch()
    stream = await high
    try:
        status, body, _ = await low
        # The short low request had a free place from the moment the model was up.
        assert status == 200, body
        assert not daemon.events("queued", client_id="low")
        ended = [e["client_id"] for e in daemon.events("request") if e.get("client_id") in ("low", "high")]
        assert ended[:1] == ["low"], ended  # it ended only once the 8000-token stream had
    finally:
        stream.close()


async def test_a_client_that_gives_up_leaves_a_busy_models_queue_at_once(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"max_inflight": 1, "parallel": 1}})
    stream = await daemon.start_stream("demo", max_tokens=1500)
    body = {**CHAT, "model": "demo"}
    queued = [asyncio.create_task(daemon.post("/v1/chat/completions", body)) for _ in range(3)]
    await eventually(lambda: _queued(daemon, "demo", 3), what="three requests queued")
    for task in queued:
        task.cancel()
    await eventually(lambda: _queued(daemon, "demo", 0), what="the queue to empty")
    assert (await daemon.health())["models"]["demo"]["inflight"] == 1  # the stream, nothing else
    await stream.close()


async def test_loads_on_different_gpus_run_in_parallel(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    # Both engines wait at a gate: the second load can only start while the first is still loading if
    # loads run in parallel (however slowly this machine answers the two requests).
    engine, gate = gated_engine(tmp_path)
    gated = {"vram_mib": 700, **engine}
    daemon = await make_daemon(models={"a": gated, "b": gated}, config=TWO_GPUS)
    chats = asyncio.gather(daemon.chat("a"), daemon.chat("b"))
    await daemon.wait_state("a", "loading")
    await daemon.wait_state("b", "loading")
    gate.touch()
    await chats
    events = [e for e in daemon.events("slot_transition") if e["to"] in ("loading", "ready")]
    assert [e["to"] for e in events] == ["loading", "loading", "ready", "ready"]
    assert {e["gpus"][0] for e in events if e["to"] == "loading"} == {0, 1}


async def test_a_crash_during_the_load_releases_the_lease(make_daemon: MakeDaemon, broken_gguf: Path) -> None:
    daemon = await make_daemon(models={"broken": {"model": str(broken_gguf), "vram_mib": 700}})
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "broken"})
    assert (status, body["error"]["code"]) == (503, "model_failed")
    (gpu,) = await gpu_memory(daemon)
    assert (gpu["leased_mib"], gpu["leases"]) == (0, [])
    assert daemon.children() == []


async def test_three_models_on_two_gpus_swap_under_traffic_of_several_priorities(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(
        models={name: {"vram_mib": 700} for name in "abc"},
        config={**TWO_GPUS, "queue_timeout_s": 60},
    )
    rng = random.Random(7)
    statuses: list[int] = []
    overcommitted: list[Any] = []
    done = asyncio.Event()

    async def client(n: int) -> None:
        for _ in range(6):
            body = {
                **CHAT,
                "model": rng.choice("abc"),
                "x_priority": rng.randint(0, 3),
                "x_client_id": f"c{n}",
            }
            statuses.append((await daemon.post("/v1/chat/completions", body))[0])

    async def watch() -> None:
        while not done.is_set():
            for gpu in await gpu_memory(daemon):
                if gpu["leased_mib"] > gpu["total_mib"] or len(gpu["leases"]) > 1:
                    overcommitted.append(gpu)
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(client(n) for n in range(4)))
    done.set()
    await watcher
    assert statuses == [200] * 24
    assert overcommitted == []
    swaps = daemon.events("slot_transition", to="loading")
    assert len(swaps) > 3  # three models, two places: they had to take turns
    evictions = [e for e in daemon.events("slot_transition", to="draining") if "evicted" in e["reason"]]
    assert evictions


async def test_a_model_without_vram_mib_is_sized_from_its_gguf(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"sized": {"vram_mib": None}})
    assert await daemon.chat("sized")
    (loading,) = daemon.events("slot_transition", model="sized", to="loading")
    assert loading["vram_source"] == "artifacts"
    assert loading["vram_mib"] > 0
    (gpu,) = await gpu_memory(daemon)
    assert gpu["leases"][0]["mib"] == loading["vram_mib"]


async def test_a_model_that_cannot_be_sized_is_refused_with_vram_unknown(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    daemon = await make_daemon(
        models={"nowhere": {"vram_mib": None, "model": str(tmp_path / "missing.gguf")}}
    )
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "nowhere"})
    assert (status, body["error"]["code"]) == (503, "vram_unknown")
    assert "vram_mib" in body["error"]["message"]
    assert daemon.children() == []


async def test_max_loaded_models_keeps_that_many_loaded(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"a": {}, "b": {}}, config={"max_loaded_models": 1})
    await daemon.chat("a")
    await daemon.chat("b")
    assert leased_models(await gpu_memory(daemon)) == {"b"}
    assert await daemon.state("a") == "unloaded"


async def test_a_tensor_parallel_model_leases_its_share_on_each_gpu(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"split": {"vram_mib": 1000, "tensor_parallel_size": 2}}, config=TWO_GPUS
    )
    assert await daemon.chat("split")
    gpus = await gpu_memory(daemon)
    assert [g["leased_mib"] for g in gpus] == [500, 500]
    (child,) = daemon.children()
    assert child.environ()["CUDA_VISIBLE_DEVICES"] == "0,1"


async def _queued(daemon: Daemon, model: str, expected: int) -> bool:
    return bool((await daemon.health())["models"][model].get("queued", 0) == expected)
