"""Command lines the tests and checks start processes with."""

from __future__ import annotations

import sys
from pathlib import Path


def serve_argv(config: Path, port: int, *more: str) -> list[str]:
    """The daemon on `port` with this config, logging JSON lines (what the tests read back)."""
    return [
        sys.executable,
        "-m",
        "supervisor",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--log-format",
        "json",
        *more,
    ]
