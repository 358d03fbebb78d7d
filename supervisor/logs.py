"""structlog set-up: JSON lines for machines or coloured console lines for people, one event per line."""

from __future__ import annotations

import logging
import sys

import structlog

from supervisor import secrets

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(log_format: str, level: str) -> None:
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
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
    # aiohttp and asyncio log through the standard library; send their warnings to the same stream.
    logging.basicConfig(
        level=max(_LEVELS[level], logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
