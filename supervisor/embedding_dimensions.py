"""`dimensions` for embeddings: each vector cut to its first values and scaled back to unit length, as
OpenAI and Ollama shorten Matryoshka embeddings. llama-server ignores the field, so the daemon does it
on the answer (the OpenAI route: float lists, or base64 of little-endian float32s; Ollama's /api/embed).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import re
import sys
from array import array
from collections.abc import Iterator
from time import perf_counter


def shortened(vector: object, dimensions: int) -> object:
    """`vector`'s first `dimensions` values at unit length; a vector already that short, or one that is
    not a list of numbers, as it was."""
    if not isinstance(vector, list) or len(vector) <= dimensions:
        return vector
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vector[:dimensions]):
        return vector  # not numbers: passed on as the engine sent it
    return _unit(vector[:dimensions])


def _unit(head: list[float]) -> list[float]:
    """`head` scaled to length 1 (all zeros: as it is)."""
    norm = math.sqrt(sum(v * v for v in head))
    return [v / norm for v in head] if norm else head


def _shortened_base64(encoded: str, dimensions: int) -> str:
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return encoded
    if len(raw) % 4 or len(raw) // 4 <= dimensions:
        return encoded
    values = array("f")
    values.frombytes(raw)
    if sys.byteorder != "little":
        values.byteswap()
    out = array("f", _unit(values.tolist()[:dimensions]))
    if sys.byteorder != "little":
        out.byteswap()
    return base64.b64encode(out.tobytes()).decode()


def _shortened_any(vector: object, dimensions: int) -> object:
    """An answer's vector shortened, whether a list of numbers or base64 of float32s; as it was when it
    needs no change."""
    return _shortened_base64(vector, dimensions) if isinstance(vector, str) else shortened(vector, dimensions)


def shortened_answer(payload: bytes, dimensions: int) -> bytes | None:
    """An OpenAI embeddings answer with each vector shortened to `dimensions`; None when it needs no
    change or is not such an answer (then it is passed on as the engine sent it)."""
    try:
        answer = json.loads(payload)
    except ValueError:
        return None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return None
    changed = False
    for item in data:
        if not isinstance(item, dict):
            continue
        vector = item.get("embedding")
        short = _shortened_any(vector, dimensions)
        if short is not vector:
            item["embedding"] = short
            changed = True
    return json.dumps(answer).encode() if changed else None


# An answer past this size is shortened (or, on the Ollama routes, translated) vector by vector, found by
# their bytes, with the event loop given its turns: decoded and encoded whole, a 40 MB answer held the
# event loop (every other request) for over a second.
STEPPED_FROM = 1 << 20
_STEP_S = 0.005  # how long a step may hold the event loop before it gives it a turn
_KEY = b'"embedding":'
_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')


def _vector_spans(payload: bytes) -> Iterator[tuple[int, int]]:
    """Where each vector's value (a list of numbers, or a base64 string) begins and ends in an
    embeddings answer. Found by the key that precedes it: inside a JSON string every quote is escaped,
    so no text can match it. Raises ValueError at a value that is neither."""
    at = payload.find(_KEY)
    while at >= 0:
        start = at + len(_KEY)
        while start < len(payload) and payload[start] in b" \t\r\n":
            start += 1
        if payload.startswith(b"[", start):
            end = payload.find(b"]", start)  # a list of numbers holds no other bracket
        elif payload.startswith(b'"', start):
            end = payload.find(b'"', start + 1)  # base64 holds no quote and no escape
        else:
            end = -1
        if end < 0:
            raise ValueError("not an embeddings answer")
        yield start, end + 1
        at = payload.find(_KEY, end)


def first_vector_length(payload: bytes) -> int | None:
    """How many values the first vector of an embeddings answer has; None when there is none to read."""
    try:
        start, end = next(_vector_spans(payload))
    except (StopIteration, ValueError):
        return None
    text = payload[start:end]
    if text.startswith(b"["):
        return text.count(b",") + 1 if text[1:-1].strip() else 0
    try:
        return len(base64.b64decode(text[1:-1], validate=True)) // 4
    except (binascii.Error, ValueError):
        return None


class _Steps:
    """Gives the event loop its turn once a step has held it for _STEP_S."""

    def __init__(self) -> None:
        self.began = perf_counter()

    async def turn(self) -> None:
        if perf_counter() - self.began > _STEP_S:
            await asyncio.sleep(0)
            self.began = perf_counter()


def _shortened_text(text: bytes, dimensions: int) -> bytes | None:
    """One vector's JSON text shortened; None when it needs no change."""
    vector = json.loads(text)
    short = _shortened_any(vector, dimensions)
    return None if short is vector else json.dumps(short).encode()


async def shortened_in_steps(payload: bytes, dimensions: int) -> bytes | None:
    """`shortened_answer` for a large answer, vector by vector (only each vector is decoded), in steps.
    None when nothing needs a change or it is not such an answer."""
    pieces: list[bytes] = []
    done = 0  # payload[:done] is in pieces
    steps = _Steps()
    try:
        for start, end in _vector_spans(payload):
            short = _shortened_text(payload[start:end], dimensions)
            if short is not None:
                pieces += (payload[done:start], short)
                done = end
            await steps.turn()
    except ValueError:
        return None  # passed on as the engine sent it
    if not pieces:
        return None
    pieces.append(payload[done:])
    return b"".join(pieces)


async def vectors_in_order(payload: bytes, dimensions: int | None) -> list[bytes]:
    """The vectors of an embeddings answer as JSON text, in the order of their `index` (each shortened to
    `dimensions`), for an answer built around them (Ollama's /api/embed), in steps. Raises ValueError for
    what is not such an answer."""
    steps = _Steps()
    vectors = []
    for start, end in _vector_spans(payload):
        text = payload[start:end]
        if dimensions is not None:
            text = _shortened_text(text, dimensions) or text
        elif text.startswith(b'"'):
            raise ValueError("the vectors are not lists of numbers")
        vectors.append(text)
        await steps.turn()
    if not vectors and b'"data"' not in payload:
        raise ValueError("the engine's embeddings response has no data")
    indices = [int(found.group(1)) for found in _INDEX.finditer(payload)]
    if len(indices) == len(vectors) and indices != sorted(indices):
        vectors = [vector for _, vector in sorted(zip(indices, vectors, strict=True), key=lambda p: p[0])]
    return vectors
