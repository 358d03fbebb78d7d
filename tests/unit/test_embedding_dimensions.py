"""Embeddings shortened to `dimensions` (supervisor/embedding_dimensions.py): float lists and base64."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from supervisor.embedding_dimensions import shortened, shortened_answer, shortened_in_steps


def _answer(*vectors: object) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return json.dumps({"object": "list", "data": data, "usage": {"prompt_tokens": 2}}).encode()


def test_a_vector_is_cut_and_scaled_back_to_unit_length() -> None:
    assert shortened([3.0, 4.0, 12.0], 2) == pytest.approx([0.6, 0.8])
    assert shortened([0.0, 0.0, 1.0], 2) == [0.0, 0.0]  # nothing to scale
    assert shortened([1.0, 2.0], 2) == [1.0, 2.0]  # already that short: as it was
    assert shortened(["a", "b", "c"], 2) == ["a", "b", "c"]  # not numbers: as the engine sent it
    assert shortened([True, False, True], 2) == [True, False, True]


def test_an_answer_is_shortened_in_floats_and_in_base64() -> None:
    packed = base64.b64encode(struct.pack("<3f", 3.0, 4.0, 12.0)).decode()
    out = json.loads(shortened_answer(_answer([3.0, 4.0, 12.0], packed), 2) or b"")
    assert out["data"][0]["embedding"] == pytest.approx([0.6, 0.8])
    assert struct.unpack("<2f", base64.b64decode(out["data"][1]["embedding"])) == pytest.approx((0.6, 0.8))
    assert out["usage"] == {"prompt_tokens": 2}


@pytest.mark.parametrize(
    "payload",
    [
        _answer([1.0, 2.0]),  # short enough
        _answer("not base64!"),
        _answer(base64.b64encode(b"12345").decode()),  # not whole float32s
        b"not json",
        json.dumps({"error": {"message": "no"}}).encode(),
    ],
    ids=["short", "bad-base64", "odd-length", "not-json", "error"],
)
async def test_what_needs_no_change_or_is_not_an_answer_is_left_alone(payload: bytes) -> None:
    assert shortened_answer(payload, 2) is None
    assert await shortened_in_steps(payload, 2) is None


async def test_a_large_answer_shortened_in_steps_is_the_answer_shortened_whole() -> None:
    """Vector by vector, found by their bytes, for an answer too large to decode at once on the event
    loop; whatever the spacing of the engine's JSON."""
    packed = base64.b64encode(struct.pack("<3f", 3.0, 4.0, 12.0)).decode()
    for payload in (
        _answer([3.0, 4.0, 12.0], packed, [1.0, 0.0, 0.0]),
        json.dumps(json.loads(_answer([3.0, 4.0, 12.0], packed)), indent=2).encode(),
    ):
        whole = json.loads(shortened_answer(payload, 2) or b"")
        stepped = json.loads(await shortened_in_steps(payload, 2) or b"")
        assert stepped == whole
