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

    # Two extensions: the scheduler, and the rest. One per module repeats mypyc's runtime in each (4.3 MB,
    # 2.7 MiB of idle RSS); one for all is a C file that gcc takes two minutes over on one core. Two build
    # in about forty seconds on two cores (`build_ext --parallel 2`). No debug info: this runs in every
    # fresh checkout's `make test`. -O3 (mypyc's default) rather than -O1: 3-4% fewer instructions per
    # request (callgrind, 2026-11-27) for ten more seconds of build. Named, they go inside the package
    # (supervisor/*__mypyc*.so), where an import finds them from any directory; by default they would land
    # at the checkout's root.
    sources = [f"{name.replace('.', '/')}.py" for name in COMPILED]
    scheduler = [path for path in sources if path.endswith("/scheduler.py")]
    rest = [path for path in sources if path not in scheduler]
    groups = [(rest, "supervisor.request_path"), (scheduler, "supervisor.request_path_scheduler")]
    ext_modules = mypycify(sources, opt_level="3", debug_level="0", separate=groups)

setup(ext_modules=ext_modules)
