"""One engine child process: spawn, log, probe, and stop together with everything it started.

The child runs in its own session (so its own process group): a signal to the group reaches the engine's
helpers too, and a Ctrl-C at the daemon's terminal does not reach the children behind its back. A pid
file per child in the state directory lets the next daemon start kill what a crashed one left behind.
On Linux each child is also told by the kernel when the daemon dies, however it dies (`before_exec`),
so a SIGKILLed daemon's engines stop at once instead of holding their GPU memory until the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, cast

import psutil
import structlog
import uvloop

from supervisor import secrets
from supervisor.cpus import cpu_list_text
from workers import sockets
from workers.base import Endpoint, LaunchSpec

log = structlog.get_logger("process")

_LINE_LIMIT = 1 << 20  # an engine can print very long lines (a whole prompt in verbose mode)
# llama-server writes each log line in three pieces, half a dozen lines per request: reading every piece
# as it comes costs more CPU than proxying the request. So after a small read a pipe is left alone for
# _BATCH_S, while the kernel keeps what arrives (64 KiB); a big read is followed by the next at once.
_BATCH_S = 0.05
_BATCH_BYTES = 16384
_LAST_WORDS_S = 0.5
_POLL_S = 0.05
# A child that could not be recorded is stopped at once; it has barely started, so this is ample.
_UNTRACKED_GRACE_S = 5.0
_SLACK_BYTES = 1 << 18  # output the ring holds beyond its last lines before it counts them (_OutputRing)
_FOLLOW_QUEUE = 1000  # lines a follower of the output may fall behind by before it is cut off
# How often a running child's tree is looked at (_keep_tree): a helper that leaves the group (setsid) is
# no descendant of anything once its parent dies, so it is found by having been seen before.
# A scan reads every process's /proc entry (0.5 ms with 64 processes here, ten times that on a busy host),
# per child: what a helper started after the ready scan risks is this long without being known.
_TREE_SCAN_S = 15.0


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def before_exec(
    death_signal: signal.Signals, cpus: frozenset[int] | None = None
) -> Callable[[], None] | None:
    """What the child runs between fork and exec so that the kernel sends it `death_signal` when the
    daemon dies (PR_SET_PDEATHSIG), SIGKILL included, which no handler of ours sees. SIGTERM lets an
    engine stop what it started itself (vLLM's EngineCore), as on an ordinary stop (`LaunchSpec`). What
    does not stop is still reaped by the next start (`reap_orphans`). Linux only; elsewhere nothing.
    With `cpus`, the child is also put on those CPUs before it runs a line of the engine, so that every
    thread it starts inherits them (supervisor/cpus.py); if none of them can be used now (gone offline
    since the daemon started), it says so on its stderr and exits 1: a failed start with its reason, not
    Python's "Exception occurred in preexec_fn".

    The kernel watches the thread that forks: the event loop's, which lives as long as the daemon."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # only here: a daemon that starts no child does not map it

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    daemon = os.getpid()
    # Built before the fork too: the child only makes system calls.
    chosen = None if cpus is None else set(cpus)
    refused = f"llm-supervisor: cannot run the engine on CPUs {cpu_list_text(cpus or ())}\n".encode()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        if os.getppid() != daemon:  # the daemon died before the prctl: nobody is left to signal us
            os._exit(1)
        if chosen is not None:
            try:
                os.sched_setaffinity(0, chosen)
            except OSError:
                os.write(2, refused)
                os._exit(1)

    return in_child


class OutputLine(NamedTuple):
    stream: str  # "stdout" or "stderr"
    line: str


class ChildStartError(Exception):
    """The child exited or missed its deadline before it became ready."""

    def __init__(self, reason: str, exit_code: int | None, stderr_tail: list[str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail


class OutputFollower:
    """New output lines of one child, in order; iteration ends with the output (or when this follower
    falls _FOLLOW_QUEUE lines behind: the output must never pile up in memory for a slow reader)."""

    def __init__(self, child: ChildProcess) -> None:
        self.queue: asyncio.Queue[OutputLine | None] = asyncio.Queue(_FOLLOW_QUEUE)
        self._child = child

    def __aiter__(self) -> AsyncIterator[OutputLine]:
        return self

    async def __anext__(self) -> OutputLine:
        entry = await self.queue.get()  # cancellable without losing a line: the queue keeps it
        if entry is None:
            raise StopAsyncIteration
        return entry

    def close(self) -> None:
        self._child._followers.discard(self.queue)


def _whole_lines(piece: bytes) -> list[bytes]:
    """The lines of a piece of output that ends with a newline (as the ring and _output get them)."""
    return piece.split(b"\n")[:-1]


class _OutputRing:
    """The last `limit` lines of a child's output, kept in the pieces its reads brought (each one or more
    whole lines) and split into lines only when somebody looks. llama-server prints about eight lines
    per request: a bytes object and a tuple per line, and the oldest freed for each new one, were 1-3%
    of a request's instructions.

    Nor are a piece's lines counted as it comes (counting its newlines was another 2%): the pieces are
    kept until they hold _SLACK_BYTES more than the last `limit` lines took when last counted, or a
    quarter more, whichever is larger; then the newest are counted back to `limit` lines and the older
    dropped. Each byte is counted a few times at most in a long-running child's life, and the ring holds
    at most those lines and that slack."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._pieces: deque[tuple[str, bytes]] = deque()  # (stream, whole lines)
        self._bytes = 0  # held in _pieces
        self._trim_at = _SLACK_BYTES  # _bytes past which the oldest pieces are let go

    def add(self, stream: str, piece: bytes) -> None:
        """`piece`: whole lines, each ending with a newline."""
        self._pieces.append((stream, piece))
        self._bytes += len(piece)
        if self._bytes > self._trim_at:
            self._trim()

    def _trim(self) -> None:
        """Keep the newest pieces that hold the last `limit` lines; drop the rest."""
        needed, kept, kept_bytes = self._limit, 0, 0
        for _, piece in reversed(self._pieces):
            if needed <= 0:
                break
            needed -= piece.count(b"\n")
            kept += 1
            kept_bytes += len(piece)
        for _ in range(len(self._pieces) - kept):
            self._pieces.popleft()
        self._bytes = kept_bytes
        self._trim_at = kept_bytes + max(_SLACK_BYTES, kept_bytes // 4)

    def newest_first(self) -> Iterator[tuple[str, bytes]]:
        """The last `limit` lines (blank ones too), newest first."""
        left = self._limit
        for stream, piece in reversed(self._pieces):
            for raw in reversed(_whole_lines(piece)):
                if left <= 0:
                    return
                left -= 1
                yield stream, raw


class ChildProcess:
    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        endpoint: Endpoint,
        pid_file: Path | None,
        tail_lines: int,
        api_key: str | None = None,
        files: Sequence[Path] = (),
    ) -> None:
        self.name = name
        self.endpoint = endpoint  # where it listens
        self.api_key = api_key  # every request to the child carries it (see supervisor/proxy.py)
        self.started_at = time.monotonic()
        self._proc = proc
        self.pid: int = proc.pid  # an attribute, not a property: the request path reads it (api/openai)
        self._pid_file = pid_file
        self._files = list(files)
        # The output as read: split and decoded only when somebody looks (see _output).
        self._tail = _OutputRing(tail_lines)
        self._followers: set[asyncio.Queue[OutputLine | None]] = set()
        self._pipes: list[_OutputPipe] = []  # followers end when the last one closes
        self.log = log.bind(model=name, pid=proc.pid)
        self.exited: asyncio.Task[int] = asyncio.create_task(proc.wait(), name=f"wait-{name}")
        # Why it is taken as failed while it runs: it refused a request's connection, and then a probe's
        # (see Scheduler.reacquire). The scheduler's watcher stops it, as it stops a hung one.
        self.unreachable: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The child as psutil knows it, its start time pinned: once it has exited the kernel may hand its
        # pid to any new process, which a lookup by the bare pid would then take for the child.
        self._root = _process(proc.pid)
        self._seen: dict[int, psutil.Process] = {}  # its descendants found so far (see _scan)
        self._recorded: frozenset[tuple[int, float]] = frozenset()  # those its pid file names
        self._tree_keeper: asyncio.Task[None] | None = None
        # Why the daemon stopped it itself (an unload, a reload...): a request it cuts short says that.
        self.stopped_for: str | None = None

    @classmethod
    async def spawn(
        cls, name: str, spec: LaunchSpec, endpoint: Endpoint, state_dir: Path | None, tail_lines: int = 200
    ) -> ChildProcess:
        """Start `spec.argv` in a new session with stdout and stderr piped to the log; write the files it
        needs (0600) and a pid file. The log shows neither the child's key nor its other secrets.
        The files it needs and those it leaves (`spec.leaves`) are removed when it stops."""
        if spec.api_key:
            secrets.remember(spec.api_key)
        secrets.remember_launch(spec.argv, spec.env)
        for value in spec.secret_values:
            secrets.remember(value)
        owned: list[Path] = []  # files written for the child, and those it makes: removed when it stops
        write_ends: list[int] = []  # the child's stdout and stderr
        outputs: list[tuple[int, str]] = []  # and where the daemon reads them
        try:
            for path, content in spec.files.items():
                _write_private(path, content)
                owned.append(path)
            owned += spec.leaves
            for label in ("stdout", "stderr"):
                read_end, write_end = os.pipe()
                write_ends.append(write_end)
                outputs.append((read_end, label))
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                env=dict(spec.env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_ends[0],
                stderr=write_ends[1],
                start_new_session=True,
                preexec_fn=before_exec(spec.death_signal, spec.cpus),
            )
        except BaseException:
            for read_end, _ in outputs:
                os.close(read_end)
            _remove(owned, spec.api_key)
            raise
        finally:
            for write_end in write_ends:
                os.close(write_end)  # the child's now: its exit (and its descendants') is the pipes' EOF
        # From here on the child exists: every way out either returns it tracked or stops it first.
        child = cls(name, proc, endpoint, None, tail_lines, spec.api_key, owned)
        try:
            await child._read_output(outputs)
        except BaseException:
            await _finish(child.stop(_UNTRACKED_GRACE_S))
            raise
        try:
            if state_dir is not None:
                child._pid_file = _write_pid_file(state_dir, name, proc.pid, spec.argv, owned)
        except BaseException as exc:
            child.log.error("pid_file_failed", state_dir=str(state_dir), error=str(exc))
            await _finish(child.stop(_UNTRACKED_GRACE_S))
            if isinstance(exc, OSError):
                where = exc.filename or state_dir
                raise OSError(exc.errno, f"cannot record the child's pid at {where}: {exc.strerror}") from exc
            raise
        cpus = None if spec.cpus is None else cpu_list_text(spec.cpus)
        child.log.info("child_started", listen=str(endpoint), argv=spec.argv, cpus=cpus)
        return child

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def tail(self, lines: int = 20) -> list[str]:
        return [entry.line for entry in self._decoded(lines)]

    def output(self) -> list[OutputLine]:
        """The ring buffer of its stdout and stderr lines, oldest first (not scrubbed)."""
        return self._decoded(None)

    def _decoded(self, count: int | None) -> list[OutputLine]:
        """The last `count` lines of the ring buffer (None: all) that are not blank, oldest first."""
        found: list[OutputLine] = []
        for label, raw in self._tail.newest_first():
            if count is not None and len(found) >= count:
                break
            if line := raw.decode("utf-8", "replace").rstrip():
                found.append(OutputLine(label, line))
        found.reverse()
        return found

    def follow(self, backlog: int) -> OutputFollower:
        """A follower of the output: the last `backlog` lines, then each new line as it is printed, until
        the child's output ends. Close it when done."""
        follower = OutputFollower(self)
        # No await between the copy and the registration: no line is missed or seen twice.
        for entry in self._decoded(backlog) if backlog > 0 else []:
            follower.queue.put_nowait(entry)
        if self._output_open():
            self._followers.add(follower.queue)
        else:
            follower.queue.put_nowait(None)
        return follower

    async def _read_output(self, outputs: Sequence[tuple[int, str]]) -> None:
        for at, (read_end, label) in enumerate(outputs):
            try:
                await self._read_pipe(read_end, label)
            except BaseException:
                for later, _ in outputs[at + 1 :]:
                    os.close(later)  # never handed to the loop (the one that failed may have been)
                raise

    async def _read_pipe(self, read_end: int, label: str) -> None:
        """Read the pipe from the event loop; its transport closes it.

        uvloop passes the descriptor itself to libuv, which closes it with the transport, and keeps the
        file object it was given, which would close the same number again when it is collected
        (MagicStack/uvloop#763). By then another thread (psutil's scans, NVML) may have been given that
        number, and loses it: the chaos test saw EBADF in a process scan. So under uvloop the file object
        does not own the descriptor; under asyncio's own loop the transport closes the file object."""
        loop = asyncio.get_running_loop()
        pipe_file = os.fdopen(read_end, "rb", buffering=0, closefd=not isinstance(loop, uvloop.Loop))
        pipe = _OutputPipe(self, label)
        self._pipes.append(pipe)
        await loop.connect_read_pipe(lambda: pipe, pipe_file)

    def _output_open(self) -> bool:
        return any(not pipe.closed.done() for pipe in self._pipes)

    def _output_ended(self) -> None:
        if not self._output_open():
            self._tell_followers(None)

    def _output(self, piece: bytes, label: str) -> None:
        """Whole lines, as a read brought them: into the ring buffer as they are; split and decoded for the
        debug log and the followers only when there are any (llama-server prints about eight lines per
        request: this runs on the request path's CPU)."""
        self._tail.add(label, piece)
        debug = self.log.is_enabled_for(logging.DEBUG)
        if not debug and not self._followers:
            return
        for raw in _whole_lines(piece):
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            entry = OutputLine(label, line)
            if debug:
                self.log.debug("child_output", stream=label, line=line)
            if self._followers:
                self._tell_followers(entry)

    def _tell_followers(self, entry: OutputLine | None) -> None:
        for queue in list(self._followers):
            if queue.full():  # a follower too far behind: its stream ends here, what it missed dropped
                self._followers.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)
            elif entry is None:  # the end: after the lines it has yet to read (a crash's last words)
                self._followers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(entry)

    async def wait_ready(self, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """Return once `probe()` is true; raise ChildStartError if the child exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        interval = 0.02
        while True:
            if self.exited.done():
                await self._drain_output()
                code = self.exited.result()
                raise ChildStartError(f"{describe_exit(code)} during start-up", code, self.tail())
            # What it starts while it loads is known if it then fails: a helper in a session of its own
            # is no one's descendant once the engine has exited, and was left running, untracked.
            with contextlib.suppress(psutil.Error, OSError):
                await asyncio.to_thread(self._scan, False)
            if await probe():
                await self.tree_pids()  # the helpers it started while loading, in case it dies before a scan
                self._tree_keeper = asyncio.create_task(self._keep_tree(), name=f"tree-{self.name}")
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildStartError(f"not ready after {timeout_s:g}s (start_timeout_s)", None, self.tail())
            # Wake early if the child exits; back off gently so a slow load is not hammered.
            await asyncio.wait({self.exited}, timeout=min(interval, remaining))
            interval = min(interval * 1.5, 0.5)

    async def stop(self, grace_s: float) -> None:
        """Stop the whole tree: SIGTERM to the group and every descendant, SIGKILL after `grace_s`.

        Returns when no process of the tree is left (zombies of reparented grandchildren count as gone).
        """
        tree, group = await asyncio.to_thread(self._scan)
        _signal_all(self.pid, tree, signal.SIGTERM, group)
        # A stopped process (a GGML assert was seen to leave one) only acts on SIGTERM once continued.
        _signal_all(self.pid, tree, signal.SIGCONT, group)
        alive = await _wait_gone(tree, grace_s)
        if alive:
            self.log.warning(
                "child_kill", reason=f"still running {grace_s:g}s after SIGTERM", pids=[p.pid for p in alive]
            )
            _signal_all(self.pid, alive, signal.SIGKILL, group)
            alive = await _wait_gone(alive, 5.0)
            if alive:
                self.log.error("child_unkillable", pids=[p.pid for p in alive])
        with contextlib.suppress(asyncio.CancelledError):
            await self.exited
        if self._tree_keeper is not None:
            self._tree_keeper.cancel()
        await self._drain_output()
        if self._pid_file is not None:
            try:
                self._pid_file.unlink(missing_ok=True)
            except OSError as exc:  # the child is gone all the same; a stale record is only reaped later
                self.log.warning("pid_file_not_removed", path=str(self._pid_file), error=str(exc))
        self.remove_files()
        self.log.info(
            "child_stopped",
            exit_code=self.returncode,
            tree=[p.pid for p in tree],
            ran_s=round(time.monotonic() - self.started_at, 3),
        )

    def remove_files(self) -> None:
        """What its start left (its key file, its socket), once it has exited: stop() does it, and so must
        whoever kills the child another way."""
        _remove(self._files, self.api_key)

    def descendant_pids(self) -> list[int]:
        """Blocking (a scan of every process): on the event loop, use `tree_pids()`."""
        return [p.pid for p in self._scan()[0]]

    async def tree_pids(self) -> list[int]:
        """The child, its descendants and its process group, found in a thread."""
        return await asyncio.to_thread(self.descendant_pids)

    def kill_all(self) -> None:
        """SIGKILL the tree as last seen, at once (a fallback for a stop that failed half-way): no pid
        that another process has been given since is signalled."""
        tree = [p for p in (self._root, *self._seen.values()) if p is not None]
        _signal_all(self.pid, tree, signal.SIGKILL, self._group_is_ours())

    async def activity(self) -> tuple[float, str]:
        """The CPU time (seconds, user and system) the child's tree has used so far, and the child's own
        state as psutil names it ("sleeping", "stopped", "disk-sleep"...), read in a thread."""
        return await asyncio.to_thread(lambda: _activity(self.pid, self._scan()[0]))

    def _scan(self, whole_group: bool = True) -> tuple[list[psutil.Process], bool]:
        """Blocking: the tree as it is now (see _tree), and whether the process group named by the child's
        pid is still its own. What is found is remembered, so that a helper that left the group is still
        stopped with the child after the process it hung from has died; and written to the pid file, for
        the next daemon's reaping if this one dies."""
        group = self._group_is_ours()
        tree = _tree(self.pid, self._root, list(self._seen.values()), group and whole_group)
        self._seen = {p.pid: p for p in tree if p is not self._root}
        recorded = frozenset((p.pid, p.create_time()) for p in self._seen.values())
        if recorded != self._recorded and self._pid_file is not None:
            self._recorded = recorded
            with contextlib.suppress(OSError, ValueError):  # only a later reaping would miss them
                _record_descendants(self._pid_file, sorted(recorded))
        return tree, group

    def _group_is_ours(self) -> bool:
        return _group_is_ours(self.pid, self._root)

    async def _keep_tree(self) -> None:
        """While the child runs, look at its tree every _TREE_SCAN_S (in a thread), so that what it starts
        is known when it dies."""
        while not self.exited.done():
            await asyncio.wait({self.exited}, timeout=_TREE_SCAN_S)
            if not self.exited.done():
                with contextlib.suppress(psutil.Error, OSError):
                    # Its descendants only: the group's members need no finding (a signal to the group
                    # reaches them), and the scan of every process for them costs as much again.
                    await asyncio.to_thread(self._scan, False)

    async def final_tail(self, lines: int = 20) -> list[str]:
        """`tail()` of a child that has exited, once its pipes are read to their end (a descendant that
        holds them open is waited for only briefly): its last words, which may still be in the pipe."""
        await self._read_to_end(_LAST_WORDS_S)
        return self.tail(lines)

    async def _read_to_end(self, timeout_s: float) -> None:
        for pipe in self._pipes:
            pipe.read_now()
        open_pipes = [pipe.closed for pipe in self._pipes if not pipe.closed.done()]
        if open_pipes:
            await asyncio.wait(open_pipes, timeout=timeout_s)

    async def _drain_output(self) -> None:
        """Read the pipes to their end: they reach EOF once every process holding them is gone; a
        grandchild that keeps one open is not waited for past 2 s."""
        await self._read_to_end(2.0)
        for pipe in self._pipes:
            pipe.close()


class _OutputPipe(asyncio.Protocol):
    """One of the child's output pipes, read in batches (see _BATCH_S) and split into lines."""

    def __init__(self, child: ChildProcess, label: str) -> None:
        self._child = child
        self._label = label
        self._partial = b""
        self._transport: asyncio.ReadTransport | None = None
        self._resume: asyncio.TimerHandle | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.ReadTransport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        text = self._partial + data if self._partial else data
        end = text.rfind(b"\n") + 1  # what follows the last newline waits for the rest of its line
        whole, partial = (text, b"") if end == len(text) else (text[:end], text[end:])
        while len(partial) >= _LINE_LIMIT:  # too long to wait for: kept in lines of the limit
            whole += partial[:_LINE_LIMIT] + b"\n"
            partial = partial[_LINE_LIMIT:]
        self._partial = partial
        if whole:
            self._child._output(whole, self._label)
        if len(data) < _BATCH_BYTES and self._transport is not None and self._resume is None:
            self._transport.pause_reading()
            self._resume = asyncio.get_running_loop().call_later(_BATCH_S, self.read_now)

    def read_now(self) -> None:
        """Read again without waiting out the batch (the timer's end, or a child that has exited)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._transport = None
        if self._partial:
            self._child._output(self._partial + b"\n", self._label)
            self._partial = b""
        if not self.closed.done():
            self.closed.set_result(None)
            self._child._output_ended()


async def _finish(stopping: Awaitable[None]) -> None:
    """Await `stopping` to its end even if we are cancelled meanwhile (then re-raise the cancellation):
    an engine nobody tracks must be gone before we return."""
    task = asyncio.ensure_future(stopping)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: its own log already said what went wrong
        raise


def _write_private(path: Path, content: str) -> None:
    """A file only the daemon's user can read: a key in it is as safe as the daemon's own memory."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(content)


def _remove(files: Sequence[Path], api_key: str | None) -> None:
    """What a child's start left: its files, and its key among the secrets the log masks."""
    for path in files:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    if api_key:
        secrets.forget(api_key)


def describe_exit(code: int | None) -> str:
    """`exited with code 1`, or `killed by SIGILL (...)` for a negative returncode."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    # SIGILL from an engine binary nearly always means it was built for CPU features this host lacks.
    hint = " (this build uses CPU instructions this machine does not have)" if name == "SIGILL" else ""
    return f"killed by {name}{hint}"


def _group_is_ours(pid: int, root: psutil.Process | None) -> bool:
    """Whether the process group named by a child's `pid` is the child's: while the child (`root`, when
    known) runs, or while no process has that pid; not once the kernel has given it to another process.
    (Linux hands out no pid that is a live group's id, so the child's group is empty then, and a group of
    that id another process's.)"""
    return (root is not None and root.is_running()) or not psutil.pid_exists(pid)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _tree(
    pid: int, root: psutil.Process | None, seen: Sequence[psutil.Process], group: bool
) -> list[psutil.Process]:
    """The child started as `pid` (`root`, while it runs), its descendants, those of `seen` (found
    before) that still run with theirs, and, when `group` (see ChildProcess._group_is_ours), anything
    else in its process group (reparented helpers). Each psutil.Process pins its start time: one whose
    pid another process now has counts as gone, and is never signalled."""
    found: dict[int, psutil.Process] = {}
    for top in (root, *seen):
        with contextlib.suppress(psutil.Error):
            if top is not None and top.pid not in found and top.is_running():
                found[top.pid] = top
                found.update((c.pid, c) for c in top.children(recursive=True) if c.pid not in found)
    if group:
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid not in found and os.getpgid(proc.pid) == pid:
                    found[proc.pid] = proc
    return list(found.values())


def _activity(pid: int, tree: Sequence[psutil.Process]) -> tuple[float, str]:
    """See ChildProcess.activity. A process that ends while it is read adds nothing."""
    used = 0.0
    state = "gone"
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            used += times.user + times.system
            if proc.pid == pid:
                state = proc.status()
    return used, state


def _signal_all(pgid: int, procs: Sequence[psutil.Process], sig: signal.Signals, group: bool = True) -> None:
    """Signal the process group (when `group`: it is still the child's), and each of `procs` that is not
    in it, exactly once.

    Once: llama-server takes a second SIGTERM as "terminating immediately" and exits from its signal
    handler while its threads still run (exit code 1, or SIGABRT after a pause of ~0.6 s).
    """
    group_signalled = False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pgid, sig)
            group_signalled = True
    for proc in procs:  # descendants that left the group (setsid) still get the signal
        with contextlib.suppress(psutil.Error, OSError):
            if group_signalled and os.getpgid(proc.pid) == pgid:
                continue
            proc.send_signal(sig)


def _is_gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


async def _wait_gone(procs: Sequence[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if not _is_gone(p)]
    interval = 0.002  # most engines exit within milliseconds of SIGTERM; a swap waits on this
    while alive and time.monotonic() < deadline:
        await asyncio.sleep(interval)
        interval = min(interval * 2, _POLL_S)
        alive = [p for p in alive if not _is_gone(p)]
    return alive


# Pid files: one JSON file per child, named by pid, holding what identifies the process beyond its pid.


def _pid_dir(state_dir: Path) -> Path:
    return state_dir / "children"


def _write_pid_file(
    state_dir: Path, name: str, pid: int, argv: Sequence[str], files: Sequence[Path]
) -> Path | None:
    try:
        create_time = psutil.Process(pid).create_time()
    except psutil.Error:
        return None  # already gone; nothing to reap later
    directory = _pid_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pid}.json"
    record = {
        "pid": pid,
        "create_time": create_time,
        "model": name,
        "argv": secrets.redact_args(argv),
        "files": [str(f) for f in files],  # removed with the child, or by the next daemon's reaping
    }
    try:
        path.write_text(json.dumps(record))
    except BaseException:
        with contextlib.suppress(OSError):  # a half-written record would only confuse the next reaping
            path.unlink(missing_ok=True)
        raise
    return path


def _record_descendants(pid_file: Path, descendants: Sequence[tuple[int, float]]) -> None:
    """Add to a child's pid file the descendants found so far, by pid and start time (blocking). Not to
    one its stop has removed meanwhile (FileNotFoundError)."""
    record = json.loads(pid_file.read_text())
    record["descendants"] = [list(d) for d in descendants]
    temporary = pid_file.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    temporary.replace(pid_file)


def _recorded_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` if it is the one that started at `create_time`, else None."""
    proc = _process(pid)
    if proc is None:
        return None
    with contextlib.suppress(psutil.Error):
        if abs(proc.create_time() - create_time) <= 0.01:
            return proc
    return None


def _leftover_tree(
    pid: int, create_time: float, descendants: Sequence[Sequence[float]]
) -> tuple[list[psutil.Process], bool]:
    """What still runs of a recorded child: its tree, the descendants the daemon had seen (a helper that
    left the group), and without it the rest of its process group; and whether that group is still the
    child's (see ChildProcess._group_is_ours).

    vLLM's EngineCore can outlive its API server. The group id cannot be handed to a new process while
    members of the group live, but the pid can: a live process with another start time is not ours.
    """
    root = _recorded_process(pid, create_time)
    group = _group_is_ours(pid, root)
    seen = [p for d in descendants if (p := _recorded_process(int(d[0]), float(d[1]))) is not None]
    return [p for p in _tree(pid, root, seen, group) if not _is_gone(p)], group


async def reap_orphans(state_dir: Path, grace_s: float) -> list[dict[str, object]]:
    """Kill the process trees a previous daemon recorded and did not stop; return what was reaped."""
    directory = _pid_dir(state_dir)
    if not directory.is_dir():
        return []
    reaped: list[dict[str, object]] = []
    for half_written in directory.glob("*.tmp"):  # a crash mid-way through _record_descendants
        half_written.unlink(missing_ok=True)
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            pid = int(record["pid"])
            descendants = record.get("descendants", [])
            tree, group = await asyncio.to_thread(
                _leftover_tree, pid, float(record["create_time"]), descendants
            )
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            record, tree, group = {}, [], False
        files = record.get("files") if isinstance(record, dict) else None
        left = [Path(f) for f in files if isinstance(f, str)] if isinstance(files, list) else []
        _remove(left, None)
        for file in left:
            sockets.remove_left_directory(file)
        if not tree:
            path.unlink(missing_ok=True)
            continue
        _signal_all(pid, tree, signal.SIGTERM, group)
        _signal_all(pid, tree, signal.SIGCONT, group)
        alive = await _wait_gone(tree, grace_s)
        if alive:
            _signal_all(pid, alive, signal.SIGKILL, group)
            await _wait_gone(alive, 5.0)
        path.unlink(missing_ok=True)
        log.warning("orphan_reaped", pid=pid, model=record.get("model"), tree=[p.pid for p in tree])
        reaped.append(record)
    return reaped
