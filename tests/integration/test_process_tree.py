"""An engine's whole tree stops with it, and nothing else does: a helper the engine started in a session
of its own (it left the engine's process group, as a daemonizing helper does), once the engine has
crashed or the daemon was killed; and never a process the kernel has given a crashed engine's pid.
Real daemons and real llama-server children, behind a wrapper script that starts the helper."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually, running
from workers.llama_server import bundled_binary


def engine_with_detached_helper(folder: Path) -> tuple[dict[str, Any], Path]:
    """llama-server behind a wrapper that first starts a `sleep` in a session of its own (setsid) and
    writes its pid to the returned file."""
    real = bundled_binary()
    if real is None:
        pytest.skip("the bundled llama-server is not installed")
    pid_file = folder / "helper.pid"
    wrapper = folder / "engine-with-helper"
    wrapper.write_text(
        f'#!/bin/sh\nsetsid sh -c \'echo $$ > "{pid_file}"; exec sleep 300\' &\nexec "{real}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return {"binary": str(wrapper), "library_path": [str(real.parent)]}, pid_file


async def engine_pid(daemon: Daemon) -> int:
    return int((await daemon.health())["models"]["demo"]["pid"])


async def lease_released(daemon: Daemon) -> bool:
    return bool((await daemon.health())["gpus"][0]["leased_mib"] == 0)


def alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return running(psutil.Process(pid))
    return False


async def test_a_crashed_engines_helper_that_left_its_group_is_stopped_with_it(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The tree was looked up only as the stop began, by then from the reaped engine's pid: the helper,
    no one's descendant any more and in a group of its own, was left running and the lease released."""
    fields, helper_file = engine_with_detached_helper(tmp_path)
    daemon = await make_daemon(models={"demo": fields})
    await daemon.chat()
    helper = int(helper_file.read_text())
    try:
        os.kill(await engine_pid(daemon), signal.SIGKILL)
        await daemon.wait_state("demo", "failed")
        await eventually(lambda: lease_released(daemon), what="the lease to be released")
        await eventually(lambda: not alive(helper), 10, "the helper to stop with its engine")
        [stopped] = daemon.events("child_stopped")
        assert helper in stopped["tree"]
    finally:
        with contextlib.suppress(OSError):
            os.kill(helper, signal.SIGKILL)


async def test_a_killed_daemons_engine_helper_is_reaped_at_the_next_start(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """A SIGKILLed daemon's engine stops with it (PR_SET_PDEATHSIG), but its helper does not: the pid file
    names it, so the next daemon on the state directory reaps it."""
    fields, helper_file = engine_with_detached_helper(tmp_path)
    first = await make_daemon(models={"demo": fields})
    await first.chat()
    helper = int(helper_file.read_text())
    [pid_file] = (first.state_dir / "children").glob("*.json")
    assert [d[0] for d in json.loads(pid_file.read_text())["descendants"]] == [helper]
    engine = await engine_pid(first)
    try:
        first.expect_exit = {-signal.SIGKILL}
        first.signal(signal.SIGKILL)
        await first.wait_exit()
        await eventually(lambda: not alive(engine), what="the engine to stop with the daemon")
        assert alive(helper)

        second = await make_daemon(root=first.root, models={"demo": fields})
        [reaped] = second.events("orphan_reaped")
        assert reaped["tree"] == [helper]
        assert not alive(helper)
    finally:
        with contextlib.suppress(OSError):
            os.kill(helper, signal.SIGKILL)


def take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A process of the test's own, unrelated to the daemon, given `pid` (root only: ns_last_pid)."""
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as last:
            last.write(str(pid - 1))
    except OSError:
        pytest.skip("cannot choose the next pid here (needs root and /proc/sys/kernel/ns_last_pid)")
    proc = subprocess.Popen(["sleep", "60"])
    if proc.pid == pid:
        return proc
    proc.kill()
    proc.wait()
    return None


async def test_stopping_a_crashed_engine_never_signals_a_process_that_took_its_pid(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The crashed engine's helper holds its output pipes, so the daemon reads the engine's last words for
    half a second after reaping it; the kernel meanwhile may give the engine's pid to any new process.
    The stop that followed looked the tree up by that bare pid, and SIGTERMed the newcomer."""
    fields, helper_file = engine_with_detached_helper(tmp_path)
    daemon = await make_daemon(models={"demo": fields})
    await daemon.chat()
    helper = int(helper_file.read_text())
    engine = await engine_pid(daemon)
    newcomer = None
    try:
        os.kill(engine, signal.SIGKILL)
        for _ in range(400):  # until the daemon has reaped it: its pid is free then
            if not psutil.pid_exists(engine):
                break
            await asyncio.sleep(0.001)
        for _ in range(5):
            if (newcomer := take_pid(engine)) is not None:
                break
        if newcomer is None:
            pytest.skip("another process took the pid first")
        await daemon.wait_state("demo", "failed")
        await eventually(lambda: lease_released(daemon), what="the lease to be released")
        await asyncio.sleep(0.5)
        assert newcomer.poll() is None, f"the newcomer with pid {engine} was killed: {newcomer.returncode}"
        assert not alive(helper)
    finally:
        if newcomer is not None and newcomer.poll() is None:
            newcomer.kill()
            newcomer.wait()
        with contextlib.suppress(OSError):
            os.kill(helper, signal.SIGKILL)


async def test_a_killed_daemons_socket_directory_is_removed_at_the_next_start(
    make_daemon: MakeDaemon,
) -> None:
    """The reaping removed a dead daemon's child sockets, then tried its socket directory, which held the
    daemon's own listener socket too, recorded nowhere: every daemon that died without its shutdown
    (SIGKILL, the OOM killer) left `$TMPDIR/llmsup-sockets-*` and a dead socket behind, for good."""
    first = await make_daemon()
    await first.chat()
    (engine,) = first.children()
    argv = engine.cmdline()
    directory = Path(argv[argv.index("--host") + 1]).parent
    assert directory.name.startswith("llmsup-sockets-")
    first.expect_exit = {-signal.SIGKILL}
    first.signal(signal.SIGKILL)
    await first.wait_exit()
    second = await make_daemon(root=first.root)
    assert second.proc is not None
    assert second.proc.returncode is None  # started: its reaping is done
    assert not directory.exists(), sorted(p.name for p in directory.iterdir())


async def test_a_helper_that_left_its_group_is_stopped_when_the_engine_fails_during_start_up(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The engine's tree was first looked at once it was ready. An engine that started a helper in a
    session of its own (setsid) and then failed to start had exited by the time the failed load's stop
    looked: the helper was no one's descendant and in no group of the engine's, so it ran on for good,
    and its pid file was removed, so no later start reaped it either. The tree is now looked at while the
    engine loads. (One that fails within a few milliseconds of starting a helper still escapes.)"""
    helper_file = tmp_path / "helper.pid"
    wrapper = tmp_path / "engine-that-fails"
    wrapper.write_text(
        f"#!/bin/sh\nsetsid sh -c 'echo $$ > \"{helper_file}\"; exec sleep 300' &\nsleep 1\nexit 1\n"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    daemon = await make_daemon(models={"demo": {"binary": str(wrapper)}})
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    status, body, _ = await daemon.post("/v1/chat/completions", chat)
    assert (status, body["error"]["code"]) == (503, "model_failed"), body
    helper = int(helper_file.read_text())
    try:
        await eventually(lambda: not alive(helper), 10, "the failed engine's helper to be stopped")
        assert not list((daemon.state_dir / "children").glob("*.json"))
    finally:
        with contextlib.suppress(OSError):
            os.kill(helper, signal.SIGKILL)
