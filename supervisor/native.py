"""The modules that `make native` compiles with mypyc (setup.py), and the check that none is stale.

A compiled module (`front.cpython-311-x86_64-linux-gnu.so` beside `front.py`) is imported in place of
its source. One compiled from an older source would run code that is no longer in the tree, so importing
the package fails on it, naming the fix: `make native` compiles again (`make run`, `make test` and
`make bench` do it themselves), and deleting the `.so` files runs the sources as they are.

This module imports nothing of the package: setup.py reads COMPILED from it before anything is built.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

# The request path, module by module: what a proxied request runs between its bytes arriving and the
# answer's leaving. Left out: api/middleware.py (aiohttp marks a middleware function with an attribute,
# which a compiled function cannot take: what it checks is api/gate.py's), keys.py (mypyc generates C
# that does not compile for a pydantic model's class), and the rest of the package (not on the request
# path). In these modules the clock functions a request calls are imported by name (`from time import
# perf_counter`): compiled, `time.perf_counter()` looks the name up on the module at every call, about four
# times what reading the module's own global costs.
COMPILED = (
    "supervisor.access",
    "supervisor.admission",
    "supervisor.bodies",
    "supervisor.capabilities",
    "supervisor.logs",
    "supervisor.metrics",
    "supervisor.output_limits",
    "supervisor.proxy",
    "supervisor.scheduler",
    "supervisor.secrets",
    "supervisor.slots",
    "supervisor.api.gate",
    "supervisor.api.openai",
    "supervisor.dataplane.front",
    "supervisor.dataplane.relay",
    "supervisor.dataplane.upstream",
)

_PACKAGE = Path(__file__).resolve().parent


def stale(package: Path = _PACKAGE) -> list[Path]:
    """The compiled modules older than their sources."""
    found = []
    for name in COMPILED:
        source = package.joinpath(*name.split(".")[1:]).with_suffix(".py")
        try:
            written = source.stat().st_mtime
        except FileNotFoundError:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            compiled = source.with_suffix(suffix)
            try:
                if compiled.stat().st_mtime < written:
                    found.append(compiled)
            except FileNotFoundError:
                continue
    return found


def refuse_stale(package: Path = _PACKAGE) -> None:
    if found := stale(package):
        names = ", ".join(str(path.relative_to(package.parent)) for path in found)
        raise ImportError(
            f"compiled modules older than their sources: {names}. Run `make native` to compile them "
            "again, or delete them to run the sources."
        )
