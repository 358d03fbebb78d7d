"""A fake NVML for tests; see pynvml.py. `daemon_env()` is what a daemon needs to use it."""

from __future__ import annotations

import _ctypes
import os
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
# The name the real pynvml loads; the daemon imports pynvml only where a driver or this library is found.
_LIBRARY_NAME = "libnvidia-ml.so.1"


def daemon_env(state: Path, scratch: Path) -> dict[str, str]:
    """The environment of a daemon whose "driver" is the fake: pynvml from this folder, its state file,
    and a stand-in for the driver's library on LD_LIBRARY_PATH (any real shared library under that name:
    the fake pynvml never calls into it, it only has to be there to be found)."""
    library_dir = scratch / "fake-nvml-library"
    library_dir.mkdir(parents=True, exist_ok=True)
    library = library_dir / _LIBRARY_NAME
    if not library.exists():
        library.symlink_to(_ctypes.__file__)
    search = [str(library_dir), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return {
        "PYTHONPATH": str(FOLDER),
        "FAKE_NVML_STATE": str(state),
        "LD_LIBRARY_PATH": os.pathsep.join(search),
    }
