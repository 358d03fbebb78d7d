"""Auto-load, reuse, one start for concurrent requests, swapping under a budget, keep-alive, pinning."""

from __future__ import annotations

import asyncio

import psutil

from tests.integration.conftest import TAKING_TURNS, MakeDaemon
from tests.integration.harness import Daemon, eventually


async def test_first_request_auto_loads_the_model(daemon: Daemon) -> None:
    assert await daemon.state("demo") == "unloaded"
    text = await daemon.chat()
    assert text.strip()
    assert await daemon.state("demo") == "ready"
    transitions = [(e["from"], e["to"]) for e in daemon.events("slot_transition", model="demo")]
    assert transitions == [("unloaded", "loading"), ("loading", "ready")]


async def test_second_request_is_served_without_a_reload(daemon: Daemon) -> None:
    await daemon.chat()
    pid = (await daemon.health())["models"]["demo"]["pid"]
    await daemon.chat()
    assert (await daemon.health())["models"]["demo"]["pid"] == pid
    assert len(daemon.events("child_started")) == 1


async def test_concurrent_first_requests_wait_for_the_same_start(daemon: Daemon) -> None:
    texts = await asyncio.gather(*(daemon.chat() for _ in range(8)))
    assert all(t.strip() for t in texts)
    assert len(daemon.events("child_started")) == 1
    assert len(daemon.children()) == 1


async def test_alias_reaches_the_same_model(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"aliases": ["demo-chat"]}})
    await daemon.chat("demo-chat")
    await daemon.chat("demo")
    assert len(daemon.events("child_started")) == 1


async def test_switching_models_under_a_budget_for_one_unloads_the_other(make_daemon: MakeDaemon) -> None:
    # A simulated 1 GiB GPU holds one 700 MiB model at a time.
    daemon = await make_daemon(
        models={"a": {"vram_mib": 700}, "b": {"vram_mib": 700}},
        config={"gpus": [{"index": 0, "total_mib": 1024}]},
    )
    await daemon.chat("a")
    pid_a = (await daemon.health())["models"]["a"]["pid"]
    await daemon.chat("b")
    health = await daemon.health()
    assert health["models"]["a"]["state"] == "unloaded"
    assert health["models"]["b"]["state"] == "ready"
    assert not psutil.pid_exists(pid_a) or psutil.Process(pid_a).status() == psutil.STATUS_ZOMBIE
    assert health["gpus"][0]["leased_mib"] == 700
    evicted = daemon.events("slot_transition", model="a", to="draining")
    assert evicted
    assert evicted[0]["reason"] == "evicted for b"
    await daemon.chat("a")  # and back
    assert (await daemon.health())["models"]["b"]["state"] == "unloaded"


async def test_least_recently_used_idle_model_is_evicted_first(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={m: {"vram_mib": 400} for m in ("a", "b", "c")},
        config={"gpus": [{"index": 0, "total_mib": 1000}]},
    )
    await daemon.chat("a")
    await daemon.chat("b")
    await daemon.chat("a")  # b is now the least recently used
    await daemon.chat("c")
    models = (await daemon.health())["models"]
    assert (models["a"]["state"], models["b"]["state"], models["c"]["state"]) == (
        "ready",
        "unloaded",
        "ready",
    )


async def test_keep_alive_zero_unloads_right_after_the_response(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"keep_alive": 0}})
    for _ in range(4):
        await daemon.chat()
        await daemon.wait_state("demo", "unloaded")
        assert not daemon.children()
    # Each stop was a clean exit: one SIGTERM, not two (llama-server takes a second one as "terminate
    # immediately" and exits from its signal handler, 1 or SIGABRT).
    assert [e["exit_code"] for e in daemon.events("child_stopped")] == [0, 0, 0, 0]


async def test_keep_alive_expiry_unloads_an_idle_model(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"keep_alive": "1s"}})
    await daemon.chat()
    await daemon.wait_state("demo", "unloaded")
    reasons = [e["reason"] for e in daemon.events("slot_transition", model="demo", to="draining")]
    assert reasons == ["idle for keep_alive 1s"]


async def test_keep_alive_forever_outlives_the_default(make_daemon: MakeDaemon) -> None:
    # The daemon's default would unload after 0.5 s; the manifest's -1 keeps the model.
    daemon = await make_daemon(
        models={"forever": {"keep_alive": -1}, "default": {}}, config={"default_keep_alive": 0.5}
    )
    await daemon.chat("forever")
    await daemon.chat("default")
    await daemon.wait_state("default", "unloaded")
    assert await daemon.state("forever") == "ready"


async def test_per_request_keep_alive_overrides_the_manifest(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"keep_alive": -1}})
    await daemon.chat(keep_alive=0)  # Ollama's field, accepted in the OpenAI body too
    await daemon.wait_state("demo", "unloaded")
    await daemon.chat(keep_alive="-1")
    await asyncio.sleep(0.5)
    assert await daemon.state("demo") == "ready"


async def test_keep_alive_timer_starts_when_the_last_request_ends(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"keep_alive": "1s", "parallel": 1}})
    client = daemon.openai()
    # A long request keeps the model busy past its keep-alive; it must not be unloaded under it.
    stream = await client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=1500, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) > 100
    assert not daemon.events("slot_transition", model="demo", to="draining")
    await daemon.wait_state("demo", "unloaded")


async def test_pinned_model_loads_at_start_and_is_never_evicted(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"pinned": {"pinned": True, "vram_mib": 600}, "a": {"vram_mib": 600}, "b": {"vram_mib": 600}},
        config={"gpus": [{"index": 0, "total_mib": 1500}]},
    )
    await daemon.wait_state("pinned", "ready")
    await daemon.chat("a")
    await daemon.chat("b")  # must evict a, not the pinned model
    models = (await daemon.health())["models"]
    assert (models["pinned"]["state"], models["a"]["state"], models["b"]["state"]) == (
        "ready",
        "unloaded",
        "ready",
    )


async def test_busy_model_is_waited_for_not_evicted(make_daemon: MakeDaemon) -> None:
    # a's stream must outlast b's wait being seen: 800 tokens took llama-server on one thread a few tens
    # of milliseconds on a fast machine, and a was idle (and evicted) by the time its state was read.
    # With room for 20,000 it streams for about a second.
    long_a = {**TAKING_TURNS["models"]["a"], "ctx_size": 32768}
    daemon = await make_daemon(models={**TAKING_TURNS["models"], "a": long_a}, config=TAKING_TURNS["config"])
    stream = await daemon.start_stream("a", max_tokens=20000)
    waiting_for_b = asyncio.create_task(daemon.chat("b"))
    await eventually(lambda: bool(daemon.events("placement_waiting", model="b")), what="b to queue")
    assert await daemon.state("a") == "ready"  # busy: not drained under its request
    rest = [chunk async for chunk in stream]
    assert rest
    assert rest[-1].choices[0].finish_reason == "length"
    assert (await waiting_for_b).strip()
    assert await daemon.state("a") == "unloaded"
