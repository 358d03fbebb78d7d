"""How the tests and checks start a daemon: a port for it, and its command line."""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

_BELOW_EPHEMERAL = 12_000  # how far below the ephemeral range free_port looks
_PORTS = random.Random()
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, for a server the test starts a moment later.

    Not the kernel's pick (bind to port 0): that comes from the ephemeral range, which every outgoing
    connection draws from too, so a client's connection could take it before the daemon binds it (seen in
    a full run: `listen_failed ... address already in use`). The kernel never hands out ports below that
    range, and each one here goes to one server per test session.
    """
    low = _ephemeral_range_start()
    for _ in range(1000):
        port = _PORTS.randrange(max(1024, low - _BELOW_EPHEMERAL), low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # some other program's
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port below {low}")


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


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
