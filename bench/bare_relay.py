"""The smallest relay there is, for comparison: bytes from each client connection to one upstream port
and back, on uvloop protocols, with no parsing, checks, scheduling, logging or metrics.

It is the floor for a Python proxy on this machine: measured against the same llama-server the daemon
fronts (README, Performance), it costs 74-86 us of CPU per request where the daemon costs 450-640 us.
Not part of `make bench`; run it by hand in front of a child and point a load at it:

    .venv/bin/python -m bench.bare_relay LISTEN_PORT UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import cast

import uvloop


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.client.transport is not None:
            self.client.transport.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.client.transport is not None:
            self.client.transport.close()


class _Client(asyncio.Protocol):
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.upstream = await loop.create_connection(
            lambda: _Upstream(self), "127.0.0.1", self.upstream_port
        )
        for data in self.early:
            self._send(data)

    def _send(self, data: bytes) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self._send(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def main(listen_port: int, upstream_port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _Client(upstream_port), "127.0.0.1", listen_port
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
