"""reap_orphans: what a crashed daemon left running is killed on the next start, and nothing else is."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import psutil

from tests.integration.harness import running
from workers.process import reap_orphans


def record(state_dir: Path, pid: int, create_time: float) -> Path:
    directory = state_dir / "children"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pid}.json"
    path.write_text(json.dumps({"pid": pid, "create_time": create_time, "model": "m", "argv": ["x"]}))
    return path


async def test_group_members_are_reaped_after_their_leader_died(tmp_path: Path) -> None:
    # Stands in for vLLM: the API server (the group leader) is gone, its EngineCore still runs.
    leader = await asyncio.create_subprocess_exec(
        *("sh", "-c", "sleep 60 >/dev/null & echo $!; read _"),  # exits once its stdin closes
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdin is not None
    assert leader.stdout is not None
    straggler = psutil.Process(int(await leader.stdout.readline()))
    created = psutil.Process(leader.pid).create_time()
    leader.stdin.close()
    await leader.wait()
    path = record(tmp_path, leader.pid, created)
    try:
        reaped = await reap_orphans(tmp_path, grace_s=5)
        assert [r["pid"] for r in reaped] == [leader.pid]
        assert not running(straggler)
        assert not path.exists()
    finally:
        if straggler.is_running():
            straggler.kill()


async def test_a_reused_pid_is_left_alone(tmp_path: Path) -> None:
    bystander = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    try:
        path = record(tmp_path, bystander.pid, psutil.Process(bystander.pid).create_time() - 100)
        assert await reap_orphans(tmp_path, grace_s=1) == []
        assert bystander.returncode is None
        assert not path.exists()
    finally:
        bystander.kill()
        await bystander.wait()


async def test_a_dead_daemons_socket_and_its_directory_go_and_nothing_else(tmp_path: Path) -> None:
    # What a daemon killed with SIGKILL leaves: a pid file naming its child's socket, in its directory.
    left = tmp_path / "llmsup-sockets-dead"
    left.mkdir(mode=0o700)
    socket = left / "0123456789abcdef.sock"
    socket.touch()
    other = tmp_path / "not-ours"
    other.mkdir()
    kept = other / "fedcba9876543210.sock"
    kept.touch()
    path = record(tmp_path, 2**22 + 1, 0.0)  # a pid no process has
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "files": [str(socket), str(kept)]}))
    assert await reap_orphans(tmp_path, grace_s=1) == []
    assert not socket.exists()
    assert not left.exists()
    assert other.exists()  # a folder the daemon did not make stays, whatever was in it


async def test_a_pid_file_half_rewritten_when_the_daemon_died_goes(tmp_path: Path) -> None:
    """A pid file is rewritten (through `<pid>.tmp`) as the child's descendants are found: one a crash
    left half-written was never removed."""
    children = tmp_path / "children"
    children.mkdir()
    (children / "123.tmp").write_text('{"pid": 123, "create_ti')
    assert await reap_orphans(tmp_path, grace_s=1) == []
    assert list(children.iterdir()) == []
