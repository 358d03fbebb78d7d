"""The compiled request path (setup.py, `make native`): a compiled module older than its source is refused,
and the build compiles all of COMPILED or none."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import native

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _module(package: Path, relative: str, source_mtime: float, compiled_mtime: float | None) -> Path:
    source = package / relative
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("")
    os.utime(source, (source_mtime, source_mtime))
    compiled = source.with_suffix(SUFFIX)
    if compiled_mtime is not None:
        compiled.write_bytes(b"")
        os.utime(compiled, (compiled_mtime, compiled_mtime))
    return compiled


def test_a_compiled_module_older_than_its_source_is_stale(tmp_path: Path) -> None:
    package = tmp_path / "supervisor"
    old = _module(package, "dataplane/front.py", source_mtime=2000, compiled_mtime=1000)
    _module(package, "proxy.py", source_mtime=1000, compiled_mtime=2000)  # compiled after its last edit
    _module(package, "bodies.py", source_mtime=2000, compiled_mtime=None)  # runs as Python
    assert native.stale(package) == [old]
    with pytest.raises(ImportError, match=r"supervisor/dataplane/front\.cpython.*make native"):
        native.refuse_stale(package)


def test_nothing_compiled_is_nothing_stale(tmp_path: Path) -> None:
    _module(tmp_path / "supervisor", "scheduler.py", source_mtime=2000, compiled_mtime=None)
    assert native.stale(tmp_path / "supervisor") == []
    native.refuse_stale(tmp_path / "supervisor")


def test_every_compiled_module_is_a_source_of_the_package() -> None:
    package = Path(native.__file__).parent
    for name in native.COMPILED:
        assert name.startswith("supervisor.")
        assert package.joinpath(*name.split(".")[1:]).with_suffix(".py").is_file(), name


def test_the_request_path_is_compiled_whole_or_not_at_all() -> None:
    # `make native` compiles every module of COMPILED, or (without a compiler) none: a half-built set
    # means a failed build that left old modules behind.
    compiled = {name: importlib.import_module(name).__file__ or "" for name in native.COMPILED}
    kinds = {path.endswith(SUFFIX) for path in compiled.values()}
    assert len(kinds) == 1, compiled


def test_the_compiled_modules_import_from_outside_the_checkout(tmp_path: Path) -> None:
    # `make run` starts the console script, whose sys.path holds the venv and not the checkout: whatever
    # the compiled modules load (mypyc's shared extension) must be found through the package.
    imported = subprocess.run(
        [sys.executable, "-c", f"import {', '.join(native.COMPILED)}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert imported.returncode == 0, imported.stderr
