"""`llm-supervisor check`, `schema`, and the client commands `list`, `ps`, `rm`, `pull`, `status`, `load`,
`unload`, `pin`, `unpin`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor import __version__, cli
from supervisor.cli import human_bytes, human_mib, human_time, main, processor, status_table


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


def test_check_of_one_manifest_file_checks_that_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check manifests/demo.yaml` said "manifest directory not found" of a file that was there."""
    manifest = tmp_path / "m.yaml"
    manifest.write_text("{name: m, engine: llama-server, model: /m.gguf}\n", encoding="utf-8")
    assert run_main(["check", str(manifest)]) == 0
    assert f"1 model(s) valid in {manifest}" in capsys.readouterr().out
    manifest.write_text("{name: m, engine: llama-server}\n", encoding="utf-8")
    assert run_main(["check", str(manifest)]) == 1
    assert "model" in capsys.readouterr().err


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
# The daemon's /api/pull and /api/delete and its admin model routes are stood in for by a tiny aiohttp
# server in the test that answers in the documented formats; `list` and `ps` also run against the real
# daemon in tests/integration/test_ollama_models.py, the admin commands in test_cli_admin.py.

PULL_DIGEST_A = "sha256:" + "a" * 64
PULL_DIGEST_B = "sha256:" + "b" * 64


class StandIn:
    """A stand-in for the daemon's Ollama routes that records what the CLI sent."""

    def __init__(self, pull_lines: list[dict[str, Any]] | None = None, pull_status: int = 200) -> None:
        self.pull_lines = pull_lines or []
        self.pull_status = pull_status
        self.received: list[tuple[Any, ...]] = []
        self.authorizations: list[str | None] = []
        self.tags: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_post("/api/pull", self.pull)
        app.router.add_delete("/api/delete", self.delete)
        app.router.add_get("/api/tags", self.list_tags)
        app.router.add_get("/v1/admin/models", self.admin_models)
        app.router.add_post("/v1/admin/models/{name}/{action}", self.admin_action)
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

    async def admin_models(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization"))
        return web.json_response({"models": [document("demo")]})

    async def admin_action(self, request: web.Request) -> web.Response:
        """Records (action, model, body); a model named `nope` is unknown, as the daemon says it."""
        self.authorizations.append(request.headers.get("Authorization"))
        name, action = request.match_info["name"], request.match_info["action"]
        self.received.append((action, name, await request.json()))
        if name == "nope":
            return web.json_response(
                {
                    "error": {
                        "message": "model 'nope' not found;\nGET /v1/models lists what is served",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "model_not_found",
                    }
                },
                status=404,
            )
        return web.json_response(document(name, state="ready" if action in ("load", "pin") else "unloaded"))


def document(name: str, state: str = "unloaded", **fields: Any) -> dict[str, Any]:
    """An admin model document, with what `status` reads of it."""
    up = state in ("loading", "ready", "draining")
    return {
        "name": name,
        "state": state,
        "replicas": [
            {"id": f"{name}#0", "state": state, "pid": 42 if up else None, "vram_mib": 512 if up else None}
        ],
        "inflight": 0,
        "queue_depth": 0,
        "expires_at": None,
        "pinned": False,
        "vram_estimate": {"mib": 512, "source": "declared", "detail": ""},
        **fields,
    }


async def run_client(argv: list[str]) -> int:
    """`main` runs its own event loop, so it runs in a thread beside the stand-in server's loop."""
    return await asyncio.to_thread(run_main, argv)


async def test_an_answer_that_is_not_utf8_is_one_line_and_exit_1_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Something else at --url (a proxy, another service) answering bytes that are not UTF-8 made every
    client command die with a UnicodeDecodeError traceback."""

    async def garbled(_: web.Request) -> web.Response:
        return web.Response(body=b"\xff\xfe{}", content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/admin/models", garbled)
    async with TestServer(app) as server:
        assert await run_client(["status", "--url", str(server.make_url(""))]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llm-supervisor: error:")
    assert "Traceback" not in err


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
    assert err.splitlines()[-1] == "llm-supervisor: error: download interrupted: disk full"


async def test_a_refused_pull_exits_1_with_the_daemons_message(capsys: pytest.CaptureFixture[str]) -> None:
    async with StandIn(pull_status=404) as url:
        assert await run_client(["pull", "m", "--url", url]) == 1
    assert capsys.readouterr().err == "llm-supervisor: error: pull model manifest: file does not exist\n"


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
    assert err == "llm-supervisor: error: model 'unknown' not found\n"


CLIENT_COMMANDS = [
    ["list"],
    ["ps"],
    ["rm", "m"],
    ["pull", "m"],
    ["status"],
    ["load", "m"],
    ["unload", "m"],
    ["pin", "m"],
    ["unpin", "m"],
]


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
async def test_a_daemon_that_is_not_running_is_one_line_naming_its_url_and_exit_2(
    command: list[str], as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert await run_client([*command, "--url", url, *(["--json"] if as_json else [])]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"llm-supervisor: error: could not reach the daemon at {url}: connection refused")


async def test_a_password_in_the_daemons_url_is_not_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """`--url http://user:password@host` (a proxy's basic auth): the line named the URL as given, password
    included, on terminals and in CI logs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert await run_client(["list", "--url", f"http://ops:s3cret@127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"could not reach the daemon at http://127.0.0.1:{port}" in err
    assert "s3cret" not in err


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_every_client_command_takes_json_and_an_api_key(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main([command[0], "--help"]) == 0
    usage = capsys.readouterr().out
    assert "--json" in usage
    assert "--api-key" in usage
    assert "--url" in usage


@pytest.mark.parametrize(
    "command", [["load"], ["load", "m", "--ctx-size", "big"], ["unload", "m", "--force"]]
)
def test_a_usage_error_exits_2(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(command) == 2
    assert "usage:" in capsys.readouterr().err


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
    # A daemon on simulated GPUs says where the model really runs.
    assert processor(100, 0, "CPU") == "100% CPU"
    assert processor(100, 100, "GPU") == "100% GPU"
    assert human_mib(512) == "512 MiB"
    assert human_mib(1536) == "1.5 GiB"
    assert human_mib(24576) == "24 GiB"
    assert human_mib(10 * 1024 + 300) == "10 GiB"


# --- the admin commands: status, load, unload, pin, unpin ----------------------------------------------


def test_status_prints_one_row_per_model_with_replicas_requests_vram_and_until() -> None:
    now = 1_000_000_000.0
    models = [
        document(
            "qwen",
            state="ready",
            inflight=3,
            queue_depth=7,
            expires_at=now + 299,
            replicas=[
                {"id": "qwen#0", "state": "ready", "vram_mib": 6144},
                {"id": "qwen#1", "state": "loading", "vram_mib": 6144},
            ],
        ),
        document("demo"),  # unloaded: what a load would take
        document("pinned-one", state="ready", pinned=True, expires_at=None),
        document("forever", state="ready", expires_at=None),
        document("starting", state="loading"),
        document("leaving", state="draining", expires_at=now),
        document("broken", state="failed", vram_estimate={"mib": None, "source": "unavailable"}),
        {"name": "sparse"},  # a document missing every field still prints
    ]
    assert status_table(models, now).splitlines() == [
        "MODEL        STATE            REPLICAS   IN FLIGHT   QUEUED   VRAM      UNTIL",
        "qwen         ready            2          3           7        12 GiB    4 minutes from now",
        "demo         unloaded         0          0           0        512 MiB   -",
        "pinned-one   ready (pinned)   1          0           0        512 MiB   Forever",
        "forever      ready            1          0           0        512 MiB   Forever",
        "starting     loading          1          0           0        512 MiB   Loading...",
        "leaving      draining         1          0           0        512 MiB   Stopping...",
        "broken       failed           0          0           0        -         -",
        "sparse       -                -          -           -        -         -",
    ]


@pytest.mark.parametrize(
    ("argv", "action", "body"),
    [
        (["load", "demo"], "load", {}),
        (
            ["load", "demo", "--ctx-size", "8192", "--replicas", "2", "--no-wait", "--keep-alive", "10m"],
            "load",
            {"overrides": {"ctx_size": 8192}, "replicas": 2, "wait": False, "keep_alive": "10m"},
        ),
        (
            ["load", "demo", "--ctx-size", "4096", "--restart"],
            "load",
            {"overrides": {"ctx_size": 4096}, "restart": True},
        ),
        (["unload", "demo"], "unload", {}),
        (["unload", "demo", "--cancel-queued"], "unload", {"queued": "cancel"}),
        (["pin", "demo"], "pin", {}),
        (["pin", "demo", "--no-wait"], "pin", {"wait": False}),
        (["unpin", "demo"], "unpin", {}),
    ],
)
async def test_model_actions_send_only_the_fields_given_and_print_the_models_row(
    argv: list[str], action: str, body: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in = StandIn()
    async with stand_in as url:
        assert await run_client([*argv, "--url", url]) == 0
    assert stand_in.received == [(action, "demo", body)]
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["MODEL", "STATE"]
    assert row.split()[:2] == ["demo", "ready" if action in ("load", "pin") else "unloaded"]


async def test_a_model_name_with_slashes_is_one_path_segment() -> None:
    stand_in = StandIn()
    async with stand_in as url:
        assert await run_client(["load", "hf.co/org/repo:Q4_K_M", "--url", url, "--json"]) == 0
    assert stand_in.received == [("load", "hf.co/org/repo:Q4_K_M", {})]


async def test_json_prints_the_daemons_answer_as_it_came(capsys: pytest.CaptureFixture[str]) -> None:
    stand_in = StandIn()
    stand_in.tags = [{"name": "qwen2.5:7b", "size": 1}]
    async with stand_in as url:
        assert await run_client(["status", "--url", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"models": [document("demo")]}
        assert await run_client(["unload", "demo", "--url", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == document("demo")
        assert await run_client(["list", "--url", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"models": [{"name": "qwen2.5:7b", "size": 1}]}
        assert await run_client(["rm", "known", "unknown", "--url", url, "--json"]) == 1
        out, err = capsys.readouterr()
        assert [json.loads(line) for line in out.splitlines()] == [{}, {"error": "model 'unknown' not found"}]
        assert err == "llm-supervisor: error: model 'unknown' not found\n"


async def test_json_pull_prints_each_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[dict[str, Any]] = [
        {"status": "pulling manifest"},
        {"status": "pulling aaaa", "digest": PULL_DIGEST_A, "total": 10, "completed": 10},
        {"status": "success"},
    ]
    async with StandIn(lines) as url:
        assert await run_client(["pull", "m", "--url", url, "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line) for line in out.splitlines()] == lines
    assert err == ""


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
async def test_a_refused_action_is_exit_1_with_the_code_and_message_on_one_line(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    async with StandIn() as url:
        assert await run_client(["load", "nope", "--url", url, *(["--json"] if as_json else [])]) == 1
    out, err = capsys.readouterr()
    assert err == (
        "llm-supervisor: error: model_not_found: "
        "model 'nope' not found; GET /v1/models lists what is served\n"
    )
    if as_json:  # the error body too, for scripts that read the code
        assert json.loads(out)["error"]["code"] == "model_not_found"
    else:
        assert out == ""


async def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = StandIn()
    async with stand_in as url:
        monkeypatch.delenv("LLM_SUPERVISOR_API_KEY", raising=False)
        assert await run_client(["status", "--url", url]) == 0
        assert await run_client(["pin", "demo", "--url", url, "--api-key", "from-flag"]) == 0
        monkeypatch.setenv("LLM_SUPERVISOR_API_KEY", "from-env")
        assert await run_client(["status", "--url", url]) == 0
        assert await run_client(["unpin", "demo", "--url", url, "--api-key", "flag-wins"]) == 0
    assert stand_in.authorizations == [None, "Bearer from-flag", "Bearer from-env", "Bearer flag-wins"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
def test_serve_makes_the_daemon_not_dumpable() -> None:
    """Engines run as the daemon's user: a dumpable daemon let one read its environment (the admin key)
    from /proc/<daemon>/environ, or its memory. Checked in a process of its own (the flag is per
    process), with PR_GET_DUMPABLE: root reads /proc/<pid>/environ whatever the flag says."""
    probe = (
        "import ctypes; from supervisor.cli import _guard_own_memory; _guard_own_memory(); "
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"  # PR_GET_DUMPABLE
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_ctrl_c_ends_a_client_command_quietly_with_130() -> None:
    """Ctrl-C on `llm-supervisor load` printed two chained Python tracebacks."""

    async def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    assert cli._run_client(interrupted, argparse.Namespace()) == 130


def test_a_url_without_a_scheme_means_http() -> None:
    """`--url localhost:11435` (as OLLAMA_HOST is often written) failed with aiohttp's unclear error."""
    assert cli._daemon_url("localhost:11435") == "http://localhost:11435"
    assert cli._daemon_url("https://gpu-box:443") == "https://gpu-box:443"


def test_the_daemons_advice_is_given_as_cli_commands() -> None:
    """`llm-supervisor unload demo` on a pinned model said to POST /v1/admin/models/demo/unpin."""
    pinned = {
        "error": {
            "code": "model_pinned",
            "message": "model 'demo' is pinned by the operator; POST /v1/admin/models/demo/unpin first",
        }
    }
    assert cli._error_of(409, pinned).endswith("; llm-supervisor unpin demo first")
    conflict = {
        "error": {
            "code": "load_conflict",
            "message": 'it runs with others; send "restart": true to '
            "drain it and start it with ctx_size=4096",
        }
    }
    assert "add --restart to drain it" in cli._error_of(409, conflict)
    # With no key, the daemon's HTTP advice: said as the CLI takes a key (a review helper).
    no_key = {
        "error": {
            "code": "invalid_api_key",
            "message": "a valid API key is required: send `Authorization: Bearer <key>` (or `x-api-key`)",
        }
    }
    assert cli._error_of(401, no_key) == (
        "invalid_api_key: a valid API key is required: pass --api-key or set $LLM_SUPERVISOR_API_KEY"
    )


@pytest.mark.parametrize("args", [["schema"], ["check", "manifests"]])
def test_the_offline_commands_end_quietly_on_a_closed_pipe(args: list[str]) -> None:
    """`llm-supervisor schema | head` printed BrokenPipeError's traceback, where the client commands end
    such a pipe quietly. The reader is gone before the first write here, so the pipe breaks at once."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", *args],
            cwd=Path(__file__).resolve().parents[2],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    assert done.returncode == 141


def test_a_lease_gpu_must_be_an_index_or_a_host_and_index() -> None:
    for good in ("0", "12", "gpu-box:1"):
        assert cli._gpu(good) == good
    for bad in ("-1", "gpu0", "gpu-box:x", ":1", "1.5", "٣"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._gpu(bad)


def test_check_warns_of_a_binary_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check` said ok of a `binary:` typo, which then showed only at the first request (a 503)."""
    (tmp_path / "m.yaml").write_text(
        f"{{name: m, engine: llama-server, model: {tmp_path / 'm.gguf'}, binary: /opt/llama/llama-servr}}\n"
    )
    assert cli.check(tmp_path) == 0
    assert "warning: binary /opt/llama/llama-servr not found" in capsys.readouterr().out


def test_a_state_directory_that_cannot_be_used_is_named_with_its_setting(tmp_path: Path) -> None:
    """`llm-supervisor: [Errno 20] Not a directory: ...` said nothing of --state-dir."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_SUPERVISOR_")}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--state-dir", str(taken / "state"), "--port", "0"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-800:]
    assert "cannot use the state directory" in done.stderr
    assert "--state-dir or LLM_SUPERVISOR_STATE_DIR" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "ftp://127.0.0.1:11435", "http://[::1", "http://"])
def test_a_daemon_url_that_is_no_url_is_a_usage_error(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It was reported as "could not reach the daemon at http://127.0.0.1:99999: http://...", as if the
    daemon were down."""
    assert run_main(["status", "--url", url]) == 2
    err = capsys.readouterr().err
    assert "not an http:// URL of the daemon" in err
    assert "could not reach" not in err


def test_a_bad_daemon_url_in_the_environment_is_a_usage_error_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLM_SUPERVISOR_URL", "http://user:pw@127.0.0.1:99999")
    assert run_main(["status"]) == 2
    err = capsys.readouterr().err
    assert "not an http:// URL of the daemon" in err
    assert "pw" not in err
