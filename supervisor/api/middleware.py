"""What runs around every route of the aiohttp app: the access gate, then error bodies in the client's
API, then the access log; outside them, the front's refusals of requests on connections it handed over.

Routes never check keys, Origins or body budgets themselves; `access_gate` does it once, before them.
The checks are api/gate.py's, which the data plane's front makes too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import HttpVersion11, web

from supervisor import logs
from supervisor.api.context import ACCESS, REQUEST_OUTCOME
from supervisor.api.gate import (
    CLIENT_GONE,
    admit_body,
    check_origin_and_host,
    cors_allow,
    cors_preflight,
    error_parts,
    identify_caller,
    log_answer,
    request_id_from,
)
from supervisor.dataplane.front import REFUSED_TARGET, refusal_for
from supervisor.errors import SupervisorError
from supervisor.metrics import REQUEST_PEER, TRACE, Trace
from supervisor.proxy import NO_BODY_STATUSES

log = structlog.get_logger("api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def error_response(request: web.Request, error: SupervisorError) -> web.Response:
    body, headers = error_parts(request, error)
    return web.json_response(body, status=error.status, headers=headers)


@web.middleware
async def front_refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: a request llhttp refused (or a head past the front's bounds) on a connection handed to
    aiohttp is answered in its turn, once the answers before it are out, with the 400 (431, 414) the
    front gives the same bytes before a hand-off, and the connection closed. front.HandedOffGuard keeps
    the request from aiohttp, gives it REFUSED_TARGET in its place, and holds the answer (refusal_for);
    on any other connection that path is no route."""
    if request.raw_path == REFUSED_TARGET:
        refusal = refusal_for(request.transport)
        if refusal is not None:
            status, body = refusal
            response = web.Response(
                status=status, body=body, content_type="application/json", charset="utf-8"
            )
            response.force_close()
            return response
    return await handler(request)


@web.middleware
async def errors_and_access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request gets an id (`X-Request-Id`, in every log event of it and sent to the child) and a
    Trace; errors become the client's API shape; requests that named a model are counted, timed and
    logged. `timing_headers` puts the id and `Server-Timing` on the answer's head."""
    started = time.perf_counter()
    rid = request_id_from(request.headers.get("X-Request-Id"))
    trace = request[TRACE] = Trace(rid, started)
    request[REQUEST_PEER] = _client_address(request)
    with logs.RequestScope(rid):
        return await _answer(request, handler, started, trace)


def _client_address(request: web.Request) -> str | None:
    """The client's address for the access log: the peer of a connection the front handed over. A
    request the front tunnelled came through the app's internal listener, whose peer is the daemon
    itself: none is better than a wrong one there."""
    transport = request.transport
    if transport is None:
        return None
    gate = request.app.get(ACCESS)
    listener = transport.get_extra_info("sockname")
    if gate is not None and (not isinstance(listener, tuple) or listener[1] != gate.settings.port):
        return None
    return request.remote


async def _answer(request: web.Request, handler: Handler, started: float, trace: Trace) -> web.StreamResponse:
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        # The client went away (aiohttp cancels the handler): still one count and one line, as nginx's 499.
        log_answer(request, CLIENT_GONE, trace, time.perf_counter() - started)
        raise
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
        if "Allow" in exc.headers:  # a 405 must say which methods the route takes (RFC 9110 15.5.6)
            response.headers["Allow"] = exc.headers["Allow"]
    except Exception:
        # A bug must cost one request, never the daemon.
        log.exception("handler_error", method=request.method, path=request.path)
        response = error_response(request, SupervisorError("internal_error", "internal error", 500))
    log_answer(request, request.get(REQUEST_OUTCOME, response.status), trace, time.perf_counter() - started)
    return response


@web.middleware
async def access_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Origin, Host, key and role, per-key concurrency, then the body read within its budget and deadline."""
    gate = request.app[ACCESS]
    settings = gate.settings
    check_origin_and_host(request, gate)
    if request.method == "OPTIONS" and request.headers.get("Origin") is not None:
        return cors_preflight(request)
    who = identify_caller(request, gate)
    reserved = 0
    if request.body_exists:
        reserved = admit_body(request, request.content_length, gate, who)
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


async def close_after_unframed_body(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: HTTP/1.0 has no chunked coding, so a body of no stated length (a stream)
    ends only with the connection. aiohttp leaves keep-alive off for it only in a local variable: an
    HTTP/1.0 client that asked for keep-alive (`ab -k`, an HTTP/1.0 proxy) waited after the stream's
    last line for the keep-alive timeout (75 s)."""
    if (
        request.version < HttpVersion11
        and response.content_length is None
        and not response.chunked
        and response.status not in NO_BODY_STATUSES  # no body, so nothing to end
        and request.method != "HEAD"
    ):
        response.force_close()


async def server_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the `Server` the front's own answers carry, not aiohttp's default (which names
    Python's and aiohttp's versions), so that every answer on the port says the same."""
    response.headers["Server"] = "llm-supervisor"
