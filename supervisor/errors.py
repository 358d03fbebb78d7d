"""Errors as values: a stable code, a message a user can act on, and the HTTP status they map to.

They are raised anywhere in the daemon and turned into an API's error body in one place per API.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.process import ChildProcess


class SupervisorError(Exception):
    """An error a client should see, with its HTTP status and an optional Retry-After in seconds."""

    def __init__(
        self,
        code: str,
        message: str,
        status: int,
        retry_after: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.retry_after = retry_after
        self.param = param  # the request field at fault, as OpenAI names it (`messages[0].content`)

    def openai_body(self) -> dict[str, Any]:
        """The body OpenAI's API returns for an error."""
        return {
            "error": {
                "message": self.message,
                "type": openai_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }

    def openai_event(self, path: str = "") -> bytes:
        """The SSE event an OpenAI stream ends with when it fails after its head was sent; on the
        Responses API's route (`path`), its own typed `error` event, which its clients dispatch on."""
        if path == "/v1/responses":
            error = {"type": "error", "code": self.code, "message": self.message, "param": self.param}
            return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"
        return b"data: " + json.dumps(self.openai_body()).encode() + b"\n\n"

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",  # a conflict with the model's state: not the server's fault, no retry
    413: "invalid_request_error",
    408: "invalid_request_error",
    429: "rate_limit_error",
    501: "invalid_request_error",
    507: "insufficient_storage",
    503: "service_unavailable",
    504: "timeout",
}


def openai_type(status: int) -> str:
    """OpenAI's `type` for an error of this status: a client's mistake unless the table says otherwise."""
    return _OPENAI_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


# A field's path at the start of a message: `max_tokens: ...`, `messages[0].content: ...`.
_FIELD_AT_FAULT = re.compile(r"([A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*|\[\d+\])*): ")


def bad_request(message: str, code: str = "invalid_request") -> SupervisorError:
    """A 400 for a request the daemon will not act on. A message that begins with the field at fault (as
    every field check writes it: `temperature: must be a number, not "hot"`) names it as `param` too,
    where OpenAI's SDKs and UIs look for it."""
    field = _FIELD_AT_FAULT.match(message)
    return SupervisorError(code, message, 400, param=field.group(1) if field else None)


def model_not_found(name: str) -> SupervisorError:
    return SupervisorError(
        "model_not_found", f"model '{name}' not found; GET /v1/models or /api/tags lists what is served", 404
    )


def capability_unsupported(code: str, message: str) -> SupervisorError:
    """A request that needs what its model cannot do (images, tools, thinking, embeddings, text)."""
    return SupervisorError(code, message, 400)


def model_failed(name: str, reason: str, retry_after: float | None = None) -> SupervisorError:
    return SupervisorError("model_failed", f"model '{name}' failed to start: {reason}", 503, retry_after)


def connection_failure(exc: BaseException | None) -> str:
    """What became of a connection (to a child, a node, the internal listener) in plain words, for a
    client's error message or a log line: never the exception's own text, which can name the daemon's
    private socket paths."""
    if exc is None:
        return "the connection was closed"
    if isinstance(exc, ConnectionRefusedError | FileNotFoundError):  # a Unix socket no longer there
        return "the connection was refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "the connection was reset"
    if isinstance(exc, TimeoutError):
        return "the connection timed out"
    return "the connection failed"


def model_crashed(name: str, reason: str) -> SupervisorError:
    return SupervisorError("model_crashed", f"model '{name}' stopped while serving: {reason}", 503, 1)


def cut_short(name: str, child: ChildProcess | None, what: str) -> SupervisorError:
    """A request whose child's answer ended early: `model_stopped` when the daemon stopped the child
    itself (an unload, a reload, an eviction, the shutdown, once drain_timeout_s had passed), which is no
    crash to report; else `model_crashed`."""
    why = child.stopped_for if child is not None else None
    if why is None:
        return model_crashed(name, what)
    message = f"model '{name}' was stopped ({why}) before it had answered, after drain_timeout_s: {what}"
    return SupervisorError("model_stopped", message, 503, 1)


def not_supported(name: str, engine: str, path: str) -> SupervisorError:
    return SupervisorError(
        "unsupported_endpoint",
        f"model '{name}' ({engine}) does not serve {path}; its engine answered 404",
        501,
    )


def engine_error(message: str, status: int) -> SupervisorError:
    """An error the engine itself answered: its 4xx or 503 status (else 502) and its message."""
    # An engine's own failure (500, or a status that is no error) is a bad gateway for our client.
    return SupervisorError("engine_error", message, status if 400 <= status < 500 or status == 503 else 502)


def upstream_failed(name: str, reason: str) -> SupervisorError:
    return SupervisorError("upstream_error", f"could not reach model '{name}': {reason}", 502, 1)


def queue_full(retry_after: float) -> SupervisorError:
    return SupervisorError(
        "queue_full", "too many requests are waiting for a model; try again later", 503, retry_after
    )


def queue_timeout(name: str, waited_s: float, why: str, retry_after: float) -> SupervisorError:
    return SupervisorError(
        "queue_timeout",
        f"model '{name}' could not serve this request within {waited_s:g}s: {why}",
        503,
        retry_after,
    )


def insufficient_vram(name: str, why: str) -> SupervisorError:
    return SupervisorError(
        "insufficient_vram", f"model '{name}' can never be placed: {why}; lower vram_mib, or add a GPU", 503
    )


def vram_unknown(name: str, why: str) -> SupervisorError:
    return SupervisorError("vram_unknown", f"model '{name}': {why}", 503)


def generation_timeout(name: str, limit_s: float) -> SupervisorError:
    return SupervisorError(
        "request_timeout",
        f"model '{name}' was still generating after {limit_s:g}s (its request_timeout_s); stopped",
        504,
    )


def shutting_down() -> SupervisorError:
    return SupervisorError("shutting_down", "the supervisor is shutting down", 503, 5)
