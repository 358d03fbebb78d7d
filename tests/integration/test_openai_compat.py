"""What a review of the OpenAI API with the real `openai` SDK found (an app, LangChain or a browser page
pointed at the daemon instead of OpenAI), against a real daemon and real llama-server children."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from typing import Any

import openai
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon
from tests.integration.test_dataplane import ECHOING_VLLM
from tests.integration.test_streams_aiohttp_side import _body, _post, _read_to_eof

EMBED: dict[str, Any] = {"args": ["--embeddings", "--pooling", "mean"], "ctx_size": 512}


@pytest.fixture
async def served(make_daemon: MakeDaemon) -> Daemon:
    return await make_daemon(
        models={"demo": {"max_output_tokens": 5, "aliases": ["chat"]}, "demo-embed": EMBED}
    )


async def test_the_responses_api_obeys_max_output_tokens(served: Daemon) -> None:
    """`max_output_tokens`, the Responses API's own field, was not capped: 500 asked, 500 generated on
    a model limited to 5, where a chat was capped."""
    response = await served.openai().responses.create(model="demo", input="hello", max_output_tokens=500)
    assert response.usage is not None
    assert response.usage.output_tokens <= 5
    plain = await served.openai().responses.create(model="demo", input="hello")  # none asked: the cap
    assert plain.usage is not None
    assert plain.usage.output_tokens <= 5


async def test_models_retrieve_finds_a_model_and_an_alias(served: Daemon) -> None:
    """`client.models.retrieve` (GET /v1/models/{id}) was a 404 "no route"."""
    client = served.openai()
    model = await client.models.retrieve("demo")
    assert (model.id, model.object, model.owned_by) == ("demo", "model", "llm-supervisor")
    alias = await client.models.retrieve("chat")
    assert alias.id == "chat"
    assert alias.model_extra is not None
    assert alias.model_extra["alias_of"] == "demo"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("nothing-here")
    assert missing.value.code == "model_not_found"


async def test_refusals_the_engine_answers_500_reach_the_client_as_400(served: Daemon) -> None:
    """llama-server answers an input to embed longer than its batch, and audio to a model without it, as
    500 server_error: the SDK retried each twice and reported a server fault for the client's mistake."""
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.embeddings.create(model="demo-embed", input="hello " * 2000)
    assert too_long.value.code == "context_length_exceeded"
    assert "too large to process" in too_long.value.message
    audio = [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    with pytest.raises(openai.BadRequestError) as no_audio:
        await client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": audio}],  # type: ignore[list-item,misc]
        )
    assert no_audio.value.code == "modality_unsupported"
    assert not served.events("handler_error")


async def test_a_long_user_picks_a_session_instead_of_a_400(served: Daemon) -> None:
    """`user` is only a hint for which replica serves: an id over 200 characters (a JWT subject, a
    chain of ids) was refused, with a message about X-Session-Id, a header the app never sent."""
    completion = await served.openai().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="u" * 500
    )
    assert completion.choices


async def test_a_preflight_allows_the_headers_an_sdk_adds(served: Daemon) -> None:
    """The OpenAI JS SDK sends x-stainless-* and OpenAI-Organization; the preflight's fixed list left
    them out, and a browser refused every request from an allowed page."""
    assert served.http is not None
    asked = "authorization, content-type, x-stainless-os, x-stainless-lang, openai-organization, bad header"
    headers = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked,
    }
    async with served.http.options(served.url + "/v1/chat/completions", headers=headers) as answer:
        assert answer.status == 204
        allowed = {h.strip().lower() for h in answer.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "x-stainless-os", "x-stainless-lang", "openai-organization"} <= allowed
    assert "bad header" not in allowed  # not a header name: not echoed


async def test_embeddings_are_shortened_to_the_dimensions_asked(served: Daemon) -> None:
    """llama-server ignores `dimensions`, so an app that sized its vector column by it got the model's
    whole vector (as /api/embed already did not: it shortens them, as Ollama does)."""
    client = served.openai()
    full = (await client.embeddings.create(model="demo-embed", input="hello")).data[0].embedding
    assert len(full) > 8
    short = (
        (await client.embeddings.create(model="demo-embed", input="hello", dimensions=8)).data[0].embedding
    )
    norm = math.sqrt(sum(v * v for v in full[:8]))
    assert short == pytest.approx([v / norm for v in full[:8]], abs=1e-6)
    assert sum(v * v for v in short) == pytest.approx(1.0)
    # base64 (what the SDK asks for by default when numpy is there): little-endian float32s.
    assert served.http is not None
    body = {"model": "demo-embed", "input": "hello", "dimensions": 8, "encoding_format": "base64"}
    async with served.http.post(served.url + "/v1/embeddings", json=body) as answer:
        encoded = (await answer.json())["data"][0]["embedding"]
    values = struct.unpack("<8f", base64.b64decode(encoded))
    assert list(values) == pytest.approx(short, abs=1e-6)
    # 8.0 is JSON's 8 too (the schemathesis test sent 1.0, and the compiled relay, typed int, gave a 500).
    async with served.http.post(served.url + "/v1/embeddings", json={**body, "dimensions": 8.0}) as answer:
        assert answer.status == 200, await answer.text()
        assert (await answer.json())["data"][0]["embedding"] == encoded


async def post_as_http_1_0(daemon: Daemon, path: str, fields: dict[str, Any]) -> tuple[bytes, bytes]:
    """The head and body of the answer to a POST of `fields` from an HTTP/1.0 client, which aiohttp's
    relay (proxy.forward) serves, not the front."""
    body = json.dumps(fields).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(
        b"POST %s HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), len(body), body)
    )
    answer = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head, payload


async def test_an_http_1_0_clients_embeddings_are_shortened_too(served: Daemon) -> None:
    """HTTP/1.0 clients are served by aiohttp's relay (proxy.forward), not the front."""
    fields = {"model": "demo-embed", "input": "hello", "dimensions": 8}
    head, payload = await post_as_http_1_0(served, "/v1/embeddings", fields)
    assert b" 200 " in head.split(b"\r\n")[0], head[:100]
    assert len(json.loads(payload)["data"][0]["embedding"]) == 8


HI: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_an_integral_float_max_tokens_is_kept_under_the_models_cap(served: Daemon, field: str) -> None:
    """`3.0` passes the field check (JSON does not tell it from 3), but the cap took anything not an int
    for "no limit" and put its own 5 in its place."""
    status, answer, _ = await served.post(
        "/v1/chat/completions", {"model": "demo", "messages": HI, field: 3.0}
    )
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] <= 3


async def test_a_prompt_too_long_for_the_context_is_openais_context_length_exceeded(served: Daemon) -> None:
    """llama-server's own 400 came as it is: an integer code, a type OpenAI does not have, no param."""
    with pytest.raises(openai.BadRequestError) as too_long:
        await served.openai().chat.completions.create(
            model="demo-embed", messages=[{"role": "user", "content": "hello " * 2000}], max_tokens=2
        )
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.type == "invalid_request_error"
    assert isinstance(too_long.value.body, dict)
    assert set(too_long.value.body) >= {"message", "type", "param", "code", "n_ctx", "n_prompt_tokens"}
    assert "context" in too_long.value.body["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "sometimes"},
        {"response_format": {"type": "xml"}},
        {"logprobs": False, "top_logprobs": 2},
    ],
    ids=["tool_choice", "response_format", "top_logprobs"],
)
async def test_an_engines_own_refusal_comes_in_openais_error_shape(
    served: Daemon, extra: dict[str, Any]
) -> None:
    status, answer, _ = await served.post(
        "/v1/chat/completions", {"model": "demo", "messages": HI, "max_tokens": 2, **extra}
    )
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["code"]) == ("invalid_request_error", "engine_error"), error
    assert error["message"]


@pytest.mark.parametrize("value", ["x", None, 5, ["deepseek"]])
async def test_a_bad_reasoning_format_is_a_400_not_the_engines_500(served: Daemon, value: object) -> None:
    """llama-server answers an unknown or mistyped `reasoning_format` with a 500, which clients retry."""
    status, answer, _ = await served.post(
        "/v1/chat/completions", {"model": "demo", "messages": HI, "max_tokens": 2, "reasoning_format": value}
    )
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error", answer


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": -5}, "max_tokens"),
        # llama-server took 0 and generated one token: OpenAI and vLLM refuse it.
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0.0}, "max_completion_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
async def test_a_refused_field_is_named_in_param(served: Daemon, body: dict[str, Any], param: str) -> None:
    """It was named only in the message; `param` is where OpenAI's SDKs and UIs look."""
    status, answer, _ = await served.post("/v1/chat/completions", {"model": "demo", "messages": HI, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


async def test_a_compressed_body_is_refused_as_the_clients_error(served: Daemon) -> None:
    """The 415's type was server_error: a status the table lacked fell back to it."""
    assert served.http is not None
    body = json.dumps({"model": "demo", "messages": HI, "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with served.http.post(served.url + "/v1/chat/completions", data=body, headers=headers) as answer:
        assert answer.status == 415
        error = (await answer.json())["error"]
    assert (error["code"], error["type"]) == ("unsupported_content_encoding", "invalid_request_error")


async def test_an_answer_the_daemon_changed_has_its_own_length_over_http_1_0(served: Daemon) -> None:
    """aiohttp's relay (HTTP/1.0 clients) sent the child's Content-Length over a body the daemon changed
    (an engine's refusal in OpenAI's shape, shortened embeddings): a client read the wrong number of
    bytes."""
    for path, fields in [
        ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user"}], "max_tokens": 2}),
        ("/v1/embeddings", {"model": "demo-embed", "input": ["hi"] * 3, "dimensions": 8}),
    ]:
        head, payload = await post_as_http_1_0(served, path, fields)
        [length] = [
            line.split(b":")[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        assert int(length) == len(payload), head
        json.loads(payload)


async def test_the_engines_refusal_of_an_image_is_the_same_400_as_on_the_openai_routes(
    make_daemon: MakeDaemon,
) -> None:
    """A model declared `vision` without a projector: llama-server refuses the image with a 500. The
    OpenAI routes answer it as the client's mistake (400 modality_unsupported); the Ollama routes made it
    a 502, which clients retry."""
    import base64
    import io

    from PIL import Image

    picture = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(picture, "PNG")
    image = base64.b64encode(picture.getvalue()).decode()
    daemon = await make_daemon(models={"sighted": {"capabilities": ["completion", "chat", "vision"]}})
    parts = [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
    ]
    status, answer, _ = await daemon.post(
        "/v1/chat/completions",
        {"model": "sighted", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]},
    )
    assert (status, answer["error"]["code"]) == (400, "modality_unsupported")
    for path, body in (
        ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": [image]}]}),
        ("/api/generate", {"prompt": "hi", "images": [f"data:image/png;base64,{image}"]}),
    ):
        status, answer, _ = await daemon.post(path, {"model": "sighted", "stream": False, **body})
        assert (status, "image input is not supported" in answer["error"]) == (400, True), (path, answer)
    assert [e["error"] for e in daemon.events("request") if e["path"] == "/api/chat"] == [
        "modality_unsupported"
    ]


async def test_dimensions_apply_to_an_embeddings_answer_over_1_mib(served: Daemon) -> None:
    """An answer past 1 MiB was streamed as the engine sent it, its vectors at full length: 900 of the
    demo's 64 values pass it (a 1024-dimension model's do at about 50 inputs)."""
    big = await served.openai().embeddings.create(
        model="demo-embed", input=["hi"] * 900, dimensions=8, encoding_format="float"
    )
    assert len(big.data) == 900
    assert {len(item.embedding) for item in big.data} == {8}
    assert math.isclose(sum(v * v for v in big.data[0].embedding), 1.0, rel_tol=1e-6)
    # The same through aiohttp's relay (HTTP/1.0 clients), in base64.
    fields = {"model": "demo-embed", "input": ["hi"] * 900, "dimensions": 8, "encoding_format": "base64"}
    head, payload = await post_as_http_1_0(served, "/v1/embeddings", fields)
    assert b" 200 " in head.split(b"\r\n")[0], head[:100]
    vectors = [base64.b64decode(item["embedding"]) for item in json.loads(payload)["data"]]
    assert {len(vector) for vector in vectors} == {8 * 4}


async def test_json_mode_constrains_a_llama_server_answer(served: Daemon) -> None:
    """OpenAI's JSON mode (`response_format: {"type": "json_object"}`) answered free text on
    llama-server, which builds a grammar only from a schema: it gets the schema of any object."""
    client = served.openai()
    for attempt in range(3):
        completion = await client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"answer in JSON {attempt}"}],
            max_tokens=5,
            response_format={"type": "json_object"},
        )
        content = completion.choices[0].message.content or ""
        assert content.lstrip().startswith("{"), f"JSON mode answered free text: {content!r}"


async def test_n_probs_is_held_to_the_logprobs_limit(served: Daemon) -> None:
    """llama-server's `n_probs` asks for what `top_logprobs` does, whose limit (20) it went around: the
    demo's whole vocabulary (555 entries) came back for every token, megabytes for a real model."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer, _ = await served.post("/v1/chat/completions", {**body, "n_probs": 100000})
    assert status == 400, answer
    assert (answer["error"]["param"], answer["error"]["type"]) == ("n_probs", "invalid_request_error")
    status, answer, _ = await served.post("/v1/chat/completions", {**body, "n_probs": 3})
    assert status == 200, answer


@pytest.mark.parametrize(
    ("manifest", "requested", "served_name"),
    [
        ({"aliases": ["vllm-alias"]}, "vllm-alias", "salted"),
        ({}, "SALTED", "salted"),
        ({}, "salted:latest", "salted"),
        ({"served_model_name": "Qwen/Qwen2.5-7B"}, "salted", "Qwen/Qwen2.5-7B"),
    ],
    ids=["alias", "case", "latest", "served_model_name"],
)
async def test_a_vllm_model_is_sent_the_name_it_serves(
    make_daemon: MakeDaemon, manifest: dict[str, Any], requested: str, served_name: str
) -> None:
    """vLLM answers 404 to a `model` other than its --served-model-name. The body went on with the name
    the client used, so an alias, another case, `:latest`, and with a `served_model_name` every name a
    client can use, failed on vLLM models (the Ollama routes sent the served name). The stand-in vLLM
    (bench/stand_in_engine.py --echo-body) answers with the body it was sent."""
    daemon = await make_daemon(models={}, start=False)
    daemon.write_manifest("salted", **ECHOING_VLLM, **manifest)
    await daemon.start()
    chat = {"model": requested, "messages": [{"role": "user", "content": "hi"}]}
    status, answer, _ = await daemon.post("/v1/chat/completions", chat)
    assert status == 200, answer
    assert json.loads(answer["choices"][0]["message"]["content"])["model"] == served_name


async def test_a_responses_stream_cut_by_request_timeout_ends_with_a_responses_error_event(
    make_daemon: MakeDaemon,
) -> None:
    """A /v1/responses stream is typed events, and the Responses API ends a failed one with `event: error`
    and data of `type` error. At request_timeout_s (or a crash) it ended with the Chat Completions shape:
    an unnamed `data: {"error": ...}`, which a client dispatching on `type` ignores."""
    daemon = await make_daemon(models={"demo": {"request_timeout_s": 1.0, "ctx_size": 8192, "parallel": 1}})
    body = {"model": "demo", "input": "hi", "max_output_tokens": 6000, "stream": True}
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(_post("/v1/responses", body, "1.1", "Connection: close\r\n"))
    data, ended = await _read_to_eof(reader, 30)
    writer.close()
    assert ended
    assert b"response.output_text.delta" in data  # llama-server streams the Responses API
    last = [block for block in _body(data).split(b"\n\n") if b"data: " in block][-1].decode()
    assert last.startswith("event: error\n"), last
    error = json.loads(last.split("data: ", 1)[1])
    assert (error["type"], error["code"]) == ("error", "request_timeout")


async def test_dimensions_beyond_the_models_vectors_are_refused(served: Daemon) -> None:
    """`dimensions: 1000` of a model whose vectors have 64 values answered 200 with 64: a client that
    sized its storage by the request learned it on insert. OpenAI and vLLM answer 400."""
    for encoding in ("float", "base64"):
        body = {"model": "demo-embed", "input": "hi", "dimensions": 1000, "encoding_format": encoding}
        status, answer, _ = await served.post("/v1/embeddings", body)
        assert status == 400, answer
        assert answer["error"]["param"] == "dimensions"
        assert "64 values" in answer["error"]["message"]
    body = {"model": "demo-embed", "input": "hi", "dimensions": 64}
    status, answer, _ = await served.post("/v1/embeddings", body)
    assert (status, len(answer["data"][0]["embedding"])) == (200, 64)
