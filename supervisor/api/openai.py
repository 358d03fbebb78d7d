"""OpenAI-compatible routes: inference passed through to the model's child, and the model list."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, NamedTuple, TypeVar

import structlog
from aiohttp import web

from supervisor import access, capabilities, errors, proxy
from supervisor.api import fleet_view
from supervisor.api.context import (
    ACCESS,
    FLEET,
    REQUEST_CLIENT,
    REQUEST_MODEL,
    REQUEST_UPSTREAM,
    SCHEDULER,
    UPSTREAM,
)
from supervisor.bodies import check_openai_fields, parse_body, schema_format
from supervisor.durations import parse_keep_alive
from supervisor.fleet import HOP_HEADER
from supervisor.manifests import LlamaServerManifest, Manifest
from supervisor.metrics import TRACE
from supervisor.output_limits import cap_output_tokens
from supervisor.scheduler import Scheduler, Ticket
from supervisor.slots import ModelSlot, SlotState, aggregate_state

log = structlog.get_logger("api.openai")
T = TypeVar("T")
routes = web.RouteTableDef()

# The routes that generate text: bounded by the manifest's max_output_tokens and request_timeout_s.
GENERATING_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# Every OpenAI inference route, served by the front (dataplane/front.py) and by aiohttp alike.
INFERENCE_PATHS: Final = GENERATING_PATHS | {"/v1/embeddings"} | capabilities.RERANK_PATHS
# Fields of ours that clients may add to a request; removed before the body reaches the engine.
_OUR_FIELDS: Final = ("keep_alive", "x_priority", "x_client_id")
_SESSION_MAX: Final = 200  # characters of a session id kept as it is


# The records of one request are plain classes (Checked, Admitted: compiled, each is built without a
# Python call, which a NamedTuple's __new__ is) or, for Scheduling, made only when a client asks for
# scheduling, a NamedTuple. Not frozen dataclasses: their __init__ calls object.__setattr__ per field.


class Scheduling(NamedTuple):
    """How the client wants this request scheduled; body fields win over X-Priority / X-Client-Id."""

    keep_alive: float | None = None
    priority: int | None = None
    client_id: str | None = None
    # Requests of one session go to the replica that served it (its prompt cache): X-Session-Id, else
    # OpenAI's `user` field.
    session: str | None = None


_UNSCHEDULED: Final = Scheduling()


def take_scheduling(payload: dict[str, Any], headers: Mapping[str, str]) -> Scheduling:
    """Pop our fields off `payload` (the engine must not see them) and validate them, or raise a 400."""
    keep_alive = None
    if (raw := payload.pop("keep_alive", None)) is not None:
        try:
            keep_alive = parse_keep_alive(raw)
        except ValueError as exc:
            raise errors.bad_request(str(exc)) from None
    priority = payload.pop("x_priority", None)
    if priority is None and "X-Priority" in headers:
        try:
            priority = int(headers["X-Priority"])
        except ValueError:
            raise errors.bad_request(
                f"X-Priority must be an integer, not {headers['X-Priority']!r}"
            ) from None
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise errors.bad_request(f"x_priority must be an integer, not {priority!r}")
    client_id = payload.pop("x_client_id", None)
    if client_id is None:
        client_id = headers.get("X-Client-Id")
    if client_id is not None and (not isinstance(client_id, str) or len(client_id) > 200):
        raise errors.bad_request("x_client_id must be a string of at most 200 characters")
    return Scheduling(keep_alive, priority, client_id, session_of(payload, headers))


def session_of(payload: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The session a request belongs to: X-Session-Id, else OpenAI's `user` (left in the body). A long
    `user` (a JWT subject, a chain of ids) is kept as its digest: it only picks a replica."""
    session = headers.get("X-Session-Id")
    if session is None and isinstance(user := payload.get("user"), str) and user:
        return user if len(user) <= _SESSION_MAX else hashlib.sha256(user.encode()).hexdigest()
    if session is not None and len(session) > _SESSION_MAX:
        raise errors.bad_request(f"X-Session-Id must be at most {_SESSION_MAX} characters")
    return session


def authorize(request: web.Request, requested: str, scheduling: Scheduling) -> tuple[ModelSlot, Scheduling]:
    """The slot the request names, which must be one the caller's key may use (404 either way), and its
    scheduling with the priority capped to the key's."""
    who = access.caller(request)
    slot = request.app[SCHEDULER].resolve(requested)
    if slot is None:
        raise errors.model_not_found(requested)
    who.check_model(slot.name, slot.manifest.aliases, requested)
    request[REQUEST_MODEL] = slot.name  # from here a refusal (queue full, timeout) counts under the model
    capped = who.cap_priority(scheduling.priority)
    if capped != scheduling.priority:
        log.info("priority_capped", key=who.name, asked=scheduling.priority, granted=capped)
        scheduling = scheduling._replace(priority=capped)
    return slot, scheduling


def note_named_model(request: web.Request, requested: object) -> None:
    """A body refused for its fields still counts under the model it names, when that is a model here
    (any other name stays `(unresolved)`: a client cannot add series to /metrics)."""
    if isinstance(requested, str) and (slot := request.app[SCHEDULER].resolve(requested)) is not None:
        request[REQUEST_MODEL] = slot.name


def note_wait(request: web.Request, queue_s: float, load_s: float) -> None:
    """The request holds a ticket after waiting so long for a turn and for a load (its Trace: metrics and
    Server-Timing)."""
    trace = request.get(TRACE)
    if trace is not None:
        trace.waited(queue_s, load_s)


def note_ticket(request: web.Request, ticket: Ticket) -> None:
    """The model, replica and child that serve the request, for the access log and the counters."""
    request[REQUEST_MODEL] = ticket.slot.name
    upstream: dict[str, object] = {"replica": ticket.slot.replica, "pid": ticket.process.pid}
    if ticket.claim.session is not None:
        upstream["session"] = ticket.claim.session
    request[REQUEST_UPSTREAM] = upstream


async def send_to_child(
    request: web.Request, ticket: Ticket, send: Callable[[Ticket], Awaitable[T]]
) -> tuple[Ticket, T]:
    """`send(ticket)`, and the ticket it went through. A child gone before it read the request (killed
    while idle: proxy.Unreachable) is waited for once (Scheduler.reacquire, within the same queue
    deadline, its wait counted as a load) and the request sent again; the ticket returned is then a new
    one, released here if that second send fails, and the one given is released."""
    try:
        return ticket, await send(ticket)
    except proxy.Unreachable:
        pass
    started = time.perf_counter()
    ticket = await request.app[SCHEDULER].reacquire(ticket)
    note_wait(request, 0.0, time.perf_counter() - started)
    note_ticket(request, ticket)
    try:
        return ticket, await send(ticket)
    except BaseException:
        ticket.release()
        raise


class Admitted:
    """A request that may go to a child: its ticket, the body to send, and whether it streams."""

    __slots__ = ("body", "stream", "ticket")

    def __init__(self, ticket: Ticket, body: bytes, stream: bool) -> None:
        self.ticket = ticket
        self.body = body
        self.stream = stream


class Checked:
    """An OpenAI inference request whose body, caller and model are known good: what is left is where it
    is served (here, or on another node of the fleet)."""

    __slots__ = ("body", "model", "payload", "requested", "scheduling", "stream")

    def __init__(
        self,
        model: ModelSlot,  # replica 0 of the model it names
        requested: str,
        body: bytes,  # our own fields taken off (re-encoded only then)
        payload: dict[str, Any],  # the body, parsed
        scheduling: Scheduling,
        stream: bool,
    ) -> None:
        self.model = model
        self.requested = requested
        self.body = body
        self.payload = payload
        self.scheduling = scheduling
        self.stream = stream


async def check(request: web.Request, body: bytes) -> Checked:
    """The body's fields, the caller's right to the model, the model's capabilities; a SupervisorError
    with the status the client gets otherwise."""
    request[REQUEST_MODEL] = "(unresolved)"  # counted and logged even when it fails before a model is known
    payload = parse_body(body)
    path, headers = request.path, request.headers  # read once: each read of a request's is a lookup
    scheduling = _UNSCHEDULED
    rewrite = False
    try:
        check_openai_fields(path, payload)
        # Three lookups in the body, not a pass over its keys (frozenset.isdisjoint walks the dict).
        ours = any(name in payload for name in _OUR_FIELDS)
        if ours or "X-Priority" in headers or "X-Client-Id" in headers:
            scheduling = take_scheduling(payload, headers)
            rewrite = True
            request[REQUEST_CLIENT] = scheduling.client_id
        elif "X-Session-Id" in headers or "user" in payload:
            scheduling = Scheduling(session=session_of(payload, headers))
    except errors.SupervisorError:
        note_named_model(request, payload.get("model"))
        raise
    requested = payload["model"]
    target, scheduling = authorize(request, requested, scheduling)
    manifest = target.manifest
    if manifest.engine == "vllm":
        rewrite |= name_the_engine_knows(payload, manifest)
    if path in GENERATING_PATHS:
        unset = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        rewrite |= cap_output_tokens(payload, manifest.max_output_tokens, unset)
        if manifest.engine == "vllm":
            gate = request.app[ACCESS]
            rewrite |= salt_prefix_cache(payload, access.caller(request), gate, HOP_HEADER in headers)
        else:
            rewrite |= keep_prompt_cache_private(payload, manifest)
            if path == "/v1/chat/completions":
                rewrite |= json_mode_as_schema(payload)
    await capabilities.check(manifest, capabilities.openai_needs(path, payload))
    if rewrite:
        body = json.dumps(payload).encode()
    return Checked(target, requested, body, payload, scheduling, payload.get("stream") is True)


def name_the_engine_knows(payload: dict[str, Any], manifest: Manifest) -> bool:
    """vLLM answers 404 to a `model` other than the one name it serves: an alias, a name in another case
    or with `:latest`, or the manifest's name beside a `served_model_name`. True when the payload
    changed (a hop to another node names the model as that node knows it: routing.hop_body)."""
    if payload.get("model") == manifest.served_name:
        return False
    payload["model"] = manifest.served_name
    return True


def json_mode_as_schema(payload: dict[str, Any]) -> bool:
    """OpenAI's JSON mode (`response_format: {"type": "json_object"}`) for llama-server, which builds a
    grammar only from a schema and answered free text to a bare json_object: it gets the schema of any
    object, as Ollama's `format: json` does (ollama_translate.format_to_openai). True when changed."""
    wanted = payload.get("response_format")
    if not isinstance(wanted, dict) or wanted.get("type") != "json_object" or "schema" in wanted:
        return False
    payload["response_format"] = schema_format({"type": "object"})
    return True


def salt_prefix_cache(
    payload: dict[str, Any], who: access.Caller, gate: access.AccessControl, hop: bool = False
) -> bool:
    """With keys configured, each key's requests to a vLLM model get a prefix-cache salt of their own
    (vLLM's `cache_salt`), whatever the client sent: keys sharing a cache could learn, by its answers'
    cached_tokens or their speed, whether another key's prompt began with a guessed text. Derived from
    the key's name and a secret (`AccessControl.cache_salt`), so it is stable (a key's own prompts
    still hit the cache) and no client can give another's. A request another node forwarded (the node
    key and the hop header, which no client holds) keeps the salt that node gave it for the client's
    key: salted here, every key's forwarded requests would share the node key's one."""
    if who.name is None:
        return False
    if who.node and hop and isinstance(payload.get("cache_salt"), str):
        return False
    payload["cache_salt"] = gate.cache_salt(who.name)
    return True


def keep_prompt_cache_private(payload: dict[str, Any], manifest: Manifest) -> bool:
    """A llama-server model whose manifest says `prompt_cache: false`: the request reuses no prompt that
    another left in the child's cache, and no later request reuses its own (llama-server keeps no cache
    per caller, as vLLM's `cache_salt` does). True when the payload changed."""
    if not isinstance(manifest, LlamaServerManifest) or manifest.prompt_cache:
        return False
    if payload.get("cache_prompt") is False:
        return False
    payload["cache_prompt"] = False
    return True


async def acquire(request: web.Request, checked: Checked) -> Admitted:
    """Wait for a ticket of the model here (loading it if need be)."""
    scheduling = checked.scheduling
    ticket = await request.app[SCHEDULER].acquire(
        checked.requested,
        scheduling.keep_alive,
        scheduling.priority,
        scheduling.client_id,
        scheduling.session,
    )
    note_wait(request, ticket.queue_s, ticket.load_s)
    return Admitted(ticket, checked.body, checked.stream)


def requested_dimensions(path: str, payload: Mapping[str, Any]) -> int | None:
    """The `dimensions` an embeddings request asked for, which the relays shorten the vectors to
    (llama-server ignores the field); checked already, so integral (1.0 is JSON's 1 too)."""
    asked = payload.get("dimensions") if path == "/v1/embeddings" else None
    return None if asked is None else int(asked)


def if_missing(path: str, manifest: Manifest) -> errors.SupervisorError | None:
    """The error for a child's 404 on a route not every engine build serves (its 404 would look like a
    wrong URL): the Responses API."""
    return errors.not_supported(manifest.name, manifest.engine, path) if path == "/v1/responses" else None


def generation_limit_s(path: str, manifest: Manifest) -> float | None:
    """How long a generation may run (the manifest's request_timeout_s); embeddings and rerankings are not
    limited."""
    return manifest.request_timeout_s if path in GENERATING_PATHS else None


async def _inference(request: web.Request) -> web.StreamResponse:
    """The requests the data plane hands to aiohttp (chunked, HTTP/1.0, or on a connection an Ollama
    request took over): served as `dataplane.relay.serve` serves the rest."""
    checked = await check(request, await request.read())
    if (forwarded := await _forwarded(request, checked)) is not None:
        return forwarded
    admitted = await acquire(request, checked)
    ticket = admitted.ticket
    dimensions = requested_dimensions(request.path, checked.payload)
    try:
        ticket, response = await send_to_child(
            request, ticket, lambda t: _forward(request, t, admitted.body, admitted.stream, dimensions)
        )
        return response
    finally:
        ticket.release()


async def _forwarded(request: web.Request, checked: Checked) -> web.StreamResponse | None:
    """In a fleet, the answer of the node this request is better served on (fleet/routing.py); None to
    serve it here. A request another node forwarded is served here."""
    fleet = request.app.get(FLEET)
    if fleet is None or HOP_HEADER in request.headers:
        return None
    from supervisor.fleet import routing  # with the fleet's modules: only in a fleet

    model = checked.model
    nodes = await routing.elsewhere(fleet, request.app[SCHEDULER], model, checked.scheduling.priority)
    if not nodes:
        return None
    request[REQUEST_MODEL] = model.name
    body = routing.hop_body(checked.payload, checked.scheduling, checked.body, model.name)
    return await routing.forward(request, fleet, nodes, body)


async def _forward(
    request: web.Request, ticket: Ticket, body: bytes, stream: bool, dimensions: int | None
) -> web.StreamResponse:
    note_ticket(request, ticket)
    manifest = ticket.slot.manifest
    return await proxy.forward(
        request.app[UPSTREAM],
        request,
        ticket.endpoint,
        body,
        ticket.slot.name,
        stream,
        if_missing(request.path, manifest),
        api_key=ticket.api_key,
        timeout_s=generation_limit_s(request.path, manifest),
        dimensions=dimensions,
        child=ticket.process,
    )


for _path in sorted(INFERENCE_PATHS):
    routes.post(_path)(_inference)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """Every configured model and alias, with the state of the model behind it."""
    scheduler = request.app[SCHEDULER]
    who = access.caller(request)
    created = int(time.time())
    fleet = fleet_view.nodes(request.app)
    data: list[dict[str, Any]] = []
    for name, slot in scheduler.slots.items():
        if not who.allows_model(name, *slot.manifest.aliases):
            continue
        entry = fleet_view.annotate(_model_entry(scheduler, slot, created), name, fleet)
        data.append(entry)
        data.extend({**entry, "id": alias, "alias_of": name} for alias in slot.manifest.aliases)
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{model:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    """One model or alias, as /v1/models lists it (the OpenAI SDK's `models.retrieve`); 404 for a name
    the caller may not use, as for one that does not exist."""
    requested = request.match_info["model"]
    scheduler = request.app[SCHEDULER]
    slot = scheduler.resolve(requested)
    if slot is None or not access.caller(request).allows_model(slot.name, *slot.manifest.aliases):
        raise errors.model_not_found(requested)
    entry = fleet_view.annotate(
        _model_entry(scheduler, slot, int(time.time())), slot.name, fleet_view.nodes(request.app)
    )
    if requested != slot.name:
        entry.update(id=requested, alias_of=slot.name)
    return web.json_response(entry)


def _model_entry(scheduler: Scheduler, slot: ModelSlot, created: int) -> dict[str, Any]:
    group = scheduler.group(slot.name)
    return {
        "id": slot.name,
        "object": "model",
        "created": created,
        "owned_by": "llm-supervisor",
        "state": str(aggregate_state(group)),
        # A replica ready, or a child up (loading or draining): its weights are in memory or on the way.
        "loaded": any(
            s.state == SlotState.READY
            or (s.process is not None and s.state in (SlotState.LOADING, SlotState.DRAINING))
            for s in group
        ),
        "engine": slot.manifest.engine,
        "aliases": list(slot.manifest.aliases),
    }
