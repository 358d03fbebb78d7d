"""Shared GPU leases in a real Redis: atomic takes, expiry of a dead holder's lease, release, wants."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import structlog
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from supervisor.fleet.leases_client import LeaseError, held_lease, list_leases, take_lease
from supervisor.fleet.redis_link import FleetDataError, RedisLink
from supervisor.fleet.shared_leases import LeaseLost, SharedLeases, gpu_key
from tests.fleet.conftest import RedisServer
from tests.integration.harness import REPO, eventually, run_cli

GPU = gpu_key("box", 0)


async def test_a_take_that_would_exceed_capacity_is_refused(redis_client: Redis) -> None:
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=100, by="node-a")
    first = await leases.take(GPU, 600, "trainer", ttl_s=30)
    assert first.outcome == "ok"
    assert first.free_mib == 300
    second = await leases.take(GPU, 400, "images", ttl_s=30)
    assert second.outcome == "refused"
    assert second.free_mib == 300
    assert (await leases.take(GPU, 300, "images", ttl_s=30)).outcome == "ok"
    budget = await leases.budget(GPU)
    assert budget.capacity_mib == 900
    assert budget.leased_mib == 900
    assert sorted(lease.owner for lease in budget.leases) == ["images", "trainer"]


async def test_an_unregistered_gpu_needs_an_explicit_capacity(redis_client: Redis) -> None:
    leases = SharedLeases(redis_client)
    assert (await leases.take(GPU, 10, "x", ttl_s=30)).outcome == "unregistered"
    assert (await leases.take(GPU, 10, "x", ttl_s=30, capacity_mib=100)).outcome == "ok"


async def test_concurrent_takes_never_exceed_capacity(redis_server: RedisServer, redis_client: Redis) -> None:
    """Many clients (own connections) race for one GPU; whatever wins, the sum stays within capacity."""
    await SharedLeases(redis_client).register(GPU, total_mib=1000, margin_mib=0, by="test")
    clients = [Redis.from_url(redis_server.url, decode_responses=True) for _ in range(6)]
    try:
        for _round in range(20):
            results = await asyncio.gather(
                *(SharedLeases(c).take(GPU, 300, f"holder{i}", ttl_s=30) for i, c in enumerate(clients))
            )
            assert sum(1 for r in results if r.outcome == "ok") == 3
            budget = await SharedLeases(redis_client).budget(GPU)
            assert budget.leased_mib == 900
            for r in results:
                if r.lease is not None:
                    await SharedLeases(redis_client).release(lease_id=r.lease.id)
    finally:
        for c in clients:
            await c.aclose()


async def test_a_dead_holders_lease_expires_after_its_ttl(redis_client: Redis) -> None:
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=0, by="test")
    assert (await leases.take(GPU, 1000, "crashed-trainer", ttl_s=1)).outcome == "ok"
    assert (await leases.take(GPU, 500, "next", ttl_s=30)).outcome == "refused"
    await asyncio.sleep(1.2)  # the holder never renews
    assert (await leases.take(GPU, 500, "next", ttl_s=30)).outcome == "ok"
    assert [lease.owner for lease in (await leases.budget(GPU)).leases] == ["next"]


async def test_renewal_keeps_a_lease_and_restores_one_redis_lost(redis_client: Redis) -> None:
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=0, by="test")
    taken = (await leases.take(GPU, 400, "svc", ttl_s=1)).lease
    assert taken is not None
    for _ in range(3):
        await asyncio.sleep(0.5)
        assert await leases.renew(taken.id, ttl_s=1) is not None
    await redis_client.flushdb()  # Redis restarted empty
    assert await leases.renew(taken.id, ttl_s=1) is None
    restored = await leases.renew(taken.id, ttl_s=30, restore=taken)
    assert restored is not None
    assert (await leases.budget(GPU)).leased_mib == 400


async def test_a_lease_renewed_too_late_whose_room_went_to_another_is_lost_not_restored(
    redis_client: Redis,
) -> None:
    """Its holder was paused past its TTL, and another took the room meanwhile: putting the lease back
    (as after a Redis restart) would lease the GPU over its capacity, so the renewal says it is lost.
    With the room still free it is restored, as before."""
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=0, by="test")
    paused = (await leases.take(GPU, 700, "node-a/demo#0", ttl_s=1)).lease
    assert paused is not None
    await asyncio.sleep(1.2)
    assert (await leases.take(GPU, 700, "node-b/demo#0", ttl_s=30)).outcome == "ok"
    with pytest.raises(LeaseLost):
        await leases.renew(paused.id, ttl_s=30, restore=paused)
    assert [lease.owner for lease in (await leases.budget(GPU)).leases] == ["node-b/demo#0"]

    late = (await leases.take(GPU, 300, "node-c/small#0", ttl_s=1)).lease
    assert late is not None
    await asyncio.sleep(1.2)  # expired, but its room is still free
    assert await leases.renew(late.id, ttl_s=30, restore=late) is not None
    assert (await leases.budget(GPU)).leased_mib == 1000


async def test_release_by_owner_or_id(redis_client: Redis) -> None:
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=0, by="test")
    a = (await leases.take(GPU, 100, "a", ttl_s=30)).lease
    await leases.take(GPU, 100, "b", ttl_s=30)
    await leases.take(GPU, 100, "b", ttl_s=30)
    assert a is not None
    assert [x.owner for x in await leases.release(owner="b")] == ["b", "b"]
    assert [x.id for x in await leases.release(lease_id=a.id)] == [a.id]
    assert (await leases.budget(GPU)).leases == []
    assert await leases.release(lease_id=a.id) == []


async def test_a_refused_take_is_recorded_as_a_want_until_it_fits_or_expires(redis_client: Redis) -> None:
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=0, by="test")
    held = (await leases.take(GPU, 800, "model", ttl_s=30)).lease
    assert held is not None
    refused = await leases.take(GPU, 500, "trainer", ttl_s=30, priority=9, want_id="want-1", want_ttl_s=1)
    assert refused.outcome == "refused"
    [want] = (await leases.budget(GPU)).wants
    assert (want.owner, want.mib, want.priority) == ("trainer", 500, 9)
    await leases.release(lease_id=held.id)
    taken = await leases.take(GPU, 500, "trainer", ttl_s=30, priority=9, want_id="want-1")
    assert taken.outcome == "ok"
    assert (await leases.budget(GPU)).wants == []
    await leases.take(GPU, 900, "late", ttl_s=30, want_id="want-2", want_ttl_s=0.5)
    await asyncio.sleep(0.7)
    assert (await leases.budget(GPU)).wants == []


def test_a_negative_lease_is_refused_before_redis() -> None:
    with pytest.raises(ValueError, match="negative"):
        asyncio.run(SharedLeases(Redis()).take(GPU, -1, "x", ttl_s=1))


async def test_an_unreadable_entry_is_dropped_not_fatal_to_every_script(redis_client: Redis) -> None:
    """One value that is not a lease (`HSET llmsup:leases:<gpu> junk "not json"`) made cjson.decode raise
    in every script on that GPU: no take, renew, release or read worked, and the daemon took the error
    for Redis being down, every second. It is now dropped as an expired lease is, and a read says so."""
    leases = SharedLeases(redis_client)
    await leases.register(GPU, total_mib=1000, margin_mib=0, by="test")
    held = await leases.take(GPU, 300, "trainer", ttl_s=30)
    assert held.lease is not None
    lease_hash, wants_hash = f"llmsup:leases:{GPU}", f"llmsup:wants:{GPU}"
    assert await redis_client.hexists(lease_hash, held.lease.id)  # the layout this test writes into
    await redis_client.hset(
        lease_hash, mapping={"junk": "not json", "list": "[1, 2]", "nomib": '{"id": "x"}'}
    )
    await redis_client.hset(wants_hash, "junk", "{")
    with structlog.testing.capture_logs() as logs:
        budget = await leases.budget(GPU)
    assert [lease.owner for lease in budget.leases] == ["trainer"]
    assert budget.wants == []
    dropped = {e["kind"]: e["fields"] for e in logs if e["event"] == "shared_entry_dropped"}
    assert dropped == {"lease": ["junk", "list", "nomib"], "want": ["junk"]}
    await redis_client.hset(lease_hash, "junk", "not json")  # and each other script gets past one
    assert (await leases.take(GPU, 700, "images", ttl_s=30)).outcome == "ok"
    await redis_client.hset(lease_hash, "junk", "not json")
    assert await leases.renew(held.lease.id, ttl_s=30) is not None
    await redis_client.hset(lease_hash, "junk", "not json")
    assert [lease.owner for lease in await leases.release(GPU, owner="images")] == ["images"]
    assert await redis_client.hkeys(lease_hash) == [held.lease.id]


async def test_an_error_redis_answers_is_bad_data_not_an_outage(
    redis_server: RedisServer, redis_client: Redis
) -> None:
    """A ResponseError (here WRONGTYPE) marked the link down like a lost connection: `fleet_degraded`,
    the node out of routing, and again at each poll. The link now stays up and says it once."""
    link = RedisLink(redis_server.url, CollectorRegistry())
    await redis_client.set("llmsup:not-a-hash", "x")
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                with pytest.raises(FleetDataError, match="WRONGTYPE"):
                    await link.call(link.client.hget("llmsup:not-a-hash", "f"))
        assert link.healthy
        assert [e["event"] for e in logs] == ["fleet_redis_error"]
        assert await link.call(link.client.get("llmsup:not-a-hash")) == "x"
    finally:
        await link.close()


async def test_a_held_lease_that_is_lost_ends_its_block_with_lease_lost(redis_server: RedisServer) -> None:
    """Redis restarts empty while a trainer holds 800 of 1000 MiB, and another takes the room it seems to
    have: the trainer's renewal cannot put its lease back. Its block ran on, told nothing, while the GPU
    was leased 1,600 MiB of 1,000."""
    url = redis_server.url
    register = Redis.from_url(url, decode_responses=True)
    await SharedLeases(register).register(GPU, total_mib=1000, margin_mib=0, by="test")
    await register.aclose()
    ran_on = False

    async def train() -> None:
        nonlocal ran_on
        async with held_lease(url, GPU, 800, "trainer", ttl_s=1.5):
            redis_server.kill()
            redis_server.start()  # empty: no persistence
            again = Redis.from_url(url, decode_responses=True)
            await SharedLeases(again).register(GPU, total_mib=1000, margin_mib=0, by="test")
            await again.aclose()
            await take_lease(url, GPU, 800, "other", ttl_s=60, timeout_s=5)
            await asyncio.sleep(10)  # the trainer's work; its renewal (every 0.5 s) ends it
            ran_on = True

    with pytest.raises(LeaseLost, match="was lost: others hold its room"):
        await train()
    assert not ran_on
    (budget,) = await list_leases(url, GPU)
    assert [(lease.owner, lease.mib) for lease in budget.leases] == [("other", 800)]


async def test_a_held_lease_outlives_redis_away_for_a_moment(redis_server: RedisServer) -> None:
    """A renewal that meets Redis down is tried again; with the room still free the lease comes back."""
    url = redis_server.url
    register = Redis.from_url(url, decode_responses=True)
    await SharedLeases(register).register(GPU, total_mib=1000, margin_mib=0, by="test")
    await register.aclose()
    async with held_lease(url, GPU, 800, "trainer", ttl_s=1.5) as lease:
        redis_server.kill()
        await asyncio.sleep(1)  # a renewal or two fail
        redis_server.start()
        register = Redis.from_url(url, decode_responses=True)
        await SharedLeases(register).register(GPU, total_mib=1000, margin_mib=0, by="test")
        await register.aclose()
        await asyncio.sleep(1.5)
        (budget,) = await list_leases(url, GPU)
        assert [held.id for held in budget.leases] == [lease.id]


async def test_lease_take_hold_exits_1_when_its_lease_is_lost(redis_server: RedisServer) -> None:
    url = redis_server.url
    register = Redis.from_url(url, decode_responses=True)
    await SharedLeases(register).register(GPU, total_mib=1000, margin_mib=0, by="test")
    await register.aclose()
    holding = asyncio.create_task(
        run_cli(
            "lease",
            "take",
            "--gpu",
            GPU,
            "--mib",
            "800",
            "--owner",
            "trainer",
            "--ttl",
            "1.5",
            "--hold",
            "--redis-url",
            url,
        )
    )

    async def held() -> bool:
        return bool((await list_leases(url, GPU))[0].leases)

    await eventually(held, 30, "the CLI to hold its lease")
    redis_server.kill()
    redis_server.start()
    register = Redis.from_url(url, decode_responses=True)
    await SharedLeases(register).register(GPU, total_mib=1000, margin_mib=0, by="test")
    await register.aclose()
    await take_lease(url, GPU, 800, "other", ttl_s=60, timeout_s=5)
    code, _, err = await asyncio.wait_for(holding, 30)  # it held on for good, told nothing
    assert code == 1
    assert "was lost: others hold its room" in err
    assert "Traceback" not in err


async def _register(url: str, total: int = 1000) -> None:
    client = Redis.from_url(url, decode_responses=True)
    await SharedLeases(client).register(GPU, total_mib=total, margin_mib=0, by="test")
    await client.aclose()


async def test_lease_take_hold_waiting_for_room_stops_on_sigterm_and_withdraws_its_want(
    redis_server: RedisServer,
) -> None:
    """Its SIGTERM/SIGINT handlers only set an event looked at once the lease was held: while the GPU
    stayed full the CLI ignored both (for ever without --timeout), still recording its want, which makes
    supervisors evict for it."""
    url = redis_server.url
    await _register(url)
    await take_lease(url, GPU, 1000, "other", ttl_s=120, timeout_s=5)  # the GPU is full
    env = {k: v for k, v in os.environ.items() if k != "LLM_SUPERVISOR_REDIS_URL"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "lease", "take", "--gpu", GPU, "--mib", "500",
        "--owner", "trainer", "--priority", "50", "--hold", "--redis-url", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO, env=env,
    )  # fmt: skip

    async def waiting() -> bool:
        return bool((await list_leases(url, GPU))[0].wants)

    try:
        await eventually(waiting, 30, "the CLI to wait (its want recorded)")
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 1
        assert b"nothing was leased" in err
        assert b"Traceback" not in err
        assert not await waiting()  # withdrawn at once, not left to expire
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize(
    "args",
    [
        ["--gpu", "0", "--mib", "-5"],
        ["--gpu", "gpu0", "--mib", "5"],
        ["--gpu", "-1", "--mib", "5"],  # these two made leases on GPUs that cannot exist
        ["--gpu", "gpu-box:x", "--mib", "5"],
        ["--gpu", "0", "--mib", "5", "--ttl", "nan"],
        ["--gpu", "0", "--mib", "5", "--ttl", "inf"],
        ["--gpu", "0", "--mib", "5", "--redis-url", "http://127.0.0.1:6379"],
        ["--gpu", "0", "--mib", "5", "--redis-url", "redis://:pw@127.0.0.1:notaport"],
    ],
    ids=[
        "negative-mib",
        "gpu-not-an-index",
        "negative-gpu",
        "gpu-key-without-an-index",
        "ttl-nan",
        "ttl-inf",
        "not-a-redis-url",
        "bad-port",
    ],
)
async def test_lease_take_usage_errors_exit_2_with_an_error_line(
    redis_server: RedisServer, args: list[str]
) -> None:
    """They ended in a Python traceback and exit 1, the code for "refused"."""
    await _register(redis_server.url)
    code, _, err = await run_cli(
        "lease", "take", "--owner", "o", "--gpu-host", "box", "--timeout", "1",
        "--redis-url", redis_server.url, *args,
    )  # fmt: skip
    assert "Traceback" not in err, err[-600:]
    assert code == 2, (code, err[-300:])
    assert "error:" in err.splitlines()[-1], err


async def test_a_take_larger_than_the_gpus_capacity_fails_at_once(redis_server: RedisServer) -> None:
    """It waited for ever (re-recording its want every poll), where a load of the scheduler's own gets
    insufficient_vram at once."""
    await _register(redis_server.url, total=1000)
    with pytest.raises(LeaseError, match=r"can never fit .* its capacity is 1000 MiB"):
        await asyncio.wait_for(take_lease(redis_server.url, GPU, 5000, "trainer", ttl_s=60), 5)
    assert not (await list_leases(redis_server.url, GPU))[0].wants


async def test_a_take_called_off_as_redis_grants_it_leaves_no_lease(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal to `lease take --hold` (or a caller's own timeout) during the round trip in which Redis
    grants the lease: the caller never learns the lease's id, which stayed held until its TTL."""
    await _register(redis_server.url)
    real = SharedLeases.take

    async def granted_then_called_off(self: SharedLeases, *args: object, **kwargs: object) -> object:
        await real(self, *args, **kwargs)  # type: ignore[arg-type]
        raise asyncio.CancelledError  # as the answer comes back

    monkeypatch.setattr(SharedLeases, "take", granted_then_called_off)
    with pytest.raises(asyncio.CancelledError):
        await take_lease(redis_server.url, GPU, 500, "trainer", ttl_s=60)
    monkeypatch.undo()
    (budget,) = await list_leases(redis_server.url, GPU)
    assert (budget.leases, budget.wants) == ([], [])


async def test_lease_reads_the_gpu_host_the_daemon_reads(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon with LLM_SUPERVISOR_GPU_HOST=box registers `box:0`; `lease take --gpu 0` in the same
    environment named this machine's host name instead, and waited on a GPU nobody registered."""
    await _register(redis_server.url)
    monkeypatch.setenv("LLM_SUPERVISOR_GPU_HOST", GPU.split(":")[0])
    code, out, err = await run_cli(
        "lease", "take", "--gpu", "0", "--mib", "5", "--owner", "o", "--timeout", "5",
        "--redis-url", redis_server.url,
    )  # fmt: skip
    assert code == 0, err[-300:]
    assert [lease.id for lease in (await list_leases(redis_server.url, GPU))[0].leases] == [out.strip()]
