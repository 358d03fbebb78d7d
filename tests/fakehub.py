"""A fake Hugging Face hub: it stands in for huggingface.co in tests, which have no internet.

It speaks the part of the hub's API that huggingface_hub's downloads use: `HEAD`/`GET
/{repo}/resolve/{rev}/{file}` (with `X-Repo-Commit`, `ETag`, `Content-Length`), `GET
/api/models/{repo}/revision/{rev}` and `GET /api/models/{repo}/tree/{rev}`. Point huggingface_hub at it
with `HF_ENDPOINT`. Knobs: slow streaming, holding bodies until released, a 500 or a body cut short on
a file's GET, files outside LFS, lying ETags and sizes, a count of the GETs of each file (to prove that
two pulls of one model downloaded it once), and the commit a branch is at (a revision that is a commit
sha stays that commit; the files' contents do not depend on it). Like the hub, it finds a repo by its id
in any case and answers with the id's own spelling (`id` of the model info).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    chunk_bytes: int = 64 * 1024
    delay_per_chunk_s: float = 0.0  # slow streaming: sleep this long between chunks of a file's body
    fail_files: set[str] = field(default_factory=set)  # GET answers 500 (the HEAD still succeeds)
    truncate_files: set[str] = field(default_factory=set)  # GETs hang up at the middle of the file
    held: asyncio.Event | None = None  # when set to an unset Event: bodies stop after a first chunk until set
    listing_held: asyncio.Event | None = None  # when set to an unset Event: the model info waits until set
    gets: Counter[str] = field(default_factory=Counter)  # "repo/file" -> completed-or-not GETs
    sent: Counter[str] = field(default_factory=Counter)  # file -> body bytes written
    finished: set[str] = field(default_factory=set)  # files whose GET ended (done, failed, or hung up on)
    commit: str = COMMIT  # where every branch is: set it to another sha for "a new commit was pushed"
    plain_files: set[str] = field(default_factory=set)  # not in LFS: no `lfs` in the tree, ETag its blob id
    etags: dict[str, str] = field(default_factory=dict)  # file -> the ETag its HEAD sends instead (a liar)
    sizes: dict[str, int] = field(default_factory=dict)  # file -> the size its tree entry says instead
    renamed: dict[str, str] = field(default_factory=dict)  # old repo id -> the id it now answers as
    bodies: dict[str, bytes] = field(default_factory=dict)  # file -> what its GET sends instead (corrupted)
    url: str = ""
    _runner: web.AppRunner | None = None

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos.setdefault(repo, {}).update(files)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("GET", "/api/models/{org}/{name}/revision/{rev}", self._revision)
        app.router.add_route("GET", "/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_route("GET", "/api/models/{org}/{name}/tree/{rev}/{path:.*}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.*}", self._resolve)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _files(self, request: web.Request) -> tuple[str, dict[str, bytes]]:
        """The repo's canonical id and files; the id asked for may be in any case."""
        asked = f"{request.match_info['org']}/{request.match_info['name']}"
        asked = next((new for old, new in self.renamed.items() if old.casefold() == asked.casefold()), asked)
        for repo, files in self.repos.items():
            if repo.casefold() == asked.casefold():
                return repo, files
        raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text=f"Repository {asked} not found")

    def _commit(self, request: web.Request) -> str:
        rev = request.match_info["rev"]
        return rev if _SHA.match(rev) else self.commit

    async def _revision(self, request: web.Request) -> web.Response:
        repo, files = self._files(request)
        if self.listing_held is not None:
            await self.listing_held.wait()
        return web.json_response(
            {
                "id": repo,
                "modelId": repo,
                "sha": self._commit(request),
                "siblings": [{"rfilename": p} for p in files],
            }
        )

    async def _tree(self, request: web.Request) -> web.Response:
        _, files = self._files(request)
        entries = []
        for path, data in sorted(files.items()):
            size = self.sizes.get(path, len(data))
            entry = {"type": "file", "path": path, "size": size, "oid": git_blob_id(data)}
            if path not in self.plain_files:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo, files = self._files(request)
        path = request.match_info["path"]
        if path not in files:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"}, text=f"{path} not found")
        data = files[path]
        headers = {
            "X-Repo-Commit": self._commit(request),
            "ETag": self.etags.get(path)
            or f'"{git_blob_id(data) if path in self.plain_files else hashlib.sha256(data).hexdigest()}"',
            "Content-Length": str(len(data)),
            "Accept-Ranges": "bytes",
        }
        if request.method == "HEAD":
            return web.Response(headers=headers)
        self.gets[f"{repo}/{path}"] += 1
        data = self.bodies.get(path, data)
        if path in self.fail_files:
            raise web.HTTPInternalServerError(text="fake hub: internal error")
        offset = 0
        if (ranged := re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))) is not None:
            offset = min(int(ranged.group(1)), len(data))
            headers["Content-Range"] = f"bytes {offset}-{len(data) - 1}/{len(data)}"
            headers["Content-Length"] = str(len(data) - offset)
        response = web.StreamResponse(status=206 if ranged else 200, headers=headers)
        await response.prepare(request)
        # A truncating hub drops every connection at the same point: resuming gets no further.
        end = max(offset, len(data) // 2) if path in self.truncate_files else len(data)
        try:
            for start in range(offset, end, self.chunk_bytes):
                piece = data[start : min(start + self.chunk_bytes, end)]
                await response.write(piece)
                self.sent[path] += len(piece)
                if self.held is not None:
                    await self.held.wait()
                if self.delay_per_chunk_s:
                    await asyncio.sleep(self.delay_per_chunk_s)
            if end < len(data):
                assert request.transport is not None
                request.transport.close()  # hang up mid-body: fewer bytes than Content-Length
                return response
            await response.write_eof()
            return response
        finally:
            self.finished.add(path)


@contextlib.asynccontextmanager
async def serving_hub(
    monkeypatch: pytest.MonkeyPatch, repos: dict[str, dict[str, bytes]]
) -> AsyncIterator[FakeHub]:
    """A fake hub serving `repos` (repo id -> file path -> content), with this process's huggingface_hub
    pointed at it; closed at the end."""
    fake = FakeHub()
    for repo, files in repos.items():
        fake.add(repo, files)
    point_this_process_at(monkeypatch, await fake.start())
    try:
        yield fake
    finally:
        await fake.close()


def git_blob_id(data: bytes) -> str:
    """The hub's (git's) id of a file: the sha1 of a header and its content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree(root: Path) -> dict[str, str]:
    """Every file and link under `root` (a cache, a store), with a link's target: to show that nothing
    changed."""
    return {
        str(p.relative_to(root)): os.readlink(p)
        if p.is_symlink()
        else hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def point_daemons_at(monkeypatch: pytest.MonkeyPatch, url: str, hf_home: Path) -> None:
    """The environment that makes daemons started from now on pull from the fake hub into `hf_home`."""
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def point_this_process_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """huggingface_hub read its endpoint at import: point its constants (in this process) at the fake hub."""
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", url)
    monkeypatch.setattr(
        "huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
        url + "/{repo_id}/resolve/{revision}/{filename}",
    )
