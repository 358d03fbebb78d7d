"""Capabilities through the real daemon: a request that needs what its model lacks is a 400 on both APIs
before anything loads, and /api/show and the admin document report the same list.

One daemon serves the module: the demo model as it is (it completes and chats; its template names
neither tools nor thinking, and llama-server runs it without a projector or --embeddings), the same
weights as an embedder, an embedding-only model by its manifest's word, and one whose manifest declares
tools and thinking. The refusals come first, while nothing has loaded.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest
import pytest_asyncio
from PIL import Image

from tests.integration.conftest import DEMO
from tests.integration.harness import Daemon

pytestmark = [pytest.mark.asyncio(loop_scope="module")]


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = _png()
HI = [{"role": "user", "content": "hello"}]
TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}
IMAGE_MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is it"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        ],
    }
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("capabilities-daemon"), {})
    demo = {"model": str(demo_gguf), **DEMO, "vram_mib": 256}
    daemon.write_manifest("demo", **demo)
    daemon.write_manifest("embedder", **demo, args=["--embeddings", "--pooling", "mean"])
    daemon.write_manifest(
        "encoder", **demo, args=["--embeddings", "--pooling", "mean"], capabilities=["embedding"]
    )
    daemon.write_manifest("declared", **demo, capabilities=["completion", "chat", "tools", "thinking"])
    await daemon.start()
    yield daemon
    leftovers = await daemon.close()
    assert not leftovers, f"engine processes outlived their daemon: {leftovers}"


async def _nothing_loaded(daemon: Daemon) -> None:
    status, running = await daemon.get("/api/ps")
    assert status == 200
    assert running["models"] == []
    for name in ("demo", "embedder", "encoder", "declared"):
        status, document = await daemon.get(f"/v1/admin/models/{name}")
        assert status == 200
        assert document["state"] == "unloaded", name
    assert daemon.children() == []


OPENAI_REFUSALS: list[tuple[str, str, dict[str, Any], str]] = [
    ("/v1/chat/completions", "demo", {"messages": IMAGE_MESSAGES}, "modality_unsupported"),
    ("/v1/chat/completions", "demo", {"messages": HI, "tools": [TOOL]}, "tools_unsupported"),
    ("/v1/chat/completions", "demo", {"messages": HI, "reasoning_effort": "high"}, "thinking_unsupported"),
    (
        "/v1/chat/completions",
        "demo",
        {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}},
        "thinking_unsupported",
    ),
    ("/v1/embeddings", "demo", {"input": "hello"}, "embedding_unsupported"),
    ("/v1/chat/completions", "encoder", {"messages": HI}, "completion_unsupported"),
    ("/v1/completions", "encoder", {"prompt": "hello"}, "completion_unsupported"),
]


@pytest.mark.parametrize(("path", "model", "body", "code"), OPENAI_REFUSALS)
async def test_an_openai_request_needing_what_the_model_lacks_is_a_400_before_any_load(
    daemon: Daemon, path: str, model: str, body: dict[str, Any], code: str
) -> None:
    status, answer, _ = await daemon.post(path, {"model": model, "max_tokens": 2, **body})
    assert status == 400, answer
    assert answer["error"]["code"] == code
    assert answer["error"]["type"] == "invalid_request_error"
    assert f"model '{model}'" in answer["error"]["message"]
    await _nothing_loaded(daemon)


async def test_the_openai_client_sees_the_code(daemon: Daemon) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await daemon.openai().chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "weather?"}],
            tools=[TOOL],  # type: ignore[list-item]
        )
    assert raised.value.code == "tools_unsupported"
    assert "does not support tools" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        await daemon.openai().embeddings.create(model="demo", input="hello")
    assert raised.value.code == "embedding_unsupported"
    assert "--embeddings" in raised.value.message  # what the operator would add
    await _nothing_loaded(daemon)


OLLAMA_REFUSALS: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "/api/chat",
        "demo",
        {"messages": [{"role": "user", "content": "what is it", "images": [PNG]}]},
        "messages[0].images: model 'demo' does not take images",
    ),
    (
        "/api/generate",
        "demo",
        {"prompt": "what is it", "images": [PNG]},
        "images: model 'demo' does not take",
    ),
    ("/api/chat", "demo", {"messages": HI, "tools": [TOOL]}, "tools: model 'demo' does not support tools"),
    ("/api/chat", "demo", {"messages": HI, "think": True}, "think: model 'demo' does not support thinking"),
    ("/api/generate", "demo", {"prompt": "hi", "think": "high"}, "does not support thinking"),
    ("/api/embed", "demo", {"input": "hello"}, "/api/embed: model 'demo' does not serve embeddings"),
    ("/api/embeddings", "demo", {"prompt": "hello"}, "does not serve embeddings"),
    ("/api/generate", "encoder", {"prompt": "hello"}, "model 'encoder' does not generate text"),
    ("/api/chat", "encoder", {"messages": HI}, "does not generate text"),
]


@pytest.mark.parametrize(("path", "model", "body", "words"), OLLAMA_REFUSALS)
async def test_an_ollama_request_needing_what_the_model_lacks_is_a_400_before_any_load(
    daemon: Daemon, path: str, model: str, body: dict[str, Any], words: str
) -> None:
    status, answer, _ = await daemon.post(path, {"model": model, "stream": False, **body})
    assert status == 400, answer
    assert list(answer) == ["error"]
    assert words in answer["error"]
    await _nothing_loaded(daemon)


async def test_the_ollama_client_sees_the_refusal(daemon: Daemon) -> None:
    client = ollama.AsyncClient(host=daemon.url, timeout=60)
    with pytest.raises(ollama.ResponseError) as raised:
        await client.chat(model="demo", messages=HI, think=True)
    assert raised.value.status_code == 400
    assert "does not support thinking" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        await client.embed(model="demo", input="hello")
    assert raised.value.status_code == 400
    await _nothing_loaded(daemon)


async def test_show_and_the_admin_document_report_the_same_list(daemon: Daemon) -> None:
    expected = {
        "demo": ["completion", "chat"],
        "embedder": ["completion", "chat", "embedding"],
        "encoder": ["embedding"],
        "declared": ["completion", "chat", "tools", "thinking"],
    }
    client = ollama.AsyncClient(host=daemon.url, timeout=60)
    for name, capabilities in expected.items():
        assert (await client.show(name)).capabilities == capabilities
        status, document = await daemon.get(f"/v1/admin/models/{name}")
        assert status == 200
        assert document["capabilities"] == capabilities
    await _nothing_loaded(daemon)


async def test_what_a_model_can_do_is_served(daemon: Daemon) -> None:
    # The manifest's list wins: llama-server takes tools and the thinking switch with any template.
    status, answer, _ = await daemon.post(
        "/v1/chat/completions", {"model": "declared", "messages": HI, "tools": [TOOL], "max_tokens": 2}
    )
    assert status == 200, answer
    client = ollama.AsyncClient(host=daemon.url, timeout=60)
    reply = await client.chat(model="declared", messages=HI, think=True, options={"num_predict": 2})
    assert reply.done
    result = await client.embed(model="embedder", input="hello")
    assert len(result.embeddings[0]) > 0
    # An embedding-only model still loads and unloads through Ollama's empty requests.
    loaded = await client.generate(model="encoder", prompt="")
    assert loaded.done_reason == "load"
    unloaded = await client.generate(model="encoder", prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload"
