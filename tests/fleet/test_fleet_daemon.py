"""Real daemons with a real redis-server: node records, /v1/admin/nodes, an external `lease take` (the CLI
as a subprocess) shrinking what the daemon may place on a shared GPU, and Redis killed mid-traffic."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from supervisor.fleet.shared_leases import SharedLeases, gpu_key
from tests.fleet.conftest import RedisServer
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually, run_cli

TTL_S = 3.0


def fleet_config(redis: RedisServer, node_id: str, **extra: Any) -> dict[str, Any]:
    return {"redis_url": redis.url, "node_id": node_id, "fleet_ttl_s": TTL_S, **extra}


async def node_record(client: Redis, node_id: str) -> dict[str, Any] | None:
    raw = await client.get(f"llmsup:node:{node_id}")
    return None if raw is None else dict(json.loads(raw))


async def test_nodes_route_without_redis_is_this_node_alone(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon()
    status, answer = await daemon.get("/v1/admin/nodes")
    assert status == 200
    assert answer["fleet"] is False
    [node] = answer["nodes"]
    assert node["url"] == daemon.url
    assert node["healthy"] is True
    assert node["gpus"][0]["index"] == 0
    assert node["models"]["demo"]["state"] == "unloaded"
    assert node["weights_on_disk"] == ["demo"]


async def test_a_node_publishes_its_record_and_drops_out_when_it_stops_renewing(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    daemon = await make_daemon(config=fleet_config(redis_server, "node-a"))
    await daemon.chat()
    record = await node_record(redis_client, "node-a")
    assert record is not None
    assert record["url"] == daemon.url
    await eventually(
        lambda: _model_state(redis_client, "node-a", "ready"), TTL_S * 2, "the record to show demo ready"
    )
    status, answer = await daemon.get("/v1/admin/nodes")
    assert status == 200
    assert answer["fleet"] is True
    assert [n["node_id"] for n in answer["nodes"]] == ["node-a"]

    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)  # alive but silent, as a hung or partitioned node is
    try:
        await eventually(
            lambda: _gone(redis_client, "node-a"), TTL_S + 2, "the stopped node's record to expire"
        )
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    await eventually(lambda: _present(redis_client, "node-a"), TTL_S + 2, "the node's record to come back")


async def test_a_redis_password_works_and_is_never_shown(
    make_daemon: MakeDaemon, redis_binary: str, tmp_path: Path
) -> None:
    """The Kubernetes example's Redis asks for a password, given in `redis_url`: a node with it publishes
    its record, one with a wrong one says why it cannot, and neither the log, the answers nor the CLI's
    output show the password."""
    password = secrets.token_hex(16)
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(redis_binary, folder, password=password)
    server.start()
    client = Redis.from_url(server.url, decode_responses=True)
    wrong_url = server.url.replace(password, "0" * len(password))
    try:
        node = await make_daemon(config=fleet_config(server, "with-password"))
        await eventually(lambda: _present(client, "with-password"), TTL_S * 2, "the node's record")
        refused = await make_daemon(config={**fleet_config(server, "wrong-password"), "redis_url": wrong_url})
        await eventually(
            lambda: bool(refused.events("fleet_degraded")),
            TTL_S * 3,
            f"the refusal logged ({refused.log_path})",
        )
        [degraded] = refused.events("fleet_degraded")
        assert "password" in degraded["error"]  # Redis's reason, without the password itself
        assert await node_record(client, "wrong-password") is None
        code, out, err = await run_cli("lease", "list", "--json", "--redis-url", server.url)
        assert code == 0, err
        bad_code, bad_out, bad_err = await run_cli("lease", "list", "--redis-url", wrong_url)
        assert bad_code == 2
        assert "could not reach Redis" in bad_err

        answers = []
        for daemon in (node, refused):
            for path in ("/v1/admin/nodes", "/v1/admin/models", "/health"):
                status, answer = await daemon.get(path)
                assert status == 200, (path, answer)
                answers.append(json.dumps(answer))
        shown = [
            node.log_path.read_text(),
            refused.log_path.read_text(),
            *answers,
            out,
            err,
            bad_out,
            bad_err,
        ]
        assert not [text[:200] for text in shown if password in text or "0" * len(password) in text]
    finally:
        await client.aclose()
        server.kill()


async def test_a_second_node_given_the_same_node_id_is_refused_loudly_and_leaves_the_first_alone(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    """Two daemons given one node_id overwrote each other's record every TTL/3, each hidden from the
    other's view, and the second's exit deleted the first's record; nothing was logged."""
    first = await make_daemon(config=fleet_config(redis_server, "same"))
    second = await make_daemon(config=fleet_config(redis_server, "same"))
    await eventually(lambda: bool(second.events("node_id_conflict")), TTL_S * 2, "the conflict to be logged")
    (conflict,) = second.events("node_id_conflict")
    assert conflict["level"] == "error"
    assert conflict["other_url"] == first.url
    await asyncio.sleep(TTL_S)  # a few of the second's publishes
    record = await node_record(redis_client, "same")
    assert record is not None
    assert record["url"] == first.url
    assert len(second.events("node_id_conflict")) == 1  # once, not at every publish
    assert not first.events("node_id_conflict")
    await second.close()
    assert await node_record(redis_client, "same") is not None  # the second's exit left it


async def test_a_node_restarted_before_its_record_expired_takes_it_over(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    """A record of another process at this node's own URL is this node's earlier run (killed, its
    record not yet expired): taken over at once, not refused as a namesake's."""
    url = "http://node-a.test:11435"
    earlier = {"node_id": "node-a", "url": url, "instance": "killed", "healthy": True, "models": {}}
    await redis_client.set("llmsup:node:node-a", json.dumps(earlier), px=60_000)
    daemon = await make_daemon(config=fleet_config(redis_server, "node-a", advertise_url=url))

    async def taken_over() -> bool:
        record = await node_record(redis_client, "node-a")
        return record is not None and record.get("instance") != "killed"

    await eventually(taken_over, TTL_S * 2, "the record to be this run's")
    assert not daemon.events("node_id_conflict")


async def _model_state(client: Redis, node_id: str, state: str) -> bool:
    record = await node_record(client, node_id)
    return record is not None and record["models"]["demo"]["state"] == state


async def _gone(client: Redis, node_id: str) -> bool:
    return await node_record(client, node_id) is None


async def _present(client: Redis, node_id: str) -> bool:
    return await node_record(client, node_id) is not None


async def _on_one_shared_gpu(
    make_daemon: MakeDaemon, redis_server: RedisServer, queue_timeout_s: float
) -> tuple[Daemon, str]:
    """node-a serving demo (512 MiB) from one 1 GiB GPU shared in Redis, on a host of a new name: the
    daemon and that name (its GPU's key is <host>:0)."""
    host = f"box-{uuid.uuid4().hex[:6]}"
    daemon = await make_daemon(
        models={"demo": {"vram_mib": 512}},
        config=fleet_config(
            redis_server,
            "node-a",
            gpus=[{"index": 0, "total_mib": 1024, "shared": True}],
            gpu_host=host,
            queue_timeout_s=queue_timeout_s,
        ),
    )
    return daemon, host


async def test_an_external_lease_shrinks_what_the_daemon_may_place(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    daemon, host = await _on_one_shared_gpu(make_daemon, redis_server, queue_timeout_s=3)
    redis = ("--redis-url", redis_server.url, "--gpu-host", host)
    code, lease_id, err = await run_cli(
        "lease", "take", "--gpu", "0", "--mib", "700", "--owner", "trainer", *redis
    )
    assert code == 0, err
    lease_id = lease_id.strip()

    refused = await daemon.post("/v1/chat/completions", _chat())
    assert refused[0] == 503
    assert refused[1]["error"]["code"] == "queue_timeout"

    code, out, err = await run_cli("lease", "release", "--id", lease_id, "--redis-url", redis_server.url)
    assert code == 0, err
    await daemon.chat()  # 1024 - 512: fits now

    code, out, err = await run_cli("lease", "list", "--json", *redis)
    assert code == 0, err
    [gpu] = json.loads(out)["gpus"]
    assert gpu["capacity_mib"] == 1024
    assert [(x["owner"].split("/")[0], x["mib"], x["kind"]) for x in gpu["leases"]] == [
        ("node-a", 512, "supervisor")
    ]
    code, out, err = await run_cli(
        "lease", "take", "--gpu", "0", "--mib", "700", "--owner", "trainer", "--timeout", "1", *redis
    )
    assert code == 1
    assert "did not fit" in err

    status, _, _ = await daemon.post("/v1/admin/models/demo/unload", {})
    assert status == 200
    code, lease_id, err = await run_cli(
        "lease", "take", "--gpu", "0", "--mib", "700", "--owner", "trainer", "--timeout", "10", *redis
    )
    assert code == 0, err  # the daemon gave its shared lease back with the child


async def test_bad_data_in_redis_is_logged_as_such_not_as_redis_out_of_reach(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    """Another tool wrote a string where a shared GPU's leases hash belongs: Redis answers the take
    with WRONGTYPE. The node said "Redis cannot be reached", sending ops after a network fault."""
    daemon, host = await _on_one_shared_gpu(make_daemon, redis_server, queue_timeout_s=1)
    await redis_client.set(f"llmsup:leases:{gpu_key(host, 0)}", "not a hash")
    status, answer, _ = await daemon.post("/v1/chat/completions", _chat())
    assert status == 503, answer
    [error] = daemon.events("fleet_redis_error")
    assert "WRONGTYPE" in error["error"]
    [unavailable] = daemon.events("shared_gpus_unavailable")
    assert unavailable["reason"].startswith("Redis answered with an error: ")
    assert not daemon.events("fleet_degraded")


async def test_an_urgent_external_lease_evicts_an_idle_model_of_lower_priority(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    host = f"box-{uuid.uuid4().hex[:6]}"
    daemon = await make_daemon(
        models={"demo": {"vram_mib": 512, "priority": 0}},
        config=fleet_config(
            redis_server,
            "node-a",
            gpus=[{"index": 0, "total_mib": 1024, "shared": True}],
            gpu_host=host,
            external_priority=5,
        ),
    )
    await daemon.chat()
    code, _, err = await run_cli(
        "lease",
        "take",
        "--gpu",
        "0",
        "--mib",
        "700",
        "--owner",
        "trainer",
        "--priority",
        "9",
        "--timeout",
        "20",
        "--redis-url",
        redis_server.url,
        "--gpu-host",
        host,
    )
    assert code == 0, err
    assert await daemon.state("demo") == "unloaded"
    [eviction] = daemon.events("evicting", reason="external")
    assert eviction["for_owner"] == "trainer"


async def test_two_daemons_sharing_a_gpu_take_turns_in_its_budget(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    host = f"box-{uuid.uuid4().hex[:6]}"
    shared = {
        "gpus": [{"index": 0, "total_mib": 1024, "shared": True}],
        "gpu_host": host,
        "queue_timeout_s": 3,
    }
    a = await make_daemon(
        models={"demo": {"vram_mib": 700}}, config=fleet_config(redis_server, "a", **shared)
    )
    b = await make_daemon(
        models={"demo": {"vram_mib": 700}}, config=fleet_config(redis_server, "b", **shared)
    )
    # With b in a's view, a still loads it itself: both have the weights and the room (a's own record
    # once lacked its weights on disk, and b won the tie).
    await eventually(lambda: _nodes_seen(a, {"a", "b"}), TTL_S * 2, "both nodes in a's fleet view")
    await a.chat()
    # Served where it lands (the hop header a forwarding node adds): b cannot place it, a's 700 MiB
    # leave 324 of the shared 1024.
    async with (
        aiohttp.ClientSession() as http,
        http.post(b.url + "/v1/chat/completions", json=_chat(), headers={"X-LLM-Supervisor-Hop": "t"}) as r,
    ):
        assert (r.status, (await r.json())["error"]["code"]) == (503, "queue_timeout")
    await eventually(lambda: _ready_on(b, "a"), TTL_S * 2, "b's fleet view to show demo ready on a")
    status, _, _ = await b.post("/v1/chat/completions", _chat())
    assert status == 200  # without it, b sends it to a, where demo is ready
    status, _, _ = await a.post("/v1/admin/models/demo/unload", {})
    assert status == 200
    await b.chat()
    await eventually(lambda: _nodes_seen(b, {"a", "b"}), TTL_S * 2, "both nodes in b's fleet view")


async def test_a_node_paused_past_its_ttl_gives_up_the_room_another_took(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    """a holds 700 of a shared 1024 MiB GPU and is paused (SIGSTOP) past its TTL; its lease expires and b
    leases 700 there. When a resumes, its renewal put the lease back (1,400 MiB leased of 1,024) and a
    went on serving from memory b holds. Now a learns its lease is lost and unloads its model."""
    host = f"box-{uuid.uuid4().hex[:6]}"
    shared = {"gpus": [{"index": 0, "total_mib": 1024, "shared": True}], "gpu_host": host}
    a = await make_daemon(
        models={"demo": {"vram_mib": 700}}, config=fleet_config(redis_server, "a", **shared)
    )
    b = await make_daemon(
        models={"demo": {"vram_mib": 700}}, config=fleet_config(redis_server, "b", **shared)
    )
    assert (await a.post("/v1/admin/models/demo/load", {}))[0] == 200
    leases = SharedLeases(redis_client)
    key = gpu_key(host, 0)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        await eventually(lambda: _nodes_seen(b, {"b"}), TTL_S * 3, "a to drop out of b's view")
        assert (await b.post("/v1/admin/models/demo/load", {}))[0] == 200
    finally:
        a.proc.send_signal(signal.SIGCONT)
    await a.wait_state("demo", "unloaded", timeout_s=TTL_S * 4)
    assert a.events("shared_lease_lost")
    budget = await leases.budget(key)
    assert [(x.owner.split("/")[0], x.mib) for x in budget.leases] == [("b", 700)]


async def test_with_nvml_another_holders_memory_on_a_shared_gpu_is_counted_once(
    make_daemon: MakeDaemon, redis_server: RedisServer
) -> None:
    """A trainer leases 900 MiB of a shared 2,048 MiB GPU (NVML, faked: the stand-in for a real driver)
    and uses them. The daemon subtracted them twice, as NVML's memory used by none of its children and
    as another holder's lease, and refused a 900 MiB model with 1,148 MiB free."""
    from supervisor.fleet.leases_client import take_lease
    from tests.integration.test_nvml_fake import FakeDriver, child_memory

    host = f"box-{uuid.uuid4().hex[:6]}"
    daemon = await make_daemon(
        models={"demo": {"vram_mib": 900}},
        config=fleet_config(redis_server, "a", gpus=None, shared_gpus=[0], gpu_host=host, queue_timeout_s=5),
        start=False,
    )
    driver = FakeDriver(daemon.root / "nvml.json")
    driver.set(
        devices=[{"index": 0, "name": "Fake GPU", "total_mib": 2048, "used_mib": 0}],
        processes=[child_memory("demo", 900)],
    )
    await daemon.start(env=driver.env())
    await take_lease(redis_server.url, f"{host}:0", 900, "trainer", ttl_s=60)
    driver.set(
        devices=[{"index": 0, "name": "Fake GPU", "total_mib": 2048, "used_mib": 900}]
    )  # the trainer's
    status, answer, _ = await daemon.post("/v1/chat/completions", _chat())
    assert status == 200, answer


async def _ready_on(daemon: Daemon, node_id: str) -> bool:
    _, answer = await daemon.get("/v1/admin/nodes")
    nodes = {n["node_id"]: n for n in answer["nodes"]}
    return bool(nodes.get(node_id, {}).get("models", {}).get("demo", {}).get("state") == "ready")


async def _nodes_seen(daemon: Daemon, expected: set[str]) -> bool:
    status, answer = await daemon.get("/v1/admin/nodes")
    return status == 200 and {n["node_id"] for n in answer["nodes"]} == expected


def _chat() -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_redis_killed_mid_traffic_fails_no_request_and_the_node_rejoins(
    make_daemon: MakeDaemon, redis_server: RedisServer, redis_client: Redis
) -> None:
    daemon = await make_daemon(config=fleet_config(redis_server, "node-a"))
    await daemon.chat()
    failures: list[str] = []
    done = asyncio.Event()

    async def traffic() -> int:
        served = 0
        while not done.is_set():
            status, body, _ = await daemon.post("/v1/chat/completions", _chat())
            if status != 200:
                failures.append(f"{status} {body}")
            served += 1
        return served

    load = asyncio.ensure_future(traffic())
    await asyncio.sleep(0.5)
    redis_server.kill()
    await eventually(lambda: bool(daemon.events("fleet_degraded")), 10, "fleet_degraded in the log")
    status, answer = await daemon.get("/v1/admin/nodes")
    assert status == 200
    assert answer["degraded"] is True
    assert await _gauge(daemon) == "1.0"
    assert [n["node_id"] for n in answer["nodes"]] == ["node-a"]
    await asyncio.sleep(1.5)  # traffic goes on without Redis
    redis_server.start()  # the same port, empty
    await eventually(
        lambda: _present(redis_client, "node-a"), TTL_S * 3, "the node's record after Redis is back"
    )
    done.set()
    served = await load
    assert failures == []
    assert served > 0
    assert len(daemon.events("fleet_degraded")) == 1
    assert len(daemon.events("fleet_rejoined")) == 1
    assert await _gauge(daemon) == "0.0"


async def _gauge(daemon: Daemon) -> str:
    assert daemon.http is not None
    async with daemon.http.get(f"{daemon.url}/metrics") as response:
        text = await response.text()
    [line] = [x for x in text.splitlines() if x.startswith("llm_supervisor_fleet_degraded ")]
    return line.split()[1]
