"""The children's Unix sockets: one private directory per daemon process, made when the first child needs
it and removed when the daemon stops.

It is made in the system's temporary directory (`TMPDIR`, else /tmp), 0700, so that only the daemon's user
can connect, and so that a socket's path stays short: it must fit in a sockaddr_un (107 bytes), which a
state directory deep in a home or test folder may not. Where even that is too long, a child gets a
loopback port instead. A socket's file name doubles as the host of the child's URLs (Endpoint.host), which
`socket_named` turns back into the socket.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
from pathlib import Path

import structlog

from workers.base import Endpoint

log = structlog.get_logger("sockets")

_PREFIX = "llmsup-sockets-"
_PATH_MAX = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
_NAME = re.compile(r"[0-9a-f]{16}\.sock")
_directory: Path | None = None


def endpoint_for(listen: str) -> Endpoint:
    """Where a new child is to listen, as its manifest's `listen` says: a socket of ours, or a port."""
    return new_endpoint() if listen == "unix" else Endpoint.loopback()


def new_endpoint() -> Endpoint:
    """A Unix socket path nobody uses yet, in this daemon's directory; a loopback port when the path would
    be too long for a socket."""
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix=_PREFIX))
    path = _directory / f"{secrets.token_hex(8)}.sock"
    if len(os.fsencode(path)) > _PATH_MAX:
        log.warning("socket_path_too_long", path=str(path), fallback="loopback port")
        return Endpoint.loopback()
    return Endpoint(socket=path)


def socket_named(host: str) -> Path | None:
    """The socket of ours that a URL's host names (Endpoint.host), or None: not one of ours."""
    if _directory is None or not _NAME.fullmatch(host):
        return None
    return _directory / host


def remove_directory() -> None:
    """At shutdown, once every child has stopped (each child's socket goes with it): the directory, if
    it is empty. A socket still in it is another scheduler's in this process (tests run several), or was
    not put there by the daemon: then it stays, and so does the directory."""
    global _directory
    if _directory is None:
        return
    try:
        _directory.rmdir()
    except OSError as exc:
        log.info("socket_directory_kept", path=str(_directory), error=str(exc))
        return
    _directory = None


def remove_left_directory(socket: Path) -> None:
    """After a daemon that died without its shutdown: the directory its reaped child's socket was in, once
    empty (the reaper removed the socket, as the pid file recorded it)."""
    directory = socket.parent
    if socket.suffix == ".sock" and directory.name.startswith(_PREFIX) and directory != _directory:
        with contextlib.suppress(OSError):  # another of its children still to reap, or gone already
            directory.rmdir()


# The daemon's own listener (aiohttp's, which the front tunnels to) is in the same directory, and no pid
# file names it: a daemon that died without its shutdown (SIGKILL, the OOM killer) left it there, and so
# the directory, for good. Its path is kept in the state directory for the next start to remove.
_LISTENER_RECORD = "listener-socket"


def record_listener(state_dir: Path, socket: Path) -> None:
    (state_dir / _LISTENER_RECORD).write_text(f"{socket}\n")


def remove_left_listener(state_dir: Path) -> None:
    """At start-up, once a dead daemon's children are reaped: the listener socket it recorded, and its
    socket directory once empty. Only a socket of ours: named as new_endpoint names one, in a directory
    named as this module names one."""
    record = state_dir / _LISTENER_RECORD
    try:
        socket = Path(record.read_text().strip())
    except OSError:
        return
    if (
        _NAME.fullmatch(socket.name)
        and socket.parent.name.startswith(_PREFIX)
        and socket.parent != _directory
    ):
        with contextlib.suppress(OSError):
            if socket.is_socket():
                socket.unlink()
        remove_left_directory(socket)
    record.unlink(missing_ok=True)


def forget_listener(state_dir: Path) -> None:
    """At shutdown, once the listener's socket is removed."""
    (state_dir / _LISTENER_RECORD).unlink(missing_ok=True)
