"""Fixtures of the store and pull tests: a fake hub serving the test module's `hub_repos`, and a store on
the test's own cache and records directories."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.fakehub import FakeHub, serving_hub


@pytest.fixture
async def hub(
    hub_repos: dict[str, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[FakeHub]:
    """The fake hub, serving the repos the module's `hub_repos` fixture gives."""
    async with serving_hub(monkeypatch, hub_repos) as fake:
        yield fake


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "hub", tmp_path / "store")
