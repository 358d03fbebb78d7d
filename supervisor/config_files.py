"""Reading the operator's small files (manifests, the config, the keys file): regular files only, and
only so much of them.

A FIFO named `*.yaml` blocked the read for ever (a reload's thread never returned, so the daemon took no
later signal, SIGTERM included), and a link to /dev/zero grew the daemon's memory until it was killed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_BYTES = 4 * 2**20  # far above any real manifest, config or keys file


def read_text(path: Path, max_bytes: int = MAX_BYTES) -> str:
    """The file's text (UTF-8). OSError when it is no regular file or is larger than `max_bytes`;
    UnicodeDecodeError (a ValueError) when it is not UTF-8."""
    # O_NONBLOCK: opening a FIFO with no writer would itself wait for one.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError("not a regular file (a directory, a FIFO, a device or a socket)")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(f"larger than {max_bytes // 2**20} MiB")
    return data.decode("utf-8")
