"""The OpenAPI 3.1 document of every route (GET /openapi.json, supervisor/api/openapi.py), built from the
app's router and the pydantic models of supervisor/api/schemas.py.

Each route the router holds is looked up in `OPERATIONS` (what it takes, how it answers, which errors
it gives); a route with no entry is still listed, as undocumented, and a unit test fails on it. Who may
call a route comes from supervisor/access.py, and the error body's shape from the path, as the
middleware decides both; neither is written twice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from supervisor import __version__, access
from supervisor.api import schemas as s

JSON = "application/json"
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Reply:
    """One status of a route: what it means, and its body per media type (a model, or None: no schema)."""

    description: str
    content: Mapping[str, type[BaseModel] | None] = field(default_factory=dict)
    headers: tuple[str, ...] = ()  # names from _HEADERS


@dataclass(frozen=True)
class Query:
    name: str
    schema: Mapping[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    """What the document says of one method on one path."""

    summary: str
    tag: str
    replies: Mapping[int, Reply]
    errors: Mapping[int, str] = field(default_factory=dict)  # status -> when (the body: the error shape)
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: tuple[Query, ...] = ()
    description: str = ""


def _json(model: type[BaseModel], description: str, *headers: str) -> Reply:
    return Reply(description, {JSON: model}, headers)


# Errors every inference route can give, besides the engine's own (passed on with its status).
_INFERENCE_ERRORS = {
    400: "invalid_request: a field of the wrong type (the message names it); or the engine refused it",
    404: "model_not_found: no model or alias has that name",
    502: "upstream_error: the child could not be reached",
    503: "model_failed, model_crashed, queue_full, queue_timeout, insufficient_vram, vram_unknown, "
    "model_unloading, shutting_down (with Retry-After where waiting helps)",
    504: "request_timeout: the generation ran past the manifest's request_timeout_s",
}
_LOAD_ERRORS = {
    404: "model_not_found",
    503: "insufficient_vram, vram_unknown, model_failed, queue_timeout, shutting_down: the scheduler's codes",
}
_MODEL_DOCUMENT = "the model's document"
_ADMIN_ACTION_NOTE = "The body is optional: every field has a default."


def _inference(
    summary: str,
    body: type[BaseModel],
    answer: Mapping[str, type[BaseModel] | None],
    errors: Mapping[int, str] | None = None,
) -> Operation:
    return Operation(
        summary,
        "openai",
        {200: Reply("the engine's answer; with `stream: true`, its server-sent events", answer)},
        {**_INFERENCE_ERRORS, **(errors or {})},
        body=body,
    )


def _ollama_generation(summary: str, body: type[BaseModel], answer: type[BaseModel]) -> Operation:
    lines = Reply(
        "NDJSON lines (the last has done: true), or one object with stream: false",
        {NDJSON: answer, JSON: answer},
    )
    return Operation(summary, "ollama", {200: lines}, _INFERENCE_ERRORS, body=body)


def _ollama_embedding(summary: str, body: type[BaseModel], answer: type[BaseModel]) -> Operation:
    return Operation(summary, "ollama", {200: _json(answer, "the embeddings")}, _INFERENCE_ERRORS, body=body)


def _admin_action(summary: str, body: type[BaseModel], code: str, loads: bool) -> Operation:
    replies = {200: _json(s.ModelDocument, _MODEL_DOCUMENT + " once done")}
    errors = {400: f"{code}: a field is unknown or has the wrong value (the message names it)"}
    if loads:
        replies[202] = _json(s.ModelDocument, _MODEL_DOCUMENT + ", at once, with wait: false", "Location")
        errors.update(_LOAD_ERRORS)
    else:
        errors[404] = "model_not_found"
    if body is s.UnloadRequest:
        errors[409] = "model_pinned: unpin it first"
        errors[503] = "shutting_down: the daemon's shutdown stops every model"
    if body is s.LoadRequest:
        errors[409] = (
            "load_conflict: it runs with other overrides; send restart: true to restart it. "
            "model_pinned: replicas below a pinned model's manifest; unpin it first"
        )
    return Operation(
        summary, "admin", replies, errors, body=body, body_required=False, description=_ADMIN_ACTION_NOTE
    )


_UI_FILE = Reply("the file", {"text/html": None, "text/javascript": None, "text/css": None}, ("ETag",))
_NOT_MODIFIED = Reply("If-None-Match named the file's ETag", headers=("ETag",))

OPERATIONS: dict[tuple[str, str], Operation] = {
    # OpenAI
    ("POST", "/v1/chat/completions"): _inference(
        "Chat completion", s.ChatCompletionRequest, {JSON: s.ChatCompletion, SSE: None}
    ),
    ("POST", "/v1/completions"): _inference(
        "Text completion", s.CompletionRequest, {JSON: s.ChatCompletion, SSE: None}
    ),
    ("POST", "/v1/embeddings"): _inference(
        "Embeddings", s.EmbeddingRequest, {JSON: s.Embeddings}, {501: "the model does not serve embeddings"}
    ),
    ("POST", "/v1/rerank"): _inference(
        "Rerank documents against a query",
        s.RerankRequest,
        {JSON: s.Reranking},
        {501: "the engine reports it does not rerank"},
    ),
    ("POST", "/rerank"): _inference(
        "Rerank (the same as /v1/rerank, where Jina's and Cohere's clients look)",
        s.RerankRequest,
        {JSON: s.Reranking},
        {501: "the engine reports it does not rerank"},
    ),
    ("POST", "/v1/responses"): _inference(
        "OpenAI Responses API",
        s.ResponsesRequest,
        {JSON: s.EngineAnswer, SSE: None},
        {501: "unsupported_endpoint: the model's engine does not serve the Responses API"},
    ),
    ("GET", "/v1/models"): Operation(
        "Every model and alias the caller may use", "openai", {200: _json(s.ModelList, "the models")}
    ),
    ("GET", "/v1/models/{model}"): Operation(
        "One model or alias the caller may use (an alias's entry names its model in alias_of)",
        "openai",
        {200: _json(s.ModelEntry, "the model")},
        {404: "model_not_found: no model or alias the caller may use has that name"},
    ),
    # health
    ("GET", "/health"): Operation(
        "Every slot's state and the GPU leases",
        "health",
        {200: _json(s.Health, "serving"), 503: _json(s.Health, "draining for shutdown")},
        description="Open. With keys configured, only an admin key gets the slots, leases and queue; "
        "any other caller gets the status alone.",
    ),
    ("GET", "/health/live"): Operation(
        "Liveness: the event loop answers", "health", {200: _json(s.Liveness, "alive")}
    ),
    ("GET", "/health/ready"): Operation(
        "Readiness: start-up is done and requests are accepted",
        "health",
        {200: _json(s.Readiness, "ready"), 503: _json(s.Readiness, "starting or draining")},
    ),
    ("GET", "/metrics"): Operation(
        "Prometheus metrics",
        "health",
        {200: Reply("the text exposition format", {"text/plain": None})},
        description="Needs an admin key, or an inference key with metrics_public.",
    ),
    ("GET", "/openapi.json"): Operation(
        "This document", "meta", {200: Reply("the OpenAPI 3.1 document", {JSON: None})}
    ),
    # admin
    ("GET", "/v1/admin/gpu-memory"): Operation(
        "Per GPU: total, used, free, margin, leases and processes",
        "admin",
        {200: _json(s.GpuMemory, "the GPUs (with neither NVML nor a `gpus` declaration, the one assumed)")},
    ),
    ("GET", "/v1/admin/nodes"): Operation(
        "Every node of the fleet (with no redis_url: this one), its GPUs and models",
        "admin",
        {200: _json(s.FleetNodes, "the nodes")},
    ),
    ("GET", "/v1/admin/models"): Operation(
        "Every model served, loaded or not", "admin", {200: _json(s.ModelDocuments, "the models")}
    ),
    ("GET", "/v1/admin/models/{name}"): Operation(
        "One model",
        "admin",
        {200: _json(s.ModelDocument, _MODEL_DOCUMENT)},
        {404: "model_not_found", 400: "invalid_load_request: overrides that this model does not accept"},
        query=(
            Query(
                "overrides",
                {"type": "string"},
                'a JSON object of load overrides, e.g. {"ctx_size": 8192}: vram_estimate is what a load '
                "with them would lease",
            ),
        ),
    ),
    ("POST", "/v1/admin/models/{name}/load"): _admin_action(
        "Load a model (with runtime overrides)", s.LoadRequest, "invalid_load_request", loads=True
    ),
    ("POST", "/v1/admin/models/{name}/unload"): _admin_action(
        "Unload a model; queued requests are served first, or cancelled",
        s.UnloadRequest,
        "invalid_unload_request",
        loads=False,
    ),
    ("POST", "/v1/admin/models/{name}/pin"): _admin_action(
        "Pin a model until unpin or restart (loads it)", s.PinRequest, "invalid_pin_request", loads=True
    ),
    ("POST", "/v1/admin/models/{name}/unpin"): _admin_action(
        "Drop a model's pin", s.UnpinRequest, "invalid_unpin_request", loads=False
    ),
    ("GET", "/v1/admin/events"): Operation(
        "Live events: a snapshot, then every change",
        "admin",
        {200: Reply("server-sent events, with a `: ping` comment every 15 s", {SSE: None})},
    ),
    ("GET", "/v1/admin/models/{name}/logs"): Operation(
        "A child's stdout and stderr",
        "admin",
        {
            200: Reply(
                "the last lines, or with follow: server-sent `log` events", {JSON: s.ChildLog, SSE: None}
            )
        },
        {
            400: "invalid_request: tail is not a count, or the model has no such replica",
            404: "model_not_found",
            409: "model_not_running: follow of a model that has run no child since the daemon started",
        },
        query=(
            Query("tail", {"type": "integer", "minimum": 0}, "only the last this many lines"),
            Query("follow", {"type": "boolean"}, "stream new lines as server-sent events"),
            Query("replica", {"type": "integer", "minimum": 0}, "which replica's child (default 0)"),
        ),
    ),
    # Ollama
    ("POST", "/api/chat"): _ollama_generation("Ollama chat", s.OllamaChatRequest, s.OllamaChatAnswer),
    ("POST", "/api/generate"): _ollama_generation(
        "Ollama completion of a prompt", s.OllamaGenerateRequest, s.OllamaGenerateAnswer
    ),
    ("POST", "/api/embed"): _ollama_embedding("Ollama embeddings", s.OllamaEmbedRequest, s.OllamaEmbedAnswer),
    ("POST", "/api/embeddings"): _ollama_embedding(
        "Ollama embeddings (legacy)", s.OllamaEmbeddingsRequest, s.OllamaEmbeddingAnswer
    ),
    ("GET", "/api/tags"): Operation(
        "Every model the daemon can serve", "ollama", {200: _json(s.Tags, "the models")}
    ),
    ("GET", "/api/ps"): Operation("The models with a child", "ollama", {200: _json(s.Running, "the models")}),
    ("POST", "/api/show"): Operation(
        "A model's card",
        "ollama",
        {200: _json(s.ModelCard, "the card")},
        {404: "model_not_found"},
        body=s.ModelRequest,
    ),
    ("GET", "/api/version"): Operation(
        "The Ollama API level followed, and the daemon's version",
        "ollama",
        {200: _json(s.Version, "versions")},
    ),
    ("GET", "/"): Operation(
        "Ollama clients' probe", "ollama", {200: Reply('"Ollama is running"', {"text/plain": None})}
    ),
    ("HEAD", "/"): Operation("Ollama clients' probe", "ollama", {200: Reply("an Ollama API is here")}),
    ("POST", "/api/pull"): Operation(
        "Pull a model from Hugging Face into the store (or join its pull)",
        "ollama",
        {
            200: Reply(
                "NDJSON progress lines, or with stream: false one object at the end",
                {NDJSON: s.PullProgress, JSON: s.Done},
            )
        },
        {
            403: "model_gated: accept its terms on the hub and set HF_TOKEN",
            404: "model_not_found: no such repository, file or quantization on the hub",
            499: "pull_cancelled: cancelled while this request waited for its end",
            502: "hub_error, pull_failed: the hub could not be reached or answered an error",
            507: "disk_full: no space left in the Hugging Face cache",
        },
        body=s.PullRequest,
    ),
    ("GET", "/api/pull/status/{model}"): Operation(
        "Reconnect to a running or recent pull",
        "ollama",
        {
            200: Reply(
                "its progress from now on, as NDJSON lines", {NDJSON: s.PullProgress, JSON: s.PullProgress}
            )
        },
        {
            400: "bad_request: not a model name the store can pull, or `stream` not true or false",
            404: "pull_not_found: no pull of it is running or recent",
        },
        query=(Query("stream", {"type": "boolean"}, "false: one object, the pull's state now"),),
    ),
    ("DELETE", "/api/pull/{model}"): Operation(
        "Cancel a running pull",
        "ollama",
        {
            200: _json(s.PullCancelled, "cancelled; its partial files are removed"),
            202: _json(s.PullCancelled, "still stopping"),
        },
        {404: "pull_not_found", 409: "pull_finished: it ended first"},
    ),
    ("DELETE", "/api/delete"): Operation(
        "Remove a pulled model from the store",
        "ollama",
        {200: _json(s.Done, "deleted")},
        {
            404: "model_not_found",
            409: "model_in_manifest (a manifest file defines it), model_busy (loaded or being pulled)",
        },
        body=s.ModelRequest,
    ),
    **{
        (method, path): Operation(
            f"Ollama's {path}: not supported (a 501 that says what to do instead)",
            "ollama",
            {},
            {501: "not_supported"},
            body_required=False,
        )
        for method, path in (
            ("POST", "/api/copy"),
            ("POST", "/api/create"),
            ("POST", "/api/push"),
            ("POST", "/api/blobs/{digest}"),
            ("HEAD", "/api/blobs/{digest}"),
        )
    },
    ("GET", "/api/status"): Operation(
        "The whole daemon in one document", "admin", {200: _json(s.DaemonStatus, "the status")}
    ),
    # the dashboard
    ("GET", "/ui"): Operation(
        "The dashboard", "ui", {200: Reply("its page", {"text/html": None}, ("ETag",)), 304: _NOT_MODIFIED}
    ),
    ("GET", "/ui/"): Operation(
        "The dashboard", "ui", {200: Reply("its page", {"text/html": None}, ("ETag",)), 304: _NOT_MODIFIED}
    ),
    ("GET", "/ui/{file}"): Operation(
        "One of the dashboard's files",
        "ui",
        {200: _UI_FILE, 304: _NOT_MODIFIED},
        {404: "not_found: not one of its files"},
    ),
}

_PATH_PARAMETERS = {
    "name": "a model's name or alias",
    "model": "the model as it was pulled (hf.co/org/repo:quant)",
    "file": "index.html, app.js or style.css",
    "digest": "a blob's digest (sha256:...)",
}
_TAGS = {
    "openai": "OpenAI-compatible inference, passed through to the model's engine",
    "ollama": "Ollama's API, translated to the engine's OpenAI API; the model store",
    "admin": "Operators: models, loads, pins, GPUs, events and logs (admin key)",
    "health": "Probes and metrics",
    "ui": "The dashboard's static files",
    "meta": "This document",
}
_HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-Id": {"description": "the client's X-Request-Id, or a new one", "schema": {"type": "string"}},
    "Retry-After": {"description": "seconds to wait before trying again", "schema": {"type": "string"}},
    "Location": {"description": "the model's document", "schema": {"type": "string"}},
    "ETag": {"description": "the file's version", "schema": {"type": "string"}},
}
_TEMPLATE_NAME = re.compile(r"\{([^{}:]+)(?::[^{}]*)?\}")


# --- building the document ---------------------------------------------------------------------------


def routed(router: web.UrlDispatcher) -> list[tuple[str, str]]:
    """Every (method, path template) the router serves, leaving out the HEAD aiohttp adds beside a GET."""
    found: set[tuple[str, str]] = set()
    for route in router.routes():
        resource = route.resource
        if resource is None:
            continue
        found.add((route.method, resource.canonical))
    return sorted(
        (method, path)
        for method, path in found
        if not (method == "HEAD" and ("GET", path) in found and (method, path) not in OPERATIONS)
    )


def undocumented(router: web.UrlDispatcher) -> list[tuple[str, str]]:
    """Routes the router serves that `OPERATIONS` does not describe."""
    return [key for key in routed(router) if key not in OPERATIONS]


def build_document(router: web.UrlDispatcher) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route `router` serves."""
    used: set[type[BaseModel]] = {s.OpenAIError, s.OllamaError}
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routed(router):
        operation = OPERATIONS.get((method, path)) or _UNDOCUMENTED
        used.update(_models(operation))
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, operation)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llm-supervisor",
            "version": _version(),
            "description": "One daemon that serves many local LLMs from a fixed pool of GPUs. Keys are "
            "needed only when the daemon has API keys configured; admin routes then need an admin key. "
            "Every JSON body is refused with a 400 that names the field when it nests deeper than 64 "
            "levels, holds a number beyond float64, NaN or Infinity, or a string with a NUL character.",
        },
        "tags": [{"name": name, "description": text} for name, text in _TAGS.items()],
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": paths,
        "components": {
            "schemas": _component_schemas(used),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
            "headers": _HEADERS,
        },
    }


_UNDOCUMENTED = Operation("Not described yet", "meta", {200: Reply("an answer")})


def _models(operation: Operation) -> Iterable[type[BaseModel]]:
    if operation.body is not None:
        yield operation.body
    for reply in operation.replies.values():
        yield from (model for model in reply.content.values() if model is not None)


def _component_schemas(models: set[type[BaseModel]]) -> dict[str, Any]:
    """Every model and the models they use, by class name, as `#/components/schemas/<name>`."""
    ordered = sorted(models, key=lambda model: model.__name__)
    _, definitions = models_json_schema([(model, "validation") for model in ordered], ref_template=REF)
    schemas: dict[str, Any] = definitions.get("$defs", {})
    return dict(sorted(schemas.items()))


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _operation(method: str, path: str, operation: Operation) -> dict[str, Any]:
    role = access.required_role(method, path, metrics_public=False)
    described: dict[str, Any] = {
        "operationId": _operation_id(method, path),
        "summary": operation.summary,
        "tags": [operation.tag],
    }
    notes = [operation.description] if operation.description else []
    if role == "admin" and path != "/metrics":
        notes.append("Needs an admin key when keys are configured.")
    if notes:
        described["description"] = " ".join(notes)
    if role is None:
        described["security"] = []  # open: probes, discovery, the dashboard's files
    parameters = [_path_parameter(name) for name in _TEMPLATE_NAME.findall(path)]
    parameters += [
        {"name": q.name, "in": "query", "required": False, "description": q.description, "schema": q.schema}
        for q in operation.query
    ]
    if parameters:
        described["parameters"] = parameters
    if operation.body is not None:
        described["requestBody"] = {
            "required": operation.body_required,
            "content": {JSON: {"schema": _ref(operation.body)}},
        }
    responses = {str(status): _reply(reply) for status, reply in operation.replies.items()}
    for status, when in _errors(operation, role).items():
        responses.setdefault(str(status), _error_reply(path, status, when))
    described["responses"] = dict(sorted(responses.items()))
    return described


def _errors(operation: Operation, role: access.Role | None) -> dict[int, str]:
    """The operation's own errors, and those the access gate and the body reader give any route."""
    errors = dict(operation.errors)
    gate = ["origin_not_allowed: a browser page from another site", "host_not_allowed: a DNS-rebound Host"]
    if role is not None:
        errors.setdefault(401, "invalid_api_key: keys are configured and none, or a wrong one, was sent")
        if role == "admin":
            gate.append("forbidden: this route needs an admin key")
    errors[403] = "; ".join([*gate, *([errors[403]] if 403 in errors else [])])
    errors.setdefault(429, "too_many_requests: the key already has max_concurrent requests in progress")
    if operation.body is not None:
        errors.setdefault(400, "invalid_request: the body is not a JSON object of the right fields")
        errors[408] = "request_timeout: the body did not arrive within client_timeout_s"
        errors[413] = "request_too_large: the body is over max_body_mib"
        busy = "server_busy: max_buffered_mib of bodies are being received already"
        errors[503] = f"{errors[503]}; {busy}" if 503 in errors else busy
    return errors


def _error_reply(path: str, status: int, when: str) -> dict[str, Any]:
    shape = s.OllamaError if path.startswith("/api/") else s.OpenAIError
    headers = ("Retry-After",) if status in (429, 503) else ()
    return _reply(Reply(when, {JSON: shape}, headers))


def _reply(reply: Reply) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": reply.description}
    headers = {"X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"}}
    headers.update({name: {"$ref": f"#/components/headers/{name}"} for name in reply.headers})
    answer["headers"] = headers
    if reply.content:
        answer["content"] = {
            media: {"schema": _ref(model) if model is not None else _UNSHAPED[media]}
            for media, model in reply.content.items()
        }
    return answer


_UNSHAPED: dict[str, dict[str, Any]] = {
    JSON: {"type": "object"},
    # One server-sent event, as OpenAPI 3.1 describes text/event-stream (tools such as schemathesis check
    # each parsed event against it); `data` is the JSON of a chunk or an event, or [DONE].
    SSE: {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    },
    NDJSON: {"type": "string"},
    "text/plain": {"type": "string"},
    "text/html": {"type": "string"},
    "text/javascript": {"type": "string"},
    "text/css": {"type": "string"},
}


def _path_parameter(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": _PATH_PARAMETERS.get(name, name),
        "schema": {"type": "string", "minLength": 1},
    }


def _operation_id(method: str, path: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", _TEMPLATE_NAME.sub(r"by_\1", path)).strip("_")
    return f"{method.lower()}_{words or 'root'}"


def _version() -> str:
    try:
        return metadata.version("llm-supervisor")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return __version__
