"""Cutting a chat too long for the context as Ollama cuts it (supervisor/ollama_context.py)."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor import ollama_context as fit

OVERFLOW = {
    "error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 8394, "n_ctx": 512}
}


def test_the_context_size_is_read_from_llama_servers_refusal_only() -> None:
    assert fit.context_size(OVERFLOW) == 512
    assert fit.context_size({"error": {"type": "invalid_request_error", "n_ctx": 512}}) is None
    assert fit.context_size({"error": "the context is full"}) is None
    assert fit.context_size(None) is None
    assert fit.context_size({"error": {"type": "exceed_context_size_error", "n_ctx": "512"}}) is None


@pytest.mark.parametrize(
    ("body", "budget"),
    [({}, 384), ({"max_tokens": 100}, 412), ({"max_tokens": 10_000}, 256), ({"max_tokens": -1}, 384)],
)
def test_the_cut_leaves_room_for_the_answer(body: dict[str, Any], budget: int) -> None:
    """The request's max_tokens, else a quarter of the context; never more than half."""
    assert fit.prompt_budget(body, 512) == budget


def _chat(*roles: str) -> fit.Messages:
    return [{"role": role, "content": f"{index:>10}"} for index, role in enumerate(roles)]


def test_a_kept_run_keeps_the_system_prompts_and_never_starts_at_a_tool_answer() -> None:
    messages = _chat("system", "user", "assistant", "tool", "user", "system", "assistant", "user")
    assert fit.starts(messages) == [1, 2, 4, 6, 7]
    assert [m["role"] for m in fit.kept(messages, 6)] == ["system", "system", "assistant", "user"]


async def test_the_longest_run_that_fits_is_kept() -> None:
    """Each message's tokens are its characters here; llama-server's template and tokenizer count them in
    the daemon. About log2(n) counts for n messages."""
    messages = _chat("system", *["user", "assistant"] * 20, "user")  # 42 messages of 10 characters
    counted: list[int] = []

    async def tokens_of(run: fit.Messages) -> int:
        counted.append(len(run))
        return sum(len(m["content"]) for m in run)

    run = await fit.cut_to_fit(messages, 105, tokens_of)
    assert run is not None
    assert len(run) == 10  # the system prompt and the last nine: 100 characters
    assert run[0] == messages[0]
    assert run[1:] == messages[-9:]
    assert len(counted) <= 6
    assert await fit.cut_to_fit(messages, 15, tokens_of) is None  # the system prompt and the last: 20


def test_the_embedding_limit_is_read_from_llama_servers_refusal_only() -> None:
    too_large = {
        "error": {
            "code": 500,
            "message": "input (10002 tokens) is too large to process. increase the physical batch size "
            "(current batch size: 512)",
            "type": "server_error",
        }
    }
    assert fit.embedding_limit(too_large) == 512
    assert fit.embedding_limit({"error": {"code": 500, "message": "out of memory"}}) is None
    assert fit.embedding_limit({"error": "input is too large"}) is None
    assert fit.embedding_limit(None) is None
