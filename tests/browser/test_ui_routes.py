"""The dashboard's files over plain HTTP: open without a key, strict headers, only the files it ships."""

from __future__ import annotations

import aiohttp
import pytest

from supervisor.access import required_role
from tests.browser.conftest import ADMIN_KEY, INFERENCE_KEY
from tests.integration.harness import Daemon

PAGES = {
    "/ui": "text/html",
    "/ui/": "text/html",
    "/ui/index.html": "text/html",
    "/ui/app.js": "text/javascript",
    "/ui/style.css": "text/css",
}


@pytest.mark.parametrize("path", ["/ui", "/ui/", "/ui/app.js", "/ui/style.css", "/ui/anything"])
def test_ui_paths_are_open_and_nothing_else_is(path: str) -> None:
    assert required_role("GET", path, metrics_public=False) is None
    assert required_role("HEAD", path, metrics_public=False) is None
    assert required_role("POST", path, metrics_public=False) == "inference"


def test_paths_that_only_start_like_ui_still_need_a_key() -> None:
    assert required_role("GET", "/uix", metrics_public=False) == "inference"
    assert required_role("GET", "/v1/admin/models", metrics_public=False) == "admin"


async def test_dashboard_files_are_served_without_a_key_with_strict_headers(keyed_daemon: Daemon) -> None:
    async with aiohttp.ClientSession() as http:
        for path, content_type in PAGES.items():
            async with http.get(keyed_daemon.url + path) as response:
                body = await response.text()
                assert response.status == 200, (path, body)
                assert response.content_type == content_type
                assert response.charset == "utf-8"
                csp = response.headers["Content-Security-Policy"]
                assert "default-src 'self'" in csp
                assert "script-src 'self'" in csp
                assert "unsafe-inline" not in csp
                assert "frame-ancestors 'none'" in csp
                assert response.headers["X-Content-Type-Options"] == "nosniff"
                assert response.headers["X-Frame-Options"] == "DENY"
                etag = response.headers["ETag"]
        async with http.get(keyed_daemon.url + "/ui/style.css", headers={"If-None-Match": etag}) as response:
            assert response.status == 304


async def test_index_has_no_inline_script_or_style(keyed_daemon: Daemon) -> None:
    async with aiohttp.ClientSession() as http, http.get(keyed_daemon.url + "/ui") as response:
        html = await response.text()
    assert '<script src="/ui/app.js" defer></script>' in html
    assert html.count("<script") == 1
    assert "style=" not in html
    assert "<style" not in html
    assert " on" + "click=" not in html


@pytest.mark.parametrize(
    "path",
    [
        "/ui/missing.js",
        "/ui/..%2Fapp.py",
        "/ui/..%2F..%2Fpyproject.toml",
        "/ui/%2e%2e%2fscheduler.py",
        "/ui/__init__.py",
    ],
)
async def test_only_the_shipped_files_are_served(keyed_daemon: Daemon, path: str) -> None:
    async with aiohttp.ClientSession() as http:
        url = keyed_daemon.url + path
        async with http.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as response:
            assert response.status == 404, await response.text()


async def test_the_data_the_page_reads_still_needs_the_admin_key(keyed_daemon: Daemon) -> None:
    async with aiohttp.ClientSession() as http:
        for key, status in ((None, 401), (INFERENCE_KEY, 403), (ADMIN_KEY, 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with http.get(keyed_daemon.url + "/v1/admin/gpu-memory", headers=headers) as response:
                assert response.status == status
            async with http.get(keyed_daemon.url + "/api/status", headers=headers) as response:
                assert response.status == status
