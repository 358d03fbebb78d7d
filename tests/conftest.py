"""Fixtures shared by every test: the tiny models the suite generates for itself (no download ever)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.demo_model import write_broken_model, write_demo_model


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama GGUF (~600 KB) that the real llama-server loads and streams words from."""
    return write_demo_model(tmp_path_factory.mktemp("models") / "demo.gguf")


@pytest.fixture(scope="session")
def broken_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF cut in half: a valid header whose tensor data is missing, so llama-server fails to load it."""
    return write_broken_model(tmp_path_factory.mktemp("models") / "broken.gguf")
