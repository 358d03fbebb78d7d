"""Reload on SIGHUP, drain on SIGTERM, and reaping what a killed daemon left behind."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk

from tests.integration.conftest import DEMO, TAKING_TURNS, MakeDaemon
from tests.integration.harness import PATIENT, REPO, Daemon, eventually, gated_engine, running
from tests.launch import free_port, serve_argv

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _traffic(daemon: Daemon, stop: asyncio.Event, models: Callable[[], list[str]]) -> list[str]:
    """Chat in a loop until `stop`; return every failure seen."""
    failures: list[str] = []
    while not stop.is_set():
        for model in models():
            try:
                await daemon.chat(model, max_tokens=4)
            except Exception as exc:
                failures.append(f"{model}: {exc!r}")
    return failures


async def _reloaded(daemon: Daemon, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return len(daemon.events("reload_applied")) + len(daemon.events("reload_rejected")) >= count

    return check


async def test_sighup_with_valid_and_broken_yaml_keeps_serving(
    make_daemon: MakeDaemon, demo_gguf: Path
) -> None:
    daemon = await make_daemon()
    stop = asyncio.Event()
    served = ["demo"]
    workers = [asyncio.create_task(_traffic(daemon, stop, lambda: list(served))) for _ in range(3)]
    await asyncio.sleep(0.3)

    # 1. A valid new model appears.
    daemon.write_manifest("second", model=str(demo_gguf), **DEMO)
    daemon.signal(signal.SIGHUP)
    await eventually(await _reloaded(daemon, 1), what="the first reload")
    assert daemon.events("reload_applied")[-1]["added"] == ["second"]
    served.append("second")
    await asyncio.sleep(0.3)

    # 2. A broken file: the reload is refused, with file and line, and the old config keeps serving.
    (daemon.manifests / "broken.yaml").write_text("name: broken\nengine: llama-server\nctx_size: lots\n")
    daemon.signal(signal.SIGHUP)
    await eventually(await _reloaded(daemon, 2), what="the refused reload")
    rejected = daemon.events("reload_rejected")[-1]
    assert any("broken.yaml:3" in e and "ctx_size" in e for e in rejected["errors"])
    await asyncio.sleep(0.3)

    # 3. Fixed again.
    (daemon.manifests / "broken.yaml").unlink()
    daemon.signal(signal.SIGHUP)
    await eventually(await _reloaded(daemon, 3), what="the last reload")
    await asyncio.sleep(0.3)

    stop.set()
    failures = [f for worker in workers for f in await worker]
    assert failures == []
    assert await daemon.state("second") == "ready"


async def test_sighup_restarts_a_changed_model_on_next_use(make_daemon: MakeDaemon, demo_gguf: Path) -> None:
    daemon = await make_daemon()
    await daemon.chat()
    old_pid = (await daemon.health())["models"]["demo"]["pid"]
    daemon.write_manifest("demo", model=str(demo_gguf), **{**DEMO, "ctx_size": 1024})
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="reload")
    assert daemon.events("reload_applied")[-1]["restarted"] == ["demo"]
    await daemon.wait_state("demo", "unloaded")
    await daemon.chat()
    assert (await daemon.health())["models"]["demo"]["pid"] != old_pid
    started = daemon.events("child_started")[-1]["argv"]
    assert started[started.index("--ctx-size") + 1] == "1024"


async def test_a_pinned_model_changed_while_it_loads_is_restarted_with_the_change_at_once(
    make_daemon: MakeDaemon, demo_gguf: Path, tmp_path: Path
) -> None:
    """A pinned model changed when ready is restarted at once. Changed while it was still loading, its
    load ended ready with the replaced manifest, and it kept serving that until a request came to find it
    out of date and restart it (a fault review)."""
    engine, gate = gated_engine(tmp_path)
    pinned = {"model": str(demo_gguf), **DEMO, **engine, "pinned": True}
    daemon = await make_daemon(models={"demo": pinned})
    await daemon.wait_state("demo", "loading")
    daemon.write_manifest("demo", **{**pinned, "ctx_size": 1024})
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="reload")
    gate.touch()

    def restarted() -> bool:
        started = daemon.events("child_started")
        return (
            len(started) == 2 and started[-1]["argv"][started[-1]["argv"].index("--ctx-size") + 1] == "1024"
        )

    await eventually(restarted, 30, "the pinned model to start again with the new manifest, unasked")
    await daemon.wait_state("demo", "ready", timeout_s=30)


async def test_sighup_applies_a_keep_alive_change_without_a_restart(
    make_daemon: MakeDaemon, demo_gguf: Path
) -> None:
    daemon = await make_daemon()
    await daemon.chat()
    daemon.write_manifest("demo", model=str(demo_gguf), **DEMO, keep_alive="1s")
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="reload")
    assert daemon.events("reload_applied")[-1]["updated"] == ["demo"]
    await daemon.wait_state("demo", "unloaded")
    assert len(daemon.events("child_started")) == 1


async def test_sighup_removing_a_model_drains_its_requests_then_stops_it(make_daemon: MakeDaemon) -> None:
    # One slot: the whole context for the stream.
    daemon = await make_daemon(models={"demo": {"parallel": 1}}, config=PATIENT)
    stream = await daemon.start_stream("demo", max_tokens=1500)
    (daemon.manifests / "demo.yaml").unlink()
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="reload")
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    status, body, _ = await daemon.post("/v1/chat/completions", chat)
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    chunks = [chunk async for chunk in stream]  # the in-flight stream still finishes
    assert chunks[-1].choices[0].finish_reason == "length"
    await eventually(lambda: not daemon.children(), what="the removed model's child to stop")


async def _reload(daemon: Daemon) -> None:
    before = len(daemon.events("reload_applied"))
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: len(daemon.events("reload_applied")) > before, what="the reload")


async def _one_queued_behind_a_stream(
    daemon: Daemon,
) -> tuple[AsyncStream[ChatCompletionChunk], asyncio.Task[tuple[int, Any, Any]]]:
    """A long stream on demo (one request at a time), and a chat queued behind it."""
    stream = await daemon.start_stream("demo", max_tokens=1500)
    queued = asyncio.create_task(daemon.post("/v1/chat/completions", CHAT))

    async def in_queue() -> bool:
        return int((await daemon.health())["models"]["demo"].get("queued", 0)) == 1

    await eventually(in_queue, what="the second request to queue")
    return stream, queued


async def test_sighup_removing_a_model_answers_its_queued_requests_404(make_daemon: MakeDaemon) -> None:
    """A request queued for a turn when its model is removed gets model_not_found (it got a 500: the
    queue looked the removed model up again)."""
    daemon = await make_daemon(models={"demo": {"parallel": 1}}, config=PATIENT)
    stream, queued = await _one_queued_behind_a_stream(daemon)
    (daemon.manifests / "demo.yaml").unlink()
    await _reload(daemon)
    status, body, _ = await asyncio.wait_for(queued, 30)
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    await stream.close()


async def test_sighup_removing_a_loading_model_leaves_the_daemon_answering(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """A model removed while its child starts: the start is called off (its child stopped, its lease
    freed) and its request gets model_not_found at once. The daemon spun its event loop for ever instead
    (100% CPU, no answer to anything, SIGTERM included), waiting on the removed slot's event, which stays
    set; and before that, the start went on for as long as it took, holding the room."""
    engine = gated_engine(tmp_path)
    daemon = await make_daemon(models={"g": engine.fields, "demo": {}})
    loading = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "g"}))
    await daemon.wait_state("g", "loading")
    (daemon.manifests / "g.yaml").unlink()
    await _reload(daemon)
    status, _ = await asyncio.wait_for(daemon.get("/health"), 10)
    assert status == 200
    status, body, _ = await asyncio.wait_for(loading, 30)  # the engine's start never finished
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    await eventually(lambda: not daemon.children(), what="the removed model's child to stop")
    assert (await daemon.health())["gpus"][0]["leased_mib"] == 0
    engine.gate.touch()
    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200  # the other model still served


async def test_a_reload_applies_no_restart_only_setting_to_the_gate_or_the_keys(
    make_daemon: MakeDaemon,
) -> None:
    """The scheduler kept the running values of restart-only settings and said so (reload_needs_restart),
    while the gate and the key ring took the new ones at once (a review helper): a lower max_body_mib
    refused bodies, a changed node_key refused the old one (in a fleet, every forwarded request, until
    each node restarted), and allow_unauthenticated let requests without a key in."""
    node_key, admin = "node-key-0123456789abcdef", "admin-key-0123456789"
    daemon = await make_daemon(config={"host": "0.0.0.0", "api_key": admin, "node_key": node_key})
    as_node = {"Authorization": f"Bearer {node_key}"}
    body = {"model": "no-such-model", "input": "x" * (2 * 2**20)}  # 2 MiB: under 64, over 1
    daemon.write_config(max_body_mib=1, node_key="node-key-fedcba9876543210")
    await _reload(daemon)
    assert daemon.events("reload_needs_restart", settings=["max_body_mib", "node_key"])
    assert (await daemon.get("/v1/models", as_node))[0] == 200
    assert daemon.http is not None
    headers = {"Authorization": f"Bearer {admin}"}
    async with daemon.http.post(daemon.url + "/v1/embeddings", json=body, headers=headers) as r:
        assert r.status == 404, await r.text()  # read whole under the running 64 MiB, not refused 413
    daemon.write_config(api_key=None, allow_unauthenticated=True)  # on 0.0.0.0: refused, it keeps its key
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_rejected", reason="no api key left")), what="refusal")
    assert (await daemon.get("/v1/models"))[0] == 401


async def test_a_new_gpu_margin_waits_for_a_restart_and_says_so(make_daemon: MakeDaemon) -> None:
    """gpu_margin_mib changed by a reload was reported applied (the new margin in /v1/admin/gpu-memory)
    while leases still went by the old one: a 700 MiB lease inside an 800 MiB margin of a 1 GiB GPU."""
    daemon = await make_daemon(
        models={"demo": {"vram_mib": 700}}, config={"gpus": [{"index": 0, "total_mib": 1024}]}
    )
    daemon.write_config(gpu_margin_mib=800)
    await _reload(daemon)
    assert daemon.events("reload_needs_restart", settings=["gpu_margin_mib"])
    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200
    gpu = (await daemon.get("/v1/admin/gpu-memory"))[1]["gpus"][0]
    assert gpu["leased_mib"] + gpu["margin_mib"] <= gpu["total_mib"], gpu


async def test_a_pinned_model_whose_manifest_a_reload_fixed_starts_at_once(
    make_daemon: MakeDaemon, broken_gguf: Path, demo_gguf: Path
) -> None:
    """The reload reset the model's back-off, but the pinned model's keeper slept out its own (up to
    failure_backoff_max_s), with /health saying failed and nobody sending a request to start it."""
    daemon = await make_daemon(
        models={"p": {"model": str(broken_gguf), "pinned": True}},
        config={"failure_backoff_s": 120, "failure_backoff_max_s": 120},
        start=False,
    )
    await daemon.start(wait=False)
    await eventually(lambda: bool(daemon.events("pinned_load_failed")), 30, "the first failed start")
    manifest = daemon.manifests / "p.yaml"
    manifest.write_text(manifest.read_text().replace(str(broken_gguf), str(demo_gguf)))
    await _reload(daemon)
    await daemon.wait_state("p", "ready", 30)  # not after the 120 s back-off


async def test_sighup_removing_a_crashed_model_calls_off_its_restart(make_daemon: MakeDaemon) -> None:
    """A crashed model's restart waits for room (b is busy on the only GPU) when a reload removes the
    model: the restart is called off. It went on: the removed model evicted b once b was idle, kept its
    lease for good, made every request for b time out, and outlived the daemon."""
    daemon = await make_daemon(
        models=TAKING_TURNS["models"], config={**TAKING_TURNS["config"], "queue_timeout_s": 20}
    )
    await daemon.chat("a")
    os.kill((await daemon.health())["models"]["a"]["pid"], signal.SIGKILL)
    await daemon.wait_state("a", "failed")
    stream = await daemon.start_stream("b", max_tokens=1500)  # b takes the GPU, busy
    waiting = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "a"}))
    await eventually(lambda: bool(daemon.events("placement_waiting", model="a")), what="a's load to wait")
    (daemon.manifests / "a.yaml").unlink()
    await _reload(daemon)
    await stream.close()  # b goes idle
    status, body, _ = await asyncio.wait_for(waiting, 30)
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "model": "b"})
    assert status == 200, body
    health = await daemon.health()
    assert set(health["models"]) == {"b"}
    assert not daemon.events("child_started", model="a")[1:]  # only the first start, none after the crash


async def test_a_request_that_joins_a_load_waiting_for_room_keeps_its_own_deadline(
    make_daemon: MakeDaemon,
) -> None:
    """b's load waits for room (a is pinned on the only GPU). b1 starts it at t=0, b2 joins at t=4
    (queue_timeout_s 6); a is unpinned at t=7. b1 times out at t=6, but b2 is served: the load waited
    for its last waiter, not for the deadline of the request that started it."""
    daemon = await make_daemon(
        models={"a": {"vram_mib": 700, "pinned": True}, "b": {"vram_mib": 700}},
        config={**TAKING_TURNS["config"], "queue_timeout_s": 6},
    )
    await daemon.wait_state("a", "ready")
    loop = asyncio.get_running_loop()
    b1 = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "b"}))
    await asyncio.sleep(4)
    b2_sent = loop.time()
    b2 = asyncio.create_task(daemon.post("/v1/chat/completions", {**CHAT, "model": "b"}))
    status, body, _ = await b1
    assert (status, body["error"]["code"]) == (503, "queue_timeout")
    await asyncio.sleep(max(0.0, b2_sent + 3 - loop.time()))
    status, _, _ = await daemon.post("/v1/admin/models/a/unpin", {})
    assert status == 200
    status, body, _ = await asyncio.wait_for(b2, 30)
    assert status == 200, f"b2 answered {status} after {loop.time() - b2_sent:.1f} s of its 6: {body}"


async def test_sigterm_drains_in_flight_requests_and_leaves_no_children(make_daemon: MakeDaemon) -> None:
    # A stream long enough to see the drain.
    daemon = await make_daemon(models={"demo": {"parallel": 1}}, config=PATIENT)
    stream = await daemon.start_stream("demo", max_tokens=1500)
    children = daemon.children()
    assert children
    daemon.signal(signal.SIGTERM)

    async def health_is_503() -> bool:
        return (await daemon.get("/health"))[0] == 503

    await eventually(health_is_503, what="/health to turn 503")
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    status, body, _ = await daemon.post("/v1/chat/completions", chat)
    assert (status, body["error"]["code"]) == (503, "shutting_down")
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"  # finished, not cut
    assert await daemon.wait_exit() == 0
    assert not any(running(p) for p in children)
    assert not list((daemon.state_dir / "children").glob("*.json"))


async def test_sigint_stops_like_sigterm(daemon: Daemon) -> None:
    await daemon.chat()
    daemon.signal(signal.SIGINT)
    assert await daemon.wait_exit() == 0
    assert not daemon.children()


async def test_a_second_daemon_on_the_same_state_directory_is_refused_and_kills_nothing(
    make_daemon: MakeDaemon,
) -> None:
    """A second daemon on the same state directory (a second `make run` in one checkout, or another port
    without its own LLM_SUPERVISOR_STATE_DIR) took the first's live engine for an orphan and killed it,
    even when it then failed to listen (a review helper). It is refused now, before it reaps anything."""
    first = await make_daemon()
    await first.chat()
    [child] = first.children()
    proc = await asyncio.create_subprocess_exec(
        *serve_argv(first.root / "config.yaml", free_port()),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # it served (the lock did not hold): it must not outlive the test
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2, err.decode()[-500:]
    assert f"is using the state directory {first.state_dir}" in err.decode()
    assert f"pid {first.proc.pid if first.proc else ''}" in err.decode()
    assert running(child)
    assert not first.events("orphan_reaped")
    assert (await first.chat()).strip()  # its engine served on, untouched


async def test_a_killed_daemons_children_stop_with_it(make_daemon: MakeDaemon) -> None:
    # SIGKILL (the OOM killer, a kill -9) runs no handler of the daemon's. The kernel tells its children
    # (PR_SET_PDEATHSIG), so an engine does not hold its GPU memory until the next start.
    first = await make_daemon()
    await first.chat()
    children = first.children()
    assert len(children) == 1
    pid_files = list((first.state_dir / "children").glob("*.json"))
    assert len(pid_files) == 1
    first.expect_exit = {-signal.SIGKILL}
    first.signal(signal.SIGKILL)
    await first.wait_exit()
    await eventually(lambda: not running(children[0]), what="the child to stop with the daemon")

    # What it could not clean up (its pid file, the child's socket and key) goes at the next start,
    # with nothing left to reap.
    second = await make_daemon(root=first.root)  # same state directory
    assert not second.events("orphan_reaped")
    assert not any(path.exists() for path in pid_files)
    assert (await second.chat()).strip()


async def test_a_fifo_in_manifests_neither_hangs_the_reload_nor_deafens_the_daemon(
    make_daemon: MakeDaemon,
) -> None:
    """A FIFO named *.yaml in manifests/: the SIGHUP's reload blocked for ever in its thread reading it,
    nothing said why, and no later SIGHUP or SIGTERM was acted on (the main loop awaits the reload before
    it looks at the signal queue again): the daemon had to be SIGKILLed, dropping every request in
    flight without a drain."""
    daemon = await make_daemon()
    fifo = daemon.manifests / "stray.yaml"
    os.mkfifo(fifo)
    daemon.signal(signal.SIGHUP)
    try:
        await eventually(lambda: bool(daemon.events("reload_rejected")), 10, "the reload to be refused")
        refused = True
    except AssertionError:
        refused = False
    daemon.signal(signal.SIGTERM)
    try:
        code: int | None = await daemon.wait_exit(20)
    except TimeoutError:
        code = None
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the reader: the daemon may go now
        await daemon.wait_exit(30)
    assert refused, "no reload_applied / reload_rejected 10 s after SIGHUP: the reload hangs reading the FIFO"
    assert code == 0, "the daemon did not act on SIGTERM within 20 s (its main loop awaits the reload)"
    assert any("stray.yaml" in e for e in daemon.events("reload_rejected")[-1]["errors"])


async def test_a_request_queued_for_a_model_renamed_to_keep_its_old_name_as_alias_is_served(
    make_daemon: MakeDaemon, demo_gguf: Path
) -> None:
    """A model renamed with its old name kept as an alias (`name: demo2, aliases: [demo]`): a request for
    `demo` queued behind a stream when the reload came was answered 404 model_not_found, though `demo`
    still named a model (a request sent a moment later was served)."""
    daemon = await make_daemon(models={"demo": {"parallel": 1, "max_inflight": 1}}, config=PATIENT)
    stream, queued = await _one_queued_behind_a_stream(daemon)
    (daemon.manifests / "demo.yaml").unlink()
    daemon.write_manifest(
        "demo2",
        model=str(demo_gguf),
        aliases=["demo"],
        ctx_size=2048,
        parallel=1,
        vram_mib=512,
        start_timeout_s=30,
    )
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="reload")
    assert daemon.events("reload_applied")[-1]["added"] == ["demo2"]
    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200  # `demo` is served, by demo2
    status, body, _ = await asyncio.wait_for(queued, 60)
    await stream.close()
    assert status == 200, body
