"""What the supervisor needs from an engine: how to launch it, and how to tell it is ready to serve."""

from __future__ import annotations

import os
import secrets
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import aiohttp

from supervisor.manifests import ENGINE_KEY_VARIABLES, Manifest

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Endpoint:
    """Where a child listens: a port on loopback, or a Unix socket (workers/sockets.py).

    A child gets a Unix socket (a manifest's `listen: tcp` a port). Connecting costs both sides less CPU
    than over TCP, which counts because llama-server closes its connection after every streamed answer.
    And only the daemon's user can open the socket, where any local user can reach a loopback port.
    """

    port: int | None = None
    socket: Path | None = None

    @classmethod
    def loopback(cls) -> Endpoint:
        return cls(port=free_port())

    # host and address are read on every proxied request: worked out once (a path's `name` and `hash`
    # are Python calls each time), kept in the instance's __dict__ beside its frozen fields.
    @cached_property
    def host(self) -> str:
        """The host of the child's URLs and of the requests it gets. For a socket, its file name: the
        upstream session's connector knows it for the socket it is (supervisor/proxy.py)."""
        return self.socket.name if self.socket is not None else f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        """The child's base URL, for the daemon's upstream session."""
        return f"http://{self.host}"

    @cached_property
    def address(self) -> tuple[str, int] | str:
        """What the data plane connects to (supervisor/dataplane/upstream.py): a socket's path as text,
        or (host, port)."""
        return str(self.socket) if self.socket is not None else (LOOPBACK, self.port or 0)

    @property
    def leaves(self) -> tuple[Path, ...]:
        """What a child listening here leaves behind when it stops (its socket: neither engine removes
        it), for LaunchSpec.leaves."""
        return () if self.socket is None else (self.socket,)

    def __str__(self) -> str:
        return str(self.socket) if self.socket is not None else f"{LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class ChildKey:
    """The bearer key one child demands on every request; only the daemon holds it.

    Without it, a local user who finds the child's loopback port would skip the queue, the priorities
    and the leases. `file` is where an engine that reads its key from a file finds it.
    """

    value: str = field(repr=False)
    file: Path

    @classmethod
    def new(cls, state_dir: Path) -> ChildKey:
        directory = state_dir.absolute() / "keys"  # the child may not share the daemon's working directory
        return cls(secrets.token_urlsafe(32), directory / f"{secrets.token_hex(8)}.key")


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    api_key: str | None = field(default=None, repr=False)  # what every request to the child must carry
    # Written (0600) just before the child starts, removed when it stops: path -> content.
    files: Mapping[Path, str] = field(default_factory=dict, repr=False)
    # Made by the child (its Unix socket), removed when it stops: it stays behind otherwise.
    leaves: tuple[Path, ...] = ()
    # What the kernel sends the child when the daemon dies without stopping it (a SIGKILL, a crash).
    # SIGTERM lets an engine stop the processes it started itself; one that started none gets SIGKILL,
    # which cannot hang: a graceful stop serves nobody once the daemon is gone.
    death_signal: signal.Signals = signal.SIGTERM
    # The CPUs it runs on (supervisor/cpus.py, for_engine); None: the daemon's.
    cpus: frozenset[int] | None = None
    # Masked wherever the child's output shows them: the manifest's `env` values, which the admin API
    # shows as *** whatever their names (operators put credentials there under any name).
    secret_values: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class GpuPlacement:
    """A child's lease as its engine needs to see it: MiB per GPU index, and each GPU's total."""

    mib_by_gpu: Mapping[int, int]
    total_mib_by_gpu: Mapping[int, int]

    @property
    def gpus(self) -> list[int]:
        return sorted(self.mib_by_gpu)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)

    def child_env(self, manifest_env: Mapping[str, str], **engine: str) -> dict[str, str]:
        """The daemon's environment, the engine's additions, the lease's GPUs, then the manifest's own.

        CUDA numbers GPUs fastest first unless told otherwise; the lease uses NVML's (PCI bus) order.
        """
        env = {k: v for k, v in os.environ.items() if _passed_to_child(k)} | engine
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        env.update(manifest_env)
        return env

    def share_of_total(self) -> float:
        """The smallest lease/total ratio over the GPUs: the fraction an engine may take of each."""
        return min((mib / self.total_mib_by_gpu[g] for g, mib in self.mib_by_gpu.items()), default=0.0)


# The daemon's own settings (its admin key, node key, Redis URL with its password) and its service
# manager's channel: none is the engine's business, and an engine may run code from a model's repo.
_DAEMON_ONLY_PREFIX = "LLM_SUPERVISOR_"
_DAEMON_ONLY = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})


def _passed_to_child(name: str) -> bool:
    """Whether a variable of the daemon's environment reaches its children. Not an engine key either: one
    in the daemon's environment would open the child to whoever knows it."""
    return (
        name not in ENGINE_KEY_VARIABLES
        and name not in _DAEMON_ONLY
        and not name.startswith(_DAEMON_ONLY_PREFIX)
    )


class LaunchError(Exception):
    """The manifest cannot be launched at all (a missing file or binary): no child was started."""


class Worker(Protocol):
    def endpoint(self, manifest: Manifest) -> Endpoint:
        """Where a new child for `manifest` is to listen."""
        ...

    def launch_spec(
        self, manifest: Manifest, endpoint: Endpoint, placement: GpuPlacement, key: ChildKey
    ) -> LaunchSpec:
        """argv and environment for a child serving `manifest` on `endpoint` within its lease,
        answering only requests that carry `key`."""
        ...

    async def is_ready(
        self, session: aiohttp.ClientSession, manifest: Manifest, endpoint: Endpoint, api_key: str
    ) -> bool:
        """True once the child answers requests."""
        ...


def free_port() -> int:
    """A loopback port that is free now. Another process could take it first; the start then fails and
    is retried like any failed start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that opens a child's door."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe_headers(api_key: str | None) -> dict[str, str]:
    """A readiness probe's headers: the child's key, and `Connection: close`, so that a probe never
    leaves a kept-alive connection in the pool that a request could later find dead (a child killed
    while idle would then look as if it had died with that request in hand)."""
    return {**bearer(api_key), "Connection": "close"}


async def http_ok(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    path: str,
    timeout_s: float = 2.0,
    api_key: str | None = None,
) -> bool:
    try:
        async with session.get(
            endpoint.url + path,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            headers=probe_headers(api_key),
            allow_redirects=False,  # a child that redirects is not healthy; nor is it followed off loopback
        ) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
