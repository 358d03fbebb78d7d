"""Ollama's inference routes (/api/chat, /api/generate, /api/embed, /api/embeddings) on OpenAI children.

Each request is translated (supervisor/ollama_translate.py) into the OpenAI request the child serves, and
the answer back into Ollama's: NDJSON written line by line as the engine's SSE events arrive, or one JSON
object with `"stream": false`. The engine is always asked to stream, so that the daemon sees the first
token and can time it when the engine reports no timings of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from typing import Any, Final

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from supervisor import access, capabilities, embedding_dimensions, errors, ollama_context, proxy
from supervisor import ollama_translate as translate
from supervisor.api.context import (
    ACCESS,
    FLEET,
    REQUEST_CLIENT,
    REQUEST_MODEL,
    REQUEST_OUTCOME,
    SCHEDULER,
    UPSTREAM,
)
from supervisor.api.openai import (
    Scheduling,
    authorize,
    keep_prompt_cache_private,
    note_named_model,
    note_ticket,
    note_wait,
    salt_prefix_cache,
    send_to_child,
    take_scheduling,
)
from supervisor.bodies import parse_body
from supervisor.fleet import HOP_HEADER
from supervisor.images import check_images
from supervisor.metrics import CLIENT_GONE, REQUEST_ERROR, TRACE, Trace
from supervisor.output_limits import cap_output_tokens
from supervisor.scheduler import Scheduler, Ticket
from supervisor.slots import ModelSlot, SlotState

log = structlog.get_logger("ollama")

routes = web.RouteTableDef()

_NDJSON = "application/x-ndjson"
_JSON_HEADERS = CIMultiDict({"Content-Type": "application/json"})
_MAX_ERROR_BODY = 64 * 1024


class _Request:
    """What every Ollama inference request starts with: its body, scheduling fields and model slot."""

    def __init__(
        self, request: web.Request, payload: dict[str, Any], scheduling: Scheduling, slot: ModelSlot
    ):
        self.request = request
        self.payload = payload
        self.scheduling = scheduling
        self.slot = slot
        self.arrived = time.perf_counter_ns()
        self.trace: Trace | None = request.get(TRACE)
        # The ticket the request holds now: a send to a child found gone replaces it (send_to_child), and
        # a helper that raises after that, before handing the new one back, must not leave it held.
        self.ticket: Ticket | None = None

    @property
    def has_schema(self) -> bool:
        """The request's `format` is a JSON schema (the engine is sent it as `json_schema`)."""
        return isinstance(self.payload.get("format"), dict)

    @property
    def scheduler(self) -> Scheduler:
        return self.request.app[SCHEDULER]

    async def acquire(self) -> tuple[Ticket, int]:
        """A ticket, and the nanoseconds spent waiting for the model to load (Ollama's load_duration)."""
        ticket = await self.scheduler.acquire(
            self.payload["model"],
            self.scheduling.keep_alive,
            self.scheduling.priority,
            self.scheduling.client_id,
            self.scheduling.session,
        )
        note_ticket(self.request, ticket)
        note_wait(self.request, ticket.queue_s, ticket.load_s)
        self.ticket = ticket
        return ticket, round(ticket.load_s * 1e9)

    def release(self) -> None:
        """Give back the ticket the request holds, whichever it is by now."""
        if self.ticket is not None:
            self.ticket.release()

    async def open_upstream(
        self, ticket: Ticket, path: str, body: bytes, stream: bool
    ) -> tuple[Ticket, aiohttp.ClientResponse]:
        """The child's response head and the ticket it came through (see openai.send_to_child)."""

        async def send(ticket: Ticket) -> aiohttp.ClientResponse:
            return await proxy.open_upstream(
                self.request.app[UPSTREAM],
                "POST",
                ticket.endpoint,
                path,
                body,
                _JSON_HEADERS,
                ticket.slot.name,
                stream,
                api_key=ticket.api_key,
                request_id=None if self.trace is None else self.trace.request_id,
            )

        ticket, upstream = await send_to_child(self.request, ticket, send)
        self.ticket = ticket
        return ticket, upstream


async def _start(request: web.Request) -> _Request:
    arrived = time.perf_counter_ns()
    request[REQUEST_MODEL] = "(unresolved)"  # counted and logged even when it fails before a model is known
    payload = parse_body(await request.read())
    try:
        scheduling = take_scheduling(payload, request.headers)
    except errors.SupervisorError:
        note_named_model(request, payload.get("model"))  # counted under it, as on the OpenAI routes
        raise
    request[REQUEST_CLIENT] = scheduling.client_id
    slot, scheduling = authorize(request, payload["model"], scheduling)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise errors.bad_request(f"stream must be true or false, not {stream!r}")
    started = _Request(request, payload, scheduling, slot)
    started.arrived = arrived
    return started


async def _forwarded(req: _Request) -> web.StreamResponse | None:
    """In a fleet, the answer of the node this request is better served on (fleet/routing.py); None to
    serve it here. A request another node forwarded is served here."""
    fleet = req.request.app.get(FLEET)
    if fleet is None or HOP_HEADER in req.request.headers:
        return None
    from supervisor.fleet import routing  # with the fleet's modules: only in a fleet

    nodes = await routing.elsewhere(fleet, req.scheduler, req.slot, req.scheduling.priority)
    if not nodes:
        return None
    req.request[REQUEST_MODEL] = req.slot.name
    payload = dict(req.payload)
    # The client's key is known only here: the node that serves it keeps this salt (_salt_for_vllm).
    salt_prefix_cache(payload, access.caller(req.request), req.request.app[ACCESS])
    body = routing.hop_body(payload, req.scheduling, json.dumps(payload).encode(), req.slot.name)
    return await routing.forward(req.request, fleet, nodes, body)


def _salt_for_vllm(body: dict[str, Any], req: _Request) -> None:
    """A vLLM prefix-cache salt of the caller's key's own, as on the OpenAI routes (`salt_prefix_cache`
    says why). A request another node forwarded carries the salt that node made for its client's key
    in its Ollama body (`_forwarded`): kept when the node key and the hop header say it is one."""
    hop = HOP_HEADER in req.request.headers
    carried = req.payload.get("cache_salt")
    if hop and isinstance(carried, str):
        body["cache_salt"] = carried
    salt_prefix_cache(body, access.caller(req.request), req.request.app[ACCESS], hop)


def _images_of(payload: dict[str, Any], kind: translate.Kind, max_images: int) -> list[tuple[str, object]]:
    """The request's images by field (`images`, `messages[1].images`); a 400 when there are more than
    `max_images` over all messages."""
    found: list[tuple[str, object]] = []
    if kind == "generate" and payload.get("images") is not None:
        found.append(("images", payload["images"]))
    messages = payload.get("messages") if kind == "chat" else None
    if isinstance(messages, list):
        found += [
            (f"messages[{i}].images", m["images"])
            for i, m in enumerate(messages)
            if isinstance(m, dict) and m.get("images") is not None
        ]
    total = sum(len(images) for _, images in found if isinstance(images, list))
    if total > max_images:
        raise errors.bad_request(f"images: {total} images in one request; at most {max_images} (max_images)")
    return found


async def _check_images(found: list[tuple[str, object]], max_images: int) -> None:
    """Each image a decodable picture, else 400. Decoding runs in a thread: its cost grows with the pixels."""
    for field, images in found:
        await asyncio.to_thread(check_images, images, max_images, field)


def _bad(exc: translate.TranslationError) -> errors.SupervisorError:
    return errors.bad_request(str(exc))


async def _lifecycle(req: _Request, kind: translate.Kind) -> web.Response:
    """Nothing to generate: load the model (done_reason "load"), or with keep_alive 0 unload it."""
    model = req.payload["model"]
    if req.scheduling.keep_alive == 0:
        if req.scheduler.unload(model) is None:
            raise errors.model_not_found(model)
        req.request[REQUEST_MODEL] = req.slot.name
        durations = {"total_duration": time.perf_counter_ns() - req.arrived}
        return web.json_response(translate.lifecycle_answer(model, kind, "unload", time.time_ns(), durations))
    load_ns = await _load(req)
    durations = {"total_duration": time.perf_counter_ns() - req.arrived, "load_duration": load_ns}
    return web.json_response(translate.lifecycle_answer(model, kind, "load", time.time_ns(), durations))


async def _load(req: _Request) -> int:
    """A request with nothing to generate: the model loaded, with the request's keep_alive; the
    nanoseconds spent loading it (Ollama's load_duration). A model already up is answered at once, as
    Ollama answers it: taking a ticket waited for a free slot, behind every answer being generated
    (`ollama run` and UIs send this to preload or ping a model)."""
    slot = req.slot
    if slot.state == SlotState.READY and not slot.stale:
        req.request[REQUEST_MODEL] = slot.name
        # Sets its keep_alive and restarts the timer, as a ticket would; loads no other replica.
        await req.scheduler.load(slot.name, req.scheduling.keep_alive, replicas=1)
        return 0
    _, load_ns = await req.acquire()
    req.release()
    return load_ns


async def _read_at_most(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or its first `limit` bytes: `content.read(n)` stops at what one chunk brought."""
    parts: list[bytes] = []
    size = 0
    while size < limit and (chunk := await upstream.content.read(limit - size)):
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


async def _error_body(upstream: aiohttp.ClientResponse) -> object:
    """The engine's error answer as JSON, None when it is not JSON."""
    try:
        return json.loads(await _read_at_most(upstream, _MAX_ERROR_BODY))
    except (aiohttp.ClientError, ValueError):
        return None


_SCHEMA_FAILED: Final = "JSON schema conversion failed"
# llama-server's other words for a schema it cannot use (a keyword of the wrong type, say), which blame a
# chat template, or name the `json_schema` field it was sent: said as the `format` they are about only
# when the request had a schema.
_SCHEMA_REFUSALS: Final = ("Automatic parser generation failed", "Field 'json_schema'")
_JSON_DETAIL: Final = "[json.exception"


def _as_engine_error(
    payload: object, status: int, model: str, schema: bool = False
) -> errors.SupervisorError:
    """The engine's own error status and message, as an Ollama error. A `format` schema llama-server
    cannot turn into a grammar is said to be that: its words blamed a chat template, or a `json_schema`
    field the client never sent (`schema`: the request had one)."""
    message = translate.engine_error_message(payload, f"model '{model}' answered HTTP {status}")
    detail: str | None = None
    if status == 400 and _SCHEMA_FAILED in message:
        detail = message[message.index(_SCHEMA_FAILED) + len(_SCHEMA_FAILED) :].strip(" :\n")
    elif status == 400 and schema and any(words in message for words in _SCHEMA_REFUSALS):
        detail = message[message.index(_JSON_DETAIL) :] if _JSON_DETAIL in message else message
    if detail is not None:
        message = f"format: the engine cannot hold the answer to this JSON schema: {detail}"
    if status == 500 and (code := proxy.client_fault_code(message.encode())) is not None:
        return errors.SupervisorError(code, message, 400)  # the client's to fix, as the OpenAI routes say
    return errors.engine_error(message, status)


async def _engine_error(upstream: aiohttp.ClientResponse, model: str) -> errors.SupervisorError:
    return _as_engine_error(await _error_body(upstream), upstream.status, model)


def _refused_prompt(
    payload: object, status: int, slot: ModelSlot, schema: bool = False
) -> errors.SupervisorError:
    """The engine's refusal of a prompt, as an Ollama error; one too long for the context in the daemon's
    words: llama-server's "try increasing it" names nothing a client can change (num_ctx above the
    limit is refused), nor where the limit comes from."""
    n_ctx = ollama_context.context_size(payload)
    if n_ctx is None:
        return _as_engine_error(payload, status, slot.name, schema)
    detail = payload["error"] if isinstance(payload, dict) else {}
    tokens = detail.get("n_prompt_tokens") if isinstance(detail, dict) else None
    prompt = f"the prompt ({tokens} tokens)" if isinstance(tokens, int) else "the prompt"
    limit = translate.context_limit(slot.launch_in_effect())
    why = f" ({limit[1]})" if limit is not None else ""
    return errors.bad_request(
        f"{prompt} is longer than the {n_ctx} tokens of context a request to model '{slot.name}' "
        f"gets{why}; shorten it, or raise ctx_size (or lower parallel) in the model's manifest"
    )


async def _context_refusal(
    upstream: aiohttp.ClientResponse, model: str, schema: bool
) -> tuple[object, int, int]:
    """The child's refusal of a prompt longer than its context: its body, its status and the context
    size it names. Any other refusal is raised as the engine's error (`schema`: see _as_engine_error)."""
    async with upstream:
        refusal, status = await _error_body(upstream), upstream.status
    n_ctx = ollama_context.context_size(refusal)
    if n_ctx is None:
        raise _as_engine_error(refusal, status, model, schema)
    return refusal, status, n_ctx


async def _open_chat(
    req: _Request, ticket: Ticket, body: dict[str, Any], truncate: bool, answer: translate.Answer
) -> tuple[Ticket, aiohttp.ClientResponse]:
    """The child's answer to a chat; with `truncate`, a chat too long for the context is sent again
    without its oldest messages, as Ollama sends it (supervisor/ollama_context.py). `answer` learns the
    prefill that the messages sent end with (llama-server repeats it)."""
    if req.slot.manifest.engine == "llama-server":
        answer.prefill = translate.assistant_prefill(body["messages"])
    ticket, upstream = await req.open_upstream(
        ticket, "/v1/chat/completions", json.dumps(body).encode(), True
    )
    if upstream.status == 200 or not truncate:
        return ticket, upstream
    name = ticket.slot.name
    refusal, status, n_ctx = await _context_refusal(upstream, name, req.has_schema)

    async def tokens_of(messages: ollama_context.Messages) -> int:
        nonlocal ticket
        ticket, templated = await _child_json(req, ticket, "/apply-template", {**body, "messages": messages})
        prompt = templated.get("prompt") if isinstance(templated, dict) else None
        if not isinstance(prompt, str):
            raise errors.upstream_failed(name, "the engine could not count the chat's tokens")
        ticket, tokens = await _tokenized(req, ticket, prompt, True)
        return len(tokens)

    async def text_tokens(text: str) -> list[int]:
        nonlocal ticket
        ticket, tokens = await _tokenized(req, ticket, text, False)
        return tokens

    async def text_of(tokens: list[int]) -> str:
        nonlocal ticket
        ticket, text = await _detokenized(req, ticket, tokens)
        return text

    messages = body["messages"]
    budget = ollama_context.prompt_budget(body, n_ctx)
    kept = await ollama_context.cut_to_fit(messages, budget, tokens_of)
    last_cut = kept is None  # not even the last message fits: its text loses its start
    if kept is None:
        shortest = ollama_context.shortest(messages)
        kept = await ollama_context.cut_last_text(shortest, budget, tokens_of, text_tokens, text_of)
    if kept is None:
        raise _refused_prompt(refusal, status, ticket.slot, req.has_schema)  # system prompts alone too long
    log.info(
        "chat_truncated",
        model=name,
        dropped=len(messages) - len(kept),
        last_message_cut=last_cut,
        n_ctx=n_ctx,
        budget=budget,
    )
    body = {**body, "messages": kept}
    answer.prefill = translate.assistant_prefill(kept)  # its start may have been cut (llama-server only)
    return await req.open_upstream(ticket, "/v1/chat/completions", json.dumps(body).encode(), True)


async def _open_raw(
    req: _Request, ticket: Ticket, body: dict[str, Any], truncate: bool
) -> tuple[Ticket, aiohttp.ClientResponse]:
    """The child's answer to a raw prompt; with `truncate`, one too long for the context is sent again
    as its first and last tokens, as Ollama's runner cuts it (supervisor/ollama_context.py)."""
    ticket, upstream = await req.open_upstream(ticket, "/v1/completions", json.dumps(body).encode(), True)
    if upstream.status == 200 or not truncate:
        return ticket, upstream
    _, _, n_ctx = await _context_refusal(upstream, ticket.slot.name, req.has_schema)
    budget = ollama_context.prompt_budget(body, n_ctx)
    ticket, tokens = await _tokenized(req, ticket, body["prompt"], True)
    cut = ollama_context.cut_raw(tokens, budget)
    log.info(
        "prompt_truncated", model=ticket.slot.name, dropped=len(tokens) - len(cut), n_ctx=n_ctx, budget=budget
    )
    body = {**body, "prompt": cut}  # as tokens: a text made of tokens may not split into them again
    return await req.open_upstream(ticket, "/v1/completions", json.dumps(body).encode(), True)


async def _embeddings(
    req: _Request, ticket: Ticket, body: dict[str, Any], truncate: bool
) -> tuple[Ticket, bytes]:
    """The child's embeddings (its JSON answer, not decoded). With `truncate`, inputs llama-server refused
    as longer than it takes at once are cut to fit, as Ollama cuts them, and sent one at a time: inputs
    embedded together share its context."""
    name = ticket.slot.name
    ticket, upstream = await req.open_upstream(ticket, "/v1/embeddings", json.dumps(body).encode(), False)
    async with upstream:
        if upstream.status == 200:
            try:
                return ticket, await upstream.read()
            except aiohttp.ClientError as exc:
                raise errors.model_crashed(name, "the answer was cut short") from exc
        refusal, status = await _error_body(upstream), upstream.status
    limit = ollama_context.embedding_limit(refusal)
    if limit is None:
        raise _as_engine_error(refusal, status, name)
    if not truncate:  # the client's input, not the engine, is at fault: Ollama's 400, not a 502
        raise errors.bad_request(ollama_context.too_long_to_embed(refusal, limit, name))

    async def tokens_of(text: str, special: bool) -> list[int]:
        nonlocal ticket
        ticket, tokens = await _tokenized(req, ticket, text, special)
        return tokens

    async def cut(text: str) -> str:
        """`text`'s start that the engine takes: cut to the limit less what the engine adds (BOS, CLS,
        SEP...), then one token shorter each time the cut text's own tokens still do not fit (a text
        made of tokens does not always split into the same tokens again)."""
        nonlocal ticket
        tokens = await tokens_of(text, False)
        keep = limit - len(await tokens_of("", True))
        for _ in range(ollama_context.CUT_TRIES):
            if keep <= 0 or len(await tokens_of(text, True)) <= limit:
                break
            ticket, text = await _detokenized(req, ticket, tokens[:keep])
            keep -= 1
        return text

    data, prompt_tokens = [], 0
    for index, text in enumerate(body["input"]):
        ticket, one = await _child_json(req, ticket, "/v1/embeddings", {**body, "input": [await cut(text)]})
        found = one.get("data") if isinstance(one, dict) else None
        if not isinstance(found, list) or len(found) != 1 or not isinstance(found[0], dict):
            raise errors.upstream_failed(name, "the engine's embeddings response has no data")
        data.append({**found[0], "index": index})
        usage = one.get("usage") if isinstance(one, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            prompt_tokens += usage["prompt_tokens"]
    log.info("embed_input_truncated", model=name, limit=limit, inputs=len(data))
    return ticket, json.dumps({"data": data, "usage": {"prompt_tokens": prompt_tokens}}).encode()


async def _tokenized(req: _Request, ticket: Ticket, text: str, special: bool) -> tuple[Ticket, list[int]]:
    """`text`'s tokens as the child counts them (llama-server's /tokenize), with the special tokens it
    adds itself (BOS...) when `special`."""
    ticket, answer = await _child_json(req, ticket, "/tokenize", {"content": text, "add_special": special})
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        raise errors.upstream_failed(ticket.slot.name, "the engine could not count the tokens")
    return ticket, tokens


async def _detokenized(req: _Request, ticket: Ticket, tokens: list[int]) -> tuple[Ticket, str]:
    """The text of `tokens` (llama-server's /detokenize)."""
    ticket, answer = await _child_json(req, ticket, "/detokenize", {"tokens": tokens})
    content = answer.get("content") if isinstance(answer, dict) else None
    if not isinstance(content, str):
        raise errors.upstream_failed(ticket.slot.name, "the engine could not cut the prompt")
    return ticket, content


async def _child_json(
    req: _Request, ticket: Ticket, path: str, body: dict[str, Any]
) -> tuple[Ticket, object]:
    """A JSON answer of the child's (llama-server's /apply-template, /tokenize)."""
    ticket, upstream = await req.open_upstream(ticket, path, json.dumps(body).encode(), False)
    async with upstream:
        if upstream.status != 200:
            raise await _engine_error(upstream, ticket.slot.name)
        try:
            return ticket, json.loads(await upstream.read())
        except (aiohttp.ClientError, ValueError) as exc:
            raise errors.upstream_failed(ticket.slot.name, f"{path} answered with no JSON: {exc}") from exc


async def _generation(request: web.Request, kind: translate.Kind) -> web.StreamResponse:
    req = await _start(request)
    payload, manifest = req.payload, req.slot.manifest
    try:
        translate.check_request(kind, payload)
        # Before a load request is answered too: a UI preloads with the options it will use.
        translate.check_num_ctx(payload.get("options"), req.slot.launch_in_effect())
    except translate.TranslationError as exc:
        raise _bad(exc) from None
    max_images = req.scheduler.settings.max_images
    images = _images_of(payload, kind, max_images)
    # Before the pictures are decoded: a model that takes none refuses them however good they are.
    await capabilities.check(manifest, capabilities.ollama_needs(kind, payload))
    await _check_images(images, max_images)
    try:
        if kind == "chat":
            if not payload.get("messages"):
                return await _lifecycle(req, kind)
            path, body = "/v1/chat/completions", translate.chat_request(payload, manifest)
        else:
            if not payload.get("prompt") and not payload.get("images"):
                return await _lifecycle(req, kind)
            templated = "chat" in await capabilities.capabilities_of(manifest)
            path, body = translate.generate_request(payload, manifest, templated)
    except translate.TranslationError as exc:
        raise _bad(exc) from None
    cap_output_tokens(body, manifest.max_output_tokens)
    if manifest.engine == "vllm":
        _salt_for_vllm(body, req)
    else:
        keep_prompt_cache_private(body, manifest)
    stream = payload.get("stream") is not False
    answer = translate.Answer(payload["model"], kind, show_thinking=payload.get("think") is not False)
    # Ollama cuts a chat or prompt longer than the context unless told not to; vLLM's refusal carries no size.
    truncate = payload.get("truncate") is not False and manifest.engine == "llama-server"

    if (forwarded := await _forwarded(req)) is not None:
        return forwarded
    ticket, load_ns = await req.acquire()
    limit_s = manifest.request_timeout_s
    # The generation's deadline: leaving `async with upstream` at it closes the connection, which stops it.
    deadline = None if limit_s is None else asyncio.get_running_loop().time() + limit_s
    try:
        name = ticket.slot.name
        timing = translate.Timing(req.arrived, load_ns, time.perf_counter_ns())
        try:
            async with asyncio.timeout_at(deadline):
                if path == "/v1/chat/completions":  # a chat, or a prompt with the model's template
                    ticket, upstream = await _open_chat(req, ticket, body, truncate, answer)
                else:
                    ticket, upstream = await _open_raw(req, ticket, body, truncate)
        except TimeoutError:
            raise errors.generation_timeout(name, limit_s or 0) from None
        async with upstream:  # leaving it closes the connection: a client gone cancels the generation
            if upstream.status != 200:
                raise _refused_prompt(
                    await _error_body(upstream), upstream.status, ticket.slot, req.has_schema
                )
            if stream:
                return await _stream(request, upstream, answer, timing, ticket, deadline, limit_s)
            try:
                async with asyncio.timeout_at(deadline):
                    return await _whole(upstream, answer, timing, ticket, req.trace)
            except TimeoutError:
                raise errors.generation_timeout(name, limit_s or 0) from None
    finally:
        req.release()


async def _events(upstream: aiohttp.ClientResponse) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The engine's SSE events, in batches of what has arrived so far, up to [DONE].

    Raises aiohttp.ClientError if the child dies. Reading whatever is there (not line by line) lets one
    write carry several tokens when the engine is ahead of us, as the plain proxy does.
    """
    pending = b""
    while chunk := await upstream.content.readany():
        *lines, pending = (pending + chunk).split(b"\n")
        batch: list[dict[str, Any]] = []
        for line in lines:
            event = translate.sse_event(line)
            if event is translate.DONE:
                if batch:
                    yield batch
                return
            if isinstance(event, dict):
                batch.append(event)
        if batch:
            yield batch


async def _stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    answer: translate.Answer,
    timing: translate.Timing,
    ticket: Ticket,
    deadline: float | None,
    limit_s: float | None,
) -> web.StreamResponse:
    trace: Trace | None = request.get(TRACE)
    model = ticket.slot.name
    response = web.StreamResponse(headers={"Content-Type": _NDJSON})
    await response.prepare(request)
    try:
        if (
            failed := await _relay(response, upstream, answer, timing, ticket, deadline, limit_s, trace)
        ) is not None:
            request[REQUEST_OUTCOME], request[REQUEST_ERROR] = failed
    except ConnectionResetError:
        # The client went away (aiohttp's ClientConnectionResetError on write). Leaving closes the
        # upstream connection, which is how the engine learns to stop generating.
        log.debug("client_gone", model=model)
        request[REQUEST_OUTCOME] = CLIENT_GONE  # counted as the client's leaving, not as the head's 200
    return response


async def _relay(
    response: web.StreamResponse,
    upstream: aiohttp.ClientResponse,
    answer: translate.Answer,
    timing: translate.Timing,
    ticket: Ticket,
    deadline: float | None,
    limit_s: float | None,
    trace: Trace | None,
) -> tuple[int, str] | None:
    """Copy the engine's events to the client as NDJSON lines; the last says done, or what went wrong.
    The status and error code of what went wrong, None when nothing did."""
    model, child = ticket.slot.name, ticket.process
    error = None
    failed, code = 502, "upstream_error"  # the engine's own error in the stream
    try:
        async with asyncio.timeout_at(deadline), contextlib.aclosing(_events(upstream)) as events:
            async for batch in events:
                mono_ns, wall_ns = time.perf_counter_ns(), time.time_ns()
                lines = []
                for event in batch:
                    text = answer.feed(event, mono_ns)
                    if answer.error is not None:
                        error = answer.error
                        break
                    if text is not None:
                        lines.append(answer.chunk_line(text[0], text[1], wall_ns))
                if lines:
                    # Written as soon as they arrive: the client sees each token as the engine makes it.
                    await response.write(b"".join(lines))
                if error is not None:
                    break
        if error is None and answer.finish_reason is None and answer.usage is None:
            crashed = errors.cut_short(model, child, "the stream ended before the answer did")
            error, failed, code = crashed.message, crashed.status, crashed.code
    except TimeoutError:
        timed_out = errors.generation_timeout(model, limit_s or 0)
        error, failed, code = timed_out.message, timed_out.status, timed_out.code
    except aiohttp.ClientError as exc:
        if isinstance(exc, ConnectionResetError):
            raise  # our client, not the child, is gone
        # The child died mid-stream: end the stream with an error the client can see, not a hang.
        log.warning("upstream_cut", model=model, error=repr(exc))
        crashed = errors.cut_short(model, child, "the stream was cut short")
        error, failed, code = crashed.message, crashed.status, crashed.code
    if error is not None:
        if trace is not None and answer.first_token is not None:
            trace.first_token = answer.first_token / 1e9  # it came, however the stream ended
        await response.write(translate.dump_line({"error": error}))
    else:
        end = []
        if (tools := answer.tool_chunk(time.time_ns())) is not None:
            end.append(translate.dump_line(tools))
        final = answer.final(timing, time.perf_counter_ns(), time.time_ns(), whole=False)
        end.append(translate.dump_line(final))
        if trace is not None:
            _count(trace, answer, final)
        await response.write(b"".join(end))
    await response.write_eof()
    return None if error is None else (failed, code)


def _count(trace: Trace, answer: translate.Answer, final: dict[str, Any]) -> None:
    """The trace's first token and token counts, from the answer's last line (Ollama's own statistics)."""
    if answer.first_token is not None:
        trace.first_token = answer.first_token / 1e9
    output, eval_ns = final["eval_count"], final["eval_duration"]
    rate = output / (eval_ns / 1e9) if output and eval_ns > 0 else None
    trace.counted(final["prompt_eval_count"], output, rate, time.perf_counter())


async def _whole(
    upstream: aiohttp.ClientResponse,
    answer: translate.Answer,
    timing: translate.Timing,
    ticket: Ticket,
    trace: Trace | None,
) -> web.Response:
    model, child = ticket.slot.name, ticket.process
    try:
        async with contextlib.aclosing(_events(upstream)) as events:
            async for batch in events:
                mono_ns = time.perf_counter_ns()
                for event in batch:
                    answer.feed(event, mono_ns)
                    if answer.error is not None:
                        raise errors.engine_error(answer.error, 502)
    except aiohttp.ClientError as exc:
        raise errors.cut_short(model, child, "the answer was cut short") from exc
    if answer.finish_reason is None and answer.usage is None:
        raise errors.cut_short(model, child, "the stream ended before the answer did")
    final = answer.final(timing, time.perf_counter_ns(), time.time_ns(), whole=True)
    if trace is not None:
        _count(trace, answer, final)
    return web.Response(body=translate.dump_line(final)[:-1], content_type="application/json")


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    """Ollama chat: NDJSON by default, one object with "stream": false."""
    return await _generation(request, "chat")


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    """Ollama completion of a prompt: through the chat template, or as it is with "raw": true."""
    return await _generation(request, "generate")


async def _embed(request: web.Request, legacy: bool) -> web.Response:
    req = await _start(request)
    payload, manifest = req.payload, req.slot.manifest
    try:
        translate.check_request("embeddings" if legacy else "embed", payload)
        texts = translate.embed_inputs(payload, legacy)
        body = translate.embed_request(payload, texts, manifest, legacy) if texts else None
        translate.check_num_ctx(payload.get("options"), req.slot.launch_in_effect())
    except translate.TranslationError as exc:
        raise _bad(exc) from None
    await capabilities.check(
        manifest, capabilities.ollama_needs("embeddings" if legacy else "embed", payload)
    )
    if (forwarded := await _forwarded(req)) is not None:
        return forwarded  # type: ignore[return-value]  # its answer streams; the client reads it whole
    if body is None:  # nothing to embed: Ollama loads the model and answers empty
        load_ns = await _load(req)
        empty: dict[str, Any] = {"embedding": []} if legacy else {"model": payload["model"], "embeddings": []}
        if not legacy:
            empty.update(total_duration=time.perf_counter_ns() - req.arrived, load_duration=load_ns)
        return web.json_response(empty)
    ticket, load_ns = await req.acquire()
    try:
        # As Ollama: an input longer than the engine takes is cut to fit unless `truncate` is false.
        truncate = payload.get("truncate") is not False and manifest.engine == "llama-server"
        _, result = await _embeddings(req, ticket, body, truncate)
    finally:
        req.release()
    prompt_tokens = proxy.embedding_prompt_tokens(result)
    if req.trace is not None and prompt_tokens is not None:
        req.trace.counted(prompt_tokens, None, None, time.perf_counter())
    # Checked already, so integral (JSON's 8.0 is 8 too). Not on the legacy route, which has no such field.
    asked = None if legacy else payload.get("dimensions")
    try:
        vectors = await embedding_dimensions.vectors_in_order(result, None if asked is None else int(asked))
    except ValueError as exc:  # json's errors too
        raise errors.upstream_failed(ticket.slot.name, f"the engine's embeddings answer: {exc}") from None
    durations = {"total_duration": time.perf_counter_ns() - req.arrived, "load_duration": load_ns}
    answer = translate.embed_answer(payload["model"], vectors, legacy, durations, prompt_tokens)
    return web.Response(body=answer, content_type="application/json")


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    """Ollama embeddings of one string or a list: {model, embeddings, durations, prompt_eval_count}."""
    return await _embed(request, legacy=False)


@routes.post("/api/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """Ollama's legacy embeddings route: {model, prompt} -> {embedding}."""
    return await _embed(request, legacy=True)
