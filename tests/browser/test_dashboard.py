"""The dashboard in a real browser (Debian's chromium) against a real daemon with real llama-server children.

The page asks for the admin key, and what is clicked in it really loads and unloads models: the tests check
the daemon's /health as well as the page.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Locator, expect

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


# The page's safety-net refresh runs every 5 s (app.js REFRESH_MS); waiting this long sees at least one.
AFTER_A_REFRESH_S = 6.5


async def _load_demo(tab: Tab, daemon: Daemon) -> Locator:
    demo = tab.page.locator('#models tr[data-model="demo"]')
    await demo.locator('button[data-action="load"]').click()
    await expect(demo).to_have_attribute("data-state", "ready", timeout=LOAD_TIMEOUT_MS)
    return demo


async def test_an_opened_stderr_tail_stays_open_across_refreshes(keyed_daemon: Daemon, tab: Tab) -> None:
    """After a crash the Last error cell offers the child's stderr in a <details>. updateRow() rebuilds the
    cell on every refresh (every 1-5 s), so the tail the operator opened snaps shut before it can be read."""
    page = tab.page
    await open_dashboard(tab, keyed_daemon)
    demo = await _load_demo(tab, keyed_daemon)
    [child] = keyed_daemon.children()
    child.kill()  # a crash: SIGKILL of its llama-server
    details = demo.locator(".col-error details")
    await expect(details).to_be_visible(timeout=20_000)
    await details.locator("summary").click()
    assert await details.evaluate("d => d.open") is True
    await asyncio.sleep(AFTER_A_REFRESH_S)
    await expect(demo).to_have_attribute("data-state", "failed")
    assert await demo.locator(".col-error details").evaluate("d => d.open") is True, (
        "the stderr tail closed by itself"
    )
    assert await page.locator(".col-error details pre").first.is_visible()


async def test_keyboard_focus_survives_a_refresh(keyed_daemon: Daemon, tab: Tab) -> None:
    """renderModels() re-appends every row to the table on every refresh (`tbody.append(row.tr)`); moving a
    row out of the document blurs the button in it, so a keyboard user's focus jumps back to <body> every
    few seconds and Tab/Enter on a row's buttons cannot be used."""
    page = tab.page
    await open_dashboard(tab, keyed_daemon)
    button = page.locator('#models tr[data-model="demo"] button[data-action="pin"]')
    await button.focus()
    await expect(button).to_be_focused()
    await asyncio.sleep(AFTER_A_REFRESH_S)
    await expect(button).to_be_focused(timeout=100)


async def test_the_selected_log_text_survives_a_refresh(keyed_daemon: Daemon, tab: Tab) -> None:
    """The log panel sets #log-lines' textContent every 3 s even when nothing changed, which drops the
    text the operator selected to copy (an error message, a stack) while they select it."""
    page = tab.page
    await open_dashboard(tab, keyed_daemon)
    demo = await _load_demo(tab, keyed_daemon)
    await demo.locator("button.model-name").click()
    await expect(page.locator("#log-lines")).not_to_be_empty()
    await asyncio.sleep(1)  # a ready child with no traffic prints nothing more
    selected = await page.evaluate(
        """() => { const range = document.createRange();
                   range.selectNodeContents(document.querySelector('#log-lines'));
                   const s = getSelection(); s.removeAllRanges(); s.addRange(range);
                   return s.toString().length; }"""
    )
    assert selected > 0
    await asyncio.sleep(4)  # one LOG_REFRESH_MS (3 s) later
    assert await page.evaluate("getSelection().toString().length") == selected, "the selection was dropped"


async def test_a_hung_daemon_is_not_shown_as_live(keyed_daemon: Daemon, tab: Tab) -> None:
    """The events stream sends `: ping` every 15 s, but the page never notices when nothing, not even a
    ping, arrives: with the daemon hung (here SIGSTOP; a network partition or a suspended laptop leave the
    same half-open connection) the pill says `live` and the table is not greyed, indefinitely. The
    refreshes do not help either: api() has no timeout, so the first hung refresh holds every later one."""
    page = tab.page
    # The page's clock (its timers and Date) runs as the real one, and is moved on past the silence the
    # page allows (SILENCE_MS, two missed pings) instead of the test waiting it out.
    await page.clock.install()
    await open_dashboard(tab, keyed_daemon)
    await expect(page.locator("#connection")).to_have_text("live")
    keyed_daemon.signal(signal.SIGSTOP)
    try:
        await page.clock.fast_forward(36_000)
        await expect(page.locator("#models")).to_have_class("stale", timeout=10_000)
        await expect(page.locator("#connection")).not_to_have_text("live")
    finally:
        keyed_daemon.signal(signal.SIGCONT)
    await expect(page.locator("#connection")).to_have_text("live", timeout=30_000)


async def test_a_key_with_an_invisible_character_is_refused_in_the_dialog(
    keyed_daemon: Daemon, tab: Tab
) -> None:
    """A key pasted with a zero-width space (trim() keeps it) cannot go in a header: fetch() throws, api()
    reports `cannot reach the daemon: ...`, the pill says `reconnecting…` for ever and the key is never asked
    for again. The dialog should stay open and say that the key holds a character that cannot be sent."""
    page = tab.page
    await page.goto(f"{keyed_daemon.url}/ui")
    await expect(page.locator("#key-dialog")).to_be_visible()
    await page.fill("#key-input", ADMIN_KEY + "\u200b")
    await page.click("#key-submit")
    await asyncio.sleep(3)
    assert "cannot reach the daemon" not in await page.locator("#notice").inner_text()
    if await page.locator("#key-dialog").is_visible():  # refused, saying why
        await expect(page.locator("#key-error")).to_be_visible()
    else:  # or the invisible character dropped, and the key works
        await expect(page.locator("#connection")).to_have_text("live")


async def test_the_keep_alive_countdown_does_not_follow_the_browser_clock(
    keyed_daemon: Daemon, tab: Tab
) -> None:
    """keepAliveText() subtracts the browser's Date.now() from the daemon's `expires_at`: a browser whose
    clock is 10 minutes ahead of the daemon's (another machine on the network) shows `unloads in 0:00` for a
    model that stays loaded another 5 minutes (the default keep_alive), one behind shows too long."""
    page = tab.page
    ahead = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=10)
    await page.clock.install(time=ahead)
    await open_dashboard(tab, keyed_daemon)
    demo = await _load_demo(tab, keyed_daemon)
    await expect(demo.locator(".col-keepalive")).to_contain_text("unloads in")
    text = await demo.locator(".col-keepalive").inner_text()
    minutes, seconds = text.removeprefix("unloads in ").split(":")
    left = int(minutes) * 60 + int(seconds)
    assert 240 <= left <= 300, f"{text!r}, while the daemon keeps it about 300 s"


async def test_opening_the_page_with_keys_logs_no_console_errors(keyed_daemon: Daemon, tab: Tab) -> None:
    """With keys configured, every visit starts with four requests sent without a key (/v1/admin/models,
    /v1/admin/gpu-memory, /api/status, /v1/admin/events): chromium logs each 401 as a console error
    (`Failed to load resource: ... 401`). The page can know beforehand: GET /health is open and answers
    `{"status"}` alone when keys are configured, the slot table when they are not."""
    await open_dashboard(tab, keyed_daemon)
    await expect(tab.page.locator("#connection")).to_have_text("live")
    errors = [line for line in tab.console if line.startswith("error")]
    assert not errors, errors
