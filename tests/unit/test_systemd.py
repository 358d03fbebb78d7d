"""sd_notify: lines reach a socket the test owns, and nothing the socket does can fail or stall the daemon."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import systemd


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound at a short path (AF_UNIX paths stop at 108 bytes); its NOTIFY_SOCKET."""
    folder = tempfile.mkdtemp(prefix="sdn", dir="/tmp")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)  # a deadline for a line that should already be there
    yield sock, path
    sock.close()
    os.unlink(path)
    os.rmdir(folder)


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_reaches_a_path_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert systemd.Notifier(path).ready()
    assert received(sock) == ["READY=1", "STATUS=serving"]


def test_abstract_namespace_socket() -> None:
    name = f"llmsup-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        assert systemd.Notifier("@" + name).stopping()
        assert received(sock)[0] == "STOPPING=1"


def test_reloading_carries_the_monotonic_clock(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    before = systemd.monotonic_usec()
    systemd.Notifier(path).reloading()
    lines = received(sock)
    assert lines[0] == "RELOADING=1"
    (stamp,) = [line for line in lines if line.startswith("MONOTONIC_USEC=")]
    assert before <= int(stamp.removeprefix("MONOTONIC_USEC=")) <= systemd.monotonic_usec()


def test_without_notify_socket_every_call_does_nothing() -> None:
    notifier = systemd.Notifier.from_environ({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert notifier.watchdog_s is None


def test_a_missing_socket_is_logged_never_raised(tmp_path: Path) -> None:
    notifier = systemd.Notifier(str(tmp_path / "nobody-listens"))
    assert notifier.notify("READY=1") is False
    assert notifier.notify("WATCHDOG=1") is False  # and again, quietly


def test_an_unsupported_address_disables_notification() -> None:
    assert systemd.socket_address("vsock:2:1234") is None
    assert not systemd.Notifier("vsock:2:1234").enabled


def test_a_full_socket_drops_the_line_instead_of_blocking(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = systemd.Notifier(path)
    # Nobody reads: the receive queue fills, and the next send fails at once (EAGAIN) instead of waiting.
    sent = 0
    while notifier.notify("WATCHDOG=1", "X" * 4000):
        sent += 1
        assert sent < 100_000, "the socket never filled up"
    assert sent > 0
    sock.recv(8192)  # room again: the notifier was not broken by the failure
    assert notifier.notify("READY=1")


def test_from_environ_takes_the_variables_away_from_children(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    environ = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid()), "A": "1"}
    notifier = systemd.Notifier.from_environ(environ)
    assert notifier.enabled
    assert notifier.watchdog_s == 15.0
    assert environ == {"A": "1"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # another process's watchdog
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_watchdog_usec_for_our_pid(
    environ: dict[str, str], expected: float | None
) -> None:
    assert systemd.watchdog_interval_s(environ, pid=4242) == expected


def test_the_watchdog_needs_a_socket() -> None:
    assert systemd.Notifier(None, watchdog_s=1.0).watchdog_s is None


async def test_keep_watchdog_pings_until_cancelled(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    pinging = asyncio.ensure_future(systemd.Notifier(path, watchdog_s=0.01).keep_watchdog())
    try:
        for _ in range(3):
            data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
            assert data == b"WATCHDOG=1"
    finally:
        pinging.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pinging


async def test_keep_watchdog_returns_at_once_without_a_watchdog(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    await asyncio.wait_for(systemd.Notifier(path).keep_watchdog(), 10)
