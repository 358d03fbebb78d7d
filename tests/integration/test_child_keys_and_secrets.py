"""Children open only to the daemon, and nothing secret (nor, for an anonymous caller, any path) in its
answers or its log."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import aiohttp
import psutil
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually
from workers.llama_server import bundled_binary

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ENV_SECRET = "hf_env_s3cret_0123456789"
ARGS_SECRET = "hf_args_s3cret_9876543210"


def engine(daemon: Daemon) -> psutil.Process:
    found = [p for p in daemon.children() if Path(p.cmdline()[0]).name == "llama-server"]
    assert len(found) == 1, found
    return found[0]


def flag(cmdline: list[str], name: str) -> str:
    return cmdline[cmdline.index(name) + 1]


def read_key(path: Path) -> tuple[int, str]:
    """The key file's permission bits and the key in it."""
    return stat.S_IMODE(path.stat().st_mode), path.read_text().strip()


async def test_a_child_refuses_requests_without_its_key_while_the_daemon_serves(daemon: Daemon) -> None:
    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200
    cmdline = engine(daemon).cmdline()
    socket_path = Path(flag(cmdline, "--host"))  # llama-server listens on a Unix socket, not a port
    assert socket_path.suffix == ".sock"
    assert "--port" not in cmdline
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700  # only the daemon's user opens it
    child = "http://localhost/v1/chat/completions"
    key_file = Path(flag(cmdline, "--api-key-file"))
    mode, key = read_key(key_file)
    assert mode == 0o600
    assert len(key) > 20
    assert not any(key in arg for arg in cmdline)  # `ps` does not show it

    # Run as the daemon's user, this test can open the socket: the key is what still keeps it out.
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(socket_path))) as session:
        for headers in ({}, {"Authorization": "Bearer guessed"}, {"X-Api-Key": "guessed"}):
            async with session.post(child, json=CHAT, headers=headers) as response:
                assert response.status == 401, headers
        async with session.post(child, json=CHAT, headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status == 200  # the key is the one the child demands

    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200
    status, _, _ = await daemon.post("/api/chat", {**CHAT, "stream": False})
    assert status == 200
    assert await daemon.state("demo") == "ready"  # the probe still gets through
    assert key not in daemon.log_path.read_text()

    assert (await daemon.post("/api/generate", {"model": "demo", "keep_alive": 0}))[0] == 200
    await daemon.wait_state("demo", "unloaded")
    await eventually(lambda: not key_file.exists(), 5, "the key file to be removed with its child")
    await eventually(lambda: not socket_path.exists(), 5, "the socket to be removed with its child")


async def test_a_clients_own_credentials_do_not_reach_the_child(daemon: Daemon) -> None:
    assert daemon.http is not None
    for headers in ({"Authorization": "Bearer the-clients-own"}, {"X-Api-Key": "the-clients-own"}):
        async with daemon.http.post(
            f"{daemon.url}/v1/chat/completions", json=CHAT, headers=headers
        ) as response:
            assert response.status == 200, await response.text()


async def test_manifest_secrets_show_nowhere(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(
        models={"demo": {"env": {"HF_TOKEN": ENV_SECRET}, "args": ["--hf-token", ARGS_SECRET]}}
    )
    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200
    assert ENV_SECRET in engine(daemon).environ().values()  # the child does get them
    status, show, _ = await daemon.post("/api/show", {"model": "demo"})
    assert status == 200
    answers = [
        json.dumps(show),
        json.dumps(await daemon.health()),
        json.dumps((await daemon.get("/api/status"))[1]),
    ]
    for text in [*answers, daemon.log_path.read_text()]:
        assert ENV_SECRET not in text
        assert ARGS_SECRET not in text
    assert "HF_TOKEN: '***'" in show["modelfile"]
    started = daemon.events("child_started")[-1]
    assert started["argv"][started["argv"].index("--hf-token") + 1] == "***"


async def test_the_daemons_own_secrets_do_not_reach_its_children(make_daemon: MakeDaemon) -> None:
    """Every deployment puts the admin key in the daemon's environment (LLM_SUPERVISOR_API_KEY), and a
    fleet the node key and the Redis URL with its password: every engine child inherited them, and an
    engine may run a model repo's own code."""
    daemon = await make_daemon(start=False)
    secret = "admin-key-from-the-environment-0123"
    await daemon.start(env={"LLM_SUPERVISOR_API_KEY": secret, "NOTIFY_SOCKET": "/run/nowhere"})
    headers = {"Authorization": f"Bearer {secret}"}
    assert daemon.http is not None
    async with daemon.http.post(daemon.url + "/v1/chat/completions", json=CHAT, headers=headers) as answer:
        assert answer.status == 200, await answer.text()
    environ = engine(daemon).environ()
    assert not [name for name in environ if name.startswith("LLM_SUPERVISOR_")]
    assert secret not in environ.values()
    assert "NOTIFY_SOCKET" not in environ
    assert "PATH" in environ  # the rest of the daemon's environment is the child's
    # Nor can a child (any process of the daemon's user) read them from the daemon itself: its environ
    # and memory (and ptrace) are the kernel's to guard once the daemon is not dumpable. Root reads them
    # anyway, so this is only seen when the tests run as another user (tests/unit/test_cli.py checks the
    # flag itself).
    assert daemon.proc is not None
    if os.geteuid() != 0:
        for part in ("environ", "mem"):
            with pytest.raises(PermissionError):
                await asyncio.to_thread(Path(f"/proc/{daemon.proc.pid}/{part}").read_bytes)


async def test_an_anonymous_caller_sees_no_absolute_path(daemon: Daemon, demo_gguf: Path) -> None:
    assert (await daemon.post("/v1/chat/completions", CHAT))[0] == 200
    status, show, _ = await daemon.post("/api/show", {"model": "demo"})
    assert status == 200
    assert "FROM demo.gguf\n" in show["modelfile"]
    assert "from demo.yaml;" in show["modelfile"]
    answers = [
        json.dumps(show),
        json.dumps(await daemon.health()),
        json.dumps((await daemon.get("/api/status"))[1]),
    ]
    for text in answers:
        assert str(demo_gguf.parent) not in text
        assert str(daemon.root) not in text
        assert str(Path.home()) not in text


async def test_a_manifest_env_value_the_child_prints_is_masked_whatever_its_name(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The admin API shows every manifest `env` value as ***, since operators put credentials there under
    any name; but only values under secret-looking names were masked in the child's output, so a
    wrapper that printed DB_PASSPHRASE showed it in /health's last_error, the model's document and the
    log."""
    real = bundled_binary()
    wrapper = tmp_path / "engine"
    wrapper.write_text('#!/bin/sh\necho "connecting with passphrase $DB_PASSPHRASE" >&2\nexit 1\n')
    wrapper.chmod(0o755)
    secret = "hunter2hunter2"
    fields = {"binary": str(wrapper), "library_path": [str(real.parent)] if real else []}
    daemon = await make_daemon(models={"demo": {**fields, "env": {"DB_PASSPHRASE": secret}}})
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, body, _ = await daemon.post("/v1/chat/completions", chat)
    assert status == 503, body
    _, document = await daemon.get("/v1/admin/models/demo")
    assert "connecting with passphrase ***" in str(document["last_error"]["stderr_tail"])
    assert secret not in str((await daemon.health())["models"]["demo"]["last_error"])
    assert secret not in daemon.log_path.read_text()
