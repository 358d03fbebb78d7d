"""structlog set-up: JSON lines for machines or coloured console lines for people, one event per line."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Callable
from time import gmtime, strftime
from time import time as wall_time
from types import TracebackType
from typing import Any

import structlog
from structlog.types import EventDict

from supervisor import secrets

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class RequestScope:
    """`with RequestScope(request_id):` every log event in the block carries `request_id`.

    Tasks and timers started in the block (a load, a keep-alive timer, a child's output pump) copy the
    context and may outlive the request: their events carry the id only while the request lasts, which
    a plain structlog contextvar could not do (clearing it does not reach the copies).
    """

    __slots__ = ("_token", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id: str | None = request_id
        self._token: contextvars.Token[RequestScope | None] | None = None

    def __enter__(self) -> None:
        self._token = _request.set(self)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.request_id = None  # seen by every copy of the context
        if self._token is not None:
            _request.reset(self._token)


_request: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar(
    "llm_supervisor_request", default=None
)


def _add_request_id(
    logger: object, method: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    scope = _request.get()
    if scope is not None and scope.request_id is not None:
        event.setdefault("request_id", scope.request_id)
    return event


class UtcTimestamp:
    """structlog processor: the event's `timestamp`, in UTC, as structlog's TimeStamper(fmt="iso", utc=True)
    writes it (2026-11-26T18:23:50.867946Z), always with its microseconds. That one builds a datetime
    and formats all of it, about 49,000 instructions per event, more than the masking; here the text up
    to the second is made once a second, and each event adds its microseconds."""

    __slots__ = ("_second",)

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")  # one tuple, so a thread never reads half of it

    def __call__(self, logger: object, method: str, event: EventDict) -> EventDict:
        # Rounded to the microsecond as datetime rounds (a time in microseconds is exact in a float)
        second, micros = divmod(round(wall_time() * 1_000_000), 1_000_000)
        made, text = self._second
        if second != made:
            text = strftime("%Y-%m-%dT%H:%M:%S", gmtime(second))
            self._second = (second, text)
        event["timestamp"] = text + "." + str(micros).rjust(6, "0") + "Z"
        return event


class _AccessLog:
    """The access log's logger, bound once per configure() rather than on every request (structlog's
    module-level loggers re-bind on each call, since a SIGHUP may reconfigure them), and whether its
    level is on at all, so a filtered access log costs nothing to build."""

    logger: Any = None
    enabled = True


ACCESS_LOG = _AccessLog()


def json_lines() -> Callable[..., bytes]:
    """structlog's JSONRenderer serializer: the event as a JSON line, by orjson (a fifth of the
    instructions json's encoder takes, the dearest part of a line after the masking). What orjson refuses
    (text with a lone surrogate, as a header decoded with surrogateescape can hold; an integer beyond
    64 bits) goes through json, which escapes it. Imported here, when the format is JSON: not at start-up
    otherwise (the first request body imports it too: bodies._fast_parse)."""
    import orjson

    dumps, option = orjson.dumps, orjson.OPT_NON_STR_KEYS

    def line(event: EventDict, **_: Any) -> bytes:
        try:
            return dumps(event, default=repr, option=option)
        except TypeError:  # orjson.JSONEncodeError
            return json.dumps(event, default=repr).encode()

    return line


def configure(log_format: str, level: str) -> None:
    renderer: structlog.types.Processor
    factory: Callable[..., Any]
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer(serializer=json_lines())
        factory = structlog.BytesLoggerFactory(sys.stderr.buffer)  # orjson's bytes, not decoded again
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        # No structlog.contextvars.merge_contextvars: nothing binds structlog's context variables (a
        # request's id comes from RequestScope), and it walks every context variable of the process on
        # every event, about 4,000 instructions. Whoever binds one adds it back.
        processors=[
            _add_request_id,
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            # After the traceback's text is made, so that it is masked too.
            secrets.redact_event,
            # After the masking: our own value, and its colons would send it through the patterns.
            UtcTimestamp(),
            renderer,
        ],
        # Filtering in the bound logger makes a disabled debug call nearly free on hot paths.
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    ACCESS_LOG.logger = structlog.get_logger("api").bind()
    ACCESS_LOG.enabled = _LEVELS[level] <= logging.INFO
    # aiohttp and asyncio log through the standard library; send their warnings to the same stream.
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Set at every call: basicConfig does nothing once the root logger has a handler, so a reload that
    # changed log_level did not reach aiohttp and asyncio.
    logging.getLogger().setLevel(max(_LEVELS[level], logging.WARNING))
