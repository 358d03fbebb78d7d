"""parse_keep_alive: Ollama-style keep_alive values (seconds or Go durations) to seconds, inf = forever."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.durations import FOREVER, LONGEST, format_keep_alive, parse_keep_alive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        ("300", 300.0),
        ("5m", 300.0),
        ("10s", 10.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("1m30s", 90.0),
        ("250ms", 0.25),
        ("0", 0.0),
        (0, 0.0),
        ("0s", 0.0),
        ("  5m  ", 300.0),
        ("+5m", 300.0),
    ],
)
def test_numbers_and_durations_parse_to_seconds(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["-1", -1, -1.0, "-5m", "-1s", -0.001])
def test_any_negative_value_keeps_forever(value: object) -> None:
    assert parse_keep_alive(value) == math.inf
    assert parse_keep_alive(value) == FOREVER


def test_zero_means_unload_at_once_not_forever() -> None:
    assert parse_keep_alive(0) == 0.0
    assert parse_keep_alive("0") == 0.0
    assert not math.isinf(parse_keep_alive("0"))


def test_result_is_always_a_float() -> None:
    assert isinstance(parse_keep_alive(300), float)
    assert isinstance(parse_keep_alive("5m"), float)


@pytest.mark.parametrize("value", ["abc", "5x", "", "   ", "-", "5m5", "1h 30m", "m5", "5 m", ".5h"])
def test_malformed_strings_are_rejected_naming_the_accepted_forms(value: str) -> None:
    with pytest.raises(ValueError, match="not a duration") as info:
        parse_keep_alive(value)
    message = str(info.value)
    assert repr(value.strip()) in message
    assert "'5m'" in message


@pytest.mark.parametrize("value", [True, False, None, [], {}, object()])
def test_non_numbers_are_rejected_with_the_offending_value(value: object) -> None:
    with pytest.raises(ValueError, match="number of seconds or a duration") as info:
        parse_keep_alive(value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [math.nan, "nan", "NaN"])
def test_nan_is_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="NaN"):
        parse_keep_alive(value)


@pytest.mark.parametrize("value", ["+-5m", "--5m"])
def test_a_doubled_sign_is_rejected(value: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_keep_alive(value)


@settings(max_examples=200, deadline=None)
@given(
    hours=st.integers(min_value=0, max_value=1000),
    minutes=st.integers(min_value=0, max_value=59),
    secs=st.integers(min_value=0, max_value=59),
)
def test_composed_durations_add_up(hours: int, minutes: int, secs: int) -> None:
    text = f"{hours}h{minutes}m{secs}s"
    assert parse_keep_alive(text) == pytest.approx(hours * 3600 + minutes * 60 + secs)
    if hours or minutes or secs:
        assert parse_keep_alive("-" + text) == math.inf


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=LONGEST, allow_nan=False))
def test_non_negative_numbers_pass_through_unchanged(value: float) -> None:
    assert parse_keep_alive(value) == value
    assert parse_keep_alive(repr(value)) == value


def test_format_keep_alive_reads_back() -> None:
    assert format_keep_alive(math.inf) == "forever"
    assert format_keep_alive(300.0) == "300s"
    assert parse_keep_alive(format_keep_alive(90.0)) == 90.0


@pytest.mark.parametrize(
    "value", [10**400, int("9" * 400), 1e20, 1e308, math.inf, "1e400", "9" * 400, "1e20"]
)
def test_a_keep_alive_beyond_ten_years_is_forever_not_an_overflow(value: object) -> None:
    assert parse_keep_alive(value) == FOREVER


@pytest.mark.parametrize("value", [-(10**400), -1e308, -math.inf, "-" + "9" * 400, "-1e400"])
def test_a_huge_negative_keep_alive_is_forever(value: object) -> None:
    assert parse_keep_alive(value) == FOREVER


def test_ten_years_is_the_longest_finite_keep_alive() -> None:
    assert parse_keep_alive(int(LONGEST)) == LONGEST
    assert parse_keep_alive(LONGEST) == LONGEST
    assert parse_keep_alive(int(LONGEST) + 1) == FOREVER
    assert parse_keep_alive(f"{int(LONGEST // 3600) + 1}h") == FOREVER


def test_a_huge_duration_string_is_forever() -> None:
    assert parse_keep_alive("9" * 400 + "h") == FOREVER
    assert parse_keep_alive("9" * 400 + "h" + "5m") == FOREVER


def test_a_long_malformed_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(ValueError, match="not a duration") as info:
        parse_keep_alive("x" * 10_000)
    assert len(str(info.value)) < 200
    with pytest.raises(ValueError, match="number of seconds") as caught:
        parse_keep_alive(["x" * 10_000])
    assert len(str(caught.value)) < 200


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.integers(),
        st.integers(min_value=10**300, max_value=10**500),
        st.floats(),
        st.text(),
        st.none(),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    )
)
def test_any_value_is_seconds_forever_or_a_value_error(value: object) -> None:
    try:
        seconds = parse_keep_alive(value)
    except ValueError:
        return
    assert seconds == FOREVER or 0 <= seconds <= LONGEST
    # What callers do with it: a deadline, and /api/ps's date.
    deadline = 1.7e9 + seconds
    if not math.isinf(deadline):
        datetime.fromtimestamp(deadline, UTC).isoformat()
