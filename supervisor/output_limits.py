"""A manifest's `max_output_tokens`: the most tokens one request may ask the engine to generate."""

from __future__ import annotations

from typing import Any

# The OpenAI request fields that bound generation (the Responses API's `max_output_tokens` too);
# llama-server also reads its own `n_predict`.
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")


def cap_output_tokens(body: dict[str, Any], limit: int | None, unset: str = "max_tokens") -> bool:
    """Lower every output-length field of an OpenAI request body to `limit`, or set `unset` (the field
    its route reads: `max_output_tokens` for /v1/responses) when the body has none (or asks for no
    limit: llama-server's -1). Returns True when `body` changed."""
    if limit is None:
        return False
    changed = False
    present = False
    for field in _LIMIT_FIELDS:
        value = body.get(field)
        # 3.0 is 3 (JSON does not tell them apart, and the field check takes a whole float).
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            present = True
            if value > limit:
                body[field] = limit
                changed = True
        elif field in body:
            # None, or a negative "unlimited": replace it with the cap.
            body[field] = limit
            present = changed = True
    if not present:
        body[unset] = limit
        changed = True
    return changed
