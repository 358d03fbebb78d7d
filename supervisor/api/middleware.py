"""One place that turns every failure into the error body of the API the client speaks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from supervisor.api.context import METRICS, REQUEST_CLIENT, REQUEST_MODEL
from supervisor.errors import SupervisorError

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
    if request.path.startswith("/api/"):
        body: dict[str, object] = {"error": error.message}  # Ollama's shape
    else:
        body = error.openai_body()
    return web.json_response(body, status=error.status, headers=error.headers())


@web.middleware
async def errors_and_access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
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
    model = request.get(REQUEST_MODEL)
    if model is not None:
        request.app[METRICS].requests.labels(model, str(response.status)).inc()
        log.info(
            "request",
            method=request.method,
            path=request.path,
            model=model,
            client_id=request.get(REQUEST_CLIENT),
            status=response.status,
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
    return response
