"""A child's output: read in batches (llama-server writes each log line in three pieces), yet every line
arrives whole and in order, followers see them, and an exited child's last words are in its tail."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from workers.base import Endpoint, LaunchSpec
from workers.process import ChildProcess

# Lines written the way llama-server's logger writes them: timestamp, level and message apart, each
# flushed on its own; then a last line on stderr just before the exit, as a crash prints its reason.
_CHILD = r"""
import sys, time
for i in range(150):  # within the 200 lines kept
    for piece in (f"0.{i:03d} ", "I ", f"line {i}\n"):
        sys.stdout.write(piece)
        sys.stdout.flush()
    if i % 50 == 0:
        time.sleep(0.01)
sys.stderr.write("last words\n")
sys.stderr.flush()
time.sleep(float(sys.argv[1]))
sys.exit(3)
"""


def _spec(linger_s: float) -> LaunchSpec:
    return LaunchSpec(argv=[sys.executable, "-c", _CHILD, str(linger_s)], env=dict(os.environ))


async def test_lines_written_in_pieces_arrive_whole_and_in_order(tmp_path: Path) -> None:
    child = await ChildProcess.spawn("m", _spec(0.0), Endpoint(port=1234), tmp_path)
    follower = child.follow(backlog=0)
    try:
        code = await asyncio.wait_for(child.exited, 10)
        last = await child.final_tail(lines=300)
        seen = [entry async for entry in follower]  # ends when both pipes have
    finally:
        follower.close()
        await child.stop(grace_s=5)
    assert code == 3
    assert "last words" in last  # read to the end, whichever pipe came last
    stdout = [entry.line for entry in child.output() if entry.stream == "stdout"]
    assert stdout == [f"0.{i:03d} I line {i}" for i in range(150)]
    assert [entry.line for entry in seen] == [entry.line for entry in child.output()]


async def test_the_tail_of_an_exited_child_waits_only_briefly_for_a_pipe_held_open(tmp_path: Path) -> None:
    """A descendant that keeps the pipe open (here: the child itself, lingering) must not hold up the
    crash report: final_tail answers within _LAST_WORDS_S with what was read."""
    child = await ChildProcess.spawn("m", _spec(30.0), Endpoint(port=1234), tmp_path)
    try:
        for _ in range(200):  # until the last words are out (the child then lingers)
            await asyncio.sleep(0.05)
            if any(entry.line == "last words" for entry in child.output()):
                break
        loop = asyncio.get_running_loop()
        started = loop.time()
        tail = await child.final_tail(lines=300)
        assert loop.time() - started < 5
        assert "last words" in tail
    finally:
        await child.stop(grace_s=5)
