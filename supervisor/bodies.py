"""Request bodies: the one JSON parser of every route, and OpenAI fields checked before an engine sees them.

Any body costs bounded work and ends as a value or a 400 that names the field: nesting is measured
before `json` can recurse, numbers no engine can read back (NaN, Infinity, beyond float64) are refused,
and so are strings that are not valid UTF-8 or hold a NUL. Field checks look at types and at integer
ranges a C++ engine can hold; what a value means (temperature 7, n 3) is the engine's to judge.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import re
import sys
from collections.abc import Callable
from json import scanner
from typing import Any, Final, NoReturn, cast

from supervisor import errors

MAX_DEPTH: Final = 64

# A JSON string (to its closing quote, or to the end when unterminated: one pass, no retry at each quote),
# or a run of anything that is neither a string nor a bracket. Removing both leaves the brackets.
_STRING = r'"[^"\\]*+(?:\\(?:.|\Z)[^"\\]*+)*+(?:"|\Z)'
_NOT_BRACKET: Final = re.compile(_STRING + r'|[^"\[\]{}]++', re.DOTALL)
_TOKEN: Final = re.compile(_STRING + r"|[\[\]{}:,]", re.DOTALL)
_STEP: Final = {"[": 1, "{": 1, "]": -1, "}": -1}
# Escapes that decode to a NUL or to half of a surrogate pair: only then must the strings be walked.
_ODD_ESCAPE: Final = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
# Raw: the regex reads the escapes (mypyc, setup.py, compiles no surrogate in a string literal).
_BAD_CHAR: Final = re.compile(r"[\x00\ud800-\udfff]")
_FLOAT_MAX: Final = int(sys.float_info.max)
_FLOAT_MAX_DIGITS: Final = len(str(_FLOAT_MAX))
# Text that could be a number beyond float64 (about 1.8e308): a three-digit exponent, or a run of digits
# long enough to pass it with a two-digit one (210: 10**209 * 1e99 is still below it). Found by mapping
# the bytes to a few classes and deleting signs (C speed), then searching for the two shapes, since a
# regex walking every position of a 32 MiB body costs about a second of the event loop. Without its sign
# an exponent has one shape; a run that a deleted sign joins is only a false alarm (the exact parse then
# looks). The same map makes both opening brackets "[", so that parse_object counts them in one call (a
# call to a bytes method costs about 1,500 instructions: its arguments are parsed as a tuple).
_SHAPE_CLASSES: Final = bytes(
    ord("0") if 48 <= b <= 57 else ord("e") if b in b"eE" else ord("[") if b in b"[{" else ord(" ")
    for b in range(256)
)
_SIGNS: Final = b"+-"
_EXPONENT_SHAPE: Final = b"e000"
_DIGITS_SHAPE: Final = b"0" * (_FLOAT_MAX_DIGITS - 99)
# A run of digits that could be an integer past 64 bits (int64's largest has 19): orjson would read it as
# a float, json as the exact integer the client sent.
_LONG_INTEGER_SHAPE: Final = b"0" * 19
_ODD_ESCAPE_BYTES: Final = re.compile(_ODD_ESCAPE.pattern.encode())  # the same, for the raw body


def number_shapes(body: bytes) -> bytes:
    """`body` with every digit as "0", every "e" or "E" as "e", both opening brackets as "[", signs
    deleted and all else a space."""
    return body.translate(_SHAPE_CLASSES, _SIGNS)


def _may_hold_huge_number(shapes: bytes) -> bool:
    # find, not `in`: CPython's `bytes in bytes` tries the needle as an int first, and raising and
    # clearing that TypeError costs more than the search.
    return shapes.find(_EXPONENT_SHAPE) >= 0 or shapes.find(_DIGITS_SHAPE) >= 0


# orjson.loads, once a body has needed it: imported at the first, not at start-up (1.4 MiB of RSS).
_loads: Callable[[bytes], Any] | None = None


def _fast_parse(body: bytes, shapes: bytes, deep: bool) -> Any:
    """The body's JSON value by orjson, where that is the value json would give and nothing in it needs
    a closer look; else _UNPARSED (then json parses it, and names what is wrong).

    orjson parses a small body in half the instructions of json's scanner. It refuses what json
    would refuse, and more: NaN and Infinity, a number past float64, a lone surrogate, bytes that are
    not UTF-8. All of those go to json, whose hooks name the field. orjson is not asked where the two
    would differ: an integer of 19 digits or more (orjson makes a float of one past 64 bits), an escaped
    NUL (orjson takes it; the walk must refuse it), a body that may nest past MAX_DEPTH (`deep`)."""
    global _loads
    if deep or shapes.find(_LONG_INTEGER_SHAPE) >= 0 or _ODD_ESCAPE_BYTES.search(body) is not None:
        return _UNPARSED
    if _loads is None:
        import orjson

        _loads = orjson.loads
    try:
        return _loads(body)
    except ValueError:  # orjson.JSONDecodeError: json parses it again, to name what is wrong
        return _UNPARSED


class _ConstantMet(Exception):
    """The shared decoder met NaN or Infinity: the body is parsed again with hooks that name where."""


def _constant_met(name: str) -> NoReturn:
    raise _ConstantMet(name)


Scanner = Callable[[str, int], tuple[Any, int]]


def scanner_of(decoder: json.JSONDecoder) -> Scanner:
    """The decoder's scanner, to call directly: (the value at an index, where it ends). json's `decode`
    and `raw_decode` are Python around it that costs as much as scanning a small object (two frames, two
    regex matches for whitespace), and a request path scans several small objects."""
    return cast(Scanner, scanner.make_scanner(cast(Any, decoder)))


# json.loads builds a new decoder on every call that passes a hook; a body with nothing to watch for
# (the usual one) goes through this one instead.
_PLAIN_DECODER: Final = json.JSONDecoder(parse_constant=_constant_met)
_PLAIN_SCAN: Final = scanner_of(_PLAIN_DECODER)
_JSON_SPACE: Final = " \t\n\r"  # json's own: other Unicode spaces after a value are an error
_UNPARSED: Final = object()


def _decode_plain(text: str) -> Any:
    """The body's JSON value, or _UNPARSED when it holds NaN or Infinity (then the hooks must name where).
    A body that starts with its value (the usual one) is scanned directly, and taken when only JSON's
    whitespace follows; the decoder, which names what is wrong, takes any other."""
    try:
        try:
            value, end = _PLAIN_SCAN(text, 0)
            if end == len(text) or not text[end:].strip(_JSON_SPACE):
                return value
        except (ValueError, StopIteration):
            pass  # the decoder's error names what is wrong
        return _PLAIN_DECODER.decode(text)
    except _ConstantMet:
        return _UNPARSED


_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Refused:
    """Put in place of a value the decoder met but must not pass on; the walk reports it with its path."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def parse_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 (SupervisorError) that says what is wrong, and where."""
    if body.startswith(codecs.BOM_UTF8):
        body = body[len(codecs.BOM_UTF8) :]
    shapes = number_shapes(body)
    # More opening brackets (inside strings too) than MAX_DEPTH: only then can it nest deeper.
    deep = shapes.count(b"[") > MAX_DEPTH
    payload = _fast_parse(body, shapes, deep)
    if isinstance(payload, dict):
        return payload
    walk = False
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        # Bad bytes become lone surrogates: inside a string the walk names its field, elsewhere json fails.
        text = body.decode("utf-8", "surrogateescape")
        walk = True
    if deep:
        _check_depth(text)
    refused: list[_Refused] = []

    def refuse(reason: str) -> _Refused:
        refused.append(_Refused(reason))
        return refused[-1]

    def parse_int(digits: str) -> int | _Refused:
        # The length first: int() of thousands of digits is itself slow, and limited.
        value = int(digits) if len(digits.lstrip("-")) <= _FLOAT_MAX_DIGITS else None
        if value is None or abs(value) > _FLOAT_MAX:
            return refuse("integer is beyond the range of a JSON number (float64, about 1.8e308)")
        return value

    def parse_float(literal: str) -> float | _Refused:
        value = float(literal)
        return value if math.isfinite(value) else refuse("number is beyond the range of float64")

    def parse_constant(name: str) -> _Refused:
        return refuse(f"{name} is not valid JSON; send a finite number")

    # A hook costs a Python call per number: only a body with a number that may overflow gets them.
    try:
        payload = _UNPARSED if _may_hold_huge_number(shapes) else _decode_plain(text)
        if payload is _UNPARSED:
            payload = json.loads(
                text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant
            )
    except ValueError as exc:  # JSONDecodeError
        raise errors.bad_request(f"request body is not valid JSON: {_clip(str(exc), 200)}") from None
    if not isinstance(payload, dict):
        raise errors.bad_request("request body must be a JSON object")
    if walk or refused or ("\\u" in text and _ODD_ESCAPE.search(text)):
        problem = _find_problem(payload, [])
        if problem is not None:
            raise errors.bad_request(problem)
    return payload


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object with a string `model`, or a 400 that says what is wrong."""
    payload = parse_object(body)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request(
            "'model' is required: a string naming the model (GET /v1/models or /api/tags)"
        )
    return payload


# --- the parser's parts --------------------------------------------------------------------------------


def _check_depth(text: str) -> None:
    """Raise a 400 when brackets (outside strings) nest deeper than MAX_DEPTH, before json recurses. Asked
    only of a body with more than MAX_DEPTH opening brackets (parse_object counts them)."""
    brackets = _NOT_BRACKET.sub("", text)
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets))) <= MAX_DEPTH:
        return
    raise errors.bad_request(f"{_deep_path(text)}: JSON nested deeper than {MAX_DEPTH} levels")


def _deep_path(text: str) -> str:
    """Where nesting first passes MAX_DEPTH, as a field path; only on the error path, so a plain scan."""
    # Each level: [key or index, expecting a key next (objects only)].
    stack: list[list[Any]] = []
    kinds: list[str] = []
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            if len(stack) >= MAX_DEPTH:
                break
            kinds.append(token)
            stack.append([0 if token == "[" else None, token == "{"])
        elif token in "]}":
            if stack:
                stack.pop()
                kinds.pop()
        elif not stack:
            continue
        elif token == ",":
            if kinds[-1] == "[":
                stack[-1][0] += 1
            else:
                stack[-1][1] = True
        elif token == ":":
            stack[-1][1] = False
        elif kinds[-1] == "{" and stack[-1][1]:  # a string where a key is expected
            try:
                stack[-1][0] = json.loads(token)
            except ValueError:
                stack[-1][0] = token.strip('"')
    parts = [level[0] for level in stack if level[0] is not None]
    shown = _path(parts[:6]) if parts else "request body"
    return shown + ("..." if len(parts) > 6 else "")


def _find_problem(value: object, parts: list[str | int]) -> str | None:
    """The first refused number, NUL or broken character, as "path: what is wrong"; None if none."""
    if isinstance(value, _Refused):
        return f"{_path(parts)}: {value.reason}"
    if isinstance(value, str):
        return _string_problem(value, parts)
    if isinstance(value, dict):
        for key, item in value.items():
            if (problem := _string_problem(key, parts, key=True)) is not None:
                return problem
            parts.append(key)
            problem = _find_problem(item, parts)
            parts.pop()
            if problem is not None:
                return problem
    elif isinstance(value, list):
        for index, item in enumerate(value):
            parts.append(index)
            problem = _find_problem(item, parts)
            parts.pop()
            if problem is not None:
                return problem
    return None


def _string_problem(text: str, parts: list[str | int], key: bool = False) -> str | None:
    found = _BAD_CHAR.search(text)
    if found is None:
        return None
    where = f"{_path(parts)}: a key" if key else f"{_path(parts)}:"
    if found.group() == "\x00":
        return f"{where} contains a NUL character (\\u0000), which engines cannot take"
    return f"{where} is not valid UTF-8 (a lone surrogate or an undecodable byte)"


def _path(parts: list[str | int]) -> str:
    """`messages[0].content`, `options.num_ctx`; odd keys quoted and cut short."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif len(part) <= 40 and _NAME.fullmatch(part):
            out += f".{part}" if out else part
        else:
            safe = _BAD_CHAR.sub("?", _clip(part, 40))
            out += f"[{json.dumps(safe)}]"
    return out or "request body"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(value: object) -> str:
    """A short JSON-ish account of a value for an error message: never the whole of a large one."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return json.dumps(_clip(_BAD_CHAR.sub("?", value), 40))
    if isinstance(value, int) and value.bit_length() > 128:  # repr() of 5,000 digits raises ValueError
        return f"an integer of {int(value.bit_length() * math.log10(2)) + 1} digits"
    return _clip(repr(value), 40)


# --- OpenAI fields -------------------------------------------------------------------------------------

Check = Callable[[object, str], object]  # raises a 400 naming the field at `path`, or returns

INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # llama-server reads a uint32 (-1: random), vLLM a Python int


def integer(low: int, high: int) -> Check:
    """An integer (an integral float too: JSON does not tell them apart) from low to high."""

    def check(value: object, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise errors.bad_request(f"{path}: must be an integer, not {describe(value)}")
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise errors.bad_request(f"{path}: must be an integer, not {describe(value)}")
        if not low <= value <= high:
            raise errors.bad_request(f"{path}: must be from {low} to {high}, not {describe(value)}")

    return check


def number(value: object, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise errors.bad_request(f"{path}: must be a number, not {describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # math.isfinite(10**400) overflows
        raise errors.bad_request(f"{path}: must be a number, not {describe(value)}")


def boolean(value: object, path: str) -> None:
    if not isinstance(value, bool):
        raise errors.bad_request(f"{path}: must be true or false, not {describe(value)}")


def string(value: object, path: str) -> None:
    if not isinstance(value, str):
        raise errors.bad_request(f"{path}: must be a string, not {describe(value)}")


def json_object(value: object, path: str) -> dict[str, Any]:
    """The value, which must be a JSON object."""
    if not isinstance(value, dict):
        raise errors.bad_request(f"{path}: must be an object, not {describe(value)}")
    return value


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `response_format` for an answer that follows a JSON schema: what llama-server builds its
    grammar from (a bare `json_object` it ignores). The OpenAI route's JSON mode and Ollama's `format`
    are both sent as this."""
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def json_list(value: object, path: str) -> list[Any]:
    """The value, which must be a JSON list."""
    if not isinstance(value, list):
        raise errors.bad_request(f"{path}: must be a list, not {describe(value)}")
    return value


def _string_or_object(value: object, path: str) -> None:
    if not isinstance(value, str | dict):
        raise errors.bad_request(f"{path}: must be a string or an object, not {describe(value)}")


def _function_type(value: object, path: str) -> None:
    if value != "function":
        raise errors.bad_request(f'{path}: must be "function", not {describe(value)}')


def _named_function(value: object, path: str) -> dict[str, Any]:
    function = json_object(value, path)
    string(function.get("name"), f"{path}.name")
    return function


def _tools(value: object, path: str) -> None:
    """Tool definitions: `{"type": "function", "function": {"name": ..., ...}}` each."""
    for index, item in enumerate(json_list(value, path)):
        where = f"{path}[{index}]"
        tool = json_object(item, where)
        _function_type(tool.get("type"), f"{where}.type")
        _named_function(tool.get("function"), f"{where}.function")


def _tool_calls(value: object, path: str) -> None:
    """An assistant message's calls: type "function", a function name, arguments a JSON string (or object)."""
    for index, item in enumerate(json_list(value, path)):
        where = f"{path}[{index}]"
        call = json_object(item, where)
        _function_type(call.get("type"), f"{where}.type")
        if "id" in call:
            string(call["id"], f"{where}.id")
        function = _named_function(call.get("function"), f"{where}.function")
        if not isinstance(function.get("arguments"), str | dict):
            raise errors.bad_request(
                f"{where}.function.arguments: must be a JSON string or an object, "
                f"not {describe(function.get('arguments'))}"
            )


def _stop(value: object, path: str) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise errors.bad_request(f"{path}: must be a string or a list of strings, not {describe(value)}")
    for index, item in enumerate(value):
        string(item, f"{path}[{index}]")


def _logit_bias(value: object, path: str) -> None:
    for key, bias in json_object(value, path).items():
        number(bias, f"{path}[{json.dumps(_clip(key, 40))}]")


def _stream_options(value: object, path: str) -> None:
    options = json_object(value, path)
    if options.get("include_usage") is not None:
        boolean(options["include_usage"], f"{path}.include_usage")


def _token_id(value: object, path: str) -> None:
    """A token id as engines read one: a JSON integer (llama-server fails on 1.0) that a C++ int holds."""
    if isinstance(value, float) and value.is_integer():
        raise errors.bad_request(f"{path}: a token id must be written as an integer, not {describe(value)}")
    _TOKEN_RANGE(value, path)


_TOKEN_RANGE = integer(0, INT32_MAX)
_TOKEN_ID = _token_id


def _tokens_or_texts(value: object, path: str) -> None:
    """A prompt or embeddings input: a string; a list of strings and token ids (with a token id in it:
    one prompt of text and tokens mixed); or a list of prompts, each a string, a list of token ids or
    llama-server's multimodal prompt object (`prompt_string`). Engines fail on any other shape."""
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise errors.bad_request(f"{path}: must be a string or a list, not {describe(value)}")
    if not value:
        raise errors.bad_request(f"{path}: must not be an empty list")
    if any(isinstance(item, int | float) and not isinstance(item, bool) for item in value):
        for index, item in enumerate(value):
            if not isinstance(item, str):
                _TOKEN_ID(item, f"{path}[{index}]")
        return
    for index, item in enumerate(value):
        where = f"{path}[{index}]"
        if isinstance(item, str):
            continue
        if isinstance(item, dict):
            string(item.get("prompt_string"), f"{where}.prompt_string")
        elif isinstance(item, list):
            for position, token in enumerate(item):
                _TOKEN_ID(token, f"{where}[{position}]")
        else:
            raise errors.bad_request(
                f"{where}: must be a string, a token id or a list of token ids, not {describe(item)}"
            )


def _documents(value: object, path: str) -> None:
    """A rerank's documents: a non-empty list of strings (or of objects, vLLM's multimodal documents)."""
    documents = json_list(value, path)
    if not documents:
        raise errors.bad_request(f"{path}: must not be an empty list")
    for index, item in enumerate(documents):
        if not isinstance(item, str | dict):
            raise errors.bad_request(f"{path}[{index}]: must be a string or an object, not {describe(item)}")


def _content(value: object, path: str) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise errors.bad_request(
            f"{path}: must be a string, a list of content parts or null, not {describe(value)}"
        )
    for index, part in enumerate(value):
        where = f"{path}[{index}]"
        part = json_object(part, where)
        string(part.get("type"), f"{where}.type")
        if part["type"] == "text":
            string(part.get("text"), f"{where}.text")


def _messages(value: object, path: str) -> None:
    if not isinstance(value, list):
        raise errors.bad_request(f"{path}: must be a list of messages, not {describe(value)}")
    if not value:
        raise errors.bad_request(f"{path}: must hold at least one message")
    for index, item in enumerate(value):
        if isinstance(item, dict) and _plain_message(item):
            continue  # nothing to refuse: no path is formatted (three strings a message, for nothing)
        where = f"{path}[{index}]"
        message = json_object(item, where)
        string(message.get("role"), f"{where}.role")
        for name, field in message.items():
            check = _MESSAGE_FIELDS.get(name)
            if check is not None and (field is not None or name in _NEVER_NULL):
                check(field, f"{where}.{name}")


def _plain_message(message: dict[str, Any]) -> bool:
    """Whether a message is one that _messages passes at a glance: a string role, and every field it
    checks a string that its check takes as it is, or an allowed null (the usual chat turn)."""
    if not isinstance(message.get("role"), str):
        return False
    for name, field in message.items():
        if name not in _MESSAGE_FIELDS or (field is None and name not in _NEVER_NULL):
            continue
        if not (isinstance(field, str) and name in _TAKE_ANY_STRING):
            return False
    return True


# Optional fields that engines fail on (a 500) when they are sent as null.
_NEVER_NULL: Final = frozenset(
    {"name", "tool_call_id", "reasoning_content", "encoding_format", "reasoning_format"}
)

_MESSAGE_FIELDS: Final[dict[str, Check]] = {
    "content": _content,
    "name": string,
    "tool_calls": _tool_calls,
    "tool_call_id": string,
    "reasoning_content": string,
}

# The message fields whose check passes any string (_content takes a string or a list of parts).
_TAKE_ANY_STRING: Final = frozenset(
    name for name, check in _MESSAGE_FIELDS.items() if check is string or check is _content
)

_COUNT = integer(-1, INT32_MAX)  # -1 is llama-server's "no limit" / "disabled"


def _output_count(value: object, path: str) -> None:
    """A limit on the tokens to generate: at least 1, as OpenAI and vLLM want, or -1 (llama-server's "no
    limit"). llama-server took 0 and generated one token, which its answer counted as asked."""
    _COUNT(value, path)
    if value == 0:
        raise errors.bad_request(f"{path}: must be at least 1 (or -1: no limit), not 0")


# The most alternatives per token a request may ask for, as OpenAI and vLLM (max_logprobs) allow:
# llama-server lists as many as asked, up to its whole vocabulary (150,000 entries) for every token.
MAX_LOGPROBS: Final = 20
_SAMPLING: Final[dict[str, Check]] = {
    "model": string,
    "user": string,
    "stream": boolean,
    "stream_options": _stream_options,
    "temperature": number,
    "top_p": number,
    "min_p": number,
    "typical_p": number,
    "repeat_penalty": number,
    "frequency_penalty": number,
    "presence_penalty": number,
    "max_tokens": _output_count,
    "top_k": _COUNT,
    "repeat_last_n": _COUNT,
    "n": integer(1, 128),
    "seed": integer(*SEED_RANGE),
    "stop": _stop,
    "logit_bias": _logit_bias,
    "response_format": json_object,
    "n_probs": integer(0, MAX_LOGPROBS),  # llama-server's own name for top_logprobs
}

_ROUTE_FIELDS: Final[dict[str, tuple[dict[str, Check], tuple[str, ...]]]] = {
    "/v1/chat/completions": (
        {
            **_SAMPLING,
            "messages": _messages,
            "max_completion_tokens": _output_count,
            "logprobs": boolean,
            "top_logprobs": integer(0, MAX_LOGPROBS),
            "tools": _tools,
            "tool_choice": _string_or_object,
            "parallel_tool_calls": boolean,
            "reasoning_format": string,  # llama-server's: how `reasoning_content` is split out
        },
        ("messages",),
    ),
    "/v1/completions": (
        {
            **_SAMPLING,
            "prompt": _tokens_or_texts,
            "logprobs": integer(0, MAX_LOGPROBS),
            "echo": boolean,
            "best_of": integer(1, 128),
            "suffix": string,
        },
        ("prompt",),
    ),
    "/v1/embeddings": (
        {
            "model": string,
            "user": string,
            "input": _tokens_or_texts,
            "dimensions": integer(1, 65536),
            "encoding_format": string,
        },
        ("input",),
    ),
    "/v1/rerank": (
        {
            "model": string,
            "query": string,
            "documents": _documents,
            "top_n": integer(0, INT32_MAX),
            "return_documents": boolean,
        },
        ("query", "documents"),
    ),
}
_ROUTE_FIELDS["/rerank"] = _ROUTE_FIELDS["/v1/rerank"]


def _plain_types(fields: dict[str, Check]) -> dict[str, type]:
    """The fields whose check passes every value of one type (`string` a str, `boolean` a bool): the
    value's type is compared instead of calling the check."""
    return {
        name: str if check is string else bool
        for name, check in fields.items()
        if check is string or check is boolean
    }


_PLAIN_TYPES: Final = {path: _plain_types(fields) for path, (fields, _) in _ROUTE_FIELDS.items()}
_NO_TYPES: Final[dict[str, type]] = {}


def check_openai_fields(path: str, payload: dict[str, Any]) -> None:
    """Raise a 400 naming the field when a well-known field of this OpenAI route has the wrong type or an
    integer out of range; a required one (messages, prompt, input) missing is one too. Null is accepted
    for optional fields (not those in _NEVER_NULL), unknown fields pass untouched, and routes without a
    table are not checked."""
    fields, required = _ROUTE_FIELDS.get(path, ({}, ()))
    for name in required:
        if payload.get(name) is None:
            raise errors.bad_request(f"{name}: is required")
    plain = _PLAIN_TYPES.get(path, _NO_TYPES)
    for name, value in payload.items():  # the body's few fields, not the table's many
        if type(value) is plain.get(name):
            continue
        check = fields.get(name)
        if check is not None and (value is not None or name in _NEVER_NULL):
            check(value, name)
