"""Ollama's inference API (/api/chat, /api/generate, /api/embed, /api/embeddings) through the real daemon.

One daemon serves the whole module, with real llama-server children, and the real `ollama` client talks
to it. Tests that unload or crash a model run last, in file order.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import pytest
import pytest_asyncio

from tests.integration.conftest import DEMO
from tests.integration.harness import Daemon, eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

HI = [{"role": "user", "content": "hello"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


ALTERNATING_TEMPLATE = """\
{%- for message in messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
<|{{ message['role'] }}|>{{ message['content'] }}
{% endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("ollama-daemon"), {})
    # 4 slots of 512 tokens. Its template names neither tools nor thinking, which llama-server takes
    # anyway: the manifest says so, or such requests would be refused (see test_capabilities.py).
    daemon.write_manifest(
        "demo",
        **{"model": str(demo_gguf), **DEMO},
        capabilities=["completion", "chat", "tools", "thinking"],
    )
    daemon.write_manifest(
        "demo-embed",
        model=str(demo_gguf),
        ctx_size=512,
        vram_mib=256,
        args=["--embeddings", "--pooling", "mean"],
    )
    # One slot with room for a long answer: for the disconnect and crash tests.
    daemon.write_manifest("long", **{"model": str(demo_gguf), **DEMO, "ctx_size": 4096, "parallel": 1})
    # A chat template that wants the turns to alternate from the user's, as Gemma's and Mistral's do.
    template = daemon.root / "alternating.jinja"
    template.write_text(ALTERNATING_TEMPLATE)
    daemon.write_manifest(
        "alternating", **{"model": str(demo_gguf), **DEMO}, args=["--chat-template-file", str(template)]
    )
    await daemon.start()
    yield daemon
    leftovers = await daemon.close()
    assert not leftovers, f"engine processes outlived their daemon: {leftovers}"


@pytest.fixture
def client(daemon: Daemon) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=daemon.url, timeout=60)


async def test_chat_streams_one_ndjson_line_per_token(daemon: Daemon) -> None:
    body = {"model": "demo", "messages": HI, "options": {"num_predict": 6}}
    assert daemon.http is not None
    async with daemon.http.post(f"{daemon.url}/api/chat", json=body) as response:
        assert response.status == 200
        assert response.content_type == "application/x-ndjson"
        lines = [json.loads(line) async for line in response.content if line.strip()]
    *tokens, final = lines
    assert all(not line["done"] and line["message"]["role"] == "assistant" for line in tokens)
    assert "".join(line["message"]["content"] for line in tokens).strip()
    assert final["done"] is True
    assert final["done_reason"] == "length"
    assert final["eval_count"] == len(tokens) == 6
    assert final["prompt_eval_count"] > 0
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int)
    assert final["total_duration"] >= final["eval_duration"] > 0


async def test_chat_with_the_ollama_client_streaming_and_not(client: ollama.AsyncClient) -> None:
    parts = [
        part
        async for part in await client.chat(
            model="demo", messages=HI, stream=True, options={"num_predict": 4}
        )
    ]
    assert parts[-1].done
    assert "".join(p.message.content or "" for p in parts).strip()

    whole = await client.chat(model="demo:latest", messages=HI, stream=False, options={"num_predict": 5})
    assert whole.done
    assert whole.model == "demo:latest"
    assert whole.message.role == "assistant"
    assert (whole.message.content or "").strip()
    assert whole.eval_count == 5
    assert whole.done_reason == "length"


async def test_a_continued_assistant_message_is_answered_with_the_continuation_alone(
    client: ollama.AsyncClient, daemon: Daemon
) -> None:
    """A chat whose last message is the assistant's ("continue this answer"): Ollama answers what the
    model adds to it. llama-server's answer repeats the message's text first, and the route passed it on:
    a client appending the answer showed the text twice (a review helper)."""
    prefill = "Once upon a time"
    messages = [{"role": "user", "content": "Write a story"}, {"role": "assistant", "content": prefill}]
    whole = await client.chat(model="demo", messages=messages, stream=False, options={"num_predict": 3})
    assert not (whole.message.content or "").startswith(prefill), whole.message.content
    parts = [
        part.message.content or ""
        async for part in await client.chat(
            model="demo", messages=messages, stream=True, options={"num_predict": 3}
        )
    ]
    assert not "".join(parts).startswith(prefill), parts
    # The engine did repeat it: the raw OpenAI route passes llama-server's answer on as it is.
    completion = await daemon.openai().chat.completions.create(
        model="demo",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
    )
    assert (completion.choices[0].message.content or "").startswith(prefill)


async def test_generate_through_the_chat_template_and_raw(client: ollama.AsyncClient) -> None:
    parts = [
        part
        async for part in await client.generate(
            model="demo", prompt="Once upon", system="Tell stories.", stream=True, options={"num_predict": 3}
        )
    ]
    assert parts[-1].done
    assert "".join(p.response or "" for p in parts).strip()

    raw = await client.generate(model="demo", prompt="Once upon a time", raw=True, options={"num_predict": 4})
    assert (raw.response or "").strip()
    assert raw.eval_count == 4
    # The raw prompt reaches the engine as it is: far fewer tokens than with a chat template around it.
    templated = await client.generate(model="demo", prompt="Once upon a time", options={"num_predict": 1})
    assert raw.prompt_eval_count is not None
    assert templated.prompt_eval_count is not None
    assert raw.prompt_eval_count < templated.prompt_eval_count


async def test_options_reach_the_engine(client: ollama.AsyncClient) -> None:
    options = {
        "num_predict": 7,
        "temperature": 0,
        "seed": 1,
        "top_k": 1,
        "top_p": 1,
        "min_p": 0,
        "num_ctx": 512,
    }
    first = await client.chat(model="demo", messages=HI, options=options)
    second = await client.chat(model="demo", messages=HI, options={**options, "repeat_penalty": 1.0})
    assert first.eval_count == 7
    assert first.message.content == second.message.content  # greedy: the same words twice


async def test_think_is_accepted(client: ollama.AsyncClient) -> None:
    # The demo model has no reasoning: the switch reaches its chat template, and no thinking comes back.
    for think in (True, False):
        answer = await client.chat(model="demo", messages=HI, think=think, options={"num_predict": 2})
        assert answer.eval_count == 2
        assert not answer.message.thinking


async def test_format_json_gives_parseable_json(client: ollama.AsyncClient) -> None:
    formats: list[Any] = ["json", {}]  # {}: any JSON value (it was free text)
    for json_format in formats:
        answer = await client.chat(model="demo", messages=HI, format=json_format, options={"num_predict": 60})
        assert isinstance(json.loads(answer.message.content or ""), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    generated = await client.generate(
        model="demo", prompt="a number", format=schema, options={"num_predict": 60}
    )
    assert isinstance(json.loads(generated.response or "")["n"], int)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "bogus"},
        # A keyword of the wrong type: other words of llama-server's (a review helper found them).
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}},
    ],
    ids=["bad-type", "mistyped-keyword"],
)
async def test_a_format_schema_the_engine_cannot_use_is_refused_naming_format(
    daemon: Daemon, schema: dict[str, Any]
) -> None:
    """llama-server's words blamed a chat template, or a `json_schema` field the client never sent."""
    for path, body in (
        ("/api/chat", {"model": "demo", "messages": HI, "stream": False}),
        ("/api/generate", {"model": "demo", "prompt": "hi", "stream": False}),
        ("/api/generate", {"model": "demo", "prompt": "hi", "raw": True, "stream": False}),
    ):
        status, answer, _ = await daemon.post(path, {**body, "format": schema})
        assert status == 400, answer
        assert answer["error"].startswith("format: "), (path, answer)


async def test_a_request_with_tools_and_earlier_tool_calls_is_accepted(client: ollama.AsyncClient) -> None:
    messages: list[dict[str, Any]] = [
        *HI,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"},
    ]
    answer = await client.chat(
        model="demo", messages=messages, tools=[WEATHER_TOOL], options={"num_predict": 4}
    )
    assert answer.done
    assert answer.message.content is not None


async def test_embed_and_legacy_embeddings(daemon: Daemon, client: ollama.AsyncClient) -> None:
    result = await client.embed(model="demo-embed", input=["the first text", "second"])
    assert len(result.embeddings) == 2
    assert len(result.embeddings[0]) == len(result.embeddings[1]) > 0
    assert result.prompt_eval_count
    single = await client.embed(model="demo-embed", input="the first text")
    assert single.embeddings[0] == pytest.approx(result.embeddings[0], abs=1e-4)
    # The legacy route gives the vector as the model makes it, as Ollama's does; /api/embed normalizes.
    legacy = await client.embeddings(model="demo-embed", prompt="the first text")
    norm = math.sqrt(sum(v * v for v in legacy.embedding))
    assert abs(norm - 1.0) > 0.01
    assert [v / norm for v in legacy.embedding] == pytest.approx(result.embeddings[0], abs=1e-4)
    # Ollama's legacy route has no `dimensions` (it ignores it, as any unknown field): it was applied,
    # rescaling the vector as /api/embed does.
    status, same, _ = await daemon.post(
        "/api/embeddings", {"model": "demo-embed", "prompt": "the first text", "dimensions": 4}
    )
    assert status == 200
    assert same["embedding"] == pytest.approx(legacy.embedding, abs=1e-4)
    # An input longer than the engine embeds at once (512 tokens here) is cut to fit, as Ollama cuts it;
    # with truncate: false it is refused in Ollama's words (a 400: it was a 502 with the engine's advice).
    long = "word " * 2000
    cut = await client.embed(model="demo-embed", input=["the first text", long])
    assert len(cut.embeddings) == 2
    assert cut.embeddings[0] == pytest.approx(result.embeddings[0], abs=1e-4)
    assert cut.prompt_eval_count is not None
    assert single.prompt_eval_count is not None
    assert 400 < cut.prompt_eval_count - single.prompt_eval_count <= 512  # the long one cut to fit
    status, body, _ = await daemon.post(
        "/api/embed", {"model": "demo-embed", "input": long, "truncate": False}
    )
    assert status == 400
    assert body["error"].startswith("input exceeds maximum context length: an input of ")
    assert "model 'demo-embed' embeds at most 512 tokens at once" in body["error"]
    # `dimensions` shortens each vector, which stays unit length (llama-server ignores the field).
    (short,) = (await client.embed(model="demo-embed", input="the first text", dimensions=8)).embeddings
    assert len(short) == 8 < len(single.embeddings[0])
    assert sum(v * v for v in short) == pytest.approx(1.0, abs=1e-4)
    # Written as 8.0, JSON's 8 too: it reached the slicing as a float, a 500 (schemathesis found it).
    status, body, _ = await daemon.post(
        "/api/embed", {"model": "demo-embed", "input": "x", "dimensions": 8.0}
    )
    assert (status, len(body["embeddings"][0])) == (200, 8)


async def test_a_chat_longer_than_the_context_loses_its_oldest_messages(
    daemon: Daemon, client: ollama.AsyncClient
) -> None:
    """As Ollama does: the system prompt and the latest messages that fit the context (512 tokens per
    slot here, less room for the answer) are sent, where llama-server refused the whole chat. With
    `truncate: false` it is refused, and so are a last message that cannot fit alone and a prompt too
    long (which are cut otherwise: the next test)."""
    turn = "the cat sat on the mat and looked at the dog " * 12  # about 130 tokens of the demo model
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for _ in range(4):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": turn}]
    messages.append({"role": "user", "content": "hello"})
    before = len(daemon.events("chat_truncated"))  # the module's daemon: other tests cut chats too
    answer = await client.chat(model="demo", messages=messages, options={"num_predict": 2})
    assert answer.done
    [cut] = daemon.events("chat_truncated")[before:]
    assert (cut["n_ctx"], cut["budget"]) == (512, 510)  # num_predict 2 is the room left for the answer
    assert 0 < cut["dropped"] < len(messages) - 1
    assert answer.prompt_eval_count is not None
    assert answer.prompt_eval_count <= 510

    # Refused in the daemon's words: where the limit comes from and what to change (llama-server's
    # "try increasing it" named nothing a client can change), on /api/generate too.
    for path, refused in (
        ("/api/chat", {"messages": messages}),
        ("/api/chat", {"messages": [{"role": "user", "content": turn * 5}]}),
        ("/api/generate", {"prompt": turn * 5}),
        ("/api/generate", {"prompt": turn * 5, "raw": True}),
    ):
        status, body, _ = await daemon.post(
            path, {"model": "demo", "stream": False, "truncate": False, **refused}
        )
        assert status == 400
        expected = " tokens) is longer than the 512 tokens of context a request to model 'demo' gets ("
        assert expected in body["error"]
        assert "ctx_size 2048 shared by parallel 4 slots" in body["error"]
        assert body["error"].endswith("raise ctx_size (or lower parallel) in the model's manifest")
    for path, asked in (("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "x"})):
        status, body, _ = await daemon.post(path, {"model": "demo", "truncate": "yes", **asked})
        assert (status, body) == (400, {"error": 'truncate: must be true or false, not "yes"'})


async def test_a_long_chat_is_cut_to_a_run_its_template_takes(daemon: Daemon) -> None:
    """The cut could begin at the assistant's reply, which a template that wants the turns to alternate
    from the user's refuses: the request failed with the engine's template error, where the last user's
    message alone fits."""
    short = [{"role": "user", "content": "and now?"}]
    words = "hello world " * 150  # about 300 tokens: two of them overflow the 512 a request gets
    chat = [{"role": "user", "content": words}, {"role": "assistant", "content": words}, *short]
    body = {"model": "alternating", "messages": chat, "stream": False, "options": {"num_predict": 2}}
    status, answer, _ = await daemon.post("/api/chat", body)
    assert status == 200, answer
    assert answer["done"] is True
    assert answer["prompt_eval_count"] < 512


async def test_a_prompt_longer_than_the_context_loses_its_start(daemon: Daemon) -> None:
    """As Ollama's runner cuts a prompt too long for the context, where llama-server refused it: a last
    message or an /api/generate prompt keeps its end (the system prompt whole), a raw prompt its first
    few tokens and its end. The answer follows from the end: here, the question asked last."""
    long = "the cat sat on the mat and looked at the dog " * 60 + "what did the cat do"  # ~660 tokens
    system = {"role": "system", "content": "be brief"}
    for path, asked, event in (
        ("/api/chat", {"messages": [system, {"role": "user", "content": long}]}, "chat_truncated"),
        ("/api/generate", {"prompt": long, "system": "be brief"}, "chat_truncated"),
        ("/api/generate", {"prompt": long}, "chat_truncated"),
        ("/api/generate", {"prompt": long, "raw": True}, "prompt_truncated"),
    ):
        status, body, _ = await daemon.post(
            path, {"model": "demo", "stream": False, "options": {"num_predict": 2}, **asked}
        )
        assert status == 200, (path, asked, body)
        assert body["done"]
        assert 0 < body["prompt_eval_count"] <= 510, (path, asked)  # 512 less num_predict's 2
        cut = daemon.events(event)[-1]
        assert (cut["n_ctx"], cut["budget"]) == (512, 510)
        assert cut.get("last_message_cut", True)  # chat_truncated: the last message lost its start
    # A last message's text is cut, the system prompt is not: too long itself, it is still refused.
    too_long_system = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "hi"}]}
    status, body, _ = await daemon.post("/api/chat", {"model": "demo", "stream": False, **too_long_system})
    assert status == 400
    assert "is longer than the 512 tokens of context" in body["error"]


async def test_unknown_model_is_a_404_in_ollama_shape(daemon: Daemon, client: ollama.AsyncClient) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        await client.chat(model="no-such-model", messages=HI)
    assert raised.value.status_code == 404
    assert "no-such-model" in raised.value.error
    status, body, _ = await daemon.post("/api/generate", {"model": "no-such-model", "prompt": "x"})
    assert (status, list(body)) == (404, ["error"])


@pytest.mark.parametrize(
    ("path", "raw", "message"),
    [
        ("/api/chat", b"{not json", "not valid JSON"),
        ("/api/chat", b'{"messages": []}', "'model' is required"),
        (
            "/api/generate",
            b'{"model": "demo", "prompt": "x", "template": "{{ .Prompt }}"}',
            "custom template",
        ),
        ("/api/chat", b'{"model": "demo", "messages": [], "keep_alive": "soon"}', "keep_alive"),
        ("/api/embed", b'{"model": "demo-embed", "input": [1, 2]}', "input[0]: must be"),
    ],
)
async def test_bad_requests_are_a_400_in_ollama_shape(
    daemon: Daemon, path: str, raw: bytes, message: str
) -> None:
    status, body, _ = await daemon.post(path, raw=raw)
    assert status == 400
    assert list(body) == ["error"]
    assert message in body["error"]


async def test_a_refused_scheduling_field_is_counted_under_the_model_named(daemon: Daemon) -> None:
    """A keep_alive or x_priority refusal was logged and counted under "(unresolved)", though the
    request named a model here (as the OpenAI routes count it)."""
    for field in ({"keep_alive": "soon"}, {"x_priority": "high"}):
        status, _, headers = await daemon.post("/api/chat", {"model": "demo", "messages": HI, **field})
        assert status == 400
        request_id = headers["X-Request-Id"]
        await eventually(lambda: bool(daemon.events("request", request_id=request_id)))  # noqa: B023
        assert daemon.events("request", request_id=request_id)[0]["model"] == "demo"


async def test_num_ctx_above_the_running_context_is_refused(
    daemon: Daemon, client: ollama.AsyncClient
) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        await client.chat(model="demo", messages=HI, options={"num_ctx": 4096})
    assert raised.value.status_code == 400
    assert "ctx_size 2048 shared by parallel 4 slots" in raised.value.error
    assert "at most 512 tokens" in raised.value.error
    # A load request with the same options is refused alike (it answered 200 "load").
    loads: list[tuple[str, dict[str, Any]]] = [("/api/generate", {}), ("/api/chat", {"messages": []})]
    for path, body in loads:
        status, answer, _ = await daemon.post(path, {"model": "demo", "options": {"num_ctx": 4096}, **body})
        assert status == 400
        assert "at most 512 tokens" in answer["error"]


async def test_an_engine_error_comes_back_with_its_message(client: ollama.AsyncClient) -> None:
    # A grammar llama-server cannot build from the format: it refuses the request with a 400 of its own.
    with pytest.raises(ollama.ResponseError) as raised:
        await client.generate(
            model="demo", prompt="x", format={"type": "no-such-type"}, options={"num_predict": 2}
        )
    assert raised.value.status_code == 400
    assert "format: the engine cannot hold the answer to this JSON schema" in raised.value.error


async def test_keep_alive_zero_with_nothing_to_do_unloads(daemon: Daemon, client: ollama.AsyncClient) -> None:
    await client.chat(model="demo", messages=HI, options={"num_predict": 1})
    assert await daemon.state("demo") == "ready"
    answer = await client.chat(model="demo", messages=[], keep_alive=0)
    assert answer.done_reason == "unload"
    await daemon.wait_state("demo", "unloaded")
    generated = await client.generate(model="demo-embed", prompt="", keep_alive=0)
    assert generated.done_reason == "unload"
    await daemon.wait_state("demo-embed", "unloaded")


async def test_empty_messages_load_the_model(daemon: Daemon, client: ollama.AsyncClient) -> None:
    assert await daemon.state("demo") == "unloaded"
    answer = await client.chat(model="demo", messages=[])
    assert answer.done_reason == "load"
    assert answer.message.content == ""
    assert answer.load_duration is not None
    assert answer.load_duration > 0
    assert await daemon.state("demo") == "ready"
    generated = await client.generate(model="demo", prompt="")
    assert generated.done_reason == "load"
    assert generated.load_duration == 0  # already loaded


async def test_a_load_request_for_a_busy_model_is_answered_at_once(daemon: Daemon) -> None:
    """The model "long" serves one request at a time and is answering a long one. A load request (no messages,
    empty prompt) for it is answered at once, as on Ollama: it waited for the free slot."""
    async with aiohttp.ClientSession() as session:
        streaming = await session.post(
            f"{daemon.url}/api/chat", json={"model": "long", "messages": HI, "options": {"num_predict": 3000}}
        )
        assert json.loads(await streaming.content.readline())["done"] is False
        for path, body in (
            ("/api/chat", {"messages": []}),
            ("/api/generate", {"keep_alive": "10m"}),
        ):
            async with asyncio.timeout(5):
                status, answer, _ = await daemon.post(path, {"model": "long", **body})
            assert status == 200, answer
            assert answer["load_duration"] == 0
        assert (await daemon.health())["models"]["long"]["inflight"] == 1  # the answer still going
        streaming.close()


async def test_keep_alive_zero_with_a_chat_unloads_after_the_answer(
    daemon: Daemon, client: ollama.AsyncClient
) -> None:
    answer = await client.chat(model="demo", messages=HI, keep_alive=0, options={"num_predict": 2})
    assert answer.eval_count == 2
    await daemon.wait_state("demo", "unloaded")


async def test_client_disconnect_mid_stream_frees_the_model(daemon: Daemon) -> None:
    body = {"model": "long", "messages": HI, "options": {"num_predict": 3000}}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{daemon.url}/api/chat", json=body)
        assert json.loads(await response.content.readline())["done"] is False
        assert (await daemon.health())["models"]["long"]["inflight"] == 1
        response.close()  # the client goes away mid-stream

    async def freed() -> bool:
        return bool((await daemon.health())["models"]["long"]["inflight"] == 0)

    await eventually(freed, what="the ticket to be released")
    await eventually(
        lambda: any("cancel task" in e["line"] for e in daemon.events("child_output", model="long")),
        what="llama-server to cancel the generation",
    )
    # A client going away is not the model crashing, and not a daemon error.
    assert not daemon.events("upstream_cut", model="long")
    assert not daemon.events("handler_error")


async def test_a_child_that_dies_mid_stream_ends_the_stream_with_an_error(
    daemon: Daemon, client: ollama.AsyncClient
) -> None:
    stream = await client.chat(model="long", messages=HI, stream=True, options={"num_predict": 3000})
    first = await anext(aiter(stream))
    assert first.done is False
    os.kill((await daemon.health())["models"]["long"]["pid"], signal.SIGKILL)
    with pytest.raises(ollama.ResponseError) as raised:
        async for _ in stream:
            pass
    assert "stopped while serving" in raised.value.error


async def test_an_unload_asked_while_busy_happens_after_the_queued_requests_too(daemon: Daemon) -> None:
    # "long" serves one request at a time: one streams, one waits its turn, then keep_alive 0 arrives.
    async with aiohttp.ClientSession() as session:
        streaming = await session.post(
            f"{daemon.url}/api/chat", json={"model": "long", "messages": HI, "options": {"num_predict": 3000}}
        )
        assert json.loads(await streaming.content.readline())["done"] is False
        queued = asyncio.create_task(
            session.post(
                f"{daemon.url}/api/chat",
                json={"model": "long", "messages": HI, "stream": False, "options": {"num_predict": 4}},
            )
        )

        async def waiting() -> bool:
            return bool((await daemon.health())["models"]["long"].get("queued") == 1)

        await eventually(waiting, what="the second request to queue")
        status, body, _ = await daemon.post("/api/generate", {"model": "long", "keep_alive": 0})
        assert (status, body["done_reason"]) == (200, "unload")
        streaming.close()
        answer = await queued
        assert (await answer.json())["done"] is True
    # The queued request brought the default keep_alive with it; the unload still happens after it.
    await daemon.wait_state("long", "unloaded")
