"""Ollama's inference API in terms of the OpenAI API the children serve: pure functions, no I/O.

Requests go one way (an Ollama body becomes an OpenAI body for /v1/chat/completions, /v1/completions or
/v1/embeddings); answers come back the other way (OpenAI SSE events become Ollama NDJSON lines, and the
last line carries Ollama's statistics in nanoseconds). The route module does the I/O and the timing.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from supervisor.bodies import INT32_MAX, SEED_RANGE, describe, scanner_of, schema_format
from supervisor.estimates import context_tokens
from supervisor.images import image_mime
from supervisor.manifests import LlamaServerManifest, Manifest, VllmManifest, flag_name

Kind = Literal["chat", "generate"]


class TranslationError(ValueError):
    """The Ollama request cannot be expressed for the engine; the message says why (a 400)."""


# --- requests ----------------------------------------------------------------------------------------

# Ollama option -> OpenAI field, the same for every engine.
_COMMON_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Sampler settings each engine accepts as extra body fields, under its own names.
_ENGINE_OPTIONS = {
    "llama-server": {
        "top_k": "top_k",
        "min_p": "min_p",
        "repeat_penalty": "repeat_penalty",
        "repeat_last_n": "repeat_last_n",
        "typical_p": "typical_p",
        "mirostat": "mirostat",
        "mirostat_tau": "mirostat_tau",
        "mirostat_eta": "mirostat_eta",
    },
    "vllm": {"top_k": "top_k", "min_p": "min_p", "repeat_penalty": "repetition_penalty"},
}
_INT32 = (-(2**31), INT32_MAX)
# Integer options and the values an engine can hold (C++ ints; -1 and -2 mean "no limit" where Ollama
# says so). Those no request can change (num_gpu, num_thread, ...) are checked and then ignored.
_INTEGER_OPTIONS: dict[str, tuple[int, int]] = {
    "seed": SEED_RANGE,
    "top_k": (-1, INT32_MAX),
    "num_predict": (-2, INT32_MAX),
    "num_ctx": (0, INT32_MAX),
    "repeat_last_n": (-1, INT32_MAX),
    "mirostat": (0, 2),
    "num_keep": _INT32,
    "num_batch": _INT32,
    "num_gpu": _INT32,
    "main_gpu": _INT32,
    "num_thread": _INT32,
}
_NUMBER_OPTIONS = frozenset(
    {
        "temperature",
        "top_p",
        "min_p",
        "typical_p",
        "tfs_z",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "mirostat_tau",
        "mirostat_eta",
    }
)
_BOOLEAN_OPTIONS = frozenset(
    {"numa", "low_vram", "f16_kv", "vocab_only", "use_mmap", "use_mlock", "logits_all", "penalize_newline"}
)
_DIMENSIONS = (1, 65536)


def _number(path: str, value: object) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TranslationError(f"{path}: must be a number, not {describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # math.isfinite(10**400) overflows
        raise TranslationError(f"{path}: must be a number, not {describe(value)}")
    return value


def _integer(path: str, value: object, low: int, high: int) -> int:
    """An integer from low to high (an integral float too: JSON does not tell them apart)."""
    number = _number(path, value)
    if isinstance(number, float) and not number.is_integer():
        raise TranslationError(f"{path}: must be an integer, not {describe(value)}")
    if not low <= number <= high:
        raise TranslationError(f"{path}: must be an integer from {low} to {high}, not {describe(value)}")
    return int(number)


def _string(path: str, value: object) -> str:
    if not isinstance(value, str):
        raise TranslationError(f"{path}: must be a string, not {describe(value)}")
    return value


def _optional(body: dict[str, Any], name: str, kind: type, what: str) -> None:
    """Null or absent, or a value of this type: `what` says it in the message."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise TranslationError(f"{name}: must be {what}, not {describe(value)}")


def _option(name: str, value: object) -> object:
    """The option's value, checked; unknown options pass unchecked (Ollama ignores them too)."""
    path = f"options.{name}"
    if name in _INTEGER_OPTIONS:
        return _integer(path, value, *_INTEGER_OPTIONS[name])
    if name in _NUMBER_OPTIONS:
        return _number(path, value)
    if name in _BOOLEAN_OPTIONS and not isinstance(value, bool):
        raise TranslationError(f"{path}: must be true or false, not {describe(value)}")
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list):
            raise TranslationError(f"{path}: must be a string or a list of strings, not {describe(value)}")
        for index, stop in enumerate(stops):
            _string(f"{path}[{index}]", stop)
        return stops
    return value


def options_to_openai(options: object, engine: str) -> dict[str, Any]:
    """The OpenAI body fields for Ollama `options`, each checked (a TranslationError names the option).

    num_ctx is checked elsewhere and never forwarded; options no engine can honour per request (num_gpu,
    num_thread, ...) are ignored, as Ollama does.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TranslationError(f"options: must be an object, not {describe(options)}")
    body: dict[str, Any] = {}
    extra = _ENGINE_OPTIONS.get(engine, {})
    for name, raw in options.items():
        if raw is None:
            continue
        value = _option(name, raw)
        target = _COMMON_OPTIONS.get(name) or extra.get(name)
        if name == "stop":
            if value:
                body["stop"] = value
        elif name == "num_predict":
            if isinstance(value, int) and value > 0:  # -1 "no limit", -2 "fill the context": the default
                body["max_tokens"] = value
        elif target is not None:
            body[target] = value
    return body


def num_ctx_of(options: object) -> int | None:
    if not isinstance(options, dict) or options.get("num_ctx") is None:
        return None
    return _integer("options.num_ctx", options["num_ctx"], *_INTEGER_OPTIONS["num_ctx"])


def context_limit(manifest: Manifest) -> tuple[int, str] | None:
    """The most context one request can have on this model's child, and how that follows from the
    manifest (its fields, or the flags and variables in `args` and `env` that llama-server reads); None
    when the manifest leaves it to the engine (the model's own length)."""
    if isinstance(manifest, LlamaServerManifest):
        context = context_tokens(manifest)
        if context is None:
            return None
        slots = manifest.slots()
        unified = any(flag_name(a) in ("-kvu", "--kv-unified") for a in manifest.args)
        if slots is None or slots == 1 or unified:
            # Without --parallel, llama-server shares one unified cache: a request may use all of it.
            return context, f"llama-server was started with ctx_size {context}"
        per_slot = context // slots
        return per_slot, (
            f"llama-server was started with ctx_size {context} shared by parallel "
            f"{slots} slots, so one request can use at most {per_slot} tokens"
        )
    if isinstance(manifest, VllmManifest) and manifest.max_model_len:
        return manifest.max_model_len, f"vLLM was started with max_model_len {manifest.max_model_len}"
    return None


def check_num_ctx(options: object, manifest: Manifest) -> None:
    """Raise TranslationError when `num_ctx` asks for more context than the running child has.

    Options never restart a child: a smaller num_ctx is accepted (and not forwarded), a larger one refused.
    """
    wanted = num_ctx_of(options)
    limit = context_limit(manifest)
    if wanted is None or limit is None or wanted <= limit[0]:
        return
    raise TranslationError(
        f"num_ctx {wanted} is above what model '{manifest.name}' serves: {limit[1]}; options do not "
        f"restart a model, so raise the limit in its manifest or ask for num_ctx <= {limit[0]}"
    )


def format_to_openai(fmt: object, engine: str, completions: bool = False) -> dict[str, Any]:
    """Body fields for Ollama `format`: "json" (any JSON object) or a JSON schema.

    llama-server ignores a bare `json_object` (it needs a schema to build its grammar), so it gets the
    schema {"type": "object"}; on /v1/completions it takes the schema as a top-level `json_schema`.
    The empty schema {} is sent as "json" is: llama-server takes it for no constraint, where Ollama
    makes a grammar of it.
    """
    if fmt is None or fmt == "":
        return {}
    if fmt in ("json", {}):
        if engine != "llama-server":
            return {"response_format": {"type": "json_object"}}
        schema: dict[str, Any] = {"type": "object"}
    elif isinstance(fmt, dict):
        schema = fmt
    else:
        raise TranslationError(f'format: must be "json" or a JSON schema object, not {describe(fmt)}')
    if completions and engine == "llama-server":
        return {"json_schema": schema}
    return {"response_format": schema_format(schema)}


def _image_head(image: object, path: str) -> tuple[str, str]:
    """(mime type, base64 text) of one Ollama image, from its first bytes only."""
    if not isinstance(image, str) or not image:
        raise TranslationError(f"{path}: must be a base64-encoded image, not {describe(image)}")
    text = image.strip()
    if any(c.isspace() for c in text[:1024]) or any(c.isspace() for c in text[-1024:]):
        text = "".join(text.split())  # base64 over lines: the engine wants it in one piece
    try:
        head = base64.b64decode(text[:24], validate=True)
    except (binascii.Error, ValueError):
        raise TranslationError(f"{path}: is not valid base64") from None
    mime = image_mime(head)
    if mime is None:
        raise TranslationError(f"{path}: is not PNG, JPEG, GIF, WebP or BMP (by its first bytes)")
    return mime, text


def image_data_url(image: object, path: str = "images[0]") -> str:
    """A data: URL for one Ollama image (base64, as the Ollama clients send them).

    Only the first bytes are decoded, to find the type: a large image costs no event-loop time here
    (supervisor/images.py decodes the whole picture, where the route asks it to).
    """
    if isinstance(image, str) and image.startswith("data:"):
        return image
    mime, text = _image_head(image, path)
    return f"data:{mime};base64,{text}"


def _images(images: object, path: str) -> list[object]:
    if images is None:
        return []
    if not isinstance(images, list):
        raise TranslationError(f"{path}: must be a list of base64-encoded images, not {describe(images)}")
    return images


def _content(text: object, images: object, path: str, images_path: str) -> str | list[dict[str, Any]]:
    """OpenAI content for Ollama text and images, found at `path` and `images_path` in the request."""
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise TranslationError(f"{path}: must be a string, not {describe(text)}")
    pictures = _images(images, images_path)
    if not pictures:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts += [
        {"type": "image_url", "image_url": {"url": image_data_url(image, f"{images_path}[{index}]")}}
        for index, image in enumerate(pictures)
    ]
    return parts


def tools_to_openai(tools: object) -> list[dict[str, Any]]:
    """Ollama's tool definitions already have OpenAI's shape; check them and default `type`."""
    if not isinstance(tools, list):
        raise TranslationError(f"tools: must be a list of tool definitions, not {describe(tools)}")
    out = []
    for index, tool in enumerate(tools):
        path = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise TranslationError(f'{path}: must be an object with a "function" object')
        _string(f"{path}.function.name", tool["function"].get("name"))
        if tool.get("type") not in (None, "function"):
            raise TranslationError(f'{path}.type: must be "function", not {describe(tool["type"])}')
        out.append(
            {**tool, "type": tool.get("type") or "function", "function": _without_nulls(tool["function"])}
        )
    return out


def _without_nulls(function: dict[str, Any]) -> dict[str, Any]:
    """A function definition without its null fields, nor its properties' (`description: null`, as a
    client writes a function without a docstring): Ollama reads null as "", llama-server refuses it."""
    out = {key: value for key, value in function.items() if value is not None}
    parameters = out.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if isinstance(parameters, dict) and isinstance(properties, dict):
        kept = {
            name: {k: v for k, v in spec.items() if v is not None} if isinstance(spec, dict) else spec
            for name, spec in properties.items()
        }
        out["parameters"] = {**parameters, "properties": kept}
    return out


def _tool_calls(calls: object, path: str, first_id: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls in OpenAI's shape: arguments a JSON string, each with an id."""
    if not isinstance(calls, list):
        raise TranslationError(f"{path}: must be a list, not {describe(calls)}")
    out = []
    for index, call in enumerate(calls):
        where = f"{path}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise TranslationError(f'{where}: must be an object with a "function" object')
        name = _string(f"{where}.function.name", function.get("name"))
        arguments = function.get("arguments") or {}
        if not isinstance(arguments, str | dict):
            raise TranslationError(
                f"{where}.function.arguments: must be an object or a JSON string, not {describe(arguments)}"
            )
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        call_id = call["id"] if isinstance(call.get("id"), str) else f"call_{first_id + index}"
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def assistant_prefill(messages: list[dict[str, Any]]) -> str:
    """The text of a chat's last message when it is the assistant's and plain text: what llama-server
    continues, and repeats at the start of its answer (Answer.prefill). Empty otherwise."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant" or last.get("tool_calls"):
        return ""
    content = last.get("content")
    return content if isinstance(content, str) else ""


def messages_to_openai(messages: object) -> list[dict[str, Any]]:
    """Ollama chat messages as OpenAI's: images become image_url parts, tool-call arguments JSON strings,
    and each role "tool" answer gets the id of the call it answers (by tool_name, else in order)."""
    if not isinstance(messages, list):
        raise TranslationError(f"messages: must be a list, not {describe(messages)}")
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, function name) of calls not yet answered
    calls = 0
    for index, message in enumerate(messages):
        path = f"messages[{index}]"
        if not isinstance(message, dict):
            raise TranslationError(f"{path}: must be an object, not {describe(message)}")
        role = _string(f"{path}.role", message.get("role"))
        for name in ("thinking", "tool_name", "name", "tool_call_id"):
            if message.get(name) is not None:
                _string(f"{path}.{name}", message[name])
        entry: dict[str, Any] = {
            "role": role,
            "content": _content(
                message.get("content"), message.get("images"), f"{path}.content", f"{path}.images"
            ),
        }
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"{path}.tool_calls", calls)
            calls += len(entry["tool_calls"])
            pending = [(c["id"], c["function"]["name"]) for c in entry["tool_calls"]]
        elif role == "tool":
            entry["tool_call_id"] = _answered_call(message, pending)
            if entry["tool_call_id"] is None:
                entry["tool_call_id"] = f"call_{calls}"
                calls += 1
        if message.get("thinking") and role == "assistant":
            entry["reasoning_content"] = message["thinking"]
        out.append(entry)
    return out


def _answered_call(message: dict[str, Any], pending: list[tuple[str, str]]) -> str | None:
    """The id of the call a role "tool" message answers, taken off `pending`: the id it names
    (LangChain sends `tool_call_id`), else the first pending call of the function it names (Ollama's own
    clients send `tool_name`), else the first pending call; None when no call is pending."""
    named = message.get("tool_call_id")
    answers = message.get("tool_name") or message.get("name")
    ids = [call_id for call_id, _ in pending]
    functions = [function for _, function in pending]
    if named in ids:
        at = ids.index(named)
    elif answers in functions:
        at = functions.index(answers)
    elif pending:
        at = 0
    else:
        return named if isinstance(named, str) else None
    return pending.pop(at)[0]


def _think_fields(think: object) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if think in ("low", "medium", "high"):
        return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": think}
    raise TranslationError(f'think: must be true, false, "low", "medium" or "high", not {describe(think)}')


def _sampling(body: dict[str, Any], engine: str) -> dict[str, Any]:
    return {
        **options_to_openai(body.get("options"), engine),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_request(body: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
    """The /v1/chat/completions body for an Ollama /api/chat body (always streamed from the engine)."""
    engine = manifest.engine
    out: dict[str, Any] = {
        "model": manifest.served_name,
        "messages": messages_to_openai(body.get("messages")),
    }
    out.update(_sampling(body, engine))
    out.update(format_to_openai(body.get("format"), engine))
    if body.get("tools") is not None:
        tools = tools_to_openai(body["tools"])
        if tools:
            out["tools"] = tools
    out.update(_think_fields(body.get("think")))
    return out


def generate_request(
    body: dict[str, Any], manifest: Manifest, templated: bool = True
) -> tuple[str, dict[str, Any]]:
    """(path, body) for an Ollama /api/generate body: raw prompts go to /v1/completions as they are,
    others to /v1/chat/completions as system + user messages, so that the model's chat template applies.

    A model without a chat template (`templated` false: a base model) has Ollama's default template,
    `{{ .Prompt }}`: its prompt goes as it is too, where the engine would wrap it in a template of its
    own choosing (llama-server: chatml), which a base model then continues."""
    engine = manifest.engine
    _check_generate_fields(body)
    if body.get("template"):
        raise TranslationError(
            "template: a custom template is not supported: the engine applies the model's own chat "
            "template; send raw: true with a prompt you formatted yourself"
        )
    if body.get("suffix"):
        raise TranslationError("suffix: fill-in-the-middle is not supported by this server")
    if body.get("context"):
        raise TranslationError("context: is not supported; send the conversation to /api/chat instead")
    prompt = body.get("prompt") or ""
    system = body.get("system")
    out: dict[str, Any] = {"model": manifest.served_name}
    raw = body.get("raw")
    if raw or not templated:
        if raw and system:
            # Ollama refuses this too: raw means the prompt is sent exactly as given.
            raise TranslationError("system: raw mode does not support template, system, or context")
        if body.get("images"):
            why = "they cannot be sent with raw: true" if raw else f"model '{manifest.name}' has none"
            raise TranslationError(f"images: need the chat template: {why}")
        out["prompt"] = prompt  # a base model's `system` goes nowhere, as `{{ .Prompt }}` uses none
        out.update(_sampling(body, engine))
        out.update(format_to_openai(body.get("format"), engine, completions=True))
        return "/v1/completions", out
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    user = _content(prompt, body.get("images"), "prompt", "images")
    messages.append({"role": "user", "content": user})
    out["messages"] = messages
    out.update(_sampling(body, engine))
    out.update(format_to_openai(body.get("format"), engine))
    out.update(_think_fields(body.get("think")))
    return "/v1/chat/completions", out


def _check_generate_fields(body: dict[str, Any]) -> None:
    _optional(body, "prompt", str, "a string")
    _optional(body, "system", str, "a string")
    _optional(body, "template", str, "a string")
    _optional(body, "suffix", str, "a string")
    _optional(body, "raw", bool, "true or false")
    _optional(body, "context", list, "a list of token ids")
    _images(body.get("images"), "images")


def embed_inputs(body: dict[str, Any], legacy: bool) -> list[str]:
    """The texts to embed: /api/embed's `input` (a string or a list), or legacy /api/embeddings' `prompt`."""
    name = "prompt" if legacy else "input"
    value = body.get(name)
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if legacy or not isinstance(value, list):
        what = "a string" if legacy else "a string or a list of strings"
        raise TranslationError(f"{name}: must be {what}, not {describe(value)}")
    for index, text in enumerate(value):
        _string(f"{name}[{index}]", text)
    return value


def embed_request(
    body: dict[str, Any], texts: list[str], manifest: Manifest, legacy: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": manifest.served_name, "input": texts}
    if legacy and manifest.engine == "llama-server":
        # Ollama's legacy /api/embeddings gives the vector as the model makes it (only /api/embed
        # normalizes); llama-server scales to unit length unless asked for none (-1).
        out["embd_normalize"] = -1
    dimensions = body.get("dimensions")
    if dimensions is not None and not legacy:
        # Checked, not sent: the route cuts and normalizes the vectors itself, for any model, as Ollama
        # does, where vLLM refuses `dimensions` for every model not trained for Matryoshka.
        _integer("dimensions", dimensions, *_DIMENSIONS)
    return out


def check_request(route: str, body: dict[str, Any]) -> None:
    """Raise TranslationError naming the field when a known field of an Ollama request has the wrong type
    or an out-of-range value: `route` is "chat", "generate", "embed" or "embeddings".

    The translation checks what it translates; this checks the rest too, and runs before a request with
    nothing to generate (no messages, no prompt) is answered by loading the model.
    """
    options_to_openai(body.get("options"), "llama-server")
    if route in ("chat", "generate"):
        format_to_openai(body.get("format"), "llama-server")
        _think_fields(body.get("think"))
        _optional(body, "truncate", bool, "true or false")
    if route == "chat":
        if body.get("messages") is not None:
            messages_to_openai(body["messages"])
        if body.get("tools") is not None:
            tools_to_openai(body["tools"])
    elif route == "generate":
        _check_generate_fields(body)
        for index, image in enumerate(_images(body.get("images"), "images")):
            image_data_url(image, f"images[{index}]")  # a data: URL too, as /api/chat takes it
    elif route in ("embed", "embeddings"):
        embed_inputs(body, legacy=route == "embeddings")
        _optional(body, "truncate", bool, "true or false")
        if route == "embed" and body.get("dimensions") is not None:
            _integer("dimensions", body["dimensions"], *_DIMENSIONS)


# --- answers -----------------------------------------------------------------------------------------

DONE = object()  # the SSE stream's `data: [DONE]`
# Called once per token: json's scanner and string encoder themselves, without json.loads/dumps' wrapping
# (decode's own Python around the scanner cost a third of a chunk's parse).
_scan = scanner_of(json.JSONDecoder())
_encode_string = json.encoder.encode_basestring


def sse_event(line: bytes) -> dict[str, Any] | object | None:
    """The JSON of one SSE `data:` line, DONE for `[DONE]`, None for anything else (blank, comments)."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return DONE
    try:
        text = data.decode()
        event, end = _scan(text, 0)  # `data` is stripped: no whitespace for decode to skip
    except (ValueError, StopIteration):  # UnicodeDecodeError is a ValueError; no value at all, a Stop
        return None
    return event if end == len(text) and isinstance(event, dict) else None


def engine_error_message(payload: object, fallback: str) -> str:
    """The message in an engine's error body (OpenAI's {"error": {"message"}}, or {"error": "..."})."""
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("message"))
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(payload.get("detail"), str):  # FastAPI (vLLM) validation errors
            return str(payload["detail"])
    return fallback


def done_reason(finish_reason: object) -> str:
    """Ollama's done_reason for an OpenAI finish_reason: "length" when cut off, else "stop"."""
    return "length" if finish_reason == "length" else "stop"


def created_at(wall_ns: int) -> str:
    """Ollama's timestamp: RFC 3339 in UTC, to the microsecond."""
    seconds, ns = divmod(wall_ns, 1_000_000_000)
    return f"{_second(seconds)}.{ns // 1000:06d}Z"


@functools.lru_cache(maxsize=4)
def _second(seconds: int) -> str:
    # Formatting a datetime for every token costs more than the rest of the line; a second is reused.
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def dump_line(obj: dict[str, Any]) -> bytes:
    """One NDJSON line."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def tool_call_to_ollama(call: dict[str, Any], index: int) -> dict[str, Any]:
    """One OpenAI tool call (arguments a JSON string) as Ollama's (arguments an object)."""
    function = call.get("function") or {}
    raw = function.get("arguments") or "{}"
    if isinstance(raw, str):
        try:
            arguments = json.loads(raw)
        except ValueError:
            arguments = {"value": raw}  # the model wrote something that is not JSON: keep it visible
    else:
        arguments = raw
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    out: dict[str, Any] = {
        "function": {"index": index, "name": function.get("name") or "", "arguments": arguments}
    }
    if call.get("id"):
        out["id"] = call["id"]
    return out


@dataclass
class ToolCallAccumulator:
    """OpenAI streams a tool call in pieces (name first, arguments as string fragments), keyed by index."""

    calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, deltas: list[dict[str, Any]]) -> None:
        for position, delta in enumerate(deltas):
            index = delta.get("index", position)
            call = self.calls.setdefault(index, {"id": None, "function": {"name": "", "arguments": ""}})
            if delta.get("id"):
                call["id"] = delta["id"]
            function = delta.get("function") or {}
            if function.get("name"):
                call["function"]["name"] += function["name"]
            if function.get("arguments"):
                arguments = function["arguments"]
                # Some servers send the arguments whole as an object rather than as string fragments.
                call["function"]["arguments"] += (
                    arguments if isinstance(arguments, str) else json.dumps(arguments)
                )

    def result(self) -> list[dict[str, Any]]:
        return [tool_call_to_ollama(self.calls[i], n) for n, i in enumerate(sorted(self.calls))]


@dataclass(frozen=True)
class Timing:
    """Monotonic nanosecond marks the route takes; Ollama's durations are differences of these."""

    arrived: int  # the request reached the daemon
    load: int  # nanoseconds acquire() spent because the model was not ready
    sent: int  # the request went to the engine


@dataclass
class Answer:
    """One answer being translated: feed it OpenAI events, get Ollama lines, end with `final()`."""

    model: str
    kind: Kind
    show_thinking: bool = True
    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    tools: ToolCallAccumulator = field(default_factory=ToolCallAccumulator)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    chunks: int = 0  # content-bearing events, the token count when the engine reports no usage
    first_token: int | None = None  # monotonic ns of the first generated text
    error: str | None = None
    # A chat's last message was the assistant's (a prefill, "continue this answer"): llama-server's answer
    # repeats its text before the continuation, and Ollama answers the continuation alone. What of it is
    # still to come, dropped from the content as it arrives (assistant_prefill).
    prefill: str = ""
    _head: bytes | None = None

    def feed(self, event: dict[str, Any], mono_ns: int) -> tuple[str, str] | None:
        """Take one OpenAI event; return (content, thinking) text it adds, or None when it adds none."""
        if event.get("error") is not None:
            self.error = engine_error_message(event, "the engine reported an error")
            return None
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        if isinstance(event.get("timings"), dict):
            self.timings = event["timings"]
        choices = event.get("choices")
        if not choices:
            return None
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if self.kind == "generate" and "text" in choice:
            text, reasoning = choice.get("text") or "", ""
        else:
            delta = choice.get("delta") or choice.get("message") or {}
            if delta.get("tool_calls"):
                self.tools.add(delta["tool_calls"])
                if self.first_token is None:
                    self.first_token = mono_ns
            text = delta.get("content") or ""
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            if not self.show_thinking:
                reasoning = ""
        if text and self.prefill:
            text = self._past_prefill(text)
        if not text and not reasoning:
            return None
        if self.first_token is None:
            self.first_token = mono_ns
        self.chunks += 1
        if text:
            self.content.append(text)
        if reasoning:
            self.thinking.append(reasoning)
        return text, reasoning

    def _past_prefill(self, text: str) -> str:
        """`text` without what it repeats of the prefill; at the first difference, nothing more is dropped."""
        if text.startswith(self.prefill):
            text, self.prefill = text[len(self.prefill) :], ""
        elif self.prefill.startswith(text):
            text, self.prefill = "", self.prefill[len(text) :]
        else:
            self.prefill = ""
        return text

    def chunk(self, text: str, reasoning: str, wall_ns: int) -> dict[str, Any]:
        """The streamed line for text that `feed` returned."""
        line: dict[str, Any] = {"model": self.model, "created_at": created_at(wall_ns)}
        self._put_text(line, text, reasoning)
        line["done"] = False
        return line

    def _put_text(
        self, line: dict[str, Any], text: str, reasoning: str, calls: list[dict[str, Any]] | None = None
    ) -> None:
        """Chat answers carry text in `message`, generate answers in `response`."""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = calls
            line["message"] = message
        else:
            line["response"] = text
            if reasoning:
                line["thinking"] = reasoning

    def chunk_line(self, text: str, reasoning: str, wall_ns: int) -> bytes:
        """`chunk` as an NDJSON line; plain text (every token of most answers) is spliced, not dumped."""
        if reasoning:
            return dump_line(self.chunk(text, reasoning, wall_ns))
        if self._head is None:
            model = json.dumps(self.model, ensure_ascii=False)
            self._head = f'{{"model":{model},"created_at":"'.encode()
        middle = b'","message":{"role":"assistant","content":' if self.kind == "chat" else b'","response":'
        tail = b'},"done":false}\n' if self.kind == "chat" else b',"done":false}\n'
        return b"".join(
            (
                self._head,
                created_at(wall_ns).encode(),
                middle,
                _encode_string(text).encode(),
                tail,
            )
        )

    def tool_chunk(self, wall_ns: int) -> dict[str, Any] | None:
        """The streamed line with the accumulated tool calls, sent once, just before the final line."""
        calls = self.tools.result()
        if not calls or self.kind != "chat":
            return None
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        return {"model": self.model, "created_at": created_at(wall_ns), "message": message, "done": False}

    def stats(self, timing: Timing, mono_ns: int) -> dict[str, int]:
        """Ollama's counts and durations (ns): from the engine's usage and timings when it sends them
        (llama-server does), else measured here: request sent to first token, first token to the end."""
        usage = self.usage or {}
        timings = self.timings or {}
        first = self.first_token if self.first_token is not None else mono_ns
        prompt_count = usage.get("prompt_tokens")
        if prompt_count is None and isinstance(computed := timings.get("prompt_n"), int | float):
            cached = timings.get("cache_n")  # served from the cache: counted in usage, not in prompt_n
            prompt_count = computed + (cached if isinstance(cached, int | float) else 0)
        eval_count = usage.get("completion_tokens", timings.get("predicted_n", self.chunks))
        prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
        stats = {
            "total_duration": mono_ns - timing.arrived,
            "load_duration": timing.load,
            "prompt_eval_count": int(prompt_count or 0),
            "prompt_eval_duration": round(prompt_ms * 1e6)
            if isinstance(prompt_ms, int | float)
            else max(0, first - timing.sent),
            "eval_count": int(eval_count or 0),
            "eval_duration": round(predicted_ms * 1e6)
            if isinstance(predicted_ms, int | float)
            else max(0, mono_ns - first),
        }
        return stats

    def final(self, timing: Timing, mono_ns: int, wall_ns: int, whole: bool) -> dict[str, Any]:
        """The last line (`done: true`, done_reason, statistics). With `whole` (stream: false), it carries
        the entire answer: text, thinking and tool calls."""
        line: dict[str, Any] = {"model": self.model, "created_at": created_at(wall_ns)}
        text = "".join(self.content) if whole else ""
        reasoning = "".join(self.thinking) if whole else ""
        self._put_text(line, text, reasoning, self.tools.result() if whole else None)
        line["done"] = True
        line["done_reason"] = done_reason(self.finish_reason)
        line.update(self.stats(timing, mono_ns))
        return line


def lifecycle_answer(
    model: str, kind: Kind, reason: str, wall_ns: int, durations: dict[str, int]
) -> dict[str, Any]:
    """The answer to a request with nothing to generate: done_reason "load" or "unload"."""
    line: dict[str, Any] = {"model": model, "created_at": created_at(wall_ns)}
    if kind == "chat":
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    line["done"] = True
    line["done_reason"] = reason
    line.update(durations)
    return line


def embed_answer(
    model: str, vectors: list[bytes], legacy: bool, durations: dict[str, int], prompt_tokens: int | None
) -> bytes:
    """Ollama's /api/embed (or legacy /api/embeddings) answer around the vectors of an OpenAI embeddings
    answer, as their JSON text (embedding_dimensions.vectors_in_order): written around them, not decoded
    and encoded again (megabytes for a batch, on the event loop)."""
    if legacy:
        return b'{"embedding": ' + (vectors[0] if vectors else b"[]") + b"}"
    head = json.dumps({"model": model})[:-1]  # without its closing brace
    tail = json.dumps({**durations, "prompt_eval_count": prompt_tokens or 0})[1:]  # without its opening one
    return b"".join((head.encode(), b', "embeddings": [', b", ".join(vectors), b"], ", tail.encode()))
