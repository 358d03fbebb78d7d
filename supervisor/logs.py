"""structlog set-up: JSON lines for machines or coloured console lines for people, one event per line."""

from __future__ import annotations

import contextvars
import logging
import sys
from types import TracebackType
from typing import Any

import structlog

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


class _AccessLog:
    """The access log's logger, bound once per configure() rather than on every request (structlog's
    module-level loggers re-bind on each call, since a SIGHUP may reconfigure them), and whether its
    level is on at all, so a filtered access log costs nothing to build."""

    logger: Any = None
    enabled = True


ACCESS_LOG = _AccessLog()


def configure(log_format: str, level: str) -> None:
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_request_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            # Last before rendering, so that a traceback's text is masked too.
            secrets.redact_event,
            renderer,
        ],
        # Filtering in the bound logger makes a disabled debug call nearly free on hot paths.
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    ACCESS_LOG.logger = structlog.get_logger("api").bind()
    ACCESS_LOG.enabled = _LEVELS[level] <= logging.INFO
    # aiohttp and asyncio log through the standard library; send their warnings to the same stream.
    logging.basicConfig(
        level=max(_LEVELS[level], logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
