"""sd_notify: tell systemd (or anything listening on `NOTIFY_SOCKET`) where the daemon stands.

A few lines over a datagram socket, the protocol of sd_notify(3): `READY=1` once serving, `RELOADING=1`
and `READY=1` around a reload, `STOPPING=1` at shutdown, `WATCHDOG=1` every half `WatchdogSec`. Every
send is non-blocking and a failed one is logged and dropped: telling systemd must never fail the daemon.
Without `NOTIFY_SOCKET` (not under systemd, a container, tests) every call does nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

import structlog

log = structlog.get_logger("systemd")

# What systemd hands a notify service; the children must not inherit them (they are not the main pid).
NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(notify_socket: str) -> str | None:
    """The AF_UNIX address named by `NOTIFY_SOCKET`: a path, or `@name` in the abstract namespace."""
    if notify_socket.startswith("/"):
        return notify_socket
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        return "\0" + notify_socket[1:]
    return None  # vsock: and anything else are not spoken here


def watchdog_interval_s(environ: Mapping[str, str], pid: int) -> float | None:
    """Half of `WATCHDOG_USEC` in seconds when the watchdog is meant for `pid`, else None."""
    raw_pid = environ.get("WATCHDOG_PID")
    if raw_pid is not None and raw_pid.strip() != str(pid):
        return None  # the watchdog is some other process's (we were started by one that uses it)
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock `MONOTONIC_USEC=` is read against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends state lines to the service manager; every method is safe to call with nobody listening."""

    def __init__(self, notify_socket: str | None = None, watchdog_s: float | None = None) -> None:
        self.address = socket_address(notify_socket) if notify_socket else None
        if notify_socket and self.address is None:
            log.warning("notify_socket_unsupported", notify_socket=notify_socket)
        self.watchdog_s = watchdog_s if self.address is not None else None
        self._failed_once = False

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Read, then remove, systemd's variables from `environ` (default `os.environ`), so that engine
        children neither inherit the socket nor think the watchdog is theirs."""
        env: MutableMapping[str, str] = os.environ if environ is None else environ
        notifier = cls(env.get("NOTIFY_SOCKET"), watchdog_interval_s(env, os.getpid()))
        for name in NOTIFY_VARIABLES:
            env.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send `lines` as one datagram; True if it went out. Never blocks, never raises."""
        if self.address is None:
            return False
        message = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)  # a full receive queue drops this line instead of stalling the loop
                sock.sendto(message, self.address)
        except OSError as exc:
            # Logged at warning once, then at debug: a watchdog line every few seconds must not flood.
            level = log.debug if self._failed_once else log.warning
            level("sd_notify_failed", lines=list(lines), error=str(exc))
            self._failed_once = True
            return False
        return True

    def ready(self, status: str = "serving") -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", "STATUS=reloading")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", "STATUS=draining and stopping models")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    async def keep_watchdog(self) -> None:
        """Send `WATCHDOG=1` every half `WatchdogSec` for as long as the event loop runs this task; a
        blocked loop misses its pings, which is what the watchdog is there to notice. Cancel to stop."""
        if self.watchdog_s is None:
            return
        log.info("watchdog_enabled", interval_s=self.watchdog_s)
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s)
