"""API keys, roles and browser protections against the real daemon, with the real openai and ollama clients.

Each attack from the security review is a test here that now gets the safe answer.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import openai
import pytest
import yaml

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually
from tests.integration.test_dataplane import ECHOING_VLLM, MODELS

ADMIN = "admin-key-0123456789abcdef"
ALICE = "alice-key-0123456789abcdef"  # inference, demo only, one request at a time, priority <= 1
BOB = "bob-key-0123456789abcdefgh"  # inference, every model


def write_keys(root: Path, entries: list[dict[str, Any]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "keys.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


KEYS: list[dict[str, Any]] = [
    {"name": "ops", "key": ADMIN, "role": "admin"},
    {"name": "alice", "key": ALICE, "models": ["demo"], "max_concurrent": 1, "max_priority": 1},
    {"name": "bob", "key": BOB},
]


@pytest.fixture
async def keyed(make_daemon: MakeDaemon, tmp_path: Path) -> Daemon:
    keys = write_keys(tmp_path / "keys", KEYS)
    return await make_daemon(
        models={"demo": {}, "other": {}},
        config={"api_keys_file": str(keys), "gpus": [{"index": 0, "total_mib": 4096}]},
    )


async def call(
    daemon: Daemon,
    method: str,
    path: str,
    key: str | None = None,
    body: Any = None,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
) -> tuple[int, Any, Any]:
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    if body is not None:
        data = json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, daemon.url + path, data=data, headers=sent) as response,
    ):
        text = await response.text()
        try:
            parsed: Any = json.loads(text)
        except ValueError:
            parsed = text
        return response.status, parsed, response.headers


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_both_clients_work_unchanged_with_a_key(keyed: Daemon) -> None:
    client = openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", api_key=BOB, max_retries=0)
    completion = await client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.choices[0].message.content is not None
    models = await client.models.list()
    assert {m.id for m in models.data} == {"demo", "other"}

    ollama_client = ollama.AsyncClient(host=keyed.url, headers={"Authorization": f"Bearer {BOB}"})
    answer = await ollama_client.chat(
        model="demo", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
    )
    assert answer.message.content is not None
    assert {m.model for m in (await ollama_client.list()).models} == {"demo:latest", "other:latest"}
    # x-api-key works too (Anthropic-style clients)
    status, _, _ = await call(keyed, "GET", "/v1/models", headers={"x-api-key": BOB})
    assert status == 200


async def test_no_key_or_a_wrong_key_is_401_in_each_apis_shape(keyed: Daemon) -> None:
    for key in (None, "not-a-key", ADMIN + "x"):
        status, body, headers = await call(keyed, "POST", "/v1/chat/completions", key, CHAT)
        assert status == 401, body
        assert body["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"].startswith("Bearer")
        status, body, _ = await call(keyed, "POST", "/api/chat", key, {"model": "demo"})
        assert status == 401
        assert isinstance(body["error"], str)
    client = openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.models.list()
    with pytest.raises(ollama.ResponseError) as raised:
        await ollama.AsyncClient(host=keyed.url).list()
    assert raised.value.status_code == 401
    # Probes and Ollama discovery stay open.
    for path in ("/health", "/", "/api/version"):
        assert (await call(keyed, "GET", path))[0] == 200, path
    assert await keyed.state("demo") == "unloaded"  # nothing was loaded by refused requests


async def test_an_inference_key_cannot_use_admin_routes(keyed: Daemon) -> None:
    admin_routes = [
        ("POST", "/api/pull", {"model": "hf.co/org/repo:Q4_K_M"}),
        ("DELETE", "/api/delete", {"model": "demo"}),
        ("DELETE", "/api/pull/org/repo", None),
        ("GET", "/api/status", None),
        ("GET", "/v1/admin/gpu-memory", None),
        ("GET", "/metrics", None),
    ]
    for method, path, body in admin_routes:
        status, answer, _ = await call(keyed, method, path, BOB, body)
        assert status == 403, (path, answer)
        code = answer["error"] if path.startswith("/api/") else answer["error"]["code"]
        assert code == "forbidden" or "admin" in code, (path, answer)
    # Each attempt's access-log line names the key that tried (it said "key": null: a security review).
    refused = [(e["path"], e["key"]) for e in keyed.events("request") if e["status"] == 403]
    assert refused == [(path, "bob") for _, path, _ in admin_routes]
    assert (await call(keyed, "GET", "/api/status", ADMIN))[0] == 200
    assert (await call(keyed, "GET", "/metrics", ADMIN))[0] == 200


async def test_each_admin_action_is_one_access_log_line_naming_the_key(keyed: Daemon) -> None:
    """Load, unload, pin, unpin, deletes, refused pulls and /api/show left no access-log line: who
    unloaded, pinned or deleted a model could not be known. Reads (probes, scrapes) stay unlogged."""
    actions = [
        ("POST", "/v1/admin/models/demo/pin", None, 200),
        ("POST", "/v1/admin/models/demo/unpin", None, 200),
        ("POST", "/v1/admin/models/demo/unload", None, 200),
        ("POST", "/v1/admin/models/nope/load", None, 404),
        ("POST", "/v1/admin/models/demo/load", {"wait": "no"}, 400),
        ("DELETE", "/api/delete", {"model": "nothing-here"}, 404),
        ("POST", "/api/show", {"model": "nothing-here"}, 404),
        ("POST", "/api/pull", {"model": "llama3"}, 400),
    ]
    for method, path, body, expected in actions:
        status, answer, _ = await call(keyed, method, path, ADMIN, body)
        assert status == expected, (path, answer)
    for path in ("/v1/admin/models", "/metrics", "/api/status"):
        assert (await call(keyed, "GET", path, ADMIN))[0] == 200
    lines = [(e["method"], e["path"], e["status"], e["key"]) for e in keyed.events("request")]
    assert lines == [(method, path, status, "ops") for method, path, _, status in actions]


async def test_health_without_an_admin_key_says_the_status_alone(keyed: Daemon) -> None:
    """/health needs no key (for probes), and it gave anyone every model name, state, pid and the
    engines' stderr tails, models that a key's `models` hide from /v1/models included."""
    assert (await call(keyed, "POST", "/v1/chat/completions", BOB, CHAT))[0] == 200
    for key in (None, BOB, "not-a-key"):
        status, body, _ = await call(keyed, "GET", "/health", key)
        assert (status, body) == (200, {"status": "ok"}), key
    status, body, _ = await call(keyed, "GET", "/health", ADMIN)
    assert status == 200
    assert set(body["models"]) == {"demo", "other"}
    assert body["models"]["demo"]["pid"]
    assert body["gpus"]


async def test_metrics_public_lets_any_key_scrape(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys", KEYS)
    daemon = await make_daemon(config={"api_keys_file": str(keys), "metrics_public": True})
    assert (await call(daemon, "GET", "/metrics", BOB))[0] == 200
    assert (await call(daemon, "GET", "/metrics"))[0] == 401


async def test_a_keys_models_filter_what_it_sees_and_uses(keyed: Daemon) -> None:
    _, listed, _ = await call(keyed, "GET", "/v1/models", ALICE)
    assert [m["id"] for m in listed["data"]] == ["demo"]
    _, tags, _ = await call(keyed, "GET", "/api/tags", ALICE)
    assert [m["name"] for m in tags["models"]] == ["demo:latest"]
    # A model the key may not use is answered as one that does not exist, word for word: a 403 naming it
    # told a restricted key which models existed, by guessing, and under which spelling.
    status, body, _ = await call(keyed, "POST", "/v1/chat/completions", ALICE, {**CHAT, "model": "OTHER"})
    _, unknown, _ = await call(keyed, "POST", "/v1/chat/completions", ALICE, {**CHAT, "model": "NOPE"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert body["error"]["message"] == unknown["error"]["message"].replace("NOPE", "OTHER")
    status, body, _ = await call(keyed, "POST", "/api/generate", ALICE, {"model": "other", "prompt": "x"})
    assert status == 404
    assert "not found" in body["error"]
    status, body, _ = await call(keyed, "POST", "/api/show", ALICE, {"model": "other"})
    assert status == 404
    assert await keyed.state("other") == "unloaded"


async def test_max_concurrent_answers_429_past_the_limit(keyed: Daemon) -> None:
    async with aiohttp.ClientSession() as session:
        stream = await session.post(
            keyed.url + "/v1/chat/completions",
            json={**CHAT, "max_tokens": 1500, "stream": True},
            headers={"Authorization": f"Bearer {ALICE}"},
        )
        try:
            assert stream.status == 200
            await stream.content.readline()  # the first event: the request is in flight
            status, body, headers = await call(keyed, "POST", "/v1/chat/completions", ALICE, CHAT)
            assert status == 429
            assert body["error"]["code"] == "too_many_requests"
            assert int(headers["Retry-After"]) >= 1
            # Another key is not limited by alice's requests.
            assert (await call(keyed, "POST", "/v1/chat/completions", BOB, CHAT))[0] == 200
        finally:
            stream.close()
    await eventually(
        lambda: _ok(call(keyed, "POST", "/v1/chat/completions", ALICE, CHAT)), 10, "alice's place back"
    )


async def _ok(pending: Any) -> bool:
    return bool((await pending)[0] == 200)


async def test_max_priority_caps_x_priority_and_the_log_names_the_key_not_the_secret(keyed: Daemon) -> None:
    status, _, _ = await call(keyed, "POST", "/v1/chat/completions", ALICE, {**CHAT, "x_priority": 100})
    assert status == 200
    capped = keyed.events("priority_capped")
    assert capped
    assert capped[-1]["key"] == "alice"
    assert capped[-1]["granted"] == 1
    requests = keyed.events("request", key="alice")
    assert requests
    assert requests[-1]["status"] == 200
    log_text = keyed.log_path.read_text()
    for secret in (ADMIN, ALICE, BOB):
        assert secret not in log_text


async def test_sighup_rereads_the_keys_and_a_broken_file_keeps_the_old(keyed: Daemon, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys" / "keys.yaml"
    new_key = "carol-key-0123456789abcdef"
    write_keys(tmp_path / "keys", [*KEYS, {"name": "carol", "key": new_key}])
    keyed.signal(signal.SIGHUP)
    await eventually(lambda: _ok(call(keyed, "GET", "/v1/models", new_key)), 10, "carol's key to work")
    keys_file.write_text("- {name: broken\n")
    keyed.signal(signal.SIGHUP)
    await eventually(lambda: bool(keyed.events("reload_rejected", reason="invalid api keys")), 10)
    assert (await call(keyed, "GET", "/v1/models", new_key))[0] == 200


@pytest.mark.parametrize(
    ("which", "text"),
    [
        ("keys", "[" * 5000 + "]" * 5000),  # RecursionError in PyYAML's composer
        ("keys", "- {name: 2024-02-30, key: carol-key-0123456789abcdef}\n"),  # ValueError: no such day
        ("manifest", "name: late\nengine: llama-server\nmodel: x.gguf\ndescription: 2024-02-30\n"),
        ("config", "node_id: 2024-02-30\n"),
    ],
    ids=["keys-nested", "keys-bad-date", "manifest-bad-date", "config-bad-date"],
)
async def test_a_file_yaml_cannot_build_is_refused_on_reload_and_the_daemon_serves_on(
    keyed: Daemon, tmp_path: Path, which: str, text: str
) -> None:
    """PyYAML raises ValueError for a date that cannot be and RecursionError for nesting too deep, not
    a YAMLError: such a keys file, manifest or config ended the daemon on SIGHUP (every stream cut)."""
    if which == "keys":
        (tmp_path / "keys" / "keys.yaml").write_text(text)
    elif which == "manifest":
        (keyed.manifests / "late.yaml").write_text(text)
    else:
        config = keyed.root / "config.yaml"
        config.write_text(config.read_text() + text)
    keyed.signal(signal.SIGHUP)
    await eventually(lambda: bool(keyed.events("reload_rejected")), 10, "the reload to be refused")
    assert (await call(keyed, "GET", "/v1/models", BOB))[0] == 200  # the old keys stay
    assert (await call(keyed, "GET", "/v1/models"))[0] == 401


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /health HTTP/1.1\r\nHost: localhost\r\nx-api-key: \xff\xfe-not-utf8\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer \xff\xfe\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer \xff\xfe\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n",
    ],
    ids=["aiohttp", "tunnelled", "front"],
)
async def test_a_key_that_is_not_utf8_is_refused_not_an_internal_error(
    keyed: Daemon, request_head: bytes
) -> None:
    """A key's bytes that are not UTF-8 (kept as surrogates when the header is read) made the key's
    digest raise: a 500 and a traceback in the log for anyone without a key, on every route."""
    reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
    try:
        writer.write(
            request_head + b"Connection: close\r\n\r\n" + (b"{}" if request_head.startswith(b"POST") else b"")
        )
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith((b"HTTP/1.1 401", b"HTTP/1.1 200")), answer[:200]  # /health needs no key
    assert not keyed.internal_errors()


async def test_a_revoked_admin_keys_event_stream_ends_at_the_reload(keyed: Daemon, tmp_path: Path) -> None:
    """An admin key removed from the keys file (SIGHUP) was refused on new requests, but the
    /v1/admin/events stream it had opened went on receiving every event (loads, crash output, pulls) for
    as long as the daemon ran. It now ends with the reload's event."""
    async with aiohttp.ClientSession() as session:
        stream = await session.get(
            keyed.url + "/v1/admin/events", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert stream.status == 200
        await stream.content.readuntil(b"\n\n")  # the snapshot
        new_admin = "ops2-key-0123456789abcdefgh"
        write_keys(
            tmp_path / "keys",
            [e for e in KEYS if e["name"] != "ops"] + [{"name": "ops2", "key": new_admin, "role": "admin"}],
        )
        keyed.signal(signal.SIGHUP)
        rest = await asyncio.wait_for(stream.content.read(), 10)  # to its end
        stream.close()
        assert b"event: reload" not in rest
        assert (await call(keyed, "GET", "/v1/admin/models", ADMIN))[0] == 401
        assert (await call(keyed, "POST", "/v1/admin/models/demo/load", new_admin, {}))[0] == 200


async def test_refuses_to_listen_beyond_loopback_without_a_key(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"host": "0.0.0.0"}, start=False)
    daemon.expect_exit = {2}
    await daemon.start(wait=False)
    assert await daemon.wait_exit() == 2
    (refused,) = daemon.events("unauthenticated_listener_refused")
    assert all(word in refused["reason"] for word in ("api_keys_file", "api_key", "allow_unauthenticated"))
    assert daemon.children() == []


# --- shared prompt caches ---------------------------------------------------------------------------


async def test_each_key_gets_a_vllm_prefix_cache_salt_of_its_own_on_both_apis(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Keys sharing a vLLM model would share its prefix cache, and could learn by its answers whether
    another key's prompt began with a guessed text: each key's requests carry a `cache_salt` of their
    own. The Ollama routes sent none, so two keys chatting there shared one cache. A stand-in engine
    started as a vLLM manifest's command (bench/stand_in_engine.py: real vLLM is tested with salts in
    test_capabilities_vllm.py, but cannot say what it got) answers with the body the daemon sent it."""
    daemon = await make_daemon(
        models={}, config={"api_keys_file": str(write_keys(tmp_path, KEYS))}, start=False
    )
    daemon.write_manifest("salted", **ECHOING_VLLM)
    await daemon.start()
    message = [{"role": "user", "content": "the same prompt"}]
    salts: dict[str, list[str]] = {}
    for key in (BOB, ADMIN, BOB):
        status, ollama_answer, _ = await call(
            daemon, "POST", "/api/chat", key, {"model": "salted", "messages": message, "stream": False}
        )
        assert status == 200, ollama_answer
        status, openai_answer, _ = await call(
            daemon, "POST", "/v1/chat/completions", key, {"model": "salted", "messages": message}
        )
        assert status == 200, openai_answer
        sent = [
            json.loads(ollama_answer["message"]["content"]),
            json.loads(openai_answer["choices"][0]["message"]["content"]),
        ]
        salts.setdefault(key, []).extend(body["cache_salt"] for body in sent)
    assert len(set(salts[BOB])) == 1  # one key: one cache, on both APIs
    assert set(salts[BOB]).isdisjoint(salts[ADMIN])


async def test_a_llama_server_model_can_keep_its_prompt_cache_to_no_one(make_daemon: MakeDaemon) -> None:
    """llama-server has no per-key cache: a manifest's `prompt_cache: false` sends `cache_prompt: false`
    with every request, whatever the client asked, on both APIs; the same prompt twice then takes
    nothing from the cache (`timings.cache_n`), where by default the second reuses the first."""
    models = {"shared": {}, "private": {"prompt_cache": False}}
    daemon = await make_daemon(models=models)
    prompt = [{"role": "user", "content": "the cat sat on the mat and looked at the dog " * 8}]
    reused = {}
    for name in models:
        for _ in range(2):
            status, answer, _ = await call(
                daemon,
                "POST",
                "/v1/chat/completions",
                body={"model": name, "messages": prompt, "max_tokens": 1, "cache_prompt": True},
            )
            assert status == 200, answer
        reused[name] = answer["timings"]["cache_n"]
    assert reused["shared"] > 0
    assert reused["private"] == 0
    # What the child gets, on both APIs: the stand-in engine answers with the body it was sent.
    echoing = await make_daemon(
        models={"echo": {**MODELS["standin"], "args": ["--echo-body"], "prompt_cache": False}}
    )
    status, ollama_answer, _ = await call(
        echoing,
        "POST",
        "/api/chat",
        body={"model": "echo", "messages": prompt, "stream": False, "options": {"cache_prompt": True}},
    )
    assert status == 200, ollama_answer
    assert json.loads(ollama_answer["message"]["content"])["cache_prompt"] is False
    status, openai_answer, _ = await call(
        echoing,
        "POST",
        "/v1/chat/completions",
        body={"model": "echo", "messages": prompt, "cache_prompt": True},
    )
    assert status == 200, openai_answer
    assert json.loads(openai_answer["choices"][0]["message"]["content"])["cache_prompt"] is False


# --- the browser ------------------------------------------------------------------------------------


async def test_a_cross_site_page_cannot_drive_the_daemon(daemon: Daemon) -> None:
    """A `text/plain` POST needs no CORS preflight, so the browser sends it: the daemon must refuse it."""
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    status, body, headers = await call(
        daemon, "POST", "/v1/chat/completions", data=json.dumps(CHAT).encode(), headers=evil
    )
    assert status == 403
    assert body["error"]["code"] == "origin_not_allowed"
    assert "Access-Control-Allow-Origin" not in headers
    status, _, _ = await call(
        daemon, "POST", "/api/pull", data=b'{"model": "hf.co/org/repo:Q4_K_M"}', headers=evil
    )
    assert status == 403
    assert await daemon.state("demo") == "unloaded"
    status, _, _ = await call(
        daemon,
        "OPTIONS",
        "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert status == 403


async def test_a_page_on_localhost_gets_cors_from_the_daemon_not_the_child(daemon: Daemon) -> None:
    local = {"Origin": "http://localhost:3000"}
    status, _, headers = await call(
        daemon,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            **local,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    allowed = {name.strip() for name in headers["Access-Control-Allow-Headers"].split(",")}
    # The key, and every scheduling header README documents (X-Session-Id was missing: a page could not
    # keep its session on one replica).
    assert {"Authorization", "X-Priority", "X-Client-Id", "X-Session-Id"} <= allowed
    status, _, headers = await call(daemon, "POST", "/v1/chat/completions", body=CHAT, headers=local)
    assert status == 200
    assert headers.getall("Access-Control-Allow-Origin") == ["http://localhost:3000"]


async def test_allowed_origins_add_more_pages(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"allowed_origins": ["https://*.example.com"]})
    status, _, headers = await call(
        daemon, "GET", "/v1/models", headers={"Origin": "https://chat.example.com"}
    )
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == "https://chat.example.com"
    assert (await call(daemon, "GET", "/v1/models", headers={"Origin": "https://example.org"}))[0] == 403


async def test_dns_rebinding_finds_nothing(daemon: Daemon) -> None:
    """A page that re-points evil.example at 127.0.0.1 reaches the port, but under its own Host name."""
    rebound = {"Host": f"evil.example:{daemon.port}"}
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", "/api/status", None),
        ("DELETE", "/api/delete", {"model": "demo"}),
        ("POST", "/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "x"}]}),
    ]:
        status, answer, _ = await call(daemon, method, path, body=body, headers=rebound)
        assert status == 403, (path, answer)
    assert (await call(daemon, "GET", "/v1/models", headers={"Host": f"localhost:{daemon.port}"}))[0] == 200


async def test_dns_rebinding_finds_nothing_beyond_loopback_without_keys(make_daemon: MakeDaemon) -> None:
    """`allow_unauthenticated` on a LAN address: a page on evil.example that re-points its name at the
    daemon's address reaches the port, and would have needed no key."""
    daemon = await make_daemon(config={"host": "0.0.0.0", "allow_unauthenticated": True})
    rebound = {"Host": f"evil.example:{daemon.port}", "Origin": f"http://evil.example:{daemon.port}"}
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", CHAT),  # the data plane's own path
        ("POST", "/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "x"}]}),
    ]:
        status, answer, _ = await call(daemon, method, path, body=body, headers=rebound)
        assert status == 403, (path, answer)
        assert "allowed_hosts" in json.dumps(answer["error"])  # Ollama's is a string, OpenAI's an object
    for host in (f"127.0.0.1:{daemon.port}", "192.168.1.10", f"{socket.gethostname()}:{daemon.port}"):
        assert (await call(daemon, "GET", "/v1/models", headers={"Host": host}))[0] == 200, host
    # The operator reads at start-up which names are answered (a proxy's own may need allowed_hosts).
    [access] = daemon.events("access")
    assert access["host_check"] is True
    assert socket.gethostname() in access["hosts_allowed"]


# --- bounded bodies ---------------------------------------------------------------------------------


async def answer_head(daemon: Daemon, sent: bytes) -> bytes:
    """The head of the daemon's answer to a request of which only `sent` ever arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()


_CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


async def test_bodies_over_the_buffer_budget_wait_outside(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"max_buffered_mib": 1})
    # Headers only: the answer must come before any of the 2 MiB body is sent.
    head = await answer_head(daemon, _CHAT_HEAD + b"Content-Length: 2097152\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), head
    assert b"Retry-After" in head
    assert (await daemon.get("/health"))[0] == 200


async def test_a_client_without_a_key_cannot_take_the_body_budget(keyed: Daemon) -> None:
    """Bodies for aiohttp's routes took their share of `max_buffered_mib` (256 MiB) before the key was
    checked: four heads with no key, each declaring a 64 MiB body or sending a chunked one that never
    came, held all of it for `client_timeout_s`, and every request with a body, from every key, was 503
    meanwhile. Now each of them is a 401 before anything is held."""
    uploads = [
        b"POST /v1/admin/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"POST /v1/admin/models HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"PUT /anything HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\nContent-Length: 9\r\n\r\n",
        # Routes that need no key take no body without one: the front's (tunnelled) and aiohttp's own.
        b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"GET /api/version HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % (64 << 20),
        b"GET /api/version HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
    ]
    held = []
    try:
        for upload in uploads:  # each connection stays open, as an attacker's would
            reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
            held.append(writer)
            writer.write(upload)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 401"), (upload, head)
        status, body, _ = await call(keyed, "POST", "/v1/chat/completions", BOB, CHAT)
        assert status == 200, body
    finally:
        for writer in held:
            writer.close()


async def test_a_client_too_slow_with_its_body_is_cut_off(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"client_timeout_s": 1})
    head = await answer_head(daemon, _CHAT_HEAD + b'Content-Length: 100\r\n\r\n{"model":')
    assert head.startswith(b"HTTP/1.1 408"), head
