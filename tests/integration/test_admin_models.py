"""The operator's model routes: documents, load, unload (serve or cancel the queue), pin and unpin."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.parse
from typing import Any

import openai
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import PATIENT, Daemon, eventually

ONE_AT_A_TIME: dict[str, Any] = {"demo": {"parallel": 1}}


async def _doc(daemon: Daemon, name: str = "demo") -> dict[str, Any]:
    status, document = await daemon.get(f"/v1/admin/models/{name}")
    assert status == 200, document
    return document  # type: ignore[no-any-return]


def _error_code(body: Any) -> str:
    return str(body["error"]["code"])


async def test_model_documents_describe_each_model_and_unknown_names_are_404(daemon: Daemon) -> None:
    status, listing = await daemon.get("/v1/admin/models")
    assert status == 200
    [demo] = listing["models"]
    assert demo["name"] == "demo"
    assert demo["engine"] == "llama-server"
    assert demo["source"] == "manifest"
    assert demo["state"] == "unloaded"
    assert demo["inflight"] == 0
    assert demo["queue_depth"] == 0
    assert demo["replica_limit"] == 1
    assert demo["replicas"] == [
        {
            "id": "demo#0",
            "state": "unloaded",
            "pid": None,
            "gpus": [],
            "vram_mib": None,
            "inflight": 0,
            "queued": 0,
            "since": demo["replicas"][0]["since"],
        }
    ]
    assert demo["vram_estimate"]["mib"] == 512
    assert demo["vram_estimate"]["source"] == "declared"
    assert demo["pinned"] is False
    assert demo["pin_source"] == "manifest"
    assert demo["last_error"] is None
    assert demo["expires_at"] is None
    assert demo["keep_alive"] == 300
    assert "completion" in demo["capabilities"]
    constraints = demo["load_constraints"]
    assert constraints["additionalProperties"] is False
    assert constraints["properties"]["ctx_size"]["default"] == 2048  # the manifest's own
    assert constraints["properties"]["ctx_size"]["minimum"] == 0
    assert {"ctx_size", "parallel", "cache_type_k", "flash_attn", "draft_n_max"} <= set(
        constraints["properties"]
    )
    assert demo["load_override"] is None
    assert demo["definition"]["name"] == "demo"
    assert demo["definition"]["model"] == "demo.gguf"

    for method, path in [
        ("get", "/v1/admin/models/nope"),
        ("post", "/v1/admin/models/nope/load"),
        ("post", "/v1/admin/models/nope/unload"),
        ("post", "/v1/admin/models/nope/pin"),
        ("post", "/v1/admin/models/nope/unpin"),
        ("get", "/v1/admin/models/nope/logs"),
    ]:
        if method == "get":
            status, body = await daemon.get(path)
        else:
            status, body, _ = await daemon.post(path, {})
        assert (status, _error_code(body)) == (404, "model_not_found"), path
        assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        ("load", {"overrides": {"ctx_size": 100}}, "overrides.ctx_size"),
        ("load", {"overrides": {"max_model_len": 4096}}, "overrides.max_model_len"),
        ("load", {"overrides": [1]}, "overrides: Input should be a valid dictionary"),
        ("load", {"restart": "yes"}, "restart"),
        ("load", {"wait": "yes"}, "wait"),
        ("load", {"keep_alive": "soon"}, "keep_alive"),
        ("load", {"gpu": 1}, "gpu: unknown field"),
        ("unload", {"queued": "drop"}, "queued"),
        ("pin", {"keep_alive": 5}, "keep_alive: unknown field"),
        ("unpin", {"wait": True}, "wait: unknown field"),
    ],
)
async def test_bad_action_bodies_are_400_naming_the_field(
    daemon: Daemon, path: str, body: dict[str, Any], names: str
) -> None:
    status, answer, _ = await daemon.post(f"/v1/admin/models/demo/{path}", body)
    assert status == 400, answer
    assert _error_code(answer) == f"invalid_{path}_request"
    assert names in answer["error"]["message"]
    assert (await _doc(daemon))["state"] == "unloaded"


async def test_concurrent_loads_share_one_child_then_unload_stops_it(daemon: Daemon) -> None:
    answers = await asyncio.gather(
        *(daemon.post("/v1/admin/models/demo/load", {"keep_alive": "10m"}) for _ in range(3))
    )
    for status, document, _ in answers:
        assert status == 200, document
        assert document["state"] == "ready"
        assert document["keep_alive"] == 600
        assert document["replicas"][0]["pid"]
        assert document["replicas"][0]["gpus"] == [0]
        assert document["replicas"][0]["vram_mib"] == 512
        assert document["expires_at"] is not None
    assert len(daemon.events("child_started")) == 1

    status, document, headers = await daemon.post("/v1/admin/models/demo/load", {"wait": False})
    assert status == 202
    assert headers["Location"] == "/v1/admin/models/demo"
    assert document["state"] == "ready"  # already loaded: nothing to wait for
    assert await daemon.chat() is not None

    status, document, _ = await daemon.post("/v1/admin/models/demo/unload")
    assert status == 200
    assert document["state"] == "unloaded"
    assert document["replicas"][0]["pid"] is None
    assert not daemon.children()
    status, document, _ = await daemon.post("/v1/admin/models/demo/unload", {"queued": "cancel"})
    assert status == 200
    assert document["state"] == "unloaded"


async def test_load_without_waiting_answers_202_and_loads_in_the_background(daemon: Daemon) -> None:
    status, document, headers = await daemon.post("/v1/admin/models/demo/load", {"wait": False})
    assert status == 202
    assert headers["Location"] == "/v1/admin/models/demo"
    # It said "unloaded" and nothing more: a script took that for nothing happening.
    assert document["state"] in ("loading", "ready") or document["load_pending"] is True
    await daemon.wait_state("demo", "ready")


async def test_a_load_that_fails_answers_503_with_the_schedulers_code(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"demo": {"args": ["--no-such-flag"]}}, config={"failure_backoff_s": 60}
    )
    status, body, _ = await daemon.post("/v1/admin/models/demo/load")
    assert status == 503
    assert _error_code(body) == "model_failed"
    document = await _doc(daemon)
    assert document["state"] == "failed"
    assert document["last_error"]["reason"]
    assert isinstance(document["last_error"]["at"], float)
    # Asked again within the back-off, it is tried again (it answered the old failure, starting nothing,
    # though the operator may just have fixed the cause); a request still meets the back-off.
    status, body, _ = await daemon.post("/v1/admin/models/demo/load")
    assert (status, _error_code(body)) == (503, "model_failed")
    assert len(daemon.events("child_started", model="demo")) == 2
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    status, body, _ = await daemon.post("/v1/chat/completions", chat)
    assert (status, body["error"]["code"]) == (503, "model_failed")
    assert len(daemon.events("child_started", model="demo")) == 2


async def test_pin_keeps_it_loaded_past_keep_alive_until_unpinned(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"keep_alive": 0}})
    status, document, _ = await daemon.post("/v1/admin/models/demo/pin", {})
    assert status == 200, document
    assert (document["state"], document["pinned"], document["pin_source"]) == ("ready", True, "runtime")
    assert document["expires_at"] is None
    await daemon.chat()  # keep_alive 0 would unload it once idle; pinned, it stays
    status, body, _ = await daemon.post("/v1/admin/models/demo/unload")
    assert (status, _error_code(body)) == (409, "model_pinned")
    assert "unpin" in body["error"]["message"]
    # Ollama's unload (keep_alive 0, nothing to generate) answered done_reason "unload", and the model
    # stayed: a UI's unload button reported success.
    status, body, _ = await daemon.post("/api/generate", {"model": "demo", "keep_alive": 0})
    assert status == 409
    assert "pinned" in body["error"]
    assert await daemon.state("demo") == "ready"

    status, document, _ = await daemon.post("/v1/admin/models/demo/unpin")
    assert status == 200
    assert document["pinned"] is False
    assert document["pin_source"] == "manifest"
    await daemon.wait_state("demo", "unloaded")  # keep_alive 0 applies again


async def test_an_unload_of_a_model_whose_load_waits_for_room_returns_after_the_drain_time(
    make_daemon: MakeDaemon,
) -> None:
    """b's load waits for room that busy a holds. An unload of b (serving its queue first, the default)
    waited for that load, which every new request for b moved on: it did not return while traffic came,
    and once a was idle, b was loaded only to be stopped. It waits as long as a drain may, then calls the
    load off; b's waiting request is told model_unloading, and b is never started."""
    daemon = await make_daemon(
        models={"a": {"vram_mib": 700, "parallel": 1}, "b": {"vram_mib": 700}},
        config={"gpus": [{"index": 0, "total_mib": 1024}], "queue_timeout_s": 60, "drain_timeout_s": 1},
    )
    stream = await daemon.start_stream("a")
    (engine,) = daemon.children()
    os.kill(engine.pid, signal.SIGSTOP)  # a stays busy for as long as the test needs
    try:
        chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}]}
        waiting = asyncio.create_task(daemon.post("/v1/chat/completions", chat))
        await eventually(lambda: bool(daemon.events("placement_waiting", model="b")), what="b to wait")
        status, body, _ = await asyncio.wait_for(daemon.post("/v1/admin/models/b/unload", {}), 20)
        assert (status, body["state"]) == (200, "unloaded")
        status, body, _ = await asyncio.wait_for(waiting, 20)
        assert (status, body["error"]["code"]) == (503, "model_unloading")
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    await stream.close()
    await asyncio.sleep(1)  # room for b to have been loaded, had its load gone on
    assert not daemon.events("child_started", model="b")


async def test_a_pin_whose_load_fails_says_the_pin_stays(make_daemon: MakeDaemon) -> None:
    """`llm-supervisor pin broken` printed the load's failure and exited 1, which reads as nothing done,
    while the pin stayed and its keeper kept starting the engine."""
    daemon = await make_daemon(models={"demo": {"args": ["--no-such-flag"]}})
    status, body, _ = await daemon.post("/v1/admin/models/demo/pin", {})
    assert (status, _error_code(body)) == (503, "model_failed")
    assert "stays pinned" in body["error"]["message"]
    assert "unpin" in body["error"]["message"]
    assert (await _doc(daemon))["pinned"] is True


async def test_unpin_overrides_a_manifest_pin_until_pinned_again(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"pinned": True}})
    await daemon.wait_state("demo", "ready")
    status, document, _ = await daemon.post("/v1/admin/models/demo/unpin")
    assert (document["pinned"], document["pin_source"]) == (False, "runtime")
    status, document, _ = await daemon.post("/v1/admin/models/demo/unload")
    assert status == 200
    assert document["state"] == "unloaded"
    status, document, _ = await daemon.post("/v1/admin/models/demo/pin", {"wait": False})
    assert status == 202
    assert (document["pinned"], document["pin_source"]) == (True, "manifest")
    await daemon.wait_state("demo", "ready")


async def _queued_behind_a_stream(daemon: Daemon) -> tuple[Any, asyncio.Task[str]]:
    """One streaming request in flight (parallel 1), and one chat queued behind it."""
    await daemon.post("/v1/admin/models/demo/load")
    stream = await daemon.start_stream()  # long enough to stay in flight while the other queues
    queued = asyncio.create_task(daemon.chat(max_tokens=4))

    async def waiting() -> bool:
        return int((await _doc(daemon))["queue_depth"]) == 1

    await eventually(waiting, what="the second request to queue")
    return stream, queued


async def _finish(stream: Any) -> str | None:
    finish = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish


async def test_unload_with_cancel_answers_the_queue_503_model_unloading(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=ONE_AT_A_TIME, config=PATIENT)
    stream, queued = await _queued_behind_a_stream(daemon)
    unloading = asyncio.create_task(daemon.post("/v1/admin/models/demo/unload", {"queued": "cancel"}))
    with pytest.raises(openai.APIStatusError) as refused:
        await queued
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "model_unloading"  # type: ignore[index]
    assert not unloading.done()  # the request in flight is still being answered
    assert await _finish(stream) is not None  # and it finishes
    status, document, _ = await unloading
    assert status == 200
    assert document["state"] == "unloaded"


async def test_unload_by_default_serves_the_queue_first(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=ONE_AT_A_TIME, config=PATIENT)
    stream, queued = await _queued_behind_a_stream(daemon)
    unloading = asyncio.create_task(daemon.post("/v1/admin/models/demo/unload"))
    assert await _finish(stream) is not None
    assert isinstance(await queued, str)  # served, not refused
    status, document, _ = await unloading
    assert status == 200
    assert document["state"] == "unloaded"


# --- what a review of the control plane found ----------------------------------------------------------


async def test_a_tail_longer_than_the_lines_held_gives_them_all(daemon: Daemon) -> None:
    """?tail=N above the lines held sliced from a negative index: the larger N, the fewer lines."""
    assert (await daemon.post("/v1/admin/models/demo/load", {}))[0] == 200
    status, body = await daemon.get("/v1/admin/models/demo/logs")
    assert status == 200
    every = body["lines"]
    assert len(every) >= 3
    for tail in (len(every), len(every) + 1, 2 * len(every)):
        assert (await daemon.get(f"/v1/admin/models/demo/logs?tail={tail}"))[1]["lines"] == every


async def test_a_refused_load_leaves_no_replicas_behind_and_a_conflict_is_not_a_server_error(
    make_daemon: MakeDaemon,
) -> None:
    """A load of 3 replicas refused 409 had already made replica slots 1 and 2: the model's document
    listed three replicas, two never started, until an unload. And 409 said `server_error`, which
    OpenAI clients take for the server's fault and retry."""
    daemon = await make_daemon(models={"demo": {"max_replicas": 3}})
    assert (await daemon.post("/v1/admin/models/demo/load", {}))[0] == 200
    status, body, _ = await daemon.post(
        "/v1/admin/models/demo/load", {"replicas": 3, "overrides": {"ctx_size": 8192}}
    )
    assert (status, body["error"]["code"], body["error"]["type"]) == (
        409,
        "load_conflict",
        "invalid_request_error",
    )
    _, document = await daemon.get("/v1/admin/models/demo")
    assert [r["id"] for r in document["replicas"]] == ["demo#0"]


async def test_the_202_location_of_a_model_whose_name_has_slashes_leads_to_its_document(
    make_daemon: MakeDaemon,
) -> None:
    """A pulled model is named hf.co/org/repo:QUANT; the Location of its 202 put the name in the path
    unencoded, which no route takes: 404 (a review helper)."""
    pulled = "hf.co/org/demo:Q4_K_M"
    daemon = await make_daemon(models={"pulled": {}}, start=False)
    manifest = daemon.manifests / "pulled.yaml"
    manifest.write_text(manifest.read_text().replace("name: pulled", f"name: {pulled}"))
    await daemon.start()
    status, _, headers = await daemon.post(
        f"/v1/admin/models/{urllib.parse.quote(pulled, safe='')}/load", {"wait": False}
    )
    assert status == 202
    status, document = await daemon.get(headers["Location"])
    assert status == 200, (headers["Location"], document)
    assert document["name"] == pulled
    await daemon.wait_state(pulled, "ready")


async def test_an_admin_400_names_the_field_at_fault_in_param(daemon: Daemon) -> None:
    """README (Errors): `param` names the field at fault when there is one; the admin actions named it
    only in the message."""
    cases = [
        ("/v1/admin/models/demo/load", {"replicas": 0}, "replicas"),
        ("/v1/admin/models/demo/load", {"overrides": {"ctx_size": "big"}}, "overrides.ctx_size"),
        ("/v1/admin/models/demo/unload", {"queued": "later"}, "queued"),
    ]
    for path, body, field in cases:
        status, answer, _ = await daemon.post(path, body)
        assert status == 400, answer
        assert answer["error"]["message"].startswith(f"{field}: "), answer
        assert answer["error"]["param"] == field, (path, body, answer)


async def test_a_405_on_an_admin_route_says_which_methods_it_takes(daemon: Daemon) -> None:
    """RFC 9110 15.5.6: a 405 carries Allow; the answer rebuilt as a JSON error dropped it."""
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/v1/admin/models/demo/load") as response:
        assert response.status == 405
        body = await response.json()
        assert body["error"]["code"] == "method_not_allowed"
        assert response.headers.get("Allow") == "POST", dict(response.headers)


async def test_a_keep_alive_of_the_wrong_type_is_named_as_the_field_not_a_union_branch(
    daemon: Daemon,
) -> None:
    """pydantic's path into a union names its branch: `keep_alive.float: Input should be a valid number`
    named a field the body has no such thing as, and said nothing of strings."""
    values: list[object] = [True, [], {"s": 1}]
    for value in values:
        status, answer, _ = await daemon.post("/v1/admin/models/demo/load", {"keep_alive": value})
        assert status == 400, answer
        assert answer["error"]["message"].startswith("keep_alive: "), answer
