"""The OpenAI-compatible surface: pass-through, streaming, listing, probes, and every error code."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import openai
import pytest

from tests.integration.conftest import TAKING_TURNS, MakeDaemon
from tests.integration.harness import Daemon, eventually

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_chat_completion_names_the_model_as_requested(daemon: Daemon) -> None:
    completion = await daemon.openai().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert completion.model == "demo"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5


async def test_text_completions_pass_through(daemon: Daemon) -> None:
    completion = await daemon.openai().completions.create(model="demo", prompt="once upon", max_tokens=5)
    assert completion.choices[0].text.strip()


async def test_embeddings_pass_through(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"embed": {"args": ["--embeddings", "--pooling", "mean"]}})
    result = await daemon.openai().embeddings.create(model="embed", input=["hello", "world"])
    assert len(result.data) == 2
    assert len(result.data[0].embedding) == 64  # the demo model's width


@pytest.mark.parametrize("stream", [False, True])
async def test_a_head_at_the_fronts_limits_reaches_llama_server_whole(daemon: Daemon, stream: bool) -> None:
    """The front's bounds are what llama-server (cpp-httplib: 100 lines) takes of the request the child
    gets, which carries up to four lines more than the client sent (six of the daemon's for a stream, less
    the client's Host and Content-Length): 96 lines, one of them 8188 bytes, pass both. One line more is
    refused by the front in the OpenAI shape; the bound had counted three, and a stream's 97th line
    reached the child, which answered an empty 400. No Content-Type: the daemon's replaces the client's."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    body = json.dumps({**CHAT, "stream": stream}).encode()
    for extra, status in ((93, b"200"), (94, b"431")):  # with Host, X-Big, Content-Length
        lines = b"".join(b"X-%d: v\r\n" % n for n in range(extra))
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(
            head + lines + b"X-Big: " + b"v" * 8183 + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        writer.close()
        assert answer.split(b" ")[1] == status, answer


async def test_sse_arrives_incrementally(daemon: Daemon) -> None:
    """Each token is its own network read: the proxy does not collect the stream before sending it."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{daemon.url}/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True}
        ) as response,
    ):
        assert response.headers["Content-Type"].startswith("text/event-stream")
        arrivals: list[tuple[float, bytes]] = []
        async for chunk in response.content.iter_any():
            arrivals.append((time.monotonic(), chunk))
    body = b"".join(c for _, c in arrivals)
    assert body.rstrip().endswith(b"data: [DONE]")
    events = [line for line in body.split(b"\n") if line.startswith(b"data: {")]
    assert len(events) >= 200
    # The first event reached the client well before the last one was generated.
    assert len(arrivals) > 5
    assert arrivals[0][1].startswith(b"data: {")


async def test_streaming_through_the_openai_client(daemon: Daemon) -> None:
    stream = await daemon.openai().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert len(text.split()) >= 5


async def test_responses_api_passes_through(daemon: Daemon) -> None:
    client = daemon.openai()
    response = await client.responses.create(model="demo", input="hi", max_output_tokens=5)
    assert response.status == "completed"
    assert response.output_text.strip()
    events = [
        event.type
        async for event in await client.responses.create(
            model="demo", input="hi", max_output_tokens=5, stream=True
        )
    ]
    assert events[0] == "response.created"
    assert events[-1] == "response.completed"
    assert events.count("response.output_text.delta") >= 3


async def test_models_lists_every_model_and_alias_with_its_state(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"aliases": ["tiny", "demo:small"]}, "other": {}})
    await daemon.chat("demo")
    page = await daemon.openai().models.list()
    listed = {m.id: m.model_extra or {} for m in page.data}
    assert set(listed) == {"demo", "tiny", "demo:small", "other"}
    assert listed["demo"]["state"] == "ready"
    assert listed["tiny"]["state"] == "ready"
    assert listed["tiny"]["alias_of"] == "demo"
    assert listed["other"]["state"] == "unloaded"


async def test_health_reports_slots_and_gpu_leases(daemon: Daemon) -> None:
    await daemon.chat()
    status, body = await daemon.get("/health")
    assert status == 200
    assert body["status"] == "ok"
    assert body["models"]["demo"]["state"] == "ready"
    assert body["gpus"][0]["leases"] == {next(iter(body["gpus"][0]["leases"])): 512}


async def test_metrics_expose_requests_slots_and_leases(daemon: Daemon) -> None:
    await daemon.chat()
    assert daemon.http is not None
    async with daemon.http.get(f"{daemon.url}/metrics") as response:
        text = await response.text()
    assert 'llm_supervisor_requests_total{model="demo",status="200"} 1.0' in text
    assert 'llm_supervisor_slot_state{model="demo",replica="0",state="ready"} 1.0' in text
    assert 'llm_supervisor_gpu_leased_mib{gpu="0"} 512.0' in text
    assert 'llm_supervisor_model_loads_total{model="demo",result="ok"} 1.0' in text


# --- errors, each in OpenAI's error body -------------------------------------------------------------


async def test_unknown_model_is_404_model_not_found(daemon: Daemon) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await daemon.chat("no-such-model")
    assert caught.value.code == "model_not_found"
    assert "no-such-model" in caught.value.message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": []}', "'model' is required"),
        (b'{"model": 7}', "'model' is required"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
async def test_malformed_requests_are_400(daemon: Daemon, raw: bytes, message: str) -> None:
    status, body, _ = await daemon.post("/v1/chat/completions", raw=raw)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]


async def test_bad_keep_alive_is_400(daemon: Daemon) -> None:
    status, body, _ = await daemon.post("/v1/chat/completions", {**CHAT, "keep_alive": "soon"})
    assert status == 400
    assert "keep_alive" in body["error"]["message"]


async def test_body_too_large_is_413(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"max_body_mib": 1})
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    status, body, _ = await daemon.post("/v1/chat/completions", huge)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"


async def test_a_body_declared_too_large_is_413_before_it_is_sent_on_every_route(
    make_daemon: MakeDaemon,
) -> None:
    """On /v1 the front answered a declared Content-Length past max_body_mib at once; on /api (aiohttp's)
    only once it had read max_body_mib of it, and a client that waits for an answer before sending its
    body (as some do without Expect) got nothing for client_timeout_s."""
    daemon = await make_daemon(config={"max_body_mib": 1})
    for path in ("/v1/chat/completions", "/api/chat"):
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        try:
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (path.encode(), 70 << 20)
            )
            status_line = await asyncio.wait_for(reader.readline(), 10)  # no body byte sent
        finally:
            writer.close()
        assert b" 413 " in status_line, (path, status_line)


async def test_unknown_route_is_404_in_openai_format(daemon: Daemon) -> None:
    status, body = await daemon.get("/v1/nothing-here")
    assert status == 404
    assert body["error"]["code"] == "not_found"


async def test_queue_full_is_503_with_retry_after(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"max_queue": 0})
    status, body, headers = await daemon.post("/v1/chat/completions", CHAT)
    assert (status, body["error"]["code"]) == (503, "queue_full")
    assert int(headers["Retry-After"]) > 0


async def test_queue_deadline_is_503_with_retry_after(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=TAKING_TURNS["models"], config=TAKING_TURNS["config"])
    stream = await daemon.start_stream("a")  # loaded under the default deadline: a busy machine is slow
    daemon.write_config(queue_timeout_s=0.5)
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="the shorter deadline")
    status, body, headers = await daemon.post("/v1/chat/completions", {**CHAT, "model": "b"})
    assert (status, body["error"]["code"]) == (503, "queue_timeout")
    assert int(headers["Retry-After"]) > 0
    await stream.close()


async def test_model_larger_than_any_gpu_is_503_insufficient_vram(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"vram_mib": 99999}})
    status, body, _ = await daemon.post("/v1/chat/completions", CHAT)
    assert (status, body["error"]["code"]) == (503, "insufficient_vram")
    assert "99999 MiB" in body["error"]["message"]


async def test_garbage_from_many_clients_never_hurts_the_daemon(daemon: Daemon) -> None:
    assert daemon.http is not None
    junk: list[bytes] = [
        b"",
        b"null",
        b"{}",
        b'{"model": null}',
        b'{"model": ""}',
        b"\x00" * 100,
        json.dumps({"model": "demo", "keep_alive": [1]}).encode(),
        json.dumps({"model": "x" * 10000}).encode(),
    ]
    results = await asyncio.gather(*(daemon.post("/v1/chat/completions", raw=j) for j in junk))
    assert all(400 <= status < 500 for status, _, _ in results)
    assert (await daemon.chat()).strip()
    await eventually(lambda: daemon.proc is not None and daemon.proc.returncode is None)
