"""Per-manifest limits on what one request may cost: output tokens and generation time, on both APIs."""

from __future__ import annotations

import base64
import json
from typing import Any

import aiohttp

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually

HI = [{"role": "user", "content": "hi"}]


async def test_max_output_tokens_caps_and_fills_in_the_limit(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"max_output_tokens": 3}})
    async with daemon.openai() as client:
        for extra in ({"max_tokens": 200}, {}, {"max_completion_tokens": 200}):
            completion = await client.chat.completions.create(
                model="demo",
                messages=HI,
                **extra,  # type: ignore[call-overload]
            )
            assert completion.usage is not None
            assert completion.usage.completion_tokens <= 3, extra
    status, body, _ = await daemon.post(
        "/api/generate", {"model": "demo", "prompt": "hi", "stream": False, "options": {"num_predict": 200}}
    )
    assert status == 200
    assert body["eval_count"] <= 3


async def _wait_idle(daemon: Daemon) -> None:
    """Until the engine has let go of the cancelled generation: a one-token request is answered."""

    async def answered() -> bool:
        one = {"model": "demo", "messages": HI, "max_tokens": 1}
        return (await daemon.post("/v1/chat/completions", one))[0] == 200

    await eventually(answered, 20, "the timed-out generation to end")


async def test_request_timeout_ends_a_long_generation_on_both_apis(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"request_timeout_s": 1.0, "ctx_size": 8192, "parallel": 1}})
    long = {"model": "demo", "messages": HI, "max_tokens": 6000}
    status, body, _ = await daemon.post("/v1/chat/completions", long)
    assert status == 504
    assert body["error"]["code"] == "request_timeout"
    await _wait_idle(daemon)

    events = await _stream_lines(daemon, "/v1/chat/completions", {**long, "stream": True})
    assert events[-1].startswith("data: ")
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "request_timeout"
    await _wait_idle(daemon)

    lines = await _stream_lines(
        daemon, "/api/chat", {"model": "demo", "messages": HI, "options": {"num_predict": 6000}}
    )
    assert "request_timeout_s" in json.loads(lines[-1])["error"]
    await _wait_idle(daemon)
    assert daemon.events("handler_error") == []


async def _stream_lines(daemon: Daemon, path: str, body: dict[str, Any]) -> list[str]:
    async with aiohttp.ClientSession() as session, session.post(daemon.url + path, json=body) as response:
        assert response.status == 200
        text = (await response.read()).decode()
    return [line for line in text.splitlines() if line.strip()]


_PNG_1PX = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360f8cfc0f01f0005000201a5f2b3a00000000049454e44ae426082"
    )
).decode()


async def test_ollama_images_are_bounded_checked_and_need_a_vision_model(daemon: Daemon) -> None:
    def chat(images: list[str]) -> dict[str, Any]:
        return {"model": "demo", "messages": [{"role": "user", "content": "what is it", "images": images}]}

    status, body, _ = await daemon.post("/api/chat", chat([_PNG_1PX] * 9))
    assert status == 400
    assert "max_images" in body["error"]
    status, body, _ = await daemon.post("/api/chat", chat([base64.b64encode(b"not a picture").decode()]))
    assert status == 400
    assert "messages[0].images[0]" in body["error"]
    status, body, _ = await daemon.post("/api/chat", chat([_PNG_1PX]))
    assert status == 400  # a valid picture, but the demo model has no vision projector
    assert "does not take images" in body["error"]
    assert await daemon.state("demo") == "unloaded"
