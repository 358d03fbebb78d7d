"""`make run`: the daemon's own settings decide what the Makefile is not told.

`make -n` prints the recipe without running it; the prerequisites (install, native, demo-model) are
marked done with `-o` so that nothing is installed or built.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _serve_argv(*make_args: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in {"HOST", "PORT", "MANIFESTS"}}
    clean = {k: v for k, v in clean.items() if not k.startswith("LLM_SUPERVISOR_")}
    printed = subprocess.run(
        ["make", "-n", "-s", "-o", "install", "-o", "native", "-o", "demo-model", "run", *make_args],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    argv = shlex.split(printed.replace("\\\n", " "))
    return argv[argv.index("serve") + 1 :]


def test_the_daemon_settings_decide_when_make_is_told_nothing() -> None:
    """`LLM_SUPERVISOR_HOST=0.0.0.0 make run` used to listen on 127.0.0.1: `--host` beat the variable."""
    assert _serve_argv(LLM_SUPERVISOR_HOST="0.0.0.0", LLM_SUPERVISOR_PORT="8080") == []


def test_make_variables_still_choose_the_address() -> None:
    assert _serve_argv("HOST=0.0.0.0", "PORT=8080") == ["--host", "0.0.0.0", "--port", "8080"]
    assert _serve_argv(PORT="8081", MANIFESTS="/srv/manifests") == [
        "--port",
        "8081",
        "--manifests",
        "/srv/manifests",
    ]
