"""The dashboard in a real browser (Debian's chromium) against a real daemon with real llama-server children.

The page asks for the admin key, and what is clicked in it really loads and unloads models: the tests check
the daemon's /health as well as the page.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import expect

from tests.browser.conftest import ADMIN_KEY, INFERENCE_KEY, Tab, chromium_path, start_keyed_daemon
from tests.fakehub import FakeHub, point_daemons_at
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import REPO, Daemon, eventually

pytestmark = pytest.mark.skipif(
    chromium_path() is None, reason="chromium is not installed: run `make system-deps`"
)

KEY_STORAGE = "llm-supervisor.admin-key"
# Set to refresh docs/dashboard.png from the screenshot the load test takes.
SCREENSHOT_ENV = "UPDATE_DASHBOARD_PNG"  # not LLM_SUPERVISOR_*: that prefix is settings
# A cold llama-server start of the demo model plus the page's own polling, with room to spare.
LOAD_TIMEOUT_MS = 45_000


async def open_dashboard(tab: Tab, daemon: Daemon, key: str = ADMIN_KEY) -> None:
    """Open /ui, answer the key prompt, and wait for the models table."""
    page = tab.page
    await page.goto(f"{daemon.url}/ui")
    await expect(page.locator("#key-dialog")).to_be_visible()
    await page.fill("#key-input", key)
    await page.click("#key-submit")
    await expect(page.locator("#key-dialog")).to_be_hidden()
    await expect(page.locator('#models tr[data-model="demo"]')).to_be_visible()


def csp_violations(tab: Tab) -> list[str]:
    return [line for line in tab.console if "Content Security Policy" in line or "pageerror" in line]


async def test_load_and_unload_from_the_page(keyed_daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    page = tab.page
    await open_dashboard(tab, keyed_daemon)
    assert await page.evaluate(f"sessionStorage.getItem('{KEY_STORAGE}')") == ADMIN_KEY
    assert await page.evaluate("localStorage.length") == 0
    demo = page.locator('#models tr[data-model="demo"]')
    await expect(demo).to_have_attribute("data-state", "unloaded")
    await expect(page.locator("#connection")).to_have_text("live")
    await page.evaluate("window.notReloaded = true")  # gone if anything reloads the page
    events_before = await page.locator("#events li").count()

    await demo.locator('button[data-action="load"]').click()
    await expect(demo).to_have_attribute("data-state", "ready", timeout=LOAD_TIMEOUT_MS)
    await keyed_daemon.wait_state("demo", "ready")
    lease = page.locator('#gpus .gpu[data-gpu="0"] .seg.lease[data-model="demo"]')
    await expect(lease).to_have_attribute("data-mib", "512")
    await expect(page.locator('#gpus .gpu[data-gpu="0"] .seg.margin')).to_have_attribute("data-mib", "256")
    await expect(demo.locator(".col-keepalive")).to_contain_text("unloads in")
    await expect(demo.locator(".col-replicas")).to_contain_text("pid")

    # The stream brought the load's events in without a reload.
    arrived = page.locator('#events li[data-type="slot_transition"][data-model="demo"]')
    await expect(arrived.first).to_be_visible()
    assert await page.locator("#events li").count() > events_before
    assert await page.evaluate("window.notReloaded") is True

    await demo.locator("button.model-name").click()
    await expect(page.locator("#log-section")).to_be_visible()
    await expect(page.locator("#log-model")).to_have_text("demo")
    await expect(page.locator("#log-lines")).not_to_be_empty()

    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copyfile(tmp_path / "dashboard.png", REPO / "docs" / "dashboard.png")

    await demo.locator('button[data-action="unload"]').click()
    await expect(demo).to_have_attribute("data-state", "unloaded", timeout=LOAD_TIMEOUT_MS)
    await keyed_daemon.wait_state("demo", "unloaded")
    await expect(lease).to_have_count(0)
    await expect(page.locator("#gpus .seg.lease")).to_have_count(0)
    assert await page.evaluate("window.notReloaded") is True
    assert not csp_violations(tab), csp_violations(tab)


async def test_pin_and_unpin_from_the_page(keyed_daemon: Daemon, tab: Tab) -> None:
    page = tab.page
    await open_dashboard(tab, keyed_daemon)
    demo = page.locator('#models tr[data-model="demo"]')
    await demo.locator('button[data-action="pin"]').click()
    await expect(demo.locator('button[data-action="unpin"]')).to_be_visible()
    await expect(demo.locator(".col-keepalive")).to_have_text("pinned")
    status, body = await keyed_daemon.get("/health")
    assert status == 200, body
    await demo.locator('button[data-action="unpin"]').click()
    await expect(demo.locator('button[data-action="pin"]')).to_be_visible()
    await expect(demo.locator(".col-keepalive")).not_to_have_text("pinned")


async def test_failed_actions_show_the_api_error(keyed_daemon: Daemon, tab: Tab) -> None:
    page = tab.page
    await open_dashboard(tab, keyed_daemon)
    huge = page.locator('#models tr[data-model="huge"]')
    await huge.locator('button[data-action="load"]').click()
    error = huge.locator(".action-error")
    await expect(error).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    await expect(error).to_contain_text("load failed:")
    await expect(error).to_contain_text("8192")  # the daemon's own message names what it needed
    assert await keyed_daemon.state("huge") != "ready"

    await page.fill("#pull-name", "not a model reference!")
    await page.click("#pull-button")
    await expect(page.locator("#pull-error")).to_contain_text("is not a Hugging Face model reference")
    assert not csp_violations(tab), csp_violations(tab)


async def test_a_wrong_or_non_admin_key_is_asked_for_again(keyed_daemon: Daemon, tab: Tab) -> None:
    page = tab.page
    await page.goto(f"{keyed_daemon.url}/ui")
    dialog = page.locator("#key-dialog")
    await expect(dialog).to_be_visible()
    await page.fill("#key-input", "not-the-key-0123456789")
    await page.click("#key-submit")
    await expect(page.locator("#key-error")).to_contain_text("not valid")
    await expect(dialog).to_be_visible()

    await page.fill("#key-input", INFERENCE_KEY)
    await page.click("#key-submit")
    await expect(page.locator("#key-error")).to_contain_text("needs an admin key")
    assert await page.evaluate(f"sessionStorage.getItem('{KEY_STORAGE}')") is None

    await page.fill("#key-input", ADMIN_KEY)
    await page.click("#key-submit")
    await expect(dialog).to_be_hidden()
    await expect(page.locator('#models tr[data-model="demo"]')).to_be_visible()

    # The key lives in this tab only: a new tab (a new session) asks again.
    other = await page.context.new_page()
    await other.goto(f"{keyed_daemon.url}/ui")
    await expect(other.locator("#key-dialog")).to_be_visible()
    await eventually(lambda: not keyed_daemon.internal_errors(), what="no internal errors")


PULLED = "hf.co/test-org/demo-GGUF:Q4_K_M"


def repo_files(demo_gguf: Path) -> dict[str, bytes]:
    return {"demo-Q4_K_M.gguf": demo_gguf.read_bytes()}


@pytest.fixture
async def hub(demo_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHub]:
    """A fake Hugging Face hub holding the demo model, and the environment that points daemons at it."""
    fake = FakeHub()
    fake.add("test-org/demo-GGUF", repo_files(demo_gguf))
    fake.chunk_bytes = 16 * 1024
    point_daemons_at(monkeypatch, await fake.start(), tmp_path / "hf")
    yield fake
    await fake.close()


async def test_a_pull_started_in_the_page_shows_progress_then_the_model(
    hub: FakeHub, make_daemon: MakeDaemon, tmp_path: Path, tab: Tab
) -> None:
    daemon = await start_keyed_daemon(make_daemon, tmp_path)
    page = tab.page
    await open_dashboard(tab, daemon)
    hub.held = asyncio.Event()  # the download stops after its first chunk until released
    await page.fill("#pull-name", PULLED)
    await page.click("#pull-button")
    running = page.locator("#pulls li.pull.running")
    await expect(running).to_be_visible()
    await expect(running.locator("progress")).to_be_visible()
    await expect(running).to_contain_text("%")
    hub.held.set()
    await expect(page.locator(f'#models tr[data-model="{PULLED}"]')).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    await expect(page.locator("#pulls li.pull.recent")).to_contain_text("success")
    await expect(page.locator("#pull-name")).to_have_value("")
    await expect(page.locator("#pull-error")).to_be_hidden()
    await expect(page.locator('#events li[data-type="pull"]').first).to_be_visible()


async def test_a_long_name_stays_in_its_column_and_a_lost_daemon_greys_the_table(
    keyed_daemon: Daemon, tab: Tab, demo_gguf: Path
) -> None:
    """A name with no break opportunity (`_`, `.`, `:` give none) made the Model column as wide as the
    window, pushing every row's state and buttons off-screen; and while the daemon was down, the rows
    kept saying `ready`, with a countdown running, as if live."""
    long = "a-very-long-model-name-" + "x" * 150 + "-Q4_K_M"
    keyed_daemon.write_manifest(long, model=str(demo_gguf), vram_mib=256)
    keyed_daemon.signal(signal.SIGHUP)
    await eventually(lambda: bool(keyed_daemon.events("reload_applied")), what="the reload")
    page = tab.page
    await page.set_viewport_size({"width": 1200, "height": 800})
    await open_dashboard(tab, keyed_daemon)
    row = page.locator(f'#models tr[data-model="{long}"]')
    await expect(row).to_be_visible()
    table = await page.evaluate("document.querySelector('#models').getBoundingClientRect().width")
    assert table <= 1200, table
    await expect(page.locator("#models")).not_to_have_class("stale")
    keyed_daemon.signal(signal.SIGTERM)
    assert await keyed_daemon.wait_exit() == 0
    await expect(page.locator("#models")).to_have_class("stale", timeout=10_000)
