"""Ollama-style durations for keep_alive: `300`, `"5m"`, `"1h30m"`, `"-1"` (forever), `0` (at once).

Anything longer than LONGEST (ten years) means forever: a timer that far out never fires in practice,
and capping it keeps `now + keep_alive` and the dates /api/ps prints within range.
"""

from __future__ import annotations

import math
import re

FOREVER = math.inf
LONGEST = 10 * 365 * 24 * 3600.0

_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object) -> float:
    """Seconds to keep a model loaded after its last request: `math.inf` (forever) for any negative value
    and for anything longer than LONGEST.

    Numbers are seconds, as in Ollama's API; strings are Go durations (`5m`, `1h30m`, `-1s`) or numbers.
    Raises ValueError (never another error, for any value) with a message that names the accepted forms.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(
            f"keep_alive must be a number of seconds or a duration like '5m', not {_show(value)}"
        )
    if isinstance(value, int):
        # Compared as an int: float() of a 400-digit integer raises OverflowError.
        seconds = FOREVER if value < 0 or value > LONGEST else float(value)
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str):
        seconds = _parse_duration_string(value.strip())
    else:
        raise ValueError(
            f"keep_alive must be a number of seconds or a duration like '5m', not {_show(value)}"
        )
    if math.isnan(seconds):
        raise ValueError("keep_alive must not be NaN")
    return FOREVER if seconds < 0 or seconds > LONGEST else seconds


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_duration_string(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    # A Go duration has at most one sign: "+-5m" is a typo, not five minutes.
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[:1] in ("+", "-") else text
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(
            f"keep_alive {_show(text)} is not a duration; use seconds (300), '5m', '1h', '-1' or '0'"
        )
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


def format_keep_alive(seconds: float) -> str:
    return "forever" if math.isinf(seconds) else f"{seconds:g}s"
