"""Runtime load overrides through POST /v1/admin/models/{name}/load: the child's argv, the lease, a
conflict, a restart with new ones, and their end when the model unloads."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

import psutil

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon, eventually

# The demo GGUF's KV cache grows with the context, so the estimate from its weights follows ctx_size.
ESTIMATED: dict[str, Any] = {"demo": {"vram_mib": None, "parallel": 1}}


async def _load(daemon: Daemon, body: dict[str, Any]) -> tuple[int, Any]:
    status, document, _ = await daemon.post("/v1/admin/models/demo/load", body)
    return status, document


def _argv(document: dict[str, Any]) -> list[str]:
    return psutil.Process(document["replicas"][0]["pid"]).cmdline()


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


async def test_overrides_change_the_argv_and_the_lease_and_end_at_unload(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=ESTIMATED)
    status, plain = await _load(daemon, {})
    assert status == 200, plain
    plain_mib = plain["replicas"][0]["vram_mib"]
    assert _flag(_argv(plain), "--ctx-size") == "2048"
    assert (await daemon.post("/v1/admin/models/demo/unload", {}))[0] == 200

    overrides = {"ctx_size": 8192, "parallel": 2, "cache_type_k": "bf16", "flash_attn": "on"}
    status, document = await _load(daemon, {"overrides": overrides})
    assert status == 200, document
    assert document["load_override"] == overrides
    argv = _argv(document)
    assert _flag(argv, "--ctx-size") == "8192"
    assert _flag(argv, "--parallel") == "2"
    assert _flag(argv, "--cache-type-k") == "bf16"
    assert argv.count("--ctx-size") == 1
    assert document["replicas"][0]["vram_mib"] > plain_mib  # a bigger KV cache leases more
    assert document["vram_estimate"]["mib"] == document["replicas"][0]["vram_mib"]
    # Two requests at once now: parallel 2 made two places.
    answers = await asyncio.gather(daemon.chat(max_tokens=4), daemon.chat(max_tokens=4))
    assert len(answers) == 2
    # Ollama's num_ctx and context_length follow the child as launched: 8192 / 2 per request, where
    # the manifest's 2048 / 1 would allow 2048.
    ps = (await daemon.get("/api/ps"))[1]["models"]
    assert [m["context_length"] for m in ps] == [4096]
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    options = {"num_ctx": 4000, "num_predict": 2}
    status, answer, _ = await daemon.post("/api/chat", {**chat, "options": options})
    assert status == 200, answer
    status, refused, _ = await daemon.post("/api/chat", {**chat, "options": {"num_ctx": 5000}})
    assert status == 400
    assert "at most 4096 tokens" in refused["error"]

    # The same overrides again: 200 at once, the same child.
    status, again = await _load(daemon, {"overrides": overrides})
    assert (status, again["replicas"][0]["pid"]) == (200, document["replicas"][0]["pid"])

    status, unloaded, _ = await daemon.post("/v1/admin/models/demo/unload", {})
    assert status == 200
    assert unloaded["load_override"] is None  # gone with the load
    status, plain_again = await _load(daemon, {})
    assert _flag(_argv(plain_again), "--ctx-size") == "2048"


async def test_other_overrides_conflict_unless_restart(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=ESTIMATED)
    status, first = await _load(daemon, {"overrides": {"ctx_size": 4096}})
    assert status == 200, first
    status, conflict = await _load(daemon, {"overrides": {"ctx_size": 1024}})
    assert status == 409
    assert conflict["error"]["code"] == "load_conflict"
    assert "restart" in conflict["error"]["message"]
    assert (await daemon.get("/v1/admin/models/demo"))[1]["replicas"][0]["pid"] == first["replicas"][0]["pid"]

    # A request in flight finishes while the model restarts with the new overrides.
    stream = await daemon.start_stream(max_tokens=40)
    restart = asyncio.create_task(_load(daemon, {"overrides": {"ctx_size": 1024}, "restart": True}))
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    status, restarted = await restart
    assert status == 200, restarted
    assert restarted["load_override"] == {"ctx_size": 1024}
    assert restarted["replicas"][0]["pid"] != first["replicas"][0]["pid"]
    assert _flag(_argv(restarted), "--ctx-size") == "1024"

    # A load without `overrides` joins whatever runs.
    status, joined = await _load(daemon, {})
    assert (status, joined["load_override"]) == (200, {"ctx_size": 1024})


async def test_a_quantized_cache_the_model_cannot_take_is_refused_before_anything_starts(
    daemon: Daemon,
) -> None:
    status, answer = await _load(daemon, {"overrides": {"cache_type_v": "q8_0", "flash_attn": "on"}})
    assert status == 400
    assert answer["error"]["code"] == "invalid_load_request"
    assert "overrides.cache_type_v" in answer["error"]["message"]
    assert (await daemon.get("/v1/admin/models/demo"))[1]["state"] == "unloaded"


async def test_the_estimate_previews_overrides_and_concurrent_loads_with_the_same_ones_share_a_child(
    make_daemon: MakeDaemon,
) -> None:
    daemon = await make_daemon(models=ESTIMATED)
    status, plain = await daemon.get("/v1/admin/models/demo")
    assert status == 200
    query = urllib.parse.quote(json.dumps({"ctx_size": 16384}))
    status, bigger = await daemon.get(f"/v1/admin/models/demo?overrides={query}")
    assert status == 200, bigger
    assert bigger["vram_estimate"]["mib"] > plain["vram_estimate"]["mib"]
    assert bigger["state"] == "unloaded"  # a preview loads nothing
    status, refused = await daemon.get("/v1/admin/models/demo?overrides=" + urllib.parse.quote('{"ctx": 1}'))
    assert status == 400
    assert "overrides.ctx" in refused["error"]["message"]

    answers = await asyncio.gather(*(_load(daemon, {"overrides": {"ctx_size": 16384}}) for _ in range(3)))
    assert [status for status, _ in answers] == [200, 200, 200]
    assert len({document["replicas"][0]["pid"] for _, document in answers}) == 1
    assert answers[0][1]["vram_estimate"]["mib"] == bigger["vram_estimate"]["mib"]


async def test_a_load_whose_overrides_cannot_fit_leaves_none_behind(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=ESTIMATED)
    status, refused = await _load(daemon, {"overrides": {"ctx_size": 8388608}})
    assert status == 503, refused
    assert refused["error"]["code"] == "insufficient_vram"
    assert (await daemon.get("/v1/admin/models/demo"))[1]["load_override"] is None
    # An ordinary request loads the model as its manifest says, not with the refused context.
    assert await daemon.chat(max_tokens=4)
    status, document = await daemon.get("/v1/admin/models/demo")
    assert _flag(_argv(document), "--ctx-size") == "2048"


async def test_concurrent_loads_with_other_overrides_conflict(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models=ESTIMATED)
    first, second = await asyncio.gather(
        _load(daemon, {"overrides": {"ctx_size": 4096}}), _load(daemon, {"overrides": {"ctx_size": 1024}})
    )
    assert sorted([first[0], second[0]]) == [200, 409], (first, second)
    winner = first[1] if first[0] == 200 else second[1]
    _, document = await daemon.get("/v1/admin/models/demo")
    assert document["load_override"] == winner["load_override"]
    assert _flag(_argv(document), "--ctx-size") == str(winner["load_override"]["ctx_size"])


async def test_a_ctx_size_override_wins_over_the_underscore_spelling_in_args(make_daemon: MakeDaemon) -> None:
    """llama-server reads `--ctx_size` as `--ctx-size`, and the last one given wins. The override took
    only the dashed spellings out of `args`: the child ran with the manifest's 768 while the document
    said 4096 was in effect, and the lease was sized for 4096."""
    daemon = await make_daemon(models={"demo": {"parallel": 1, "args": ["--ctx_size", "768"]}})
    status, body, _ = await daemon.post("/v1/admin/models/demo/load", {"overrides": {"ctx_size": 4096}})
    assert status == 200, body
    assert body["load_override"] == {"ctx_size": 4096}

    async def slot_contexts() -> list[str]:
        status, log = await daemon.get("/v1/admin/models/demo/logs")
        assert status == 200, log
        return [line for line in log["lines"] if "n_ctx_slot" in line]

    async def logged() -> bool:
        return bool(await slot_contexts())

    await eventually(logged, what="the child's slot context in its log")
    assert "n_ctx_slot = 4096" in (await slot_contexts())[-1]
