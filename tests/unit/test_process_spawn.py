"""ChildProcess.spawn: once a child exists it is either tracked (pid file) or stopped before spawn returns."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor import secrets
from tests.integration.harness import eventually, running
from workers.base import Endpoint, LaunchSpec
from workers.process import ChildProcess, ChildStartError


def _spec(tmp_path: Path) -> tuple[LaunchSpec, str]:
    """A child that would run for a minute, findable by a marker in its environment, with a key file."""
    marker = uuid.uuid4().hex
    key = f"key-{marker}"
    spec = LaunchSpec(
        argv=["sleep", "60"],
        env={**os.environ, "SPAWN_TEST_MARKER": marker},
        api_key=key,
        files={tmp_path / "keys" / f"{marker}.key": key},
    )
    return spec, marker


def _running(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("SPAWN_TEST_MARKER") == marker:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("breakage", ["children_dir_is_a_file", "disk_full"])
async def test_a_child_whose_pid_file_cannot_be_written_is_stopped_and_the_error_raised(
    tmp_path: Path, breakage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    if breakage == "children_dir_is_a_file":
        (state_dir / "children").write_text("in the way")
    else:
        real_write = Path.write_text

        def full(path: Path, data: str, *args: Any, **kwargs: Any) -> int:
            if path.parent.name == "children":
                real_write(path, data[:10])  # a partial record, as a full disk leaves one
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_write(path, data, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", full)
    spec, marker = _spec(tmp_path)
    with pytest.raises(OSError, match="cannot record the child's pid"):
        await ChildProcess.spawn("m", spec, Endpoint(port=1234), state_dir)
    assert _running(marker) == []
    assert not any(path.exists() for path in spec.files)  # the key file went with it
    assert spec.api_key is not None
    assert spec.api_key not in secrets._known
    children = state_dir / "children"
    assert not children.is_dir() or not list(children.iterdir())  # no partial record either


async def test_a_tracked_child_has_a_pid_file_until_it_is_stopped(tmp_path: Path) -> None:
    spec, marker = _spec(tmp_path)
    child = await ChildProcess.spawn("m", spec, Endpoint(port=1234), tmp_path)
    try:
        pid_file = tmp_path / "children" / f"{child.pid}.json"
        assert pid_file.is_file()
        assert [p.pid for p in _running(marker)] == [child.pid]
    finally:
        await child.stop(grace_s=5)
    assert not pid_file.exists()
    assert _running(marker) == []
    assert not any(path.exists() for path in spec.files)


async def test_a_child_that_cannot_run_on_its_cpus_fails_to_start_and_says_why(tmp_path: Path) -> None:
    # CPU 4095: none of the machines this runs on has it, as a CPU gone offline since the daemon
    # started is gone (the manifest's check, against the CPUs the daemon started with, let it through).
    spec, marker = _spec(tmp_path)
    spec = replace(spec, cpus=frozenset({4095}))
    child = await ChildProcess.spawn("m", spec, Endpoint(port=1234), tmp_path)
    try:
        with pytest.raises(ChildStartError) as info:
            await child.wait_ready(_never_ready, 10)
    finally:
        await child.stop(grace_s=5)
    assert info.value.exit_code == 1
    assert "llm-supervisor: cannot run the engine on CPUs 4095" in info.value.stderr_tail
    assert _running(marker) == []


async def _never_ready() -> bool:
    return False


async def test_stop_succeeds_when_the_pid_file_can_no_longer_be_removed(tmp_path: Path) -> None:
    spec, marker = _spec(tmp_path)
    child = await ChildProcess.spawn("m", spec, Endpoint(port=1234), tmp_path)
    children = tmp_path / "children"
    children.rename(tmp_path / "children.aside")
    children.write_text("in the way")  # unlinking children/<pid>.json now fails with ENOTDIR
    await child.stop(grace_s=5)
    assert _running(marker) == []
    assert not any(path.exists() for path in spec.files)


# A daemon (this module's ChildProcess in a process of its own) that starts one child and then waits to
# be SIGKILLed. The child ignores SIGTERM, as an engine whose shutdown hangs effectively does.
_STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
_DAEMON = """
import asyncio, os, signal, sys
from workers.base import Endpoint, LaunchSpec
from workers.process import ChildProcess

def ignores_sigterm(pid):
    with open(f"/proc/{pid}/status") as status:
        ignored = next(line for line in status if line.startswith("SigIgn:")).split()[1]
    return int(ignored, 16) >> (signal.SIGTERM - 1) & 1

async def main():
    spec = LaunchSpec(argv=[sys.executable, "-c", sys.argv[2]], env=dict(os.environ),
                      death_signal=signal.Signals[sys.argv[1]])
    child = await ChildProcess.spawn("m", spec, Endpoint(port=1234), None)
    while not ignores_sigterm(child.pid):
        await asyncio.sleep(0.05)
    print("child_pid", child.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.parametrize(("death_signal", "child_survives"), [("SIGKILL", False), ("SIGTERM", True)])
async def test_the_kernel_sends_the_childs_death_signal_when_its_daemon_is_killed(
    death_signal: str, child_survives: bool
) -> None:
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DAEMON, death_signal, _STUBBORN, stdout=asyncio.subprocess.PIPE
    )
    assert daemon.stdout is not None
    line = b""
    while not line.startswith(b"child_pid "):  # after the log's lines
        line = await asyncio.wait_for(daemon.stdout.readline(), 30)
        assert line, "the daemon ended without starting its child"
    child = psutil.Process(int(line.split()[1]))
    daemon.kill()
    await daemon.wait()
    try:
        if child_survives:
            await asyncio.sleep(2)  # the kernel signals at once; this is ample time to have acted on it
            assert running(child)
        else:
            await eventually(lambda: not running(child), what="the child to stop with its daemon")
    finally:
        with contextlib.suppress(psutil.Error):
            child.kill()
