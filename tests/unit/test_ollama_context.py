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


async def test_a_run_that_starts_at_a_users_message_is_kept_first() -> None:
    """A run that began at the assistant's reply broke templates that want the turns to alternate from
    the user's (Gemma's, Mistral's), where the last user's message alone fit."""
    messages = _chat("user", "assistant", "user", "assistant", "user")

    async def tokens_of(run: fit.Messages) -> int:
        return sum(len(m["content"]) for m in run)

    run = await fit.cut_to_fit(messages, 25, tokens_of)  # the last two messages would fit: 20 characters
    assert run == messages[-1:]


async def test_an_agents_latest_tool_rounds_are_kept_when_no_run_from_a_users_message_fits() -> None:
    """One user's turn, then tool rounds too many for the context: as Ollama does, the latest rounds that
    fit are kept (a run from the user's message alone would refuse the request)."""
    messages = _chat("system", "user", "assistant", "user", *["assistant", "tool"] * 10)

    async def tokens_of(run: fit.Messages) -> int:
        return sum(len(m["content"]) for m in run)

    run = await fit.cut_to_fit(messages, 75, tokens_of)
    assert run is not None
    assert [m["role"] for m in run] == [
        "system",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert run[-1] is messages[-1]


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
    assert len(run) == 10  # the system prompt and the last nine, which begin with a user's: 100 characters
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


def test_a_raw_prompt_keeps_its_first_few_tokens_and_its_end() -> None:
    tokens = list(range(100))
    assert fit.cut_raw(tokens, 20) == [0, 1, 2, 3, *range(84, 100)]
    assert fit.cut_raw(tokens, 6) == [0, 1, 2, *range(97, 100)]  # never more than half of the budget
    assert fit.cut_raw(tokens, 100) == tokens


async def test_a_last_message_keeps_its_end_until_the_prompt_fits() -> None:
    """Characters stand in for the engine's tokens; the template adds 10 per message. A text cut from
    tokens may come out longer than its tokens (as a token split differently does): cut again."""
    counted: list[int] = []

    async def tokens_of(messages: fit.Messages) -> int:
        counted.append(sum(10 + len(m["content"]) for m in messages))
        return counted[-1]

    async def text_tokens(text: str) -> list[int]:
        return [ord(c) for c in text]

    async def text_of(tokens: list[int]) -> str:
        return ("!!" if len(counted) == 1 else "") + "".join(map(chr, tokens))  # the first cut splits long

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 90 + "question"}]
    cut = await fit.cut_last_text(chat, 60, tokens_of, text_tokens, text_of)
    assert cut is not None
    assert cut[0] == chat[0]
    assert cut[1]["content"].endswith("question")
    assert counted[-1] <= 60
    assert len(counted) == 3  # the whole, the first cut (2 over), the second
    assert (
        await fit.cut_last_text(chat, 25, tokens_of, text_tokens, text_of) is None
    )  # the system prompt alone
    images = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert await fit.cut_last_text(images, 5, tokens_of, text_tokens, text_of) is None
