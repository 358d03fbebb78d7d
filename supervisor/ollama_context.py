"""A request too long for the model's context, cut as Ollama cuts it: a chat loses its oldest messages,
a prompt its start, an input to embed its end.

Ollama (`chatPrompt` in its server) keeps the system prompts and the longest run of latest messages
whose prompt fits the context, so a long conversation in a chat UI goes on working instead of failing.
llama-server refuses such a prompt with its context size (`exceed_context_size_error`, `n_ctx`); the
Ollama routes then send the chat again, cut here. A kept run never starts with a tool answer, which
would lose the call it answers, and always holds the last message.

llama-server shifts no context by default: a prompt that fills it leaves no room for the answer. So the
cut leaves room for one: the request's own `max_tokens`, or a quarter of the context, at most half.

A last message (or an /api/generate prompt) too long on its own loses its text's start, as Ollama's
runner cuts a prompt longer than the context: the end is what the answer follows from. A raw prompt,
whose template the client wrote, keeps its first few tokens too, as the runner keeps them.

An input to embed that is longer than llama-server takes at once (its physical batch, which its refusal
names) is cut to that many tokens, as Ollama's embed handler cuts it unless told not to.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

Messages = list[dict[str, Any]]

OVERFLOW = "exceed_context_size_error"  # llama-server's error type for a prompt longer than its context
# llama-server's refusal of an input to embed longer than its physical batch (a server_error, 500).
_TOO_LARGE = re.compile(r"too large to process.*current batch size: (\d+)")
_INPUT_TOKENS = re.compile(r"\((\d+) tokens\) is too large to process")


def context_size(error: object) -> int | None:
    """The context size in llama-server's refusal of a prompt too long for it; None for another error."""
    if not isinstance(error, dict) or not isinstance(error.get("error"), dict):
        return None
    detail = error["error"]
    n_ctx = detail.get("n_ctx")
    if detail.get("type") != OVERFLOW or not isinstance(n_ctx, int) or n_ctx <= 0:
        return None
    return n_ctx


def prompt_budget(body: dict[str, Any], n_ctx: int) -> int:
    """The tokens a cut prompt may take: the context less the room kept for the answer."""
    asked = body.get("max_tokens")
    room = asked if isinstance(asked, int) and asked > 0 else n_ctx // 4
    return n_ctx - min(room, n_ctx // 2)


def shortest(messages: Messages) -> Messages:
    """The shortest run `cut_to_fit` tries: the system prompts and the last message (with the call a
    last tool answer answers)."""
    candidates = starts(messages)
    return kept(messages, candidates[-1]) if candidates else messages


def starts(messages: Messages) -> list[int]:
    """Where a kept run may start, longest first: any message after the first but a system prompt (kept
    anyway) or a tool answer (kept with its call)."""
    return [i for i in range(1, len(messages)) if messages[i].get("role") not in ("system", "tool")]


def kept(messages: Messages, start: int) -> Messages:
    """The system prompts before `start`, then every message from `start` on."""
    return [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]


async def cut_to_fit(
    messages: Messages, budget: int, tokens_of: Callable[[Messages], Awaitable[int]]
) -> Messages | None:
    """The longest run of latest messages (with the system prompts) whose prompt takes at most `budget`
    tokens, by `tokens_of`; None when not even the shortest fits.

    A run that starts at a user's message first: many chat templates (Gemma's, Mistral's) refuse a chat
    whose turns do not alternate from the user's, and a run that began at the assistant's reply failed
    where a shorter one would have fit. When no such run fits, the latest messages after the last
    user's (an agent's tool rounds) that do, as Ollama keeps them."""
    candidates = starts(messages)
    users = [i for i in candidates if messages[i].get("role") == "user"]
    found = await _longest_fit(messages, users, budget, tokens_of)
    if found is None:
        after = [i for i in candidates if not users or i > users[-1]]
        found = await _longest_fit(messages, after, budget, tokens_of)
    return found


async def _longest_fit(
    messages: Messages, candidates: list[int], budget: int, tokens_of: Callable[[Messages], Awaitable[int]]
) -> Messages | None:
    """The run from the earliest of `candidates` whose prompt fits `budget`, None if none does. A binary
    search: a shorter run never takes more tokens, so about log2(len(candidates)) prompts are counted."""
    low, high = 0, len(candidates) - 1
    best: int | None = None
    while low <= high:
        middle = (low + high) // 2
        if await tokens_of(kept(messages, candidates[middle])) <= budget:
            best, high = middle, middle - 1
        else:
            low = middle + 1
    return None if best is None else kept(messages, candidates[best])


# Tries at cutting a text to a token budget before the engine's refusal stands: a text made of tokens
# does not always split into the same tokens again, so a cut may come out a token or two long.
CUT_TRIES = 4
# What Ollama's runner keeps of a prompt's start when it cuts a raw prompt (`num_keep`'s default).
RAW_KEPT_START = 4


async def cut_last_text(
    messages: Messages,
    budget: int,
    tokens_of: Callable[[Messages], Awaitable[int]],
    text_tokens: Callable[[str], Awaitable[list[int]]],
    text_of: Callable[[list[int]], Awaitable[str]],
) -> Messages | None:
    """The chat with the end of its last message's text, so that its prompt takes at most `budget`
    tokens by `tokens_of`: Ollama's runner keeps a prompt's end too. None when the last message's
    content is not text, or even its empty text does not fit (the system prompts alone are too long).
    `text_tokens` and `text_of` turn the text into the engine's tokens and back."""
    last = messages[-1]
    text = last.get("content")
    if not isinstance(text, str) or not text:
        return None
    tokens = await text_tokens(text)
    keep = len(tokens) - (await tokens_of(messages) - budget)
    for _ in range(CUT_TRIES):
        if keep <= 0:
            return None
        cut = [*messages[:-1], {**last, "content": await text_of(tokens[-keep:])}]
        over = await tokens_of(cut) - budget
        if over <= 0:
            return cut
        keep -= over
    return None


def cut_raw(tokens: list[int], budget: int) -> list[int]:
    """A raw prompt's tokens cut to `budget` as Ollama's runner cuts them: its first few (the BOS and
    what a hand-made template puts first), then its end."""
    if len(tokens) <= budget:
        return tokens
    start = min(RAW_KEPT_START, budget // 2)
    return tokens[:start] + tokens[len(tokens) - (budget - start) :]


def _message(error: object) -> str:
    """The message of llama-server's error body `{"error": {"message": ...}}`; "" for another shape."""
    detail = error.get("error") if isinstance(error, dict) else None
    message = detail.get("message") if isinstance(detail, dict) else None
    return message if isinstance(message, str) else ""


def embedding_limit(error: object) -> int | None:
    """The most tokens llama-server embeds at once, from its refusal of a longer input; None for
    another error."""
    found = _TOO_LARGE.search(_message(error))
    return int(found.group(1)) if found else None


def too_long_to_embed(error: object, limit: int, model: str) -> str:
    """Ollama's refusal of an input longer than the `limit` the engine embeds at once (with `truncate:
    false`), with the input's tokens from llama-server's refusal `error` when it names them."""
    found = _INPUT_TOKENS.search(_message(error))
    input_tokens = f"an input of {found.group(1)} tokens" if found else "an input"
    return (
        f"input exceeds maximum context length: {input_tokens}, and model '{model}' embeds at most "
        f"{limit} tokens at once; leave truncate on (the default) to embed the input's start"
    )
