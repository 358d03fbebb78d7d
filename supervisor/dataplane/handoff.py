"""aiohttp's handler for a connection the front hands over, whose own answers are in the API's error shape.

The front hands aiohttp the connections whose requests it does not serve itself (front.FrontConnection),
behind front.HandedOffGuard, which keeps from aiohttp the heads llhttp refuses. A few still reach
aiohttp's parser (a head that begins in the read where a chunked body ends, or one padded past what the
guard holds back), and aiohttp answered those itself: a text/plain 400 that named its parser, which an
OpenAI or Ollama client cannot read. `RequestHandler.handle_error` is where aiohttp makes that answer (and
the 500 of an exception that escapes every middleware): here it makes the front's own refusal instead.
aiohttp does not know the request's path by then, so the shape is OpenAI's, as the front's is for bytes
that are not HTTP.

Not compiled (setup.py): a mypyc class cannot subclass aiohttp's.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = structlog.get_logger("front")


class ApiErrorsHandler(RequestHandler):
    """aiohttp's RequestHandler; its own answers to a request it could not parse or handle are JSON."""

    __slots__ = ()

    @property
    def idle(self) -> bool:
        """Between requests, waiting for the next: none handled now, none parsed and waiting its turn (read
        from aiohttp's own state: this handler is aiohttp's, at the version pinned)."""
        return not self._request_in_progress and not self._messages

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's: an answer has begun, no other can be sent
            raise ConnectionError("Response is sent already, cannot send another response with the error")
        if status >= 500:
            log.error("handed_off_request_failed", status=status, exc_info=exc)
            code, text, kind = "internal_error", "internal error", "server_error"
        else:
            # aiohttp's message draws a caret under the bytes it refused, on lines of their own
            why = (message or (str(exc) if exc is not None else "") or "invalid request").splitlines()[0]
            log.warning("handed_off_request_refused", status=status, reason=why[:200])
            code, text, kind = "invalid_request", f"bad request: {why[:200]}", "invalid_request_error"
        error = {"message": text, "type": kind, "param": None, "code": code}
        response = web.Response(
            status=status, body=json.dumps({"error": error}), content_type="application/json"
        )
        response.force_close()
        return response


def refuse_body(handler: object, error: Exception) -> None:
    """The body `handler` (one of ours) reads for its latest request will not come whole: the guard's
    parser refused its framing. aiohttp's own parser drops such a body without a word to its reader,
    which then waits for the rest until client_timeout_s. The reader gets `error` now (the gate's read
    answers it in the API's shape), and the connection closes once that answer is out."""
    if not isinstance(handler, ApiErrorsHandler):
        return
    reading = [payload for _, payload in reversed(handler._messages)]
    if handler._current_request is not None:
        reading.append(handler._current_request.content)
    payload = next((p for p in reading if not p.is_eof()), None)
    if payload is not None:
        payload.set_exception(error)
        payload.feed_eof()  # read to its end: aiohttp does not linger on it after the answer
    handler.close()  # no request after this one: where it ends is not known


def idle(handler: object) -> bool:
    """Whether `handler` is one of ours that waits for its connection's next request."""
    return isinstance(handler, ApiErrorsHandler) and handler.idle


def new_handler(server: web.Server) -> RequestHandler:
    """What `server()` makes for a connection, with the API's errors: the same settings (aiohttp keeps
    the keyword arguments its runner was given, such as the bounds on a head, in `_kwargs`)."""
    settings: dict[str, Any] = server._kwargs
    return ApiErrorsHandler(server, loop=server._loop, **settings)
