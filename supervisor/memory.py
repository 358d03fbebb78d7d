"""Hand the heap's free pages back to the system once start-up is done.

Start-up builds and drops a good deal (the imports' module-level work, the manifests' validation, the
route tables). glibc keeps those freed pages in the process, where they count in RSS until the allocator
happens to reuse them; `malloc_trim(0)` returns them at once (about 2 MiB of an idle daemon's ~65).
Elsewhere (musl, macOS) there is no such call, and nothing is done.
"""

from __future__ import annotations

import ctypes
import sys

import structlog

log = structlog.get_logger("memory")


def give_back_free_heap() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded, libc's among them
    except (OSError, AttributeError):
        return  # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    log.debug("free_heap_returned")
