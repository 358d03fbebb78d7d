"""The log set-up's own parts: the timestamp every event carries."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
import structlog

from supervisor import logs


def stamp(when: float, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(logs, "wall_time", lambda: when)  # the clock the stamper reads
    text = logs.UtcTimestamp()({}, "info", {})["timestamp"]
    monkeypatch.undo()
    assert isinstance(text, str)
    return text


def test_the_timestamp_is_what_structlogs_iso_utc_stamper_writes() -> None:
    before = datetime.now(UTC)
    ours = logs.UtcTimestamp()(None, "info", {})["timestamp"]
    theirs = structlog.processors.TimeStamper(fmt="iso", utc=True)(None, "info", {})["timestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", ours)
    parsed = datetime.fromisoformat(ours.replace("Z", "+00:00"))
    assert before <= parsed <= datetime.fromisoformat(theirs.replace("Z", "+00:00"))


def test_the_timestamp_rounds_to_the_microsecond_and_carries_into_the_next_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert stamp(100.999999, monkeypatch) == "1970-01-01T00:01:40.999999Z"
    assert stamp(100.9999996, monkeypatch) == "1970-01-01T00:01:41.000000Z"
    assert stamp(101.0, monkeypatch) == "1970-01-01T00:01:41.000000Z"
    assert stamp(1_795_000_000.000001, monkeypatch) == "2026-11-18T11:06:40.000001Z"


def test_one_stamper_follows_the_clock_across_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    stamper = logs.UtcTimestamp()
    seen = []
    for when in (5.5, 5.75, 6.25, 3600.0):
        monkeypatch.setattr(logs, "wall_time", lambda when=when: when)
        seen.append(stamper(None, "info", {})["timestamp"])
    assert seen == [
        "1970-01-01T00:00:05.500000Z",
        "1970-01-01T00:00:05.750000Z",
        "1970-01-01T00:00:06.250000Z",
        "1970-01-01T01:00:00.000000Z",
    ]


def test_a_json_line_is_json_whatever_orjson_refuses() -> None:
    line = logs.json_lines()
    assert json.loads(line({"event": "request", "ms": 1.5, "status": 200})) == {
        "event": "request",
        "ms": 1.5,
        "status": 200,
    }
    # orjson refuses a lone surrogate (a header decoded with surrogateescape) and integers past 64 bits:
    # json writes those, escaped.
    assert json.loads(line({"client_id": "a\udcffb"})) == {"client_id": "a\udcffb"}
    assert json.loads(line({"count": 2**70})) == {"count": 2**70}
    # Keys that are not text, and values JSON has no type for, are written as text.
    assert json.loads(line({"inflight": {1: 2}, "path": Path("/x")})) == {
        "inflight": {"1": 2},
        "path": "PosixPath('/x')",
    }


def test_the_json_log_writes_one_line_per_event_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    logs.configure("json", "info")
    try:
        structlog.get_logger("api").info("request", path="/v1/chat/completions", token="sekrit-value")
        structlog.get_logger("api").debug("not_written")
    finally:
        structlog.reset_defaults()
    lines = capfd.readouterr().err.splitlines()
    record = json.loads(lines[-1])
    assert record["event"] == "request"
    assert record["token"] == "***"
    assert record["level"] == "info"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", record["timestamp"])
    assert not any("not_written" in line for line in lines)


def test_each_configure_sets_the_standard_librarys_level_too() -> None:
    """A reload that changed log_level reached structlog but not aiohttp and asyncio (the standard
    library's root logger): basicConfig does nothing once a handler is there."""
    root = logging.getLogger()
    kept = root.level
    try:
        logs.configure("console", "error")
        assert root.level == logging.ERROR
        logs.configure("console", "info")
        assert root.level == logging.WARNING  # their info lines stay out: warnings and up
    finally:
        root.setLevel(kept)
        structlog.reset_defaults()
