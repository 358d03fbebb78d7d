"""The dashboard's tests: real daemons (the integration fixtures) and Debian's chromium through Playwright."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from playwright.async_api import Page, async_playwright

from tests.integration.conftest import MakeDaemon, make_daemon
from tests.integration.harness import Daemon

__all__ = ["make_daemon"]  # a fixture: pytest finds it here by name

ADMIN_KEY = "dashboard-admin-key-0123456789"
INFERENCE_KEY = "dashboard-inference-key-012345"
# Debian's chromium: Playwright's own browser download cannot work on these machines.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# `demo` fits the simulated 4 GiB GPU; `huge` never can, so loading it shows the API's error.
MODELS: dict[str, dict[str, Any]] = {"demo": {"vram_mib": 512}, "huge": {"vram_mib": 8192}}


def chromium_path() -> str | None:
    return shutil.which("chromium")


async def start_keyed_daemon(make_daemon: MakeDaemon, tmp_path: Path) -> Daemon:
    """A daemon with an admin and an inference key on one simulated 4 GiB GPU, serving `demo` and `huge`."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            [
                {"name": "ops", "key": ADMIN_KEY, "role": "admin"},
                {"name": "app", "key": INFERENCE_KEY, "role": "inference"},
            ]
        )
    )
    return await make_daemon(
        models=MODELS,
        config={"api_keys_file": str(keys), "gpus": [{"index": 0, "total_mib": 4096}], "gpu_margin_mib": 256},
    )


@pytest.fixture
async def keyed_daemon(make_daemon: MakeDaemon, tmp_path: Path) -> Daemon:
    return await start_keyed_daemon(make_daemon, tmp_path)


@dataclass
class Tab:
    """A page in headless chromium, with what its console said (CSP violations show up there)."""

    page: Page
    console: list[str] = field(default_factory=list)


@pytest.fixture
async def tab() -> AsyncIterator[Tab]:
    executable = chromium_path()
    if executable is None:
        pytest.skip("chromium is not installed: run `make system-deps`")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1400, "height": 1000})
            found = Tab(await context.new_page())
            found.page.on("console", lambda message: found.console.append(f"{message.type}: {message.text}"))
            found.page.on("pageerror", lambda error: found.console.append(f"pageerror: {error}"))
            yield found
        finally:
            await browser.close()
