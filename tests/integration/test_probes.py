"""Probes and deployments: /health/live and /health/ready, sd_notify to a socket the test owns, and
reloads from watching the manifests directory (a plain edit, a ConfigMap's symlink swap, a broken file)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import DEMO, MakeDaemon
from tests.integration.harness import Daemon, eventually, gated_engine


async def _probe(daemon: Daemon, path: str) -> tuple[int, Any]:
    return await daemon.get(path)


# --- /health/live and /health/ready -------------------------------------------------------------------


async def test_live_and_ready_answer_200_on_a_serving_daemon(daemon: Daemon) -> None:
    assert await _probe(daemon, "/health/live") == (200, {"status": "alive"})
    await eventually(
        lambda: bool(daemon.events("start_up_complete")), what="start-up to finish (no pinned models)"
    )
    assert await _probe(daemon, "/health/ready") == (200, {"status": "ready"})
    assert (await _probe(daemon, "/health"))[0] == 200


async def test_probes_need_no_key_when_keys_are_configured(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"api_key": "s3cret-key-for-probes"})
    assert (await daemon.get("/v1/models"))[0] == 401
    assert (await _probe(daemon, "/health/live"))[0] == 200
    await eventually(lambda: bool(daemon.events("start_up_complete")), what="start-up to finish")
    assert (await _probe(daemon, "/health/ready"))[0] == 200


async def test_ready_waits_for_pinned_models_while_live_answers(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    engine, gate = gated_engine(tmp_path)
    daemon = await make_daemon(
        models={
            "demo": {},
            "big": {"pinned": True, **engine},
        }
    )
    await daemon.wait_state("big", "loading")
    assert await _probe(daemon, "/health/ready") == (503, {"status": "starting", "waiting_for": ["big"]})
    assert (await _probe(daemon, "/health/live"))[0] == 200
    assert (await _probe(daemon, "/health"))[0] == 200  # the overview still answers
    assert await daemon.chat("demo")  # other models are served meanwhile

    gate.touch()
    await daemon.wait_state("big", "ready", timeout_s=30)
    await eventually(
        lambda: bool(daemon.events("start_up_complete")), what="start-up to finish once big is loaded"
    )
    assert await _probe(daemon, "/health/ready") == (200, {"status": "ready"})


async def test_ready_names_the_pinned_models_it_waits_for_to_an_admin_key_only(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """`waiting_for` named the pinned models to anyone during start-up, while /health keeps its slot
    table to admin keys: a model's name may be one that a key's `models` hide (a security review)."""
    engine, gate = gated_engine(tmp_path)
    daemon = await make_daemon(
        models={"demo": {}, "topsecret-project": {"pinned": True, **engine}},
        config={"api_key": "an-admin-key-for-the-probe"},
    )
    await daemon.wait_state("topsecret-project", "loading")
    assert await _probe(daemon, "/health/ready") == (503, {"status": "starting"})
    admin = {"Authorization": "Bearer an-admin-key-for-the-probe"}
    assert await daemon.get("/health/ready", admin) == (
        503,
        {"status": "starting", "waiting_for": ["topsecret-project"]},
    )
    gate.touch()
    await daemon.wait_state("topsecret-project", "ready", timeout_s=30)


async def test_a_pinned_model_that_fails_its_first_load_ends_start_up(
    make_daemon: MakeDaemon, broken_gguf: Path
) -> None:
    # Its keeper retries it; the daemon serves the other models, so it is ready for traffic.
    daemon = await make_daemon(models={"demo": {}, "broken": {"pinned": True, "model": str(broken_gguf)}})
    await eventually(lambda: bool(daemon.events("start_up_complete")), 60, "start-up to finish")
    assert (await _probe(daemon, "/health/ready"))[0] == 200
    # The keeper logs the failure when it sees the load end, which may come just after start-up does.
    await eventually(lambda: bool(daemon.events("pinned_load_failed")), 30, "the keeper to log the failure")


async def test_ready_turns_503_while_draining_and_live_stays_200(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"drain_timeout_s": 120})
    await eventually(lambda: bool(daemon.events("start_up_complete")), what="start-up to finish")
    stream = await daemon.start_stream("demo", max_tokens=1500)
    (engine,) = daemon.children()
    os.kill(engine.pid, signal.SIGSTOP)  # the stream stays in flight for as long as the test needs
    try:
        daemon.signal(signal.SIGTERM)
        await eventually(lambda: bool(daemon.events("shutdown_started")), what="the drain to begin")
        assert await _probe(daemon, "/health/ready") == (503, {"status": "draining"})
        assert await _probe(daemon, "/health/live") == (200, {"status": "alive"})
        assert (await _probe(daemon, "/health"))[0] == 503
        # The drain stops every model: an operator's unload meanwhile said 200 of a model still ready.
        for action in ("unload", "load"):
            status, body, _ = await daemon.post(f"/v1/admin/models/demo/{action}", {})
            assert (status, body["error"]["code"]) == (503, "shutting_down"), action
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        await stream.close()
    assert await daemon.wait_exit() == 0


# --- sd_notify ------------------------------------------------------------------------------------


class NotifySocket:
    """The test's side of NOTIFY_SOCKET: a datagram socket in the abstract namespace (`@name`), read all the
    time, as systemd does (a unix datagram queue holds only a few messages: a full one drops lines)."""

    def __init__(self) -> None:
        self.name = f"@llmsup-probes-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.sock.setblocking(False)
        self.messages: list[list[str]] = []
        self._arrived = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            self.messages.append(data.decode().split("\n"))
            self._arrived.set()

    async def until(self, line: str, after: int = 0, timeout_s: float = 30) -> int:
        """Wait for a message from index `after` on that holds `line`; the index of that message."""

        async def seen() -> int:
            while True:
                for index in range(after, len(self.messages)):
                    if line in self.messages[index]:
                        return index
                self._arrived.clear()
                await self._arrived.wait()

        return await asyncio.wait_for(seen(), timeout_s)  # a deadline, not a performance threshold

    def states(self) -> list[str]:
        """The state lines in order, without the watchdog's and the status texts."""
        return [
            line
            for message in self.messages
            for line in message
            if line.split("=")[0] in ("READY", "RELOADING", "STOPPING")
        ]

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close()


@pytest.fixture
async def notify_socket() -> AsyncIterator[NotifySocket]:
    listener = NotifySocket()
    yield listener
    await listener.close()


async def test_sd_notify_ready_reload_watchdog_and_stopping(
    make_daemon: MakeDaemon, notify_socket: NotifySocket
) -> None:
    daemon = await make_daemon(start=False)
    # No WATCHDOG_PID: the daemon is the process systemd would start, so the watchdog is its own.
    # A ping a second: the socket's queue (about ten datagrams) outlasts any pause in the test's reading.
    await daemon.start(env={"NOTIFY_SOCKET": notify_socket.name, "WATCHDOG_USEC": "2000000"})
    ready = await notify_socket.until("READY=1")
    assert daemon.events("listening"), "READY=1 came before the daemon listened"
    assert (await _probe(daemon, "/health/ready"))[0] == 200

    await notify_socket.until("WATCHDOG=1")
    await notify_socket.until("WATCHDOG=1", after=len(notify_socket.messages))  # and again: it repeats

    # Children are not the service's main process: they must not inherit the socket or the watchdog.
    await daemon.chat()
    (engine,) = daemon.children()
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC"} & set(engine.environ())

    daemon.signal(signal.SIGHUP)
    reloading = await notify_socket.until("RELOADING=1", after=ready + 1)
    assert any(line.startswith("MONOTONIC_USEC=") for line in notify_socket.messages[reloading])
    await notify_socket.until("READY=1", after=reloading + 1)

    daemon.signal(signal.SIGTERM)
    assert await daemon.wait_exit() == 0
    await notify_socket.until("STOPPING=1")
    assert notify_socket.states() == ["READY=1", "RELOADING=1", "READY=1", "STOPPING=1"]
    assert not daemon.events("sd_notify_failed")


async def test_a_notify_socket_nobody_listens_on_does_not_fail_the_daemon(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    daemon = await make_daemon(start=False)
    await daemon.start(env={"NOTIFY_SOCKET": str(tmp_path / "nobody"), "WATCHDOG_USEC": "200000"})
    await eventually(lambda: bool(daemon.events("sd_notify_failed")), what="the failed notification")
    assert await daemon.chat()
    daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(daemon.events("reload_applied")), what="the reload")
    assert (await _probe(daemon, "/health/ready"))[0] == 200


# --- watch_manifests ----------------------------------------------------------------------------------


async def _models(daemon: Daemon) -> set[str]:
    return set((await daemon.health())["models"])


async def test_an_edited_manifest_directory_reloads_without_a_signal(
    make_daemon: MakeDaemon, demo_gguf: Path
) -> None:
    daemon = await make_daemon(config={"watch_manifests": True})
    await eventually(lambda: bool(daemon.events("manifest_watch_started")), what="the watcher to start")
    daemon.write_manifest("second", model=str(demo_gguf), **DEMO)

    async def second_listed() -> bool:
        return "second" in await _models(daemon)

    await eventually(second_listed, what="the new model to appear")
    assert daemon.events("reload_applied")[-1]["added"] == ["second"]
    assert await daemon.chat("second")

    # A broken file: rejected as SIGHUP would reject it, and the old config keeps serving.
    (daemon.manifests / "broken.yaml").write_text("name: broken\nengine: llama-server\nctx_size: lots\n")
    await eventually(lambda: bool(daemon.events("reload_rejected")), what="the broken file to be refused")
    rejected = daemon.events("reload_rejected")[-1]
    assert any("broken.yaml:3" in error for error in rejected["errors"])
    assert await _models(daemon) == {"demo", "second"}
    assert await daemon.chat("demo")
    assert await daemon.chat("second")


def _configmap_version(directory: Path, version: str, models: list[dict[str, Any]]) -> None:
    """What the kubelet does on a ConfigMap update: write `..<version>/`, then swap `..data` to it with one
    rename; `models.yaml -> ..data/models.yaml` itself never changes."""
    (directory / f"..{version}").mkdir()
    (directory / f"..{version}" / "models.yaml").write_text(yaml.safe_dump(models))
    if not (directory / "models.yaml").is_symlink():
        (directory / "models.yaml").symlink_to("..data/models.yaml")
    (directory / "..data_tmp").symlink_to(f"..{version}")
    os.replace(directory / "..data_tmp", directory / "..data")


async def test_a_configmap_style_symlink_swap_reloads(
    make_daemon: MakeDaemon, demo_gguf: Path, tmp_path: Path
) -> None:
    mounted = tmp_path / "configmap"
    mounted.mkdir()
    model = {"engine": "llama-server", "model": str(demo_gguf), **DEMO}
    _configmap_version(mounted, "v1", [{"name": "demo", **model}])
    daemon = await make_daemon(models={}, config={"manifests": str(mounted), "watch_manifests": True})
    assert await _models(daemon) == {"demo"}
    await eventually(lambda: bool(daemon.events("manifest_watch_started")), what="the watcher to start")

    _configmap_version(mounted, "v2", [{"name": "demo", **model}, {"name": "second", **model}])

    async def second_listed() -> bool:
        return "second" in await _models(daemon)

    await eventually(second_listed, what="the swapped-in model to appear")
    assert await daemon.chat("second")
    assert daemon.events("manifests_changed")[-1]["files"] == ["models.yaml"]
