"""Issue 14, latency you can see: every inference answer says where its time went (`Server-Timing`) and
which request it was (`X-Request-Id`, also in the daemon's log and sent to the child), and `/metrics`
holds the histograms and counters the Grafana dashboard graphs."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually, gated_engine

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EMBED_ARGS = {"args": ["--embeddings", "--pooling", "mean"]}
_TIMING = re.compile(r"(\w+);dur=([0-9.]+)")


async def post(daemon: Daemon, path: str, body: Any, **headers: str) -> tuple[int, CIMultiDict[str], bytes]:
    assert daemon.http is not None
    async with daemon.http.post(daemon.url + path, json=body, headers=headers) as response:
        return response.status, CIMultiDict(response.headers), await response.read()


def timings(headers: Mapping[str, str]) -> dict[str, float]:
    return {name: float(ms) for name, ms in _TIMING.findall(headers["Server-Timing"])}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scrape(daemon: Daemon) -> str:
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


async def test_a_whole_answer_says_queue_load_ttft_and_total(daemon: Daemon) -> None:
    status, headers, _ = await post(daemon, "/v1/chat/completions", CHAT)
    assert status == 200
    first = timings(headers)
    assert set(first) == {"queue", "load", "ttft", "total"}
    assert first["load"] > 0  # the first request waited for the model to load
    assert first["load"] <= first["ttft"] <= first["total"]
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])

    status, headers, _ = await post(daemon, "/v1/chat/completions", CHAT)
    assert timings(headers)["load"] == 0  # loaded already


async def test_a_stream_says_queue_and_load_in_its_head(daemon: Daemon) -> None:
    status, headers, body = await post(daemon, "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200
    assert body.rstrip().endswith(b"data: [DONE]")
    assert set(timings(headers)) == {"queue", "load"}  # the head went out before the first token
    assert headers["X-Request-Id"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "demo", "prompt": "once", "max_tokens": 3}),
        ("/v1/responses", {"model": "demo", "input": "hi", "max_output_tokens": 3}),
        ("/v1/embeddings", {"model": "embed", "input": ["hello"]}),
        ("/api/chat", {**CHAT, "stream": False, "options": {"num_predict": 3}}),
        (
            "/api/generate",
            {"model": "demo", "prompt": "once", "stream": False, "options": {"num_predict": 3}},
        ),
        ("/api/embed", {"model": "embed", "input": "hello"}),
        ("/api/embeddings", {"model": "embed", "prompt": "hello"}),
    ],
)
async def test_every_inference_route_says_where_its_time_went(
    make_daemon: MakeDaemon, path: str, body: dict[str, Any]
) -> None:
    daemon = await make_daemon(models={"demo": {}, "embed": EMBED_ARGS})
    status, headers, _ = await post(daemon, path, body, **{"X-Request-Id": "route-check"})
    assert status == 200
    assert headers["X-Request-Id"] == "route-check"
    assert {"queue", "load", "total"} <= set(timings(headers))


async def test_an_ollama_stream_says_queue_and_load_in_its_head(daemon: Daemon) -> None:
    status, headers, body = await post(daemon, "/api/chat", {**CHAT, "options": {"num_predict": 3}})
    assert status == 200
    assert body.count(b"\n") >= 2
    assert set(timings(headers)) == {"queue", "load"}


async def test_the_clients_request_id_names_every_log_event_of_its_request(daemon: Daemon) -> None:
    status, headers, _ = await post(daemon, "/v1/chat/completions", CHAT, **{"X-Request-Id": "trace-42"})
    assert status == 200
    assert headers["X-Request-Id"] == "trace-42"
    tagged = daemon.events(request_id="trace-42")
    names = {event["event"] for event in tagged}
    # The access log line, and the load the request waited for while it waited.
    assert {"request", "slot_transition"} <= names
    assert daemon.events("request", path="/v1/chat/completions", request_id="trace-42")


@pytest.mark.parametrize("given", ["x" * 201, "two words", "caf\u00e9", ""])
async def test_a_request_id_that_is_not_sane_is_replaced(daemon: Daemon, given: str) -> None:
    assert daemon.http is not None
    async with daemon.http.post(
        daemon.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": given}
    ) as response:
        assert response.status == 200
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-Id"])


async def test_error_answers_carry_a_request_id_too(daemon: Daemon) -> None:
    for path in ("/v1/chat/completions", "/api/chat"):
        status, headers, _ = await post(daemon, path, {**CHAT, "model": "nope"}, **{"X-Request-Id": "e-1"})
        assert status == 404
        assert headers["X-Request-Id"] == "e-1"
    assert daemon.events("request", status=404, request_id="e-1")


async def test_what_a_model_does_after_the_request_ended_is_not_logged_under_its_id(daemon: Daemon) -> None:
    status, _, _ = await post(
        daemon, "/v1/chat/completions", {**CHAT, "keep_alive": 0}, **{"X-Request-Id": "k0"}
    )
    assert status == 200
    await daemon.wait_state("demo", "unloaded")
    stopped = daemon.events("slot_transition", to="unloaded")
    assert stopped
    assert all("request_id" not in event for event in stopped)


async def test_metrics_time_each_request_and_count_its_tokens(daemon: Daemon) -> None:
    for body in (CHAT, {**CHAT, "stream": True, "stream_options": {"include_usage": True}}):
        status, _, _ = await post(daemon, "/v1/chat/completions", body)
        assert status == 200
    status, _, _ = await post(daemon, "/api/chat", {**CHAT, "options": {"num_predict": 3}})
    assert status == 200
    text = await scrape(daemon)
    assert value(text, "llm_supervisor_requests_total", model="demo", status="200") == 3
    for histogram in (
        "queue_wait_seconds",
        "time_to_first_token_seconds",
        "request_duration_seconds",
        "output_tokens_per_second",
    ):
        assert value(text, f"llm_supervisor_{histogram}_count", model="demo") == 3, histogram
    assert value(text, "llm_supervisor_load_wait_seconds_count", model="demo") == 1  # the first one
    assert value(text, "llm_supervisor_output_tokens_total", model="demo") == 4 + 4 + 3
    assert value(text, "llm_supervisor_prompt_tokens_total", model="demo") > 0
    assert value(text, "llm_supervisor_replica_starts_total", model="demo") == 1
    assert value(text, "llm_supervisor_model_leased_mib", model="demo") == 512
    assert value(text, "llm_supervisor_gpu_leased_mib", gpu="0") == 512
    # The daemon times its own garbage collections: start-up's full pass at least (then gc.freeze).
    assert value(text, "llm_supervisor_gc_pause_seconds_count", generation="2") >= 1


async def test_an_embeddings_answer_counts_the_prompt_tokens_its_usage_names(make_daemon: MakeDaemon) -> None:
    """llama-server puts an embeddings list's usage before the vectors; that is where it is read."""
    daemon = await make_daemon(models={"embed": EMBED_ARGS})
    status, _, body = await post(daemon, "/v1/embeddings", {"model": "embed", "input": ["hello", "there"]})
    assert status == 200
    usage = json.loads(body)["usage"]
    assert body.find(b'"usage"') < body.find(b'"embedding"')  # the shape this test is about
    text = await scrape(daemon)
    assert value(text, "llm_supervisor_prompt_tokens_total", model="embed") == usage["prompt_tokens"] > 0
    assert value(text, "llm_supervisor_output_tokens_total", model="embed") == 0


async def test_a_streamed_chat_counts_its_cached_prompt_tokens_too(make_daemon: MakeDaemon) -> None:
    """A streamed chat without `stream_options.include_usage` (what most OpenAI clients send) was counted
    from llama-server's `timings.prompt_n`, which leaves out the `cache_n` tokens its prompt cache
    served: the same prompt sent twice added 26 prompt tokens, then 1, where its usage says 26 twice."""
    daemon = await make_daemon(models={"demo": {"parallel": 1}})  # one slot: the second prompt hits its cache
    assert daemon.http is not None
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    added = []
    for _ in range(2):
        before = value(await scrape(daemon), "llm_supervisor_prompt_tokens_total", model="demo")
        async with daemon.http.post(daemon.url + "/v1/chat/completions", json=chat) as response:
            assert response.status == 200
            await response.read()
        added.append(value(await scrape(daemon), "llm_supervisor_prompt_tokens_total", model="demo") - before)
    status, whole, _ = await daemon.post("/v1/chat/completions", {**chat, "stream": False})
    assert status == 200
    assert added == [whole["usage"]["prompt_tokens"]] * 2


async def test_scrape_time_with_20_models_on_4_gpus(make_daemon: MakeDaemon) -> None:
    """Reports how long /metrics takes with 20 loaded models on 4 declared GPUs; no threshold."""
    models = {f"m{i:02d}": {"vram_mib": 512, "parallel": 1, "ctx_size": 512} for i in range(20)}
    daemon = await make_daemon(
        models=models, config={"gpus": [{"index": i, "total_mib": 4096} for i in range(4)]}
    )
    answers = await asyncio.gather(
        *(post(daemon, "/v1/chat/completions", {**CHAT, "model": m}) for m in models)
    )
    assert [status for status, _, _ in answers] == [200] * 20
    await scrape(daemon)  # warm
    took = []
    for _ in range(30):
        started = time.perf_counter()
        text = await scrape(daemon)
        took.append((time.perf_counter() - started) * 1000)
    assert value(text, "llm_supervisor_requests_total", model="m19", status="200") == 1
    print(
        f"\n/metrics with 20 models on 4 GPUs: p50 {statistics.median(took):.2f} ms, "
        f"max {max(took):.2f} ms over {len(took)} scrapes, {len(text.encode())} bytes, "
        f"{len(samples(text))} samples"
    )


# --- what a review of operations found: every request counted and logged once, as what it was ----------


def _requests(text: str, model: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llm_supervisor_requests_total" and s.labels.get("model") == model
    )


# A stream that lasts (on long_streams' model), on the front and on aiohttp (the Ollama route).
LONG_STREAM = {**CHAT, "max_tokens": 100000, "stream": True, "ignore_eos": True}
ON_BOTH_SERVERS = pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", LONG_STREAM),
        ("/api/chat", {"model": "demo", "messages": CHAT["messages"], "options": {"num_predict": 100000}}),
    ],
    ids=["front", "aiohttp"],
)


@pytest.fixture
async def long_streams(make_daemon: MakeDaemon) -> Daemon:
    """The demo model with room for a stream that lasts. The usual 512 tokens a request (2048 shared by
    4 slots) take llama-server a few milliseconds on one thread, so a client could not be sure to leave,
    nor a child to die, before its stream had ended. 32768 take it about half a second."""
    return await make_daemon(models={"demo": {"ctx_size": 32768, "parallel": 1}})


@ON_BOTH_SERVERS
async def test_a_request_whose_client_leaves_is_logged_and_counted_as_499(
    long_streams: Daemon, path: str, body: dict[str, Any]
) -> None:
    """A client that left mid-stream (or gave up in a queue or a cold load) left no access log line and
    no count, on either server: the requests an operator looks for at 3 a.m."""
    daemon = long_streams
    assert await daemon.chat()
    before = _requests(await scrape(daemon), "demo")
    assert daemon.http is not None
    async with daemon.http.post(daemon.url + path, json=body) as response:
        assert response.status == 200
        await response.content.readany()
        response.close()  # gone, mid-stream

    async def logged() -> bool:
        return any(e["status"] == 499 for e in daemon.events("request"))

    await eventually(logged, 10, "the request to be logged")
    assert _requests(await scrape(daemon), "demo") == before + 1
    assert value(await scrape(daemon), "llm_supervisor_requests_total", model="demo", status="499") == 1


@ON_BOTH_SERVERS
async def test_a_stream_cut_by_a_crash_counts_as_the_error_it_ended_with_and_times_its_first_token(
    long_streams: Daemon, path: str, body: dict[str, Any]
) -> None:
    """The client saw a model_crashed event (or Ollama's error line), but the log and the counters said
    200, and its first token, which did come, was not timed."""
    daemon = long_streams
    assert await daemon.chat()
    ttft = value(await scrape(daemon), "llm_supervisor_time_to_first_token_seconds_count", model="demo")
    assert daemon.http is not None
    async with daemon.http.post(daemon.url + path, json=body) as response:
        assert response.status == 200
        await response.content.readany()
        (engine,) = daemon.children()
        engine.kill()
        rest = await response.read()
    assert b"model_crashed" in rest or b"stopped while serving" in rest
    await eventually(lambda: _last_status_is(daemon, 503), 10, "the cut stream's log line")
    *served, cut = daemon.events("request")
    assert all(line["error"] is None for line in served)
    assert cut["error"] == "model_crashed"
    assert cut["peer"] == "127.0.0.1"  # on the front's connections too
    text = await scrape(daemon)
    assert value(text, "llm_supervisor_requests_total", model="demo", status="503") == 1
    assert value(text, "llm_supervisor_time_to_first_token_seconds_count", model="demo") == ttft + 1


@pytest.mark.parametrize("end", ["crash", "client leaves"])
async def test_an_http_1_0_stream_ends_logged_as_what_ended_it(long_streams: Daemon, end: str) -> None:
    """HTTP/1.0 clients are served by aiohttp's relay (proxy.forward), whose stream cut by a crash was
    logged and counted as the head's 200, like one whose client left while the relay wrote."""
    daemon = long_streams
    assert await daemon.chat()
    body = json.dumps(LONG_STREAM).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    first = await asyncio.wait_for(reader.read(4096), 20)
    assert first.startswith(b"HTTP/1.0 200") or first.startswith(b"HTTP/1.1 200"), first[:100]
    if end == "crash":
        (engine,) = daemon.children()
        engine.kill()
        rest = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        assert b"model_crashed" in first + rest
        status = 503
    else:
        writer.transport.abort()  # gone, mid-stream
        status = 499
    await eventually(lambda: _last_status_is(daemon, status), 10, "the stream's log line")
    assert value(await scrape(daemon), "llm_supervisor_requests_total", model="demo", status=str(status)) == 1
    last = daemon.events("request")[-1]
    assert last["error"] == ("model_crashed" if end == "crash" else None)
    assert last["peer"] == "127.0.0.1"  # an HTTP/1.0 connection is handed to aiohttp: its peer is known


async def _last_status_is(daemon: Daemon, status: int) -> bool:
    lines = daemon.events("request")
    return bool(lines) and lines[-1]["status"] == status


async def test_refusals_are_logged_under_the_model_they_named(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """A known model's queue_timeout was logged and counted under `(unresolved)`, with the 404s of names
    that do not exist; a body too large left no line at all."""
    engine, gate = gated_engine(tmp_path)  # a load that waits: the request times out in the queue
    daemon = await make_daemon(models={"demo": engine}, config={"queue_timeout_s": 1, "max_body_mib": 1})
    assert (await post(daemon, "/v1/chat/completions", CHAT))[0] == 503
    ollama_chat = {"model": "demo", "messages": CHAT["messages"], "stream": False}
    assert (await post(daemon, "/api/chat", ollama_chat))[0] == 503
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    assert (await post(daemon, "/v1/chat/completions", big))[0] == 413
    gate.touch()
    await daemon.wait_state("demo", "ready")
    lines = daemon.events("request")
    assert [(line["model"], line["status"]) for line in lines] == [("demo", 503), ("demo", 503), (None, 413)]
    assert value(await scrape(daemon), "llm_supervisor_requests_total", model="demo", status="503") == 2
    # Each line says why (a 503 is any of nine causes), never the message (it can hold paths).
    assert [line["error"] for line in lines] == ["queue_timeout", "queue_timeout", "request_too_large"]
    # and who: the Ollama route's connection is aiohttp's, whose peer is the client's.
    assert lines[1]["peer"] == "127.0.0.1"


async def test_a_body_refused_for_its_fields_counts_under_the_model_it_named(daemon: Daemon) -> None:
    """A bad field of a request for a real model (found by the docs review) was counted under
    `(unresolved)`, with the 404s of names that do not exist, so a model's 400s did not show under it."""
    bad = [
        ({**CHAT, "keep_alive": "abc"}, {}),
        ({**CHAT, "x_priority": "high"}, {}),
        ({**CHAT, "messages": "x"}, {}),
        (CHAT, {"X-Priority": "high"}),
        ({**CHAT, "model": "nothing-here", "messages": "x"}, {}),  # no such model: stays (unresolved)
    ]
    for body, headers in bad:
        assert (await post(daemon, "/v1/chat/completions", body, **headers))[0] == 400
    lines = daemon.events("request")
    assert [line["model"] for line in lines] == ["demo"] * 4 + ["(unresolved)"]
    metrics = await scrape(daemon)
    assert value(metrics, "llm_supervisor_requests_total", model="demo", status="400") == 4
    assert value(metrics, "llm_supervisor_requests_total", model="(unresolved)", status="400") == 1


async def test_a_models_crash_load_and_eviction_counters_are_there_at_zero_before_any_event(
    make_daemon: MakeDaemon,
) -> None:
    """They appeared at their first event with the value 1, so Prometheus' increase() never saw the
    first crash of a model (nor a failed load, nor an eviction): the shipped dashboard and an alert on
    increase(crashes[10m]) > 0 missed it."""
    daemon = await make_daemon(models={"demo": {}})
    text = await scrape(daemon)
    zero = [
        ("llm_supervisor_model_crashes_total", {}),
        ("llm_supervisor_model_loads_total", {"result": "ok"}),
        ("llm_supervisor_model_loads_total", {"result": "failed"}),
        ("llm_supervisor_evictions_total", {"reason": "keep_alive"}),
        ("llm_supervisor_evictions_total", {"reason": "room"}),
    ]
    for name, labels in zero:
        assert samples(text).get((name, frozenset({"model": "demo", **labels}.items()))) == 0, name
    # A model a reload adds starts at zero too.
    (daemon.manifests / "second.yaml").write_text(
        (daemon.manifests / "demo.yaml").read_text().replace("name: demo", "name: second")
    )
    daemon.signal(signal.SIGHUP)

    async def registered() -> bool:
        found = samples(await scrape(daemon))
        return found.get(("llm_supervisor_model_crashes_total", frozenset({"model": "second"}.items()))) == 0

    await eventually(registered, 20, "the added model's series at zero")


async def test_unloads_by_keep_alive_0_and_by_the_operator_are_counted(daemon: Daemon) -> None:
    """The evictions counter had room, keep_alive (the timer), lease_lost and external: a model unloaded
    by a request's keep_alive 0 or by an operator left no count and (keep_alive 0) no eviction event."""
    assert (await daemon.post("/v1/admin/models/demo/load", {"keep_alive": "0"}))[0] == 200
    await daemon.wait_state("demo", "unloaded")
    assert (await daemon.post("/v1/admin/models/demo/load"))[0] == 200
    assert (await daemon.post("/v1/admin/models/demo/unload"))[0] == 200
    assert (await daemon.post("/v1/admin/models/demo/unload"))[0] == 200  # not loaded: nothing to count
    text = await scrape(daemon)
    for reason, count in (("keep_alive_0", 1), ("operator", 1), ("keep_alive", 0), ("room", 0)):
        assert value(text, "llm_supervisor_evictions_total", model="demo", reason=reason) == count, reason


async def test_the_series_of_a_model_a_reload_removed_go_once_it_has_stopped(make_daemon: MakeDaemon) -> None:
    """They stayed until the daemon restarted: a fleet renaming models through ConfigMaps exported every
    name it ever had."""
    daemon = await make_daemon(models={"demo": {}, "second": {}})
    assert await daemon.chat("second")
    assert await daemon.chat("demo")
    assert value(await scrape(daemon), "llm_supervisor_requests_total", model="second", status="200") == 1
    (daemon.manifests / "second.yaml").unlink()
    daemon.signal(signal.SIGHUP)

    async def forgotten() -> bool:
        return 'model="second"' not in await scrape(daemon)

    await eventually(forgotten, 20, "the removed model's series to go")
    assert value(await scrape(daemon), "llm_supervisor_requests_total", model="demo", status="200") == 1


async def test_metrics_show_the_daemons_own_process_and_build(daemon: Daemon) -> None:
    """No process_* or build metrics: the daemon's CPU and memory could not be told from its engines'."""
    text = await scrape(daemon)
    assert value(text, "process_resident_memory_bytes") > 0
    assert value(text, "process_open_fds") > 0
    families = samples(text)
    (build,) = [labels for name, labels in families if name == "llm_supervisor_build_info"]
    assert dict(build)["version"]


async def test_an_engine_refusal_answered_as_the_daemons_own_400_logs_its_code(
    make_daemon: MakeDaemon,
) -> None:
    """llama-server refuses an input longer than its batch with a 500, which the daemon answers as the
    400 `context_length_exceeded` it is; its access-log line said `error: null` (a review helper)."""
    daemon = await make_daemon(
        models={"demo": {"args": ["--embeddings", "--pooling", "mean"], "ctx_size": 512}}
    )
    assert daemon.http is not None
    async with daemon.http.post(
        daemon.url + "/v1/embeddings", json={"model": "demo", "input": "hello " * 4000}
    ) as response:
        status, body = response.status, await response.json()
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
    await eventually(lambda: bool(daemon.events("request")), 10, "the access log line")
    [line] = daemon.events("request")
    assert (line["status"], line["error"]) == (400, "context_length_exceeded")


async def test_health_probes_answered_503_while_draining_are_not_access_logged(
    make_daemon: MakeDaemon,
) -> None:
    """Every answer of a refusal's status was logged whatever the route: the probes' own 503 while the
    daemon starts or drains wrote a line per probe (a readiness probe each second, for a vLLM start of
    minutes or a drain of drain_timeout_s). Refusals, which carry an error code, still are."""
    daemon = await make_daemon(config={"drain_timeout_s": 120})
    await eventually(lambda: bool(daemon.events("start_up_complete")), what="start-up to finish")
    stream = await daemon.start_stream("demo", max_tokens=1500)
    (engine,) = daemon.children()
    os.kill(engine.pid, signal.SIGSTOP)  # the stream stays in flight: the daemon stays draining
    try:
        daemon.signal(signal.SIGTERM)
        await eventually(lambda: bool(daemon.events("shutdown_started")), what="the drain to begin")
        for _ in range(5):
            assert (await daemon.get("/health/ready"))[0] == 503
            assert (await daemon.get("/health"))[0] == 503
        status, _, _ = await daemon.post("/v1/admin/models/demo/load")
        assert status == 503
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        await stream.close()
    assert await daemon.wait_exit() == 0
    logged = daemon.events("request")
    assert not [e for e in logged if e.get("path") in ("/health", "/health/ready")]
    assert [e["error"] for e in logged if e["path"] == "/v1/admin/models/demo/load"] == ["shutting_down"]


async def test_an_operator_load_is_not_a_queued_request(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """An admin load with `wait: false` has no client waiting for it, yet while it loaded the per-model
    gauge and /health said one request was queued (the daemon-wide gauge and `queue_depth` said none):
    a phantom queue on the dashboard for every operator or pinned load, for as long as it waits."""
    engine, gate = gated_engine(tmp_path)  # a load that lasts until the test lets it go on
    daemon = await make_daemon(models={"demo": engine})
    status, _, _ = await daemon.post("/v1/admin/models/demo/load", {"wait": False})
    assert status == 202
    try:
        await daemon.wait_state("demo", "loading")
        text = await scrape(daemon)
        assert value(text, "llm_supervisor_model_queued_requests", model="demo") == 0
        assert "queued" not in (await daemon.health())["models"]["demo"]
    finally:
        gate.touch()
        await daemon.wait_state("demo", "ready")
