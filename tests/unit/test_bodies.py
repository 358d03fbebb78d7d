"""supervisor.bodies: any request body is a JSON object or a 400 naming what is wrong, at bounded cost."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.bodies import (
    _ROUTE_FIELDS,
    MAX_DEPTH,
    _fast_parse,
    _may_hold_huge_number,
    _plain_message,
    check_openai_fields,
    describe,
    number_shapes,
    parse_body,
    parse_object,
)
from supervisor.errors import SupervisorError


def error_of(call: Callable[..., object], *args: Any) -> SupervisorError | None:
    """The SupervisorError the call raised, or None; any other exception fails the test."""
    try:
        call(*args)
    except SupervisorError as exc:
        return exc
    return None


def refused(body: bytes) -> str:
    with pytest.raises(SupervisorError) as caught:
        parse_object(body)
    assert caught.value.status == 400
    assert caught.value.code == "invalid_request"
    return caught.value.message


# --- the parser ----------------------------------------------------------------------------------------


def test_an_ordinary_body_parses_as_it_is() -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": 'héllo 😀 \\n " ]}'}],
        "options": {"temperature": 0.5, "seed": -1, "num_ctx": 4096, "big": 10**300, "tiny": 1e-300},
        "stop": ["[", "{"],
    }
    assert parse_object(json.dumps(body).encode()) == body
    assert parse_object(json.dumps(body, ensure_ascii=False).encode()) == body


def test_json_whitespace_around_the_body_is_fine_and_nothing_else_is() -> None:
    assert parse_object(b'{"model": "demo"}\r\n\t ') == {"model": "demo"}  # curl's --data-binary @file
    assert parse_object(b' \n{"model": "demo"}') == {"model": "demo"}
    assert refused('{"model": "demo"}\u00a0'.encode()).startswith("request body is not valid JSON")
    assert refused(b'{"model": "demo"} x').startswith("request body is not valid JSON")


def test_a_utf8_byte_order_mark_is_skipped() -> None:
    assert parse_object(b'\xef\xbb\xbf{"model": "demo"}') == {"model": "demo"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "request body is not valid JSON"),
        (b"{not json", "request body is not valid JSON"),
        (b'{"a": 1} {"b": 2}', "request body is not valid JSON"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b'"text"', "request body must be a JSON object"),
        (b"null", "request body must be a JSON object"),
        (b"\xff\xfe", "request body is not valid JSON"),
        (b'{"a": \xff}', "request body is not valid JSON"),
    ],
)
def test_malformed_bodies_are_400(body: bytes, message: str) -> None:
    assert refused(body).startswith(message)


def test_a_hundred_thousand_brackets_are_refused_without_recursing() -> None:
    message = refused(b"[" * 100_000)
    assert f"nested deeper than {MAX_DEPTH} levels" in message
    assert refused(b"{" * 100_000 + b"}" * 100_000).endswith(f"nested deeper than {MAX_DEPTH} levels")
    # Balanced, so json.loads would recurse all the way down: it must never be asked to.
    assert "nested deeper" in refused(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_deep_nesting_names_the_field_where_it_starts() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 200 + b"]" * 200 + b"}]}"
    assert refused(body) == f"messages[0].content[0][0][0]...: JSON nested deeper than {MAX_DEPTH} levels"
    body = b'{"a": {"b": {"c": ' + b'{"d": ' * 100 + b"1" + b"}" * 103
    assert refused(body).startswith("a.b.c.d.d.d...: JSON nested deeper")


def test_exactly_the_maximum_depth_parses() -> None:
    inner = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    assert parse_object(f'{{"a": {inner}}}'.encode())["a"] is not None
    deeper = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert "nested deeper" in refused(f'{{"a": {deeper}}}'.encode())


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = "[" * 1000 + '\\"{' * 1000
    assert parse_object(json.dumps({"a": text}).encode()) == {"a": text}


@pytest.mark.parametrize(
    "body",
    [b'"' + b'\\"' * 100_000, b'{"a": "' + b'\\"' * 100_000 + b"\\", b'{"a": "' + b"[" * 100_000],
)
def test_unterminated_strings_are_refused_in_one_pass(body: bytes) -> None:
    assert refused(body).startswith("request body is not valid JSON")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"keep_alive": ' + b"9" * 400 + b"}", "keep_alive: integer is beyond the range"),
        (b'{"options": {"num_ctx": ' + b"9" * 400 + b"}}", "options.num_ctx: integer is beyond the range"),
        (b'{"options": {"seed": -' + b"9" * 5000 + b"}}", "options.seed: integer is beyond the range"),
        (b'{"temperature": ' + b"1" * 400 + b"}", "temperature: integer is beyond the range"),
        (b'{"dimensions": 1e400}', "dimensions: number is beyond the range of float64"),
        (b'{"a": [1, 2, -1.5e309]}', "a[2]: number is beyond the range of float64"),
        (b'{"b": -1E+400}', "b: number is beyond the range of float64"),
        (b'{"c": ' + b"9" * 300 + b"e9}", "c: number is beyond the range of float64"),  # a short exponent
        (b'{"options": {"temperature": NaN}}', "options.temperature: NaN is not valid JSON"),
        (b'{"x": Infinity}', "x: Infinity is not valid JSON"),
        (b'{"x": [-Infinity]}', "x[0]: -Infinity is not valid JSON"),
    ],
)
def test_numbers_no_engine_can_read_are_refused_by_path(body: bytes, message: str) -> None:
    assert refused(body).startswith(message)


@given(
    sign=st.sampled_from(["", "-"]),
    digits=st.integers(min_value=1, max_value=400),
    exponent=st.one_of(st.none(), st.integers(min_value=-1200, max_value=1200)),
    marker=st.sampled_from(["e", "E", "e+", "E+"]),
)
def test_every_number_beyond_float64_takes_the_exact_parse(
    sign: str, digits: int, exponent: int | None, marker: str
) -> None:
    # The shapes are a quick pre-check: a miss would pass an infinite number on to the engine.
    text = sign + "9" * digits + ("" if exponent is None else f"{marker if exponent >= 0 else 'e'}{exponent}")
    body = f'{{"n": {text}}}'.encode()
    too_big = math.isinf(float(text)) or (exponent is None and abs(int(text)) > sys.float_info.max)
    if too_big:
        assert _may_hold_huge_number(number_shapes(body))
        assert "beyond the range" in refused(body)


def test_the_largest_float64_integer_is_still_a_number() -> None:
    biggest = int(1.7976931348623157e308)
    assert parse_object(f'{{"n": {biggest}, "m": 1e308}}'.encode()) == {"n": biggest, "m": 1e308}
    assert "beyond the range" in refused(f'{{"n": {biggest * 2}}}'.encode())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"messages": [{"content": "a\\u0000b"}]}', "messages[0].content: contains a NUL character"),
        (b'{"model": "demo\\u0000"}', "model: contains a NUL character"),
        (b'{"options": {"st\\u0000op": 1}}', "options: a key contains a NUL character"),
        (b'{"a\\u0000": 1}', "request body: a key contains a NUL character"),
        (b'{"messages": [{"content": "a\xffb"}]}', "messages[0].content: is not valid UTF-8"),
        (b'{"prompt": ["ok", "\xc3\x28"]}', "prompt[1]: is not valid UTF-8"),
        (b'{"input": "\\ud800"}', "input: is not valid UTF-8"),
        (b'{"input": "\\uDFFFx"}', "input: is not valid UTF-8"),
        (b'{"odd key!": {"\xfe": 1}}', '["odd key!"]: a key is not valid UTF-8'),
    ],
)
def test_strings_engines_cannot_take_are_refused_by_path(body: bytes, message: str) -> None:
    assert refused(body).startswith(message)


def test_a_surrogate_pair_is_one_valid_character() -> None:
    assert parse_object(b'{"a": "\\ud83d\\ude00"}') == {"a": "😀"}


def test_an_escaped_backslash_before_u0000_is_text() -> None:
    assert parse_object(b'{"a": "\\\\u0000"}') == {"a": "\\u0000"}


NUL_TEXT = "nul\x00here"


def test_a_path_with_odd_keys_is_quoted_and_cut_short() -> None:
    message = refused(json.dumps({"x" * 100: {"a b": [NUL_TEXT]}}).encode())
    assert message.startswith('["' + "x" * 37 + '..."]["a b"][0]: contains a NUL')


def test_parse_body_needs_a_model() -> None:
    assert parse_body(b'{"model": "demo"}') == {"model": "demo"}
    for body in (b"{}", b'{"model": ""}', b'{"model": 7}', b'{"model": null}'):
        with pytest.raises(SupervisorError, match="'model' is required") as caught:
            parse_body(body)
        assert caught.value.status == 400


def test_error_messages_stay_short_for_huge_values() -> None:
    assert len(refused(b'{"' + b"k" * 100_000 + b'\\u0000": 1}')) < 200
    assert len(describe("x" * 100_000)) < 50
    assert describe(10**5000) == "an integer of 5001 digits"


# --- property: nothing but a dict or a 400 -------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**320)
    | st.floats()
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(JSON)
def test_any_json_value_parses_or_is_a_400(value: Any) -> None:
    text = json.dumps(value)  # allow_nan: NaN and Infinity literals are among the inputs
    body = text.encode("utf-8", "surrogatepass")
    error = error_of(parse_object, body)
    if error is not None:
        assert error.status == 400
        return
    payload = parse_object(body)
    assert isinstance(payload, dict)
    # What a parsed body can always become again: a strict JSON body for an engine, in UTF-8.
    json.dumps(payload, allow_nan=False, ensure_ascii=False).encode()


def _typed(value: Any) -> Any:
    """`value` with each number's type and exact bits kept, so 1 != 1.0 and 0.0 != -0.0 in a comparison."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(item) for item in value]
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


# Text an engine can take: no NUL, no lone surrogate (the parser refuses both, by path).
ENGINE_TEXT = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
STRICT_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=ENGINE_TEXT),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(ENGINE_TEXT, max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.text(ENGINE_TEXT, max_size=6), STRICT_JSON, max_size=6), st.booleans())
def test_orjson_and_json_read_every_body_alike(value: dict[str, Any], ascii_only: bool) -> None:
    # orjson takes most bodies (_fast_parse); what it reads must be exactly what json reads: the same
    # keys, the same integers (not floats past 64 bits), the same float bits.
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert _typed(parse_object(body)) == _typed(json.loads(body))


def test_an_ordinary_body_takes_the_fast_parse() -> None:
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 1}).encode()
    assert _fast_parse(body, number_shapes(body), deep=False) == json.loads(body)


def test_an_integer_past_64_bits_stays_an_exact_integer() -> None:
    # orjson would make a float of it; such a body goes to json.
    for number in (2**64, -(2**63) - 1, 123456789012345678901234567890):
        assert parse_object(b'{"seed": %d}' % number) == {"seed": number}


@settings(max_examples=400, deadline=None)
@given(
    st.binary(max_size=64)
    | st.builds(lambda n, s: s * n, st.integers(0, 3000), st.sampled_from([b"[", b"{", b'{"a":', b'"\\']))
)
def test_any_bytes_parse_or_are_a_400(body: bytes) -> None:
    error = error_of(parse_object, body)
    assert error is None or error.status == 400


# --- OpenAI fields -------------------------------------------------------------------------------------

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "demo", "prompt": "hi"}
EMBEDDING = {"model": "demo", "input": "hi"}


def fields_refused(path: str, payload: dict[str, Any]) -> str:
    with pytest.raises(SupervisorError) as caught:
        check_openai_fields(path, payload)
    assert caught.value.status == 400
    return caught.value.message


def test_well_formed_requests_pass() -> None:
    check_openai_fields(
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [
                {"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "content": "x", "tool_call_id": "c"},
            ],
            "temperature": 0.7,
            "top_p": 1,
            "max_tokens": 8,
            "max_completion_tokens": None,
            "n": 1,
            "seed": 2**63,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["\n"],
            "logprobs": True,
            "top_logprobs": 2,
            "logit_bias": {"15": -100},
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
            "response_format": {"type": "json_object"},
            "unknown_extension": {"anything": [1, "x"]},
        },
    )
    check_openai_fields("/v1/completions", {**COMPLETION, "prompt": [1, 2, 3], "logprobs": 2, "echo": False})
    check_openai_fields("/v1/completions", {**COMPLETION, "prompt": [[1, 2], "text", {"prompt_string": "x"}]})
    check_openai_fields("/v1/embeddings", {**EMBEDDING, "input": ["a", "b"], "dimensions": 64})
    check_openai_fields("/v1/embeddings", {**EMBEDDING, "encoding_format": "base64"})
    check_openai_fields("/v1/responses", {"model": "demo", "input": 5})  # no table: the engine's to judge


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"messages": None}, "messages: is required"),
        ({"messages": "hi"}, 'messages: must be a list of messages, not "hi"'),
        ({"messages": []}, "messages: must hold at least one message"),
        ({"messages": ["hi"]}, 'messages[0]: must be an object, not "hi"'),
        ({"messages": [{"content": "hi"}]}, "messages[0].role: must be a string, not null"),
        ({"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role: must be a string, not 1"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
            "messages[1].content: must be a string, a list of content parts or null, not 5",
        ),
        ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content[0]: must be an object"),
        ({"messages": [{"role": "user", "content": [{}]}]}, "messages[0].content[0].type: must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text: must be a string",
        ),
        ({"messages": [{"role": "a", "tool_calls": {}}]}, "messages[0].tool_calls: must be a list"),
        ({"messages": [{"role": "a", "tool_calls": [1]}]}, "messages[0].tool_calls[0]: must be an object"),
        ({"messages": [{"role": "tool", "tool_call_id": 1}]}, "messages[0].tool_call_id: must be a string"),
        # Engines answer 500 to these: a null name, a tool call without type or arguments, a bare tool.
        ({"messages": [{"role": "user", "name": None}]}, "messages[0].name: must be a string, not null"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}
                ]
            },
            'messages[0].tool_calls[0].type: must be "function", not null',
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments: must be a JSON string or an object, not null",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function: must be an object, not null"),
        ({"tools": [{"type": "other", "function": {"name": "f"}}]}, 'tools[0].type: must be "function"'),
        (
            {"tools": [{"type": "function", "function": {}}]},
            "tools[0].function.name: must be a string, not null",
        ),
        ({"temperature": "hot"}, 'temperature: must be a number, not "hot"'),
        ({"temperature": True}, "temperature: must be a number, not true"),
        ({"top_p": [0.9]}, "top_p: must be a number, not a list"),
        ({"frequency_penalty": {}}, "frequency_penalty: must be a number, not an object"),
        ({"presence_penalty": "1"}, "presence_penalty: must be a number"),
        ({"max_tokens": 10**30}, "max_tokens: must be from -1 to 2147483647"),
        ({"max_tokens": 1.5}, "max_tokens: must be an integer, not 1.5"),
        ({"max_tokens": "8"}, 'max_tokens: must be an integer, not "8"'),
        ({"max_completion_tokens": -5}, "max_completion_tokens: must be from -1"),
        ({"n": 0}, "n: must be from 1 to 128"),
        ({"seed": 2**64}, "seed: must be from"),
        ({"seed": 10**400}, "seed: must be from"),
        ({"top_k": 1e300}, "top_k: must be from -1"),
        ({"stream": "yes"}, 'stream: must be true or false, not "yes"'),
        ({"stream": 1}, "stream: must be true or false, not 1"),
        ({"stream_options": []}, "stream_options: must be an object"),
        ({"stream_options": {"include_usage": "y"}}, "stream_options.include_usage: must be true or false"),
        ({"stop": 5}, "stop: must be a string or a list of strings"),
        ({"stop": ["a", None]}, "stop[1]: must be a string, not null"),
        ({"logprobs": 3}, "logprobs: must be true or false"),
        ({"top_logprobs": -1}, "top_logprobs: must be from 0"),
        # llama-server lists as many as asked, up to its whole vocabulary for every token (OpenAI: 20)
        ({"top_logprobs": 21}, "top_logprobs: must be from 0 to 20"),
        ({"logit_bias": {"1": "x"}}, 'logit_bias["1"]: must be a number'),
        ({"tools": {"a": 1}}, "tools: must be a list"),
        ({"tool_choice": 1}, "tool_choice: must be a string or an object"),
        ({"response_format": "json"}, "response_format: must be an object"),
        ({"user": 5}, "user: must be a string"),
    ],
)
def test_a_wrong_chat_field_is_named(change: dict[str, Any], message: str) -> None:
    assert fields_refused("/v1/chat/completions", {**CHAT, **change}).startswith(message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": None}, "prompt: is required"),
        ({"prompt": 5}, "prompt: must be a string or a list"),
        ({"prompt": []}, "prompt: must not be an empty list"),
        ({"prompt": [1, -2]}, "prompt[1]: must be from 0"),
        ({"prompt": [[1, "a"]]}, 'prompt[0][1]: must be an integer, not "a"'),
        ({"prompt": [None]}, "prompt[0]: must be a string, a token id or a list of token ids"),
        ({"prompt": [1.5]}, "prompt[0]: must be an integer"),
        ({"prompt": [1.0]}, "prompt[0]: a token id must be written as an integer, not 1.0"),
        ({"prompt": [[1], 2]}, "prompt[0]: must be an integer, not a list"),
        ({"prompt": [{"a": 1}]}, "prompt[0].prompt_string: must be a string, not null"),
        ({"logprobs": True}, "logprobs: must be an integer"),
        ({"logprobs": 2**20}, "logprobs: must be from 0 to 20"),
        ({"echo": "no"}, "echo: must be true or false"),
        ({"best_of": 0}, "best_of: must be from 1"),
        ({"suffix": 1}, "suffix: must be a string"),
        ({"max_tokens": [1]}, "max_tokens: must be an integer"),
    ],
)
def test_a_wrong_completion_field_is_named(change: dict[str, Any], message: str) -> None:
    assert fields_refused("/v1/completions", {**COMPLETION, **change}).startswith(message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"input": None}, "input: is required"),
        ({"input": {"a": 1}}, "input: must be a string or a list"),
        ({"input": []}, "input: must not be an empty list"),
        ({"input": ["a", True]}, "input[1]: must be a string, a token id"),
        ({"dimensions": 0}, "dimensions: must be from 1 to 65536"),
        ({"dimensions": 10**400}, "dimensions: must be from 1 to 65536, not an integer of 401 digits"),
        ({"dimensions": "8"}, "dimensions: must be an integer"),
        ({"encoding_format": 1}, "encoding_format: must be a string"),
        ({"encoding_format": None}, "encoding_format: must be a string, not null"),
        ({"input": [[2.0]]}, "input[0][0]: a token id must be written as an integer"),
    ],
)
def test_a_wrong_embeddings_field_is_named(change: dict[str, Any], message: str) -> None:
    assert fields_refused("/v1/embeddings", {**EMBEDDING, **change}).startswith(message)


def test_null_optional_fields_pass() -> None:
    nulls = dict.fromkeys(["temperature", "max_tokens", "stop", "seed", "stream", "tools", "n"])
    check_openai_fields("/v1/chat/completions", {**CHAT, **nulls})


OPENAI_FIELDS = ["messages", "prompt", "input", "temperature", "max_tokens", "n", "seed", "stream", "stop"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
    body=st.dictionaries(st.sampled_from(OPENAI_FIELDS), JSON, max_size=5),
)
def test_any_openai_body_passes_or_is_a_400(path: str, body: dict[str, Any]) -> None:
    error = error_of(check_openai_fields, path, body)
    if error is not None:
        assert error.status == 400
        assert ":" in error.message
        return
    if path == "/v1/embeddings":
        return  # sampling fields mean nothing there; the engine ignores them
    for name in ("temperature", "max_tokens", "n", "seed"):
        value = body.get(name)
        assert value is None or (isinstance(value, int | float) and not isinstance(value, bool))
        assert not isinstance(value, float) or math.isfinite(value)


ODD_VALUES = st.none() | st.text(max_size=3) | st.integers() | st.booleans() | st.lists(st.none(), max_size=1)
MESSAGE = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "x"]),
    ODD_VALUES | st.just([{"type": "text", "text": "hi"}]),
    max_size=5,
)


@settings(max_examples=500, deadline=None)
@given(MESSAGE)
def test_a_message_passed_at_a_glance_passes_the_whole_check(message: dict[str, Any]) -> None:
    # _plain_message spares the usual message its field paths; it must never pass one the check refuses.
    if _plain_message(message):
        check_openai_fields("/v1/chat/completions", {**CHAT, "messages": [message]})


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["model", "user", "stream", "logprobs", "echo", "parallel_tool_calls"]), ODD_VALUES)
def test_fields_passed_by_their_type_are_refused_as_before(name: str, value: Any) -> None:
    # A str `model` or a bool `stream` skips its check; the verdict is still the check's own.
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        check = _ROUTE_FIELDS[path][0].get(name)
        if check is None:
            continue  # not this route's field
        expected = None if value is None else error_of(check, value, name)
        error = error_of(check_openai_fields, path, {**body, name: value})
        assert (error and error.message) == (expected and expected.message)
