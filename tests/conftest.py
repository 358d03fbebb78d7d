"""Fixtures shared by every test: the tiny models the suite generates for itself (no download ever)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.demo_model import write_broken_model, write_demo_model

# Every llama-server the suite starts (through any daemon, whose children inherit its environment) computes
# on one thread. By default it takes every core, and its threads wait for each other at every step of a
# token: on a 2-core machine where the tests, the daemon or another job hold a core, a 1,500-token stream
# took 40-70 s instead of 2. The tiny model gains nothing from a second thread.
os.environ.setdefault("LLAMA_ARG_THREADS", "1")


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama GGUF (~600 KB) that the real llama-server loads and streams words from."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "demo.gguf")


@pytest.fixture(scope="session")
def broken_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF cut in half: a valid header whose tensor data is missing, so llama-server fails to load it."""
    return write_broken_model(tmp_path_factory.mktemp("models") / "broken.gguf")
