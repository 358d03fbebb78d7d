"""`llm-supervisor check`, `schema`, and the client commands `list`, `ps`, `rm`, `pull`."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor import __version__
from supervisor.cli import human_bytes, human_time, main, processor


def run_main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    assert isinstance(code, int)
    return code


def test_check_accepts_valid_manifests_and_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "a.yaml").write_text(
        "name: present\nengine: llama-server\nmodel: model.gguf\n", encoding="utf-8"
    )
    (tmp_path / "b.yaml").write_text(
        "- {name: absent, engine: llama-server, model: /nowhere/absent.gguf}\n", encoding="utf-8"
    )
    assert run_main(["check", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"ok  present  [llama-server]  {tmp_path / 'a.yaml'}"
    assert lines[1].startswith(f"ok  absent  [llama-server]  {tmp_path / 'b.yaml'}")
    assert "warning: /nowhere/absent.gguf does not exist yet" in lines[1]
    assert lines[2] == f"2 model(s) valid in {tmp_path}"
    assert err == ""


def test_check_of_an_empty_directory_is_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["check", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"0 model(s) valid in {tmp_path}\n"


def test_check_reports_every_error_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: m\nengine: llama-server\nmodel: /m.gguf\nctx_size: big\nextra: 1\n", encoding="utf-8"
    )
    broken = tmp_path / "broken.yml"
    broken.write_text("name: [unclosed\n", encoding="utf-8")
    (tmp_path / "good.yaml").write_text("{name: g, engine: llama-server, model: /g.gguf}\n", encoding="utf-8")
    assert run_main(["check", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert any(line.startswith(f"{bad}:4: model 'm' field 'ctx_size':") for line in lines)
    assert any(line.startswith(f"{bad}:5: model 'm' field 'extra':") for line in lines)
    assert any(line.startswith(f"{broken}:") and "invalid YAML" in line for line in lines)
    assert lines[-1] == f"3 error(s) in {tmp_path}"


def test_check_of_a_missing_directory_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert run_main(["check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"{missing}: manifest directory not found" in err


def test_check_defaults_to_the_manifests_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "m.yaml").write_text(
        "{name: m, engine: llama-server, model: /m.gguf}\n", encoding="utf-8"
    )
    assert run_main(["check"]) == 0
    assert "1 model(s) valid in manifests" in capsys.readouterr().out


def test_schema_prints_the_manifest_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    main(["schema"])
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "llm-supervisor manifest"
    assert "llama-server" in json.dumps(schema)


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([]) == 2
    assert "required" in capsys.readouterr().err


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"llm-supervisor {__version__}"


# --- client commands -----------------------------------------------------------------------------------
# The daemon's /api/pull and /api/delete are stood in for by a tiny aiohttp server in the test that answers
# in Ollama's documented formats; `list` and `ps` also run against the real daemon in
# tests/integration/test_ollama_models.py.

PULL_DIGEST_A = "sha256:" + "a" * 64
PULL_DIGEST_B = "sha256:" + "b" * 64


class StandIn:
    """A stand-in for the daemon's Ollama routes that records what the CLI sent."""

    def __init__(self, pull_lines: list[dict[str, Any]] | None = None, pull_status: int = 200) -> None:
        self.pull_lines = pull_lines or []
        self.pull_status = pull_status
        self.received: list[tuple[str, Any]] = []
        self.tags: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_post("/api/pull", self.pull)
        app.router.add_delete("/api/delete", self.delete)
        app.router.add_get("/api/tags", self.list_tags)
        self.server = TestServer(app)

    async def __aenter__(self) -> str:
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()

    async def pull(self, request: web.Request) -> web.StreamResponse:
        self.received.append(("pull", await request.json()))
        if self.pull_status != 200:
            return web.json_response({"error": "pull model manifest: file does not exist"}, status=404)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for line in self.pull_lines:
            await response.write(json.dumps(line).encode() + b"\n")
        await response.write_eof()
        return response

    async def delete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(("delete", body))
        if body["model"] == "known":
            return web.Response()  # Ollama answers a delete with 200 and no body
        return web.json_response({"error": f"model '{body['model']}' not found"}, status=404)

    async def list_tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self.tags})


async def run_client(argv: list[str]) -> int:
    """`main` runs its own event loop, so it runs in a thread beside the stand-in server's loop."""
    return await asyncio.to_thread(run_main, argv)


async def test_pull_draws_a_bar_per_digest_and_prints_success(capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[dict[str, Any]] = [
        {"status": "pulling manifest"},
        {"status": "pulling aaaa", "digest": PULL_DIGEST_A, "total": 4000, "completed": 0},
        {"status": "pulling aaaa", "digest": PULL_DIGEST_A, "total": 4000, "completed": 1500},
        {"status": "pulling bbbb", "digest": PULL_DIGEST_B, "total": 900},
        {"status": "pulling aaaa", "digest": PULL_DIGEST_A, "total": 4000, "completed": 4000},
        {"status": "pulling bbbb", "digest": PULL_DIGEST_B, "total": 900, "completed": 900},
        {"status": "verifying sha256 digest"},
        {"status": "writing manifest"},
        {"status": "success"},
    ]
    stand_in = StandIn(lines)
    async with stand_in as url:
        assert await run_client(["pull", "someone/tiny-GGUF", "--url", url]) == 0
    assert stand_in.received == [("pull", {"model": "someone/tiny-GGUF", "stream": True})]
    out, err = capsys.readouterr()
    assert out == "success\n"
    assert "pulling manifest" in err
    assert "verifying sha256 digest" in err
    assert "pulling aaaaaaaaaaaa" in err
    assert "pulling bbbbbbbbbbbb" in err
    assert err.count("100%") == 2  # both bars finished


async def test_an_error_line_in_the_pull_stream_exits_1_with_the_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines: list[dict[str, Any]] = [
        {"status": "pulling manifest"},
        {"status": "pulling aaaa", "digest": PULL_DIGEST_A, "total": 4000, "completed": 100},
        {"error": "download interrupted: disk full"},
    ]
    async with StandIn(lines) as url:
        assert await run_client(["pull", "m", "--url", url]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == "llm-supervisor: download interrupted: disk full"


async def test_a_refused_pull_exits_1_with_the_daemons_message(capsys: pytest.CaptureFixture[str]) -> None:
    async with StandIn(pull_status=404) as url:
        assert await run_client(["pull", "m", "--url", url]) == 1
    assert capsys.readouterr().err == "llm-supervisor: pull model manifest: file does not exist\n"


async def test_a_pull_stream_that_ends_without_success_is_a_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with StandIn([{"status": "pulling manifest"}]) as url:
        assert await run_client(["pull", "m", "--url", url]) == 1
    assert "ended before the daemon said success" in capsys.readouterr().err


async def test_rm_deletes_each_model_and_reports_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    stand_in = StandIn()
    async with stand_in as url:
        assert await run_client(["rm", "known", "unknown", "--url", url]) == 1
    assert stand_in.received == [("delete", {"model": "known"}), ("delete", {"model": "unknown"})]
    out, err = capsys.readouterr()
    assert out == "deleted 'known'\n"
    assert err == "llm-supervisor: model 'unknown' not found\n"


@pytest.mark.parametrize("command", [["list"], ["ps"], ["rm", "m"], ["pull", "m"]])
async def test_a_daemon_that_is_not_running_is_one_line_naming_its_url(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert await run_client([*command, "--url", url]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"llm-supervisor: could not reach the daemon at {url}: connection refused")


async def test_list_prints_an_aligned_table_from_the_url_in_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in = StandIn()
    an_hour_ago = datetime.fromtimestamp(time.time() - 3 * 3600, UTC).isoformat()
    stand_in.tags = [
        {
            "name": "qwen2.5:7b",
            "digest": "0a8c26691023" + "f" * 52,
            "size": 4_683_075_271,
            "modified_at": an_hour_ago,
        },
        {"name": "hub", "digest": "", "size": 0, "modified_at": None},
    ]
    async with stand_in as url:
        monkeypatch.setenv("LLM_SUPERVISOR_URL", url)
        assert await run_client(["list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "NAME         ID             SIZE     MODIFIED",
        "qwen2.5:7b   0a8c26691023   4.7 GB   3 hours ago",
        "hub          -              -        -",
    ]


def test_sizes_times_and_processors_read_as_ollama_prints_them() -> None:
    assert human_bytes(4_683_075_271) == "4.7 GB"
    assert human_bytes(627_904) == "627 KB"
    assert human_bytes(2_000_000_000) == "2 GB"
    assert human_bytes(512) == "512 B"
    now = 1_000_000_000.0
    assert human_time(now - 0.5, now) == "Less than a second ago"
    assert human_time(now - 90, now) == "About a minute ago"
    assert human_time(now + 299, now) == "4 minutes from now"
    assert human_time(now - 3 * 86400, now) == "3 days ago"
    assert human_time(now + 300 * 365 * 86400, now) == "Forever"
    assert human_time(None, now) == "-"
    assert processor(100, 100) == "100% GPU"
    assert processor(100, 0) == "100% CPU"
    assert processor(100, 25) == "75%/25% CPU/GPU"
