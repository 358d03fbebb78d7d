"""A child's output: read in batches (llama-server writes each log line in three pieces), yet every line
arrives whole and in order, followers see them, an exited child's last words are in its tail, and the
ring buffer keeps exactly the last lines, as a deque of lines would."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import deque
from pathlib import Path
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from workers import process
from workers.base import Endpoint, LaunchSpec
from workers.process import _LINE_LIMIT, ChildProcess, _OutputRing

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


_LINE = st.binary(max_size=6).map(lambda b: b.replace(b"\n", b"."))
_PIECES = st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.lists(_LINE, min_size=1, max_size=5)))


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 12), slack=st.integers(0, 40), pieces=_PIECES)
def test_the_ring_keeps_the_last_lines_as_a_deque_of_lines_would(
    limit: int, slack: int, pieces: list[tuple[str, list[bytes]]]
) -> None:
    """The ring keeps whole reads and splits them when asked: the lines it gives back must be the ones
    a deque of `limit` lines would hold, blank ones included, newest first. A small slack (the real one
    is 256 KiB) makes it count and let go of old reads as often as it can."""
    with patch.object(process, "_SLACK_BYTES", slack):
        ring = _OutputRing(limit)
        kept: deque[tuple[str, bytes]] = deque(maxlen=limit)
        for stream, lines in pieces:
            ring.add(stream, b"".join(line + b"\n" for line in lines))
            kept.extend((stream, line) for line in lines)
            assert list(ring.newest_first()) == list(reversed(kept))
            # What it holds beyond the last lines is bounded: the slack, or a quarter of those lines.
            assert ring._bytes <= ring._trim_at
            assert sum(len(piece) for _, piece in ring._pieces) == ring._bytes
        ring._trim()
        counts = [piece.count(b"\n") for _, piece in ring._pieces]
        assert not counts or sum(counts[1:]) < limit  # once counted, no read kept that is not needed


async def test_a_line_longer_than_the_limit_is_kept_in_lines_of_the_limit(tmp_path: Path) -> None:
    """A line with no end in sight is not held in memory whole: each _LINE_LIMIT bytes of it become a
    line, and what is left when the output ends is the last one."""
    script = f"import sys; sys.stdout.write('x' * {2 * _LINE_LIMIT + 10}); sys.stdout.write('\\nend\\n')"
    spec = LaunchSpec(argv=[sys.executable, "-c", script], env=dict(os.environ))
    child = await ChildProcess.spawn("m", spec, Endpoint(port=1234), tmp_path)
    try:
        await asyncio.wait_for(child.exited, 10)
        await child.final_tail()
    finally:
        await child.stop(grace_s=5)
    assert [len(entry.line) for entry in child.output()] == [_LINE_LIMIT, _LINE_LIMIT, 10, 3]
