"""Routing across nodes, with real daemons (real llama-server children) sharing a real redis-server: a
request is served where the model is ready, a model loaded nowhere is loaded where it fits, and a node
that dies drops out of the fleet view, its requests served elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from tests.fleet.conftest import RedisServer
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, argv_of, eventually, running
from tests.integration.test_dataplane import ECHOING_VLLM
from workers.process import reap_orphans

TTL_S = 3.0
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def node(redis: RedisServer, node_id: str, **extra: Any) -> dict[str, Any]:
    return {"redis_url": redis.url, "node_id": node_id, "fleet_ttl_s": TTL_S, **extra}


async def _sees(
    daemon: Daemon, node_id: str, model: str, state: str | None, headers: dict[str, str] | None = None
) -> bool:
    """Whether `daemon`'s fleet view has `model` in `state` on `node_id` (None: the node is not there);
    `headers`: an admin key's, where keys are configured."""
    _, answer = await daemon.get("/v1/admin/nodes", headers)
    nodes = {n["node_id"]: n for n in answer["nodes"]}
    if state is None:
        return node_id not in nodes
    return node_id in nodes and nodes[node_id]["models"].get(model, {}).get("state") == state


async def _chat(daemon: Daemon) -> tuple[int, dict[str, Any]]:
    """One chat on a new connection (the front's), as a client of `daemon` would send it."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(daemon.url + "/v1/chat/completions", json=CHAT) as r,
    ):
        return r.status, await r.json()


def _demo_pids(daemon: Daemon) -> list[int]:
    """The engines serving `demo` (every model here runs the demo GGUF: its --alias tells them apart)."""
    return [p.pid for p in daemon.children() if " --alias demo " in f" {' '.join(argv_of(p))} "]


async def test_a_request_is_served_by_the_node_where_its_model_is_ready(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    a = await make_daemon(config=node(redis_server, "node-a"))
    b = await make_daemon(config=node(redis_server, "node-b"))
    status, _, _ = await b.post("/v1/admin/models/demo/load", {})
    assert status == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")

    status, answer = await _chat(a)
    assert status == 200, answer
    assert answer["choices"]
    assert _demo_pids(a) == []  # nothing started on node-a
    [served] = [e for e in a.events("request") if e.get("node") == "node-b"]
    [on_b] = b.events("request", request_id=served["request_id"])
    assert on_b["pid"] in _demo_pids(b)  # node-b's child answered it
    assert on_b["key"] is None  # loopback, no keys: the hop needs none

    # The Ollama API too: node-a passes the request on as it came, node-b translates and answers.
    async with aiohttp.ClientSession() as http:
        ollama = {
            "model": "demo",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 4},
        }
        async with http.post(a.url + "/api/chat", json={**ollama, "stream": False}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["done"] is True
        async with http.post(a.url + "/api/chat", json=ollama) as r:
            lines = [line for line in (await r.read()).splitlines() if line]
            assert r.status == 200
            assert json.loads(lines[-1])["done"] is True

    def both_logged() -> bool:  # a streamed answer's log line is written once its handler has returned
        return len([e for e in a.events("request", path="/api/chat") if e.get("node") == "node-b"]) == 2

    await eventually(both_logged, 10, "node-a's access log to name node-b for both Ollama requests")
    assert _demo_pids(a) == []

    # The listings show the fleet: where each model is, and what runs on the other node.
    _, listed = await a.get("/v1/models")
    [demo] = [m for m in listed["data"] if m["id"] == "demo"]
    assert (demo["node"], demo["nodes"]["node-b"]) == ("node-a", "ready")
    _, running = await a.get("/api/ps")
    assert [(m["name"], m["node"]) for m in running["models"]] == [("demo:latest", "node-b")]
    # As this node's rows have it: Ollama's Go client reads expires_at as a time, and a number (or null)
    # failed `ollama ps` on the whole listing.
    datetime.fromisoformat(running["models"][0]["expires_at"])
    _, documents = await a.get("/v1/admin/models")
    assert documents["models"][0]["nodes"] == {"node-a": "unloaded", "node-b": "ready"}
    _, tags = await a.get("/api/tags")
    assert tags["models"][0]["nodes"]["node-b"] == "ready"


async def test_a_model_loaded_nowhere_is_loaded_on_the_node_with_room(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    # Three nodes: node-a's and node-b's GPUs are taken by a model more important than demo; node-c's
    # is free. A request for demo reaching node-a is loaded on node-c.
    models = {"demo": {"vram_mib": 512}, "big": {"vram_mib": 3800, "priority": 10}}
    a = await make_daemon(models=models, config=node(redis_server, "node-a"))
    b = await make_daemon(models=models, config=node(redis_server, "node-b"))
    c = await make_daemon(models=models, config=node(redis_server, "node-c"))
    for full in (a, b):
        assert (await full.post("/v1/admin/models/big/load", {}))[0] == 200
    for other in ("node-a", "node-b"):
        await eventually(
            lambda o=other: _sees(a, o, "big", "ready"), TTL_S * 3, f"node-a to see {other} full"
        )
    await eventually(lambda: _sees(a, "node-c", "demo", "unloaded"), TTL_S * 3, "node-a to see node-c")

    status, answer = await _chat(a)
    assert status == 200, answer
    assert (_demo_pids(a), _demo_pids(b)) == ([], [])
    assert len(_demo_pids(c)) == 1  # loaded where it fit, not by evicting big anywhere
    assert (await a.state("big"), await b.state("big")) == ("ready", "ready")


async def test_a_dead_node_drops_out_and_its_requests_are_served_elsewhere(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    a = await make_daemon(config=node(redis_server, "node-a"))
    b = await make_daemon(config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    orphans = [psutil.Process(pid) for pid in _demo_pids(b)]

    b.expect_exit = {-signal.SIGKILL}
    b.signal(signal.SIGKILL)
    killed = time.monotonic()
    # At once, before the view has noticed: node-b refuses the connection, so node-a serves it itself.
    status, answer = await _chat(a)
    assert status == 200, answer
    assert len(_demo_pids(a)) == 1
    await eventually(lambda: _sees(a, "node-b", "demo", None), TTL_S * 3, "node-b to drop out of the view")
    assert time.monotonic() - killed <= TTL_S + 2  # its record's TTL, plus the view's 1 s refresh
    assert (await _chat(a))[0] == 200
    # A SIGKILLed daemon's children stop with it (workers/process.py, before_exec). Its next start
    # removes what it left, the child's socket and its directory under /tmp: done here as that start would.
    await eventually(lambda: not any(running(o) for o in orphans), what="node-b's child to stop")
    assert await reap_orphans(b.state_dir, grace_s=5.0) == []


async def test_a_node_whose_record_names_no_http_url_is_skipped_by_both_apis(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    # Nodes talk plain HTTP (settings refuse any other advertise_url), and the daemon's HTTP client holds
    # no CA bundle (supervisor/__main__.py). A record in Redis may still name another URL: one written by
    # hand, or by another program. Both APIs' forwarding skip that node and serve the request here.
    from redis.asyncio import Redis

    a = await make_daemon(config=node(redis_server, "node-a"))
    client = Redis.from_url(redis_server.url)
    try:
        raw = await client.get("llmsup:node:node-a")
        assert raw is not None
        record = json.loads(raw)
        record.update(node_id="node-c", url="https://node-c.invalid", last_seen=time.time())
        ready = {"state": "ready", "replicas": 1, "inflight": 0, "queued": 0, "max_inflight": 4}
        record["models"]["demo"] = {**record["models"]["demo"], **ready}
        await client.set("llmsup:node:node-c", json.dumps(record), px=60_000)
        await eventually(lambda: _sees(a, "node-c", "demo", "ready"), TTL_S * 3, "node-a to see node-c")

        # Each request loads demo here; unloaded in between, so that the second also looks elsewhere.
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                a.url + "/api/chat",
                json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": False},
            ) as r,
        ):
            assert r.status == 200, await r.text()
        status, _, _ = await a.post("/v1/admin/models/demo/unload", {})
        assert status == 200
        status, answer = await _chat(a)
        assert status == 200, answer
        skipped = a.events("forward_skipped", node="node-c")
        assert len(skipped) == 2
        assert "not an http:// URL" in skipped[0]["error"]
        assert not [e for e in a.events("request") if e.get("node") == "node-c"]
    finally:
        await client.delete("llmsup:node:node-c")
        await client.aclose()


ALICE = {"Authorization": "Bearer alice-key-0123456789"}


def _alices_keys(tmp_path: Path) -> Path:
    """A keys file with one admin key, alice's (ALICE sends it)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(json.dumps([{"name": "alice", "key": "alice-key-0123456789", "role": "admin"}]))
    return keys


async def _demo_ready_on_b(http: aiohttp.ClientSession, a: Daemon, b: Daemon) -> None:
    """Load demo on node-b (with `http`'s key), and wait until node-a sees it ready there."""
    async with http.post(b.url + "/v1/admin/models/demo/load", json={}) as r:
        assert r.status == 200
    await eventually(
        lambda: _sees(a, "node-b", "demo", "ready", ALICE), TTL_S * 3, "node-a to see demo on node-b"
    )


async def test_with_api_keys_the_nodes_prove_themselves_with_the_node_key(
    make_daemon: MakeDaemon, redis_server: RedisServer, tmp_path: Any
) -> None:
    """A client whose key node-a accepts is served by node-b, where demo is ready: the hop carries the
    node key, not the client's. Without a node key every forwarded request was b's 401 for a key a had
    just accepted; such a node now refuses to start, saying why."""
    keys = _alices_keys(tmp_path)
    fleet_keys = {"api_keys_file": str(keys), "node_key": "node-key-0123456789abcdef"}
    a = await make_daemon(config=node(redis_server, "node-a", **fleet_keys))
    b = await make_daemon(config=node(redis_server, "node-b", **fleet_keys))
    async with aiohttp.ClientSession(headers=ALICE) as http:
        await _demo_ready_on_b(http, a, b)
        async with http.post(a.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200, await r.text()
    assert _demo_pids(a) == []  # served by node-b

    lone = await make_daemon(config=node(redis_server, "node-c", api_keys_file=str(keys)), start=False)
    lone.expect_exit = {2}
    await lone.start(wait=False)
    assert await lone.wait_exit() == 2
    (refused,) = lone.events("node_key_missing")
    assert "node_key" in refused["reason"]


async def test_a_node_that_refuses_this_nodes_node_key_is_routed_around_not_blamed_on_the_client(
    make_daemon: MakeDaemon, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two nodes set up with different node keys (a deployment mistake). node-b refuses node-a's hops
    with its 401; node-a passed that 401 on, telling a client whose key it had just accepted that its
    key was wrong. Now node-a logs what is wrong with the fleet and serves the request itself."""
    keys = _alices_keys(tmp_path)
    a = await make_daemon(
        config=node(redis_server, "node-a", api_keys_file=str(keys), node_key="node-key-a-0123456789abcdef")
    )
    b = await make_daemon(
        config=node(redis_server, "node-b", api_keys_file=str(keys), node_key="node-key-b-0123456789abcdef")
    )
    async with aiohttp.ClientSession(headers=ALICE) as http:
        await _demo_ready_on_b(http, a, b)
        async with http.post(a.url + "/v1/chat/completions", json=CHAT) as r:  # the front's relay
            assert r.status == 200, await r.text()
        assert len(_demo_pids(a)) == 1  # served here
        async with http.post(a.url + "/v1/admin/models/demo/unload", json={}) as r:
            assert r.status == 200
        async with http.post(a.url + "/api/chat", json=OLLAMA_CHAT) as r:  # aiohttp's relay
            assert r.status == 200, await r.text()
    refused = a.events("forward_refused")
    assert [e["node"] for e in refused] == ["node-b", "node-b"]
    assert "node_key" in refused[0]["reason"]
    assert "node-key-" not in a.log_path.read_text()


async def test_a_forwarded_request_keeps_the_vllm_cache_salt_of_its_clients_key(
    make_daemon: MakeDaemon, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The node a request is forwarded to sees the node key, not the client's: salted there, every
    key's forwarded requests would share one vLLM prefix cache. The first node salts for the client's
    key and the hop keeps it, on both APIs (the Ollama one lost it). An OpenAI request with a chunked
    body (which the front hands to aiohttp) is forwarded too: it was served, and its model loaded, on
    the node it reached. The stand-in engine, as a vLLM manifest's command, stands in for vLLM and
    answers with the body it got."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        json.dumps(
            [
                {"name": "alice", "key": "alice-key-0123456789", "role": "admin"},
                {"name": "bob", "key": "bob-key-0123456789ab", "role": "inference"},
            ]
        )
    )
    fleet_keys = {"api_keys_file": str(keys), "node_key": "node-key-0123456789abcdef"}
    nodes = []
    for name in ("node-a", "node-b"):
        daemon = await make_daemon(models={}, config=node(redis_server, name, **fleet_keys), start=False)
        daemon.write_manifest("salted", **ECHOING_VLLM)
        await daemon.start()
        nodes.append(daemon)
    a, b = nodes
    alice = {"Authorization": "Bearer alice-key-0123456789"}
    bob = {"Authorization": "Bearer bob-key-0123456789ab"}
    chat = {"model": "salted", "messages": [{"role": "user", "content": "the same prompt"}]}

    # A connection per request: one the front handed to aiohttp would carry the next request there too.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(b.url + "/v1/admin/models/salted/load", json={}, headers=alice) as r:
            assert r.status == 200
        await eventually(
            lambda: _sees(a, "node-b", "salted", "ready", alice), TTL_S * 3, "node-a to see salted on node-b"
        )
        salts: dict[str, set[str]] = {"alice": set(), "bob": set()}
        for who, headers in (("alice", alice), ("bob", bob)):
            async with http.post(a.url + "/api/chat", json={**chat, "stream": False}, headers=headers) as r:
                assert r.status == 200, await r.text()
                salts[who].add(json.loads((await r.json())["message"]["content"])["cache_salt"])
            for sent in ({"json": chat}, {"data": _chunked(chat)}):
                async with http.post(a.url + "/v1/chat/completions", headers=headers, **sent) as r:
                    assert r.status == 200, await r.text()
                    content = (await r.json())["choices"][0]["message"]["content"]
                    salts[who].add(json.loads(content)["cache_salt"])
        # Sent to node-b directly: the same salt, so both reach one prefix cache there (one node key).
        async with http.post(b.url + "/v1/chat/completions", json=chat, headers=alice) as r:
            assert r.status == 200, await r.text()
            direct = json.loads((await r.json())["choices"][0]["message"]["content"])["cache_salt"]

    def served() -> list[str | None]:
        return [e.get("node") for e in a.events("request") if e.get("model") == "salted"]

    # Each access line is written once its answer has left: the client may read the answer first.
    await eventually(lambda: len(served()) == 6, 5, "node-a to log the six requests")
    assert served() == ["node-b"] * 6
    assert a.children() == []  # nothing loaded on node-a
    assert len(salts["alice"]) == len(salts["bob"]) == 1  # one key, one salt, on both APIs
    assert salts["alice"] != salts["bob"]
    assert salts["alice"] == {direct}


async def _chunked(body: dict[str, Any]) -> AsyncIterator[bytes]:
    """`body` sent in chunks (no Content-Length), which makes the request aiohttp's, not the front's."""
    yield json.dumps(body).encode()


async def _status_within(daemon: Daemon, path: str, body: dict[str, Any], timeout_s: float) -> int | None:
    """The answer's status, None if it did not end within `timeout_s`."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.post(daemon.url + path, json=body) as r,
        ):
            await r.read()
            return r.status
    except TimeoutError:
        return None


OLLAMA_CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": False}


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/api/chat", OLLAMA_CHAT)])
async def test_a_request_forwarded_to_a_node_that_hangs_ends_when_the_node_leaves_the_fleet(
    make_daemon: MakeDaemon, redis_server: RedisServer, path: str, body: dict[str, Any]
) -> None:
    """node-b hangs (SIGSTOP: its kernel still accepts connections, as a wedged or cut-off host's
    would) with a request forwarded to it. Once node-b drops out of node-a's view (it renews its record
    no more), that request ends with a 502; it used to wait for ever."""
    a = await make_daemon(config=node(redis_server, "node-a"))
    b = await make_daemon(config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    assert b.proc is not None
    b.proc.send_signal(signal.SIGSTOP)
    try:
        stuck = asyncio.ensure_future(_status_within(a, path, body, TTL_S * 6))
        await asyncio.sleep(0.5)  # forwarded to node-b before it leaves the view
        assert await stuck == 502
        assert a.events("forward_failed", node="node-b", error="left the fleet")
    finally:
        b.proc.send_signal(signal.SIGCONT)


async def test_a_request_by_an_alias_only_this_node_knows_is_forwarded_by_the_models_name(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    """node-a's demo has the alias `chat`, node-b's has none: a request for `chat`, routed to node-b
    where demo is ready, was forwarded under the name node-b does not know (404)."""
    a = await make_daemon(models={"demo": {"aliases": ["chat"]}}, config=node(redis_server, "node-a"))
    b = await make_daemon(config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    status, answer, _ = await a.post("/v1/chat/completions", {**CHAT, "model": "chat"})
    assert status == 200, answer
    assert _demo_pids(a) == []


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/api/chat", OLLAMA_CHAT)])
async def test_a_node_that_shuts_down_is_routed_around_at_once(
    make_daemon: MakeDaemon, redis_server: RedisServer, path: str, body: dict[str, Any]
) -> None:
    """A rolling restart: node-b (demo ready) drains a stream after SIGTERM. node-a routed demo there
    until node-b's next publish, and relayed its 503 shutting_down, though it could serve the request
    itself. node-b now says at once that it takes nothing new, and a refusal that says so sends the
    request on (here)."""
    a = await make_daemon(config=node(redis_server, "node-a"))
    b = await make_daemon(config=node(redis_server, "node-b", drain_timeout_s=20))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    async with aiohttp.ClientSession() as http:
        draining = await http.post(
            b.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1500, "stream": True}
        )
        await draining.content.readline()
        # The stream stays in flight for as long as the test needs: ended (the demo model makes its
        # 512 tokens in tens of milliseconds), node-b finished its drain and exited under node-a's request.
        (engine,) = b.children()
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            b.signal(signal.SIGTERM)
            await eventually(lambda: bool(b.events("shutdown_started")), 5, "node-b to begin its drain")
            assert await _status_within(a, path, body, 30) == 200
        finally:
            os.kill(engine.pid, signal.SIGCONT)
            draining.close()
    assert _demo_pids(a)  # served (and loaded) here


@pytest.mark.parametrize(
    ("path", "chunked"),
    [("/v1/chat/completions", False), ("/v1/chat/completions", True), ("/api/chat", False)],
)
async def test_a_forwarded_stream_whose_node_dies_mid_answer_ends_with_an_error(
    make_daemon: MakeDaemon, redis_server: RedisServer, path: str, chunked: bool
) -> None:
    """node-b (demo ready) is killed while node-a relays its stream. The Ollama stream ended cleanly
    after the last token node-b sent, with neither `done` nor an error line: a client took the cut
    answer for a whole one. Both APIs' streams now end with their error, as a local crash ends them,
    also when a chunked body made the request aiohttp's."""
    a = await make_daemon(config=node(redis_server, "node-a"))
    b = await make_daemon(models={"demo": {"parallel": 1}}, config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    assert b.proc is not None
    engines = b.children()
    messages = [{"role": "user", "content": "story"}]
    if path == "/api/chat":
        body: dict[str, Any] = {"model": "demo", "messages": messages, "options": {"num_predict": 1900}}
    else:
        body = {"model": "demo", "messages": messages, "max_tokens": 1900, "stream": True}
    try:
        sent = {"data": _chunked(body)} if chunked else {"json": body}
        async with aiohttp.ClientSession() as http, http.post(a.url + path, **sent) as r:
            assert r.status == 200
            await r.content.readline()
            b.expect_exit = {-9, 0}
            b.proc.send_signal(signal.SIGKILL)
            lines = [line for line in (await r.read()).splitlines() if line.strip()]
    finally:
        for engine in engines:
            with contextlib.suppress(psutil.Error):
                engine.kill()
    last = lines[-1].decode()
    if path == "/api/chat":
        assert json.loads(last) == {
            "error": "model 'demo' stopped while serving: node node-b stopped answering: "
            "the stream was cut short"
        }
    else:
        assert last.startswith("data: ")
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "model_crashed"
    await eventually(lambda: bool(a.events("request", path=path)), 5, "node-a to log the request")
    logged = a.events("request", path=path)[-1]
    assert (logged["status"], logged["error"]) == (503, "model_crashed")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
async def test_a_forwarded_stream_whose_node_leaves_the_fleet_mid_answer_ends_with_an_error(
    make_daemon: MakeDaemon, redis_server: RedisServer, path: str
) -> None:
    """node-b hangs (SIGSTOP) while node-a relays its stream. Once node-b drops out of node-a's view the
    stream ends with the API's error; the OpenAI stream used to wait until the client left."""
    a = await make_daemon(config=node(redis_server, "node-a"))
    b = await make_daemon(config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    assert b.proc is not None
    messages = [{"role": "user", "content": "story"}]
    if path == "/api/chat":
        body: dict[str, Any] = {"model": "demo", "messages": messages, "options": {"num_predict": 1900}}
    else:
        body = {"model": "demo", "messages": messages, "max_tokens": 1900, "stream": True}
    timeout = aiohttp.ClientTimeout(total=TTL_S * 6)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, http.post(a.url + path, json=body) as r:
            assert r.status == 200
            await r.content.readline()
            b.proc.send_signal(signal.SIGSTOP)
            lines = [line for line in (await r.read()).splitlines() if line.strip()]
    finally:
        b.proc.send_signal(signal.SIGCONT)
    last = lines[-1].decode()
    if path == "/api/chat":
        assert "node node-b stopped answering" in json.loads(last)["error"]
    else:
        assert last.startswith("data: ")
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "model_crashed"


def _story(path: str) -> dict[str, Any]:
    """A streamed chat long enough to stay in flight while its engine is stopped (SIGSTOP)."""
    messages = [{"role": "user", "content": "story"}]
    if path == "/api/chat":
        return {"model": "demo", "messages": messages, "options": {"num_predict": 1500}}
    return {"model": "demo", "messages": messages, "max_tokens": 1500, "stream": True}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
async def test_a_node_that_shuts_down_drains_the_streams_it_forwarded(
    make_daemon: MakeDaemon, redis_server: RedisServer, path: str
) -> None:
    """node-a relays node-b's stream when it gets SIGTERM. The forwarded request held no ticket on
    node-a, whose drain did not wait for it: node-a exited at once and the client's stream broke off.
    It is now drained as a local one is: it runs to its end, then node-a exits."""
    a = await make_daemon(config=node(redis_server, "node-a", drain_timeout_s=20))
    b = await make_daemon(config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    (engine,) = b.children()
    async with aiohttp.ClientSession() as http, http.post(a.url + path, json=_story(path)) as r:
        assert r.status == 200
        await r.content.readline()
        os.kill(engine.pid, signal.SIGSTOP)  # the stream stays in flight while node-a begins its drain
        try:
            a.signal(signal.SIGTERM)
            await asyncio.sleep(1)
            assert a.proc is not None
            assert a.proc.returncode is None  # still draining
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        lines = [line for line in (await r.read()).splitlines() if line.strip()]
    assert await a.wait_exit(20) == 0
    last = lines[-1].decode()
    if path == "/api/chat":
        assert json.loads(last)["done"] is True
    else:
        assert last == "data: [DONE]"


@pytest.mark.parametrize(
    ("path", "second_signal"),
    [("/v1/chat/completions", False), ("/api/chat", False), ("/api/chat", True)],
)
async def test_a_forwarded_stream_left_at_the_drains_end_ends_with_the_apis_error(
    make_daemon: MakeDaemon, redis_server: RedisServer, path: str, second_signal: bool
) -> None:
    """node-b's engine stops answering while node-a relays its stream, and node-a is told to stop. At the
    end of node-a's drain (drain_timeout_s, or a second SIGTERM) the stream ends with the API's error, as
    a local stream cut at the drain's end does. The Ollama stream kept node-a from exiting for over a
    minute (aiohttp's clean-up waited for it) whatever the drain said or a second signal asked."""
    drain_s = 60 if second_signal else 2
    a = await make_daemon(config=node(redis_server, "node-a", drain_timeout_s=drain_s))
    b = await make_daemon(config=node(redis_server, "node-b"))
    assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "ready"), TTL_S * 3, "node-a to see demo on node-b")
    (engine,) = b.children()
    try:
        async with aiohttp.ClientSession() as http, http.post(a.url + path, json=_story(path)) as r:
            assert r.status == 200
            await r.content.readline()
            os.kill(engine.pid, signal.SIGSTOP)
            a.signal(signal.SIGTERM)
            if second_signal:
                await eventually(lambda: bool(a.events("forwarded_draining")), 5, "node-a to drain")
                a.signal(signal.SIGTERM)
            lines = [line for line in (await asyncio.wait_for(r.read(), 15)).splitlines() if line.strip()]
        assert await a.wait_exit(10) == 0
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    last = lines[-1].decode()
    if path == "/api/chat":
        assert json.loads(last) == {
            "error": "model 'demo' stopped while serving: this node shut down: the stream was cut short"
        }
    else:
        assert last.startswith("data: ")
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "model_crashed"
    assert a.events("forwarded_drain_abandoned" if second_signal else "forwarded_drain_timeout")


async def test_a_forwarded_ollama_request_refused_with_a_503_relays_the_nodes_error(
    make_daemon: MakeDaemon, redis_server: RedisServer, broken_gguf: Path
) -> None:
    """node-a's GPU is taken by a model more important than demo; node-b has room, and a demo whose
    weights its engine cannot load. node-a sends an Ollama chat for demo to node-b, which answers 503
    `model_failed`. Reading that body to see whether it was `shutting_down` consumed it: the client got
    a 503 with an empty body. It now gets node-b's error as node-b sent it."""
    models = {"demo": {"vram_mib": 512}, "big": {"vram_mib": 3800, "priority": 10}}
    a = await make_daemon(models=models, config=node(redis_server, "node-a"))
    broken = {**models, "demo": {"vram_mib": 512, "model": str(broken_gguf)}}
    await make_daemon(models=broken, config=node(redis_server, "node-b"))
    assert (await a.post("/v1/admin/models/big/load", {}))[0] == 200
    await eventually(lambda: _sees(a, "node-b", "demo", "unloaded"), TTL_S * 3, "node-a to see node-b")
    async with aiohttp.ClientSession() as http, http.post(a.url + "/api/chat", json=OLLAMA_CHAT) as r:
        assert r.status == 503
        answer = await r.json(content_type=None)
    assert answer["error"].startswith("model 'demo' failed to start: ")
    # The access line is written once the answer has left: the client may read it first.
    await eventually(lambda: bool(a.events("request", path="/api/chat")), 5, "node-a to log the request")
    assert a.events("request", path="/api/chat")[-1]["node"] == "node-b"
