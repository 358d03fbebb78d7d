"""The request path compiled to C with mypyc, beside its sources: `make native` runs

    LLM_SUPERVISOR_NATIVE=1 python setup.py build_ext --inplace

Why: the daemon's CPU per proxied request is Python's work, spread thin over the modules below (no one
function above a few percent of it). mypyc turns each into a C extension from the same, unchanged source,
as black and mypy ship themselves: callgrind counts about a quarter fewer instructions per request
(bench/instructions.py). The sources stay the truth: without a compiler, or with LLM_SUPERVISOR_NATIVE
unset (every `pip install`), nothing is compiled and the same modules run as Python.

A compiled module shadows its source, so `supervisor/native.py` refuses to start from one older than the
source it was compiled from; `make` rebuilds them whenever a source changes.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

from setuptools import setup

# Read by path: importing the package would refuse the stale modules this build is about to replace.
COMPILED = runpy.run_path(str(Path(__file__).parent / "supervisor" / "native.py"))["COMPILED"]

ext_modules = []
if os.environ.get("LLM_SUPERVISOR_NATIVE") == "1":
    from mypyc.build import mypycify

    # A C file per module (separate), so that `build_ext --parallel` compiles them on every core; -O1 and
    # no debug info, because this runs in every fresh checkout's `make test`.
    sources = [f"{name.replace('.', '/')}.py" for name in COMPILED]
    ext_modules = mypycify(sources, opt_level="1", debug_level="0", separate=True)

setup(ext_modules=ext_modules)
