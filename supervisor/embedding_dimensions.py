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
import sys
from array import array
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
        short = (
            _shortened_base64(vector, dimensions)
            if isinstance(vector, str)
            else shortened(vector, dimensions)
        )
        if short is not vector:
            item["embedding"] = short
            changed = True
    return json.dumps(answer).encode() if changed else None


# An answer past this size is shortened vector by vector (shortened_in_steps): decoded and encoded whole,
# a 40 MB answer held the event loop (every other request) for over a second.
STEPPED_FROM = 1 << 20
_STEP_S = 0.005  # how long a step may hold the event loop before it gives it a turn
_KEY = b'"embedding":'


async def shortened_in_steps(payload: bytes, dimensions: int) -> bytes | None:
    """`shortened_answer` for a large answer, with the event loop given its turn every few milliseconds:
    each vector is found by its bytes (`"embedding":` then a list or a base64 string; inside a JSON
    string every quote is escaped, so text cannot match the key) and only it is decoded. None when
    nothing needs a change."""
    pieces: list[bytes] = []
    done = 0  # payload[:done] is in pieces
    at = payload.find(_KEY)
    step_began = perf_counter()
    while at >= 0:
        start = at + len(_KEY)
        while start < len(payload) and payload[start] in b" \t\r\n":
            start += 1
        end = _value_end(payload, start)
        if end < 0:
            return None  # not such an answer: passed on as the engine sent it
        vector = json.loads(payload[start:end])
        short = (
            _shortened_base64(vector, dimensions)
            if isinstance(vector, str)
            else shortened(vector, dimensions)
        )
        if short is not vector:
            pieces += (payload[done:start], json.dumps(short).encode())
            done = end
        at = payload.find(_KEY, end)
        if perf_counter() - step_began > _STEP_S:
            await asyncio.sleep(0)
            step_began = perf_counter()
    if not pieces:
        return None
    pieces.append(payload[done:])
    return b"".join(pieces)


def _value_end(payload: bytes, start: int) -> int:
    """Where the list of numbers or the string that begins at `start` ends (just past it); -1 if neither."""
    if payload.startswith(b"[", start):
        end = payload.find(b"]", start)  # a list of numbers holds no other bracket
    elif payload.startswith(b'"', start):
        end = payload.find(b'"', start + 1)  # base64 holds no quote and no escape
    else:
        return -1
    return -1 if end < 0 else end + 1
