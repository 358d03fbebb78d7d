"""Ollama <-> OpenAI translation: requests one way, SSE events to NDJSON lines and statistics the other."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import embedding_dimensions
from supervisor import ollama_translate as t
from supervisor.embedding_dimensions import vectors_in_order
from supervisor.manifests import LlamaServerManifest, VllmManifest

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\x00" * 40).decode()
WEBP = base64.b64encode(b"RIFF\x00\x00\x00\x00WEBPVP8 " + b"\x00" * 40).decode()

# Fields the property test mixes: the ones the translation reads, with values of every JSON type.
FIELDS = ["prompt", "system", "raw", "images", "format", "think", "tools", "input", "dimensions", "truncate"]
MESSAGE_FIELDS = ["role", "content", "images", "tool_calls", "thinking", "tool_name"]
OPTIONS = ["temperature", "seed", "num_ctx", "num_predict", "stop", "top_k", "mirostat", "use_mmap", "x"]
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["json", "high", "user", "assistant", "tool", PNG]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def llama(**fields: Any) -> LlamaServerManifest:
    return LlamaServerManifest(name="demo", engine="llama-server", model=Path("/m.gguf"), **fields)


def vllm(**fields: Any) -> VllmManifest:
    return VllmManifest(name="qwen", engine="vllm", model="org/qwen", **fields)


# --- requests ----------------------------------------------------------------------------------------


def test_options_map_to_openai_fields_and_engine_extras() -> None:
    options = {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "num_predict": 12,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "num_ctx": 512,
        "num_gpu": 99,  # not something a request can change: ignored, as Ollama does
    }
    assert t.options_to_openai(options, "llama-server") == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "max_tokens": 12,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    on_vllm = t.options_to_openai(options, "vllm")
    assert on_vllm["repetition_penalty"] == 1.1
    assert "repeat_penalty" not in on_vllm
    assert "num_ctx" not in on_vllm


def test_num_predict_unlimited_is_left_to_the_engine() -> None:
    assert t.options_to_openai({"num_predict": -1}, "llama-server") == {}
    assert t.options_to_openai({"num_predict": -2}, "llama-server") == {}


def test_a_single_stop_string_becomes_a_list() -> None:
    assert t.options_to_openai({"stop": "END"}, "vllm") == {"stop": ["END"]}


@pytest.mark.parametrize(
    "options", [{"temperature": "hot"}, {"seed": 1.5}, {"stop": [1]}, {"num_predict": True}, "not an object"]
)
def test_bad_options_are_refused_with_the_option_named(options: Any) -> None:
    with pytest.raises(t.TranslationError):
        t.options_to_openai(options, "llama-server")


def test_num_ctx_limit_is_per_slot_when_llama_server_splits_its_context() -> None:
    manifest = llama(ctx_size=2048, parallel=4)
    assert t.context_limit(manifest) == (
        512,
        "llama-server was started with ctx_size 2048 shared by parallel 4 slots, "
        "so one request can use at most 512 tokens",
    )
    t.check_num_ctx({"num_ctx": 512}, manifest)
    with pytest.raises(t.TranslationError, match=r"num_ctx 513 .* at most 512 tokens"):
        t.check_num_ctx({"num_ctx": 513}, manifest)


def test_num_ctx_limit_is_the_whole_context_with_a_unified_cache() -> None:
    assert t.context_limit(llama(ctx_size=4096))[0] == 4096  # type: ignore[index]
    assert t.context_limit(llama(ctx_size=4096, parallel=4, args=["--kv-unified"]))[0] == 4096  # type: ignore[index]


def test_num_ctx_limit_on_vllm_is_max_model_len_and_unknown_is_accepted() -> None:
    with pytest.raises(t.TranslationError, match="max_model_len 8192"):
        t.check_num_ctx({"num_ctx": 16384}, vllm(max_model_len=8192))
    t.check_num_ctx({"num_ctx": 1_000_000}, llama())  # no ctx_size: the model's own, which we do not know
    t.check_num_ctx({"num_ctx": 1_000_000}, vllm())


def test_format_json_is_a_grammar_llama_server_enforces() -> None:
    assert t.format_to_openai("json", "vllm") == {"response_format": {"type": "json_object"}}
    schema = {"type": "object"}
    wrapped = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    }
    assert t.format_to_openai("json", "llama-server") == wrapped
    assert t.format_to_openai("json", "llama-server", completions=True) == {"json_schema": schema}
    # The empty schema (any JSON value) likewise: llama-server took it for no constraint at all.
    assert t.format_to_openai({}, "llama-server") == wrapped
    assert t.format_to_openai({}, "llama-server", completions=True) == {"json_schema": schema}
    assert t.format_to_openai({}, "vllm") == {"response_format": {"type": "json_object"}}


def test_format_schema_becomes_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert t.format_to_openai(schema, "vllm")["response_format"]["json_schema"]["schema"] == schema
    assert t.format_to_openai("", "vllm") == {}
    with pytest.raises(t.TranslationError):
        t.format_to_openai("yaml", "vllm")


@pytest.mark.parametrize(("image", "mime"), [(PNG, "image/png"), (JPEG, "image/jpeg"), (WEBP, "image/webp")])
def test_images_become_data_urls_typed_by_their_magic_bytes(image: str, mime: str) -> None:
    assert t.image_data_url(image) == f"data:{mime};base64,{image}"


def test_unknown_or_broken_images_are_refused() -> None:
    with pytest.raises(t.TranslationError, match="PNG, JPEG"):
        t.image_data_url(base64.b64encode(b"just some text here").decode())
    with pytest.raises(t.TranslationError, match="base64"):
        t.image_data_url("!!!not base64!!!")


def test_generate_takes_a_data_url_image_as_chat_does() -> None:
    """/api/generate's field check read the `data:image/png;base64,` prefix as base64: a 400 for an image
    /api/chat takes."""
    url = f"data:image/png;base64,{PNG}"
    t.check_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi", "images": [url]}]})
    t.check_request("generate", {"model": "m", "prompt": "hi", "images": [url]})
    manifest = LlamaServerManifest(name="m", engine="llama-server", model=Path("/m.gguf"))
    _, body = t.generate_request({"model": "m", "prompt": "hi", "images": [url]}, manifest)
    assert body["messages"][-1]["content"][-1]["image_url"]["url"] == url


def test_chat_request_with_images_tools_and_earlier_tool_calls() -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    body = {
        "model": "demo:latest",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is this?", "images": [PNG]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
            },
            {"role": "tool", "content": "12 C", "tool_name": "weather"},
        ],
        "tools": tools,
        "options": {"num_predict": 5},
        "stream": False,
    }
    out = t.chat_request(body, llama(ctx_size=2048))
    assert out["model"] == "demo"
    assert out["stream"] is True  # the engine always streams; the route assembles "stream": false
    assert out["stream_options"] == {"include_usage": True}
    assert out["max_tokens"] == 5
    assert out["tools"] == tools
    system, user, assistant, tool = out["messages"]
    assert system == {"role": "system", "content": "be brief"}
    assert user["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
    ]
    call = assistant["tool_calls"][0]
    assert call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert tool == {"role": "tool", "content": "12 C", "tool_call_id": call["id"]}


def test_tool_answers_are_matched_to_their_calls_by_name_then_order() -> None:
    messages = [
        {
            "role": "assistant",
            "tool_calls": [
                {"function": {"name": "a", "arguments": {}}},
                {"function": {"name": "b", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "from b", "tool_name": "b"},
        {"role": "tool", "content": "from a"},
    ]
    out = t.messages_to_openai(messages)
    ids = [c["id"] for c in out[0]["tool_calls"]]
    assert [out[1]["tool_call_id"], out[2]["tool_call_id"]] == [ids[1], ids[0]]
    assert out[0]["content"] == ""


def test_a_tool_answer_that_names_its_call_by_id_keeps_it() -> None:
    """LangChain's ChatOllama sends a tool answer with `tool_call_id` and no `tool_name`: with two calls
    of one function answered out of order, each answer stays with the call it names."""
    messages = [
        {"role": "user", "content": "weather in Oslo and Rome"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_oslo", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                {"id": "call_rome", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "25 degrees", "tool_call_id": "call_rome"},
        {"role": "tool", "content": "12 degrees", "tool_call_id": "call_oslo"},
    ]
    out = t.messages_to_openai(messages)
    assert [m["tool_call_id"] for m in out[2:]] == ["call_rome", "call_oslo"]


def test_vllm_gets_its_served_name() -> None:
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
    assert t.chat_request(body, vllm(served_model_name="Qwen/Qwen2.5"))["model"] == "Qwen/Qwen2.5"


def test_think_maps_to_the_chat_template_switch() -> None:
    body: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "think": False}
    assert t.chat_request(body, llama())["chat_template_kwargs"] == {"enable_thinking": False}
    body["think"] = "high"
    assert t.chat_request(body, llama())["reasoning_effort"] == "high"


def test_generate_goes_through_the_chat_template_unless_raw() -> None:
    path, out = t.generate_request({"model": "demo", "prompt": "hi", "system": "be kind"}, llama())
    assert path == "/v1/chat/completions"
    assert out["messages"] == [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}]
    path, out = t.generate_request(
        {"model": "demo", "prompt": "[INST] hi", "raw": True, "format": "json"}, llama()
    )
    assert path == "/v1/completions"
    assert out["prompt"] == "[INST] hi"
    assert "messages" not in out
    assert out["json_schema"] == {"type": "object"}
    # A system prompt has nowhere to go in a raw prompt: refused, as Ollama refuses it, not dropped.
    with pytest.raises(t.TranslationError, match="raw mode does not support"):
        t.generate_request({"model": "demo", "prompt": "hi", "raw": True, "system": "be kind"}, llama())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("template", "{{ .Prompt }}", "custom template"),
        ("suffix", "end", "suffix"),
        ("context", [1, 2], "context"),
    ],
)
def test_generate_refuses_what_it_cannot_honour(field: str, value: Any, message: str) -> None:
    with pytest.raises(t.TranslationError, match=message):
        t.generate_request({"model": "demo", "prompt": "hi", field: value}, llama())


def test_embed_inputs() -> None:
    assert t.embed_inputs({"input": "a"}, legacy=False) == ["a"]
    assert t.embed_inputs({"input": ["a", "b"]}, legacy=False) == ["a", "b"]
    assert t.embed_inputs({"input": []}, legacy=False) == []
    assert t.embed_inputs({"prompt": "a"}, legacy=True) == ["a"]
    with pytest.raises(t.TranslationError):
        t.embed_inputs({"input": [1]}, legacy=False)
    assert t.embed_request({"dimensions": 8}, ["a"], llama()) == {"model": "demo", "input": ["a"]}


def test_api_embed_dimensions_are_cut_here_not_sent_to_vllm() -> None:
    """The route cuts and normalizes the vectors itself, for any model, as Ollama does; `dimensions` was
    sent on too, and vLLM refuses it for every model not trained for Matryoshka (bge-m3, e5, ...): 400
    'does not support matryoshka representation' (vLLM's docs, Matryoshka Embeddings)."""
    assert t.embed_request({"input": "x", "dimensions": 256}, ["x"], vllm()) == {
        "model": "qwen",
        "input": ["x"],
    }
    with pytest.raises(t.TranslationError, match="dimensions"):
        t.embed_request({"input": "x", "dimensions": 0}, ["x"], vllm())


@pytest.mark.parametrize(
    ("fields", "per_request"),
    [
        ({"args": ["-c", "1024", "-np", "2"]}, 512),
        # `args` come after the field's --ctx-size in argv: llama-server takes the last one.
        ({"ctx_size": 8192, "parallel": 2, "args": ["--ctx-size", "1024"]}, 512),
        ({"env": {"LLAMA_ARG_CTX_SIZE": "1024"}, "parallel": 2}, 512),
        ({"ctx_size": 1024, "env": {"LLAMA_ARG_N_PARALLEL": "2"}}, 512),
    ],
    ids=["flags", "flag-after-field", "context-variable", "slots-variable"],
)
def test_the_context_a_request_gets_follows_the_flags_llama_server_is_started_with(
    fields: dict[str, Any], per_request: int
) -> None:
    """context_limit read only the `ctx_size` and `parallel` fields: with `-c 1024 -np 2` in `args`,
    /api/show said num_ctx 4096 (the trained length), /api/ps context_length 4096, and num_ctx 4096 was
    accepted for a child whose requests get 512 tokens."""
    manifest = llama(**fields)
    assert (t.context_limit(manifest) or (None,))[0] == per_request
    with pytest.raises(t.TranslationError):
        t.check_num_ctx({"num_ctx": 4096}, manifest)


def test_a_base_models_prompt_goes_as_it_is() -> None:
    """A model without a chat template has Ollama's default one, `{{ .Prompt }}`; the prompt went to
    /v1/chat/completions, and llama-server wrapped it in chatml, which a base model continues."""
    body = {"model": "demo", "prompt": "hello", "system": "be brief", "options": {"num_predict": 3}}
    path, sent = t.generate_request(body, llama(), templated=False)
    assert (path, sent["prompt"], "messages" in sent) == ("/v1/completions", "hello", False)
    with pytest.raises(t.TranslationError, match="images: need the chat template: model 'demo' has none"):
        t.generate_request({**body, "images": [base64.b64encode(b"x").decode()]}, llama(), templated=False)


def test_a_tools_null_fields_are_dropped() -> None:
    """Ollama reads a null `description` (a function without a docstring) as ""; llama-server refused
    the request: 400 'Failed to parse tools: ... type must be string, but is null'."""
    parameters = {"type": "object", "properties": {"zone": {"type": "string", "description": None}}}
    tool = {"function": {"name": "now", "description": None, "parameters": parameters}}
    assert t.tools_to_openai([tool]) == [
        {
            "type": "function",
            "function": {
                "name": "now",
                "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
            },
        }
    ]


# --- every field checked, and named when wrong ----------------------------------------------------------


def refused(call: Any, *args: Any) -> str:
    with pytest.raises(t.TranslationError) as caught:
        call(*args)
    return str(caught.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("not an object", "options: must be an object"),
        ({"temperature": "hot"}, "options.temperature: must be a number"),
        ({"top_p": [1]}, "options.top_p: must be a number"),
        ({"seed": 1.5}, "options.seed: must be an integer"),
        ({"seed": 2**64}, "options.seed: must be an integer from"),
        ({"num_ctx": 10**400}, "options.num_ctx: must be an integer from 0 to 2147483647"),
        ({"num_ctx": -1}, "options.num_ctx: must be an integer from 0"),
        ({"num_ctx": "4096"}, "options.num_ctx: must be a number"),
        ({"num_predict": True}, "options.num_predict: must be a number"),
        ({"num_predict": -3}, "options.num_predict: must be an integer from -2"),
        ({"num_predict": 1e300}, "options.num_predict: must be an integer from -2"),
        ({"mirostat": 3}, "options.mirostat: must be an integer from 0 to 2"),
        ({"top_k": -2}, "options.top_k: must be an integer from -1"),
        ({"num_gpu": 2**40}, "options.num_gpu: must be an integer"),
        ({"num_thread": "all"}, "options.num_thread: must be a number"),
        ({"use_mmap": "yes"}, "options.use_mmap: must be true or false"),
        ({"stop": 5}, "options.stop: must be a string or a list of strings"),
        ({"stop": ["a", 1]}, "options.stop[1]: must be a string"),
    ],
)
def test_a_bad_option_is_named_with_its_path(options: object, message: str) -> None:
    assert refused(t.options_to_openai, options, "llama-server").startswith(message)
    assert refused(t.check_request, "embed", {"options": options}).startswith(message)


def test_options_that_are_null_or_unknown_pass() -> None:
    assert t.options_to_openai({"temperature": None, "made_up": {"x": 1}}, "vllm") == {}


def test_an_integral_float_is_an_integer() -> None:
    assert t.options_to_openai({"num_predict": 12.0, "seed": 3.0}, "vllm") == {"max_tokens": 12, "seed": 3}
    assert t.num_ctx_of({"num_ctx": 512.0}) == 512


def test_a_huge_num_ctx_is_a_translation_error_not_an_overflow() -> None:
    assert "options.num_ctx" in refused(t.check_num_ctx, {"num_ctx": 10**400}, llama(ctx_size=2048))
    assert "options.num_ctx" in refused(t.num_ctx_of, {"num_ctx": 1e308})


PNG_MESSAGE = {"role": "user", "content": "hi", "images": [PNG]}


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ({"role": "user"}, "messages: must be a list"),
        (["hello"], "messages[0]: must be an object"),
        ([{"content": "hi"}], "messages[0].role: must be a string"),
        ([PNG_MESSAGE, {"role": "user", "content": 5}], "messages[1].content: must be a string"),
        ([PNG_MESSAGE, {"role": "user", "content": ["a"]}], "messages[1].content: must be a string"),
        ([{"role": "user", "images": PNG}], "messages[0].images: must be a list"),
        ([{"role": "user", "images": [PNG, "!!!"]}], "messages[0].images[1]: is not valid base64"),
        ([{"role": "user", "images": [PNG, 7]}], "messages[0].images[1]: must be a base64"),
        ([{"role": "user", "images": [base64.b64encode(b"text" * 9).decode()]}], "messages[0].images[0]: "),
        ([{"role": "assistant", "thinking": 1}], "messages[0].thinking: must be a string"),
        ([{"role": "tool", "tool_name": ["f"]}], "messages[0].tool_name: must be a string"),
        ([{"role": "assistant", "tool_calls": {"a": 1}}], "messages[0].tool_calls: must be a list"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
        (
            [{"role": "assistant", "tool_calls": ["f"]}],
            'messages[0].tool_calls[0]: must be an object with a "',
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
            "messages[0].tool_calls[0].function.arguments: must be an object or a JSON string",
        ),
    ],
)
def test_a_bad_message_is_named_with_its_path(messages: object, message: str) -> None:
    body = {"model": "demo", "messages": messages}
    assert refused(t.chat_request, body, llama()).startswith(message)
    assert refused(t.check_request, "chat", body).startswith(message)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": {"function": {}}}, "tools: must be a list"),
        ({"tools": [{"function": {"name": 3}}]}, "tools[0].function.name: must be a string"),
        ({"tools": [{"type": 3, "function": {"name": "f"}}]}, 'tools[0].type: must be "function"'),
        ({"format": 5}, 'format: must be "json" or a JSON schema'),
        ({"think": "max"}, "think: must be true, false"),
        ({"options": {"seed": "x"}}, "options.seed: must be a number"),
    ],
)
def test_other_chat_fields_are_named(body: dict[str, Any], message: str) -> None:
    full = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **body}
    assert refused(t.chat_request, full, llama()).startswith(message)
    assert refused(t.check_request, "chat", full).startswith(message)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": 5}, "prompt: must be a string"),
        ({"prompt": ["hi"]}, "prompt: must be a string"),
        ({"system": {"a": 1}}, "system: must be a string"),
        ({"raw": "yes"}, "raw: must be true or false"),
        ({"template": 1}, "template: must be a string"),
        ({"suffix": ["x"]}, "suffix: must be a string"),
        ({"context": "abc"}, "context: must be a list of token ids"),
        ({"images": PNG}, "images: must be a list"),
        ({"images": [PNG, "%%%"]}, "images[1]: is not valid base64"),
        ({"options": {"num_predict": 10**30}}, "options.num_predict: must be an integer"),
    ],
)
def test_bad_generate_fields_are_named(body: dict[str, Any], message: str) -> None:
    full = {"model": "demo", "prompt": "hi", **body}
    assert refused(t.generate_request, full, llama()).startswith(message)
    assert refused(t.check_request, "generate", full).startswith(message)


def test_a_falsy_value_of_the_wrong_type_is_refused_before_the_model_loads() -> None:
    # The route answers a body with nothing to generate by loading the model: check_request comes first.
    assert refused(t.check_request, "generate", {"model": "demo", "prompt": 0}).startswith("prompt:")
    assert refused(t.check_request, "chat", {"model": "demo", "messages": {}}).startswith("messages:")
    assert refused(t.check_request, "embed", {"model": "demo", "input": 0}).startswith("input:")
    t.check_request("chat", {"model": "demo"})
    t.check_request("generate", {"model": "demo", "prompt": "", "images": None})
    t.check_request("embed", {"model": "demo", "input": []})


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("embed", {"input": {"a": 1}}, "input: must be a string or a list of strings"),
        ("embed", {"input": ["a", 1]}, "input[1]: must be a string"),
        ("embed", {"input": "a", "truncate": "no"}, "truncate: must be true or false"),
        ("embed", {"input": "a", "dimensions": 0}, "dimensions: must be an integer from 1 to 65536"),
        ("embed", {"input": "a", "dimensions": 10**400}, "dimensions: must be an integer from 1"),
        ("embed", {"input": "a", "dimensions": "8"}, "dimensions: must be a number"),
        ("embeddings", {"prompt": ["a"]}, "prompt: must be a string"),
    ],
)
def test_bad_embed_fields_are_named(route: str, body: dict[str, Any], message: str) -> None:
    assert refused(t.check_request, route, {"model": "demo", **body}).startswith(message)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    route=st.sampled_from(["chat", "generate", "embed", "embeddings"]),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5),
    messages=st.lists(st.dictionaries(st.sampled_from(MESSAGE_FIELDS), JSON_VALUES, max_size=4), max_size=2),
    options=st.dictionaries(st.sampled_from(OPTIONS), JSON_VALUES, max_size=4),
)
def test_any_body_translates_or_is_a_translation_error(
    route: str, body: dict[str, Any], messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    body = {"model": "demo", "messages": messages, "options": options, **body}
    for manifest in (llama(ctx_size=2048, parallel=2), vllm(max_model_len=1024)):
        try:
            t.check_request(route, body)
            t.check_num_ctx(body.get("options"), manifest)
            if route == "chat":
                json.dumps(t.chat_request(body, manifest), allow_nan=False)
            elif route == "generate":
                json.dumps(t.generate_request(body, manifest), allow_nan=False)
            else:
                texts = t.embed_inputs(body, legacy=route == "embeddings")
                json.dumps(t.embed_request(body, texts, manifest), allow_nan=False)
        except t.TranslationError:
            pass


# --- answers -----------------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


TIMING = t.Timing(arrived=1_000, load=500, sent=2_000)


def test_sse_lines() -> None:
    assert t.sse_event(b'data: {"a": 1}\n') == {"a": 1}
    assert t.sse_event(b"data: [DONE]\n") is t.DONE
    assert t.sse_event(b"\n") is None
    assert t.sse_event(b": keep-alive\n") is None
    assert t.sse_event(b'data:   {"a": 2}  \n') == {"a": 2}


@pytest.mark.parametrize(
    "line",
    [
        b"data: \n",
        b'data: {"a"\n',
        b'data: {"a": 1} x\n',
        b'data: {"a": 1}{}\n',
        b"data: [1]\n",
        b"data: \xff\n",
    ],
)
def test_an_sse_line_that_is_not_one_json_object_is_skipped(line: bytes) -> None:
    assert t.sse_event(line) is None


@pytest.mark.parametrize(
    ("finish", "reason"), [("stop", "stop"), ("length", "length"), ("tool_calls", "stop"), (None, "stop")]
)
def test_done_reason(finish: str | None, reason: str) -> None:
    assert t.done_reason(finish) == reason


def test_streamed_chat_lines_and_the_final_statistics_from_llama_server_timings() -> None:
    answer = t.Answer("demo", "chat")
    assert answer.feed(chunk({"role": "assistant", "content": None}), 2_500) is None
    assert answer.feed(chunk({"content": " hello"}), 3_000) == (" hello", "")
    line = answer.chunk(" hello", "", 1_700_000_000_000_000_000)
    assert line == {
        "model": "demo",
        "created_at": "2023-11-14T22:13:20.000000Z",
        "message": {"role": "assistant", "content": " hello"},
        "done": False,
    }
    answer.feed(chunk({"content": " world"}), 4_000)
    answer.feed(chunk({}, "length"), 5_000)
    usage = {"prompt_tokens": 26, "completion_tokens": 2}
    answer.feed({"choices": [], "usage": usage, "timings": {"prompt_ms": 1.5, "predicted_ms": 0.25}}, 5_100)
    final = answer.final(TIMING, 6_000, 1_700_000_000_000_000_000, whole=False)
    assert final["done"] is True
    assert final["done_reason"] == "length"
    assert final["message"] == {"role": "assistant", "content": ""}
    assert {k: final[k] for k in final if k.endswith(("duration", "count"))} == {
        "total_duration": 5_000,
        "load_duration": 500,
        "prompt_eval_count": 26,
        "prompt_eval_duration": 1_500_000,
        "eval_count": 2,
        "eval_duration": 250_000,
    }


def test_the_prompt_count_without_usage_counts_what_the_cache_served() -> None:
    """As usage counts it: llama-server's prompt_n leaves out the cache_n tokens its cache served."""
    answer = t.Answer("qwen", "chat")
    answer.feed(chunk({"content": "a"}), 3_000)
    answer.feed({**chunk({}, "stop"), "timings": {"cache_n": 25, "prompt_n": 1, "predicted_n": 1}}, 4_000)
    assert answer.stats(TIMING, 5_000)["prompt_eval_count"] == 26


def test_durations_are_measured_when_the_engine_sends_no_timings() -> None:
    answer = t.Answer("qwen", "chat")
    answer.feed(chunk({"content": "a"}), 3_000)  # first token: 1 us after the request was sent
    answer.feed(chunk({"content": "b"}), 7_000)
    answer.feed(chunk({}, "stop"), 8_000)
    stats = answer.stats(TIMING, 9_000)
    assert stats["prompt_eval_duration"] == 1_000
    assert stats["eval_duration"] == 6_000
    assert stats["eval_count"] == 2  # no usage: one per content event
    assert stats["prompt_eval_count"] == 0


def test_whole_answer_carries_text_thinking_and_tool_calls() -> None:
    answer = t.Answer("demo", "chat")
    answer.feed(chunk({"reasoning_content": "hmm"}), 3_000)
    answer.feed(chunk({"content": "ok"}), 3_100)
    answer.feed(
        chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}]}),
        3_200,
    )
    answer.feed(chunk({}, "tool_calls"), 3_300)
    final = answer.final(TIMING, 4_000, 0, whole=True)
    assert final["message"] == {
        "role": "assistant",
        "content": "ok",
        "thinking": "hmm",
        "tool_calls": [{"id": "c1", "function": {"index": 0, "name": "f", "arguments": {"x": 1}}}],
    }
    assert final["done_reason"] == "stop"


def test_think_false_hides_reasoning() -> None:
    answer = t.Answer("demo", "chat", show_thinking=False)
    assert answer.feed(chunk({"reasoning_content": "hmm"}), 3_000) is None


def test_streamed_tool_call_fragments_are_accumulated_by_index() -> None:
    answer = t.Answer("demo", "chat")
    deltas = [
        [
            {
                "index": 0,
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ],
        [{"index": 0, "function": {"arguments": '{"ci'}}],
        [{"index": 1, "id": "call_b", "function": {"name": "get_time", "arguments": "{}"}}],
        [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}],
    ]
    for delta in deltas:
        assert answer.feed(chunk({"tool_calls": delta}), 3_000) is None  # nothing streamed until complete
    answer.feed(chunk({}, "tool_calls"), 3_500)
    line = answer.tool_chunk(0)
    assert line is not None
    assert line["message"]["tool_calls"] == [
        {"id": "call_a", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "call_b", "function": {"index": 1, "name": "get_time", "arguments": {}}},
    ]
    assert answer.final(TIMING, 4_000, 0, whole=False)["done_reason"] == "stop"


def test_tool_arguments_that_are_not_json_stay_visible() -> None:
    call = t.tool_call_to_ollama({"function": {"name": "f", "arguments": "{oops"}}, 0)
    assert call["function"]["arguments"] == {"value": "{oops"}


def test_generate_lines_use_response_and_raw_completion_text() -> None:
    answer = t.Answer("demo", "generate")
    assert answer.feed({"choices": [{"text": " once", "finish_reason": None}]}, 3_000) == (" once", "")
    assert answer.chunk(" once", "", 0)["response"] == " once"
    answer.feed({"choices": [{"text": "", "finish_reason": "stop"}]}, 3_100)
    final = answer.final(TIMING, 4_000, 0, whole=True)
    assert final["response"] == " once"
    assert "message" not in final


def test_an_error_event_mid_stream_is_reported() -> None:
    answer = t.Answer("demo", "chat")
    answer.feed({"error": {"message": "context exceeded", "code": 400}}, 3_000)
    assert answer.error == "context exceeded"


def test_engine_error_messages() -> None:
    assert t.engine_error_message({"error": {"message": "bad", "code": 400}}, "x") == "bad"
    assert t.engine_error_message({"error": "bad"}, "x") == "bad"
    assert t.engine_error_message({"detail": "bad"}, "x") == "bad"
    assert t.engine_error_message(None, "fallback") == "fallback"


def test_lifecycle_answers() -> None:
    line = t.lifecycle_answer("demo", "generate", "unload", 0, {"total_duration": 5})
    assert line == {
        "model": "demo",
        "created_at": "1970-01-01T00:00:00.000000Z",
        "response": "",
        "done": True,
        "done_reason": "unload",
        "total_duration": 5,
    }
    assert t.lifecycle_answer("demo", "chat", "load", 0, {})["message"] == {
        "role": "assistant",
        "content": "",
    }


async def _embed_answer(payload: dict[str, Any], legacy: bool, dimensions: int | None = None) -> Any:
    """Ollama's answer for an OpenAI embeddings answer, as the route builds it."""
    data = json.dumps(payload).encode()
    vectors = await vectors_in_order(data, dimensions)
    durations = {"total_duration": 10, "load_duration": 0}
    return json.loads(
        t.embed_answer("e", vectors, legacy, durations, payload.get("usage", {}).get("prompt_tokens"))
    )


async def test_embed_answer_keeps_input_order() -> None:
    payload = {
        "data": [{"index": 1, "embedding": [0.2]}, {"index": 0, "embedding": [0.1]}],
        "usage": {"prompt_tokens": 4},
    }
    assert await _embed_answer(payload, False) == {
        "model": "e",
        "embeddings": [[0.1], [0.2]],
        "total_duration": 10,
        "load_duration": 0,
        "prompt_eval_count": 4,
    }
    assert await _embed_answer(payload, True) == {"embedding": [0.1]}
    assert await _embed_answer({"data": []}, False) == {
        "model": "e",
        "embeddings": [],
        "total_duration": 10,
        "load_duration": 0,
        "prompt_eval_count": 0,
    }
    with pytest.raises(ValueError, match="no data"):
        await vectors_in_order(b'{"error": "no"}', None)


async def test_embed_answer_shortens_vectors_to_dimensions_and_keeps_them_unit_length() -> None:
    """llama-server ignores `dimensions`; Ollama cuts each vector and normalizes it again."""
    payload: dict[str, Any] = {
        "data": [{"index": 0, "embedding": [0.6, 0.0, 0.8, 0.0]}, {"index": 1, "embedding": [3.0]}]
    }
    shortened = (await _embed_answer(payload, False, dimensions=2))["embeddings"]
    assert shortened == [[1.0, 0.0], [3.0]]  # a vector already that short is left as it is
    assert (await _embed_answer(payload, False, dimensions=8))["embeddings"][0] == [0.6, 0.0, 0.8, 0.0]


async def test_a_large_answer_gives_the_event_loop_turns_while_it_is_translated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 40 MB answer, decoded and encoded whole on the event loop, held every other request for over a
    second. Vector by vector, each step gives the loop its turn (here, with no time allowed a step,
    after every vector)."""
    monkeypatch.setattr(embedding_dimensions, "_STEP_S", 0.0)
    payload = json.dumps({"data": [{"index": i, "embedding": [0.5] * 4} for i in range(50)]}).encode()
    turns = 0

    async def other_request() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_request())
    await asyncio.sleep(0)
    before = turns
    vectors = await vectors_in_order(payload, 2)
    other.cancel()
    assert len(vectors) == 50
    assert turns - before >= 40


@pytest.mark.parametrize("kind", ["chat", "generate"])
def test_spliced_lines_equal_dumped_lines(kind: t.Kind) -> None:
    answer = t.Answer('a "quoted" model', kind)
    for text, reasoning in ((' caf\u00e9 "x"\n', ""), ("", "thinking")):
        line = answer.chunk_line(text, reasoning, 1_700_000_000_123_456_789)
        assert line.endswith(b"\n")
        assert json.loads(line) == answer.chunk(text, reasoning, 1_700_000_000_123_456_789)
    assert answer.chunk("", "", 1_700_000_000_123_456_789)["created_at"] == "2023-11-14T22:13:20.123456Z"


def _delta(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


@pytest.mark.parametrize(
    ("pieces", "content"),
    [
        (["Once upon a time where", " then"], " where then"),  # glued to the first token, as llama-server
        (["Once up", "on a ", "time", " where"], " where"),  # arriving in pieces
        (["Twice", " more"], "Twice more"),  # not repeated after all: nothing dropped
    ],
)
def test_a_prefill_the_engine_repeats_is_dropped_from_the_content(pieces: list[str], content: str) -> None:
    answer = t.Answer("demo", "chat", prefill="Once upon a time")
    fed = [answer.feed(_delta(piece), 0) for piece in pieces]
    assert "".join(answer.content) == content
    assert answer.chunks == sum(1 for f in fed if f is not None)


def test_the_prefill_is_a_last_assistant_message_of_plain_text() -> None:
    user = {"role": "user", "content": "hi"}
    assert t.assistant_prefill([user, {"role": "assistant", "content": "Once"}]) == "Once"
    assert t.assistant_prefill([user]) == ""
    assert t.assistant_prefill([]) == ""
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert t.assistant_prefill([user, {"role": "assistant", "content": "x", "tool_calls": calls}]) == ""
