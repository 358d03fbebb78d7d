"""What every request goes through, whichever server took it: the aiohttp app's middlewares
(api/middleware.py) or the data plane's front (dataplane/front.py). Its id, the Origin, Host and key
checks, the body budget, the error body in the client's API, CORS, and the access log.

The middlewares themselves stay in api/middleware.py: aiohttp marks them with an attribute, which a
function compiled by `make native` cannot take. This module is compiled (supervisor/native.py).
"""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Mapping
from typing import Final

import structlog
from aiohttp import web

from supervisor import access, logs, secrets
from supervisor.api.context import ACCESS, METRICS, REQUEST_CLIENT, REQUEST_MODEL, REQUEST_UPSTREAM
from supervisor.errors import SupervisorError
from supervisor.metrics import CLIENT_GONE as CLIENT_GONE
from supervisor.metrics import REQUEST_ERROR, REQUEST_PEER, Trace

log = structlog.get_logger("api")

# What a page on an allowed Origin may send, and read of an answer.
_CORS_ALLOW_HEADERS: Final = (
    "Authorization, Content-Type, X-Api-Key, X-Request-Id, X-Priority, X-Client-Id, X-Session-Id"
)
_CORS_METHODS: Final = "GET, POST, DELETE, OPTIONS"
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")  # RFC 9110's token, bounded
_CORS_ASKED_MAX: Final = 32  # names of a preflight's Access-Control-Request-Headers looked at
_CORS_EXPOSE_HEADERS: Final = "Retry-After, X-Request-Id, Server-Timing"

# Errors whose message carries what a child or the hub said: file paths, URLs, stderr lines.
_REPORTS_FROM_BELOW: Final = frozenset(
    {
        "model_failed",
        "model_crashed",
        "model_stopped",
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
    what a child or the hub said cut short for callers who may not see internals. The code goes to the
    access log: a 503 alone is any of nine causes."""
    request[REQUEST_ERROR] = error.code
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


# A client's X-Request-Id is kept if it is 1 to 200 visible ASCII characters: it goes to logs and the child.
_SANE_REQUEST_ID: Final = re.compile(r"[!-~]{1,200}")
# New ids: 32 hex digits like a uuid4's, a random half per process and a counter, without a syscall each.
_ID_PREFIX: Final = uuid.uuid4().hex[:16]
_ids: Final = itertools.count(int.from_bytes(os.urandom(6)))


def request_id_from(given: str | None) -> str:
    """The client's `X-Request-Id` (`given`) when it is a sane one, else a new id like a uuid4's hex."""
    if given is not None and _SANE_REQUEST_ID.fullmatch(given):
        return given
    # bytes.hex rather than a format spec (`:016x`), which costs five times as much
    return _ID_PREFIX + (next(_ids) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big").hex()


# Refused before a model is known: no key or not allowed, too slow or too large a body, a compressed
# body, too many at once, no room for the body (server_busy) or shutting down. Logged (not counted: no
# model to count under).
_GATE_REFUSALS: Final = frozenset((401, 403, 408, 413, 415, 429, 503))
# Methods of the requests that change something (load, unload, pin, unpin, pull, delete) or ask about
# one model by name (Ollama's POST /api/show): logged whatever they answer, with the key that sent them.
# Reads (GET: probes, scrapes, the dashboard's polling) are not: they would drown the log.
_ACTIONS: Final = frozenset(("POST", "DELETE", "PUT", "PATCH"))


def log_answer(request: web.Request, status: int, trace: Trace, elapsed: float) -> None:
    """Count, time and log a request that named a model; log one that the gate refused or that acted
    (an admin action, a pull, a delete): the access log."""
    model = request.get(REQUEST_MODEL)
    # A refusal is an error answer (REQUEST_ERROR): the health probes' own 503 (starting, draining) is not
    # one, and a probe every second would write a line every second.
    refused = status in _GATE_REFUSALS and request.get(REQUEST_ERROR) is not None
    if model is not None or refused or request.method in _ACTIONS:
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
            peer=request.get(REQUEST_PEER),
            **request.get(REQUEST_UPSTREAM, {}),
            status=status,
            error=request.get(REQUEST_ERROR),
            ms=round(elapsed * 1000, 2),
        )


def check_origin_and_host(request: web.Request, gate: access.AccessControl) -> None:
    """403 for a browser page of another site (Origin) and, where Host is checked (a loopback listener, or
    any listener without keys), a Host name that is not this machine's."""
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
    if gate.host_checked and host is not None and not access.host_allowed(host, gate.allowed_hosts):
        # A DNS-rebinding page reaches the daemon under its own host name: refuse that name.
        raise SupervisorError(
            "host_not_allowed",
            f"Host {host[:200]!r} is not this machine; add it to `allowed_hosts` to allow it",
            403,
        )


def identify_caller(
    request: web.Request, gate: access.AccessControl, ahead: Mapping[str, int] | None = None
) -> access.Caller:
    """The caller (401/403 for a missing, wrong or too weak key), noted on the request; 429 when its key
    already has `max_concurrent` requests in progress. `ahead`: requests of the key counted already that
    this one will not run beside (pipelined before it on its connection, which answers one at a time)."""
    who = gate.identify(request)
    request[access.REQUEST_CALLER] = who
    if (
        who.name is not None
        and who.max_concurrent is not None
        and gate.inflight[who.name] - (ahead.get(who.name, 0) if ahead else 0) >= who.max_concurrent
    ):
        raise SupervisorError(
            "too_many_requests",
            f"API key '{who.name}' already has {who.max_concurrent} requests in progress "
            "(max_concurrent); try again when one finishes",
            429,
            retry_after=1,
        )
    return who


def check_body_encoding(request: web.Request) -> None:
    """415 for a body sent compressed (`Content-Encoding` other than identity). Its size could not be
    counted against `max_buffered_mib` before it is unpacked (a 60 KiB gzip body can hold 60 MiB), and
    neither engine reads one: every route takes its body as sent. Every line is read: a repeated header
    is one list (RFC 9110 5.3), and aiohttp would unpack by the last line, not the first."""
    lines: list[str] = request.headers.getall("Content-Encoding", [])
    codings = [coding.strip().lower() for line in lines for coding in line.split(",")]
    if any(coding not in ("", "identity") for coding in codings):
        encoding = ", ".join(lines)
        raise SupervisorError(
            "unsupported_content_encoding",
            f"request bodies sent with Content-Encoding {encoding[:50]!r} are not accepted; "
            "send the body uncompressed",
            415,
        )


def body_too_large(size: int, gate: access.AccessControl) -> SupervisorError:
    """413, as aiohttp words it."""
    return SupervisorError(
        "request_too_large",
        f"request body too large: Maximum request body size {gate.max_body_bytes} exceeded, "
        f"actual body size {size}",
        413,
    )


def admit_body(
    request: web.Request, length: int | None, gate: access.AccessControl, who: access.Caller
) -> int:
    """What a body meets before it is read, on either server: its declared size (413, at once, before a
    byte of it), its encoding (415), then its share of max_buffered_mib (503); the bytes reserved.
    `length`: the declared Content-Length, None for a chunked body."""
    if length is not None and length > gate.max_body_bytes:
        raise body_too_large(length, gate)
    check_body_encoding(request)
    return reserve_body(length, gate, who)


def reserve_body(content_length: int | None, gate: access.AccessControl, who: access.Caller) -> int:
    """Count this body against `max_buffered_mib` before reading it, or answer 503 `server_busy`. While
    keys are configured, a caller without one (on a route that needs none) sends no body: what it held
    would come out of every caller's budget, and none of those routes reads one."""
    if who.keys_configured and who.name is None:
        raise SupervisorError(
            "invalid_api_key",
            "a request with a body needs a valid API key: send `Authorization: Bearer <key>`",
            401,
        )
    limit = gate.max_body_bytes
    size = content_length if content_length is not None else limit
    size = min(size, limit) or 1
    if gate.buffered_bytes + size > gate.max_buffered_bytes:
        raise SupervisorError(
            "server_busy",
            f"too many request bodies are being received at once (max_buffered_mib "
            f"{gate.settings.max_buffered_mib}); try again shortly",
            503,
            retry_after=1,
        )
    gate.buffered_bytes += size
    return size


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


def cors_preflight(request: web.Request) -> web.Response:
    """The answer to a CORS preflight from an allowed Origin (check_origin_and_host refused the others):
    our headers, and those the page asks to send. SDKs add their own (the OpenAI JS SDK's `x-stainless-*`,
    `OpenAI-Organization`); a header grants nothing here, and the Origin is one the operator allowed."""
    allowed = _CORS_ALLOW_HEADERS
    asked = request.headers.get("Access-Control-Request-Headers", "")
    names = [name.strip() for name in asked.split(",")[:_CORS_ASKED_MAX]]
    extra = [name for name in names if _HEADER_NAME.fullmatch(name)]
    if extra:
        allowed += ", " + ", ".join(extra)
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Allow-Headers": allowed,
            "Access-Control-Max-Age": "600",
        },
    )
