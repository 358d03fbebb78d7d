"""What runs around every route: the access gate, then error bodies in the client's API, then the access log.

Routes never check keys, Origins or body budgets themselves; `access_gate` does it once, before them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

import structlog
from aiohttp import web

from supervisor import access, logs, secrets
from supervisor.api.context import ACCESS, METRICS, REQUEST_CLIENT, REQUEST_MODEL, REQUEST_UPSTREAM
from supervisor.errors import SupervisorError
from supervisor.metrics import TRACE, Trace

log = structlog.get_logger("api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}
# What a page on an allowed Origin may send and read.
_CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Request-Id, X-Priority, X-Client-Id"
_CORS_EXPOSE_HEADERS = "Retry-After, X-Request-Id, Server-Timing"
_CORS_METHODS = "GET, POST, DELETE, OPTIONS"


# Errors whose message carries what a child or the hub said: file paths, URLs, stderr lines.
_REPORTS_FROM_BELOW = frozenset(
    {
        "model_failed",
        "model_crashed",
        "engine_error",
        "upstream_error",
        "hub_error",
        "pull_failed",
        "disk_full",
        "vram_unknown",
        "insufficient_vram",
    }
)


def error_parts(request: web.Request, error: SupervisorError) -> tuple[dict[str, object], dict[str, str]]:
    """The error's body in the client's API (Ollama's under /api/, else OpenAI's) and its headers, with
    what a child or the hub said cut short for callers who may not see internals."""
    if error.code in _REPORTS_FROM_BELOW:
        message = secrets.shown(error.message, access.caller(request).sees_internals)
        error = SupervisorError(error.code, message, error.status, error.retry_after)
    if request.path.startswith("/api/"):
        body: dict[str, object] = {"error": error.message}  # Ollama's shape
    else:
        body = error.openai_body()
    headers = error.headers()
    if error.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="llm-supervisor"'
    return body, headers


def error_response(request: web.Request, error: SupervisorError) -> web.Response:
    body, headers = error_parts(request, error)
    return web.json_response(body, status=error.status, headers=headers)


# A client's X-Request-Id is kept if it is 1 to 200 visible ASCII characters: it goes to logs and the child.
_SANE_REQUEST_ID = re.compile(r"[!-~]{1,200}")
# New ids: 32 hex digits like a uuid4's, a random half per process and a counter, without a syscall each.
_ID_PREFIX = uuid.uuid4().hex[:16]
_ids = itertools.count(int.from_bytes(os.urandom(6)))


def request_id(request: web.Request) -> str:
    """The client's `X-Request-Id` when it is a sane one, else a new uuid4 in hex."""
    return request_id_from(request.headers)


def request_id_from(headers: Mapping[str, str]) -> str:
    given = headers.get("X-Request-Id")
    if given is not None and _SANE_REQUEST_ID.fullmatch(given):
        return given
    return f"{_ID_PREFIX}{next(_ids) & 0xFFFFFFFFFFFFFFFF:016x}"


@web.middleware
async def errors_and_access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request gets an id (`X-Request-Id`, in every log event of it and sent to the child) and a
    Trace; errors become the client's API shape; requests that named a model are counted, timed and
    logged. `timing_headers` puts the id and `Server-Timing` on the answer's head."""
    started = time.perf_counter()
    rid = request_id(request)
    trace = request[TRACE] = Trace(rid, started)
    with logs.RequestScope(rid):
        return await _answer(request, handler, started, trace)


async def _answer(request: web.Request, handler: Handler, started: float, trace: Trace) -> web.StreamResponse:
    try:
        response = await handler(request)
    except SupervisorError as exc:
        response = error_response(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 413:
            message = f"request body too large: {exc.reason}"
        elif exc.status == 404:
            message = f"no route {request.method} {request.path}"
        response = error_response(
            request, SupervisorError(_HTTP_CODES.get(exc.status, "http_error"), message, exc.status)
        )
    except Exception:
        # A bug must cost one request, never the daemon.
        log.exception("handler_error", method=request.method, path=request.path)
        response = error_response(request, SupervisorError("internal_error", "internal error", 500))
    log_answer(request, response.status, trace, time.perf_counter() - started)
    return response


def log_answer(request: web.Request, status: int, trace: Trace, elapsed: float) -> None:
    """Count, time and log a request that named a model, or that the gate refused (the access log)."""
    model = request.get(REQUEST_MODEL)
    if model is not None or status in (401, 403, 429):
        if model is not None:
            request.app[METRICS].answered(model, status, trace, elapsed)
        if not logs.ACCESS_LOG.enabled:
            return
        (logs.ACCESS_LOG.logger or log).info(
            "request",
            method=request.method,
            path=request.path,
            model=model,
            key=access.caller(request).name,
            client_id=request.get(REQUEST_CLIENT),
            **request.get(REQUEST_UPSTREAM, {}),
            status=status,
            ms=round(elapsed * 1000, 2),
        )


@web.middleware
async def access_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Origin, Host, key and role, per-key concurrency, then the body read within its budget and deadline."""
    gate = request.app[ACCESS]
    settings = gate.settings
    check_origin_and_host(request, gate)
    if request.method == "OPTIONS" and request.headers.get("Origin") is not None:
        return _preflight(request)
    who = identify_caller(request, gate)
    reserved = reserve_body(request.content_length, gate) if request.body_exists else 0
    if who.name is not None:
        gate.inflight[who.name] += 1
    try:
        if reserved:
            try:
                async with asyncio.timeout(settings.client_timeout_s):
                    await request.read()  # cached: the route's own read() returns these bytes
            except TimeoutError:
                raise SupervisorError(
                    "request_timeout",
                    f"the request body did not arrive within {settings.client_timeout_s:g}s",
                    408,
                ) from None
        return await handler(request)
    finally:
        gate.buffered_bytes -= reserved
        if who.name is not None:
            gate.inflight[who.name] -= 1
            if not gate.inflight[who.name]:
                del gate.inflight[who.name]


def check_origin_and_host(request: web.Request, gate: access.AccessControl) -> None:
    """403 for a browser page of another site (Origin) and, on a loopback listener, a foreign Host name."""
    settings = gate.settings
    origin = request.headers.get("Origin")
    if origin is not None and not access.origin_allowed(
        origin, settings.allowed_origins, request.headers.get("Host")
    ):
        raise SupervisorError(
            "origin_not_allowed",
            f"requests from the web page at {origin[:200]} are not allowed; "
            "add its origin to `allowed_origins` to allow it",
            403,
        )
    host = request.headers.get("Host")
    if gate.loopback_listener and host is not None and not access.host_allowed(host, settings.allowed_hosts):
        # A DNS-rebinding page reaches a loopback daemon under its own host name: refuse that name.
        raise SupervisorError(
            "host_not_allowed",
            f"Host {host[:200]!r} is not this machine; add it to `allowed_hosts` to allow it",
            403,
        )


def identify_caller(request: web.Request, gate: access.AccessControl) -> access.Caller:
    """The caller (401/403 for a missing, wrong or too weak key), noted on the request; 429 when its key
    already has `max_concurrent` requests in progress."""
    who = gate.identify(request)
    request[access.REQUEST_CALLER] = who
    if (
        who.name is not None
        and who.max_concurrent is not None
        and gate.inflight[who.name] >= who.max_concurrent
    ):
        raise SupervisorError(
            "too_many_requests",
            f"API key '{who.name}' already has {who.max_concurrent} requests in progress "
            "(max_concurrent); try again when one finishes",
            429,
            retry_after=1,
        )
    return who


def reserve_body(content_length: int | None, gate: access.AccessControl) -> int:
    """Count this body against `max_buffered_mib` before reading it, or answer 503 `server_busy`."""
    limit = gate.settings.max_body_mib * 2**20
    size = content_length if content_length is not None else limit
    size = min(size, limit) or 1
    budget = gate.settings.max_buffered_mib * 2**20
    if gate.buffered_bytes + size > budget:
        raise SupervisorError(
            "server_busy",
            f"too many request bodies are being received at once (max_buffered_mib "
            f"{gate.settings.max_buffered_mib}); try again shortly",
            503,
            retry_after=1,
        )
    gate.buffered_bytes += size
    return size


def _preflight(request: web.Request) -> web.Response:
    """A CORS preflight from an allowed Origin (the gate refused the others already)."""
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Allow-Headers": _CORS_ALLOW_HEADERS,
            "Access-Control-Max-Age": "600",
        },
    )


async def timing_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer's head carries its `X-Request-Id`, and, once a model served it,
    `Server-Timing` with what is known when the head leaves: a whole answer is complete by then (total),
    a stream has only waited so far."""
    trace = request.get(TRACE)
    if trace is None:
        return
    response.headers["X-Request-Id"] = trace.request_id
    if trace.acquired:
        total_s = time.perf_counter() - trace.arrived if isinstance(response, web.Response) else None
        response.headers["Server-Timing"] = trace.server_timing(total_s)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed Origin may read the answer; the gate refused every other Origin."""
    for name in [h for h in response.headers if h.lower().startswith("access-control-allow-origin")]:
        del response.headers[name]
    for name, value in cors_allow(request):
        response.headers.add(name, value)


def cors_allow(request: web.Request) -> list[tuple[str, str]]:
    """The CORS headers of an answer to an allowed Origin; none for a request without one."""
    origin = request.headers.get("Origin")
    if origin is None:
        return []
    allowed = request.app[ACCESS].settings.allowed_origins
    if not access.origin_allowed(origin, allowed, request.headers.get("Host")):
        return []
    return [
        ("Access-Control-Allow-Origin", origin),
        ("Access-Control-Expose-Headers", _CORS_EXPOSE_HEADERS),
        ("Vary", "Origin"),
    ]
