"""One daemon per state directory.

The state directory holds the pid files of the children a daemon runs, and a start-up reaps every child a
pid file names as an orphan of a daemon that died (workers.process.reap_orphans). A second daemon started
on the same directory (a second `make run` in the same checkout, or one on another port without its own
LLM_SUPERVISOR_STATE_DIR) took the first's live engines for orphans and killed them, even when it then
failed to listen. So a daemon holds an exclusive lock on `<state_dir>/daemon.lock` from before it reaps
until it exits (the kernel drops it however the process ends), and a second one is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class StateDirBusy(Exception):
    """Another process holds the state directory; the message says which, and what to do."""


def hold(state_dir: Path) -> int:
    """Take the state directory for this process, until it exits; the lock file's descriptor, to keep
    open. Raises StateDirBusy when another daemon holds it."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = ""
        with contextlib.suppress(OSError):
            owner = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        who = f"pid {owner}" if owner.isdigit() else "another process"
        raise StateDirBusy(
            f"another llm-supervisor ({who}) is using the state directory {state_dir}: give this one its "
            "own (--state-dir or LLM_SUPERVISOR_STATE_DIR)"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
