"""take_scheduling: our per-request fields come off the body (the engine never sees them), validated."""

from __future__ import annotations

import math

import pytest

from supervisor.api.openai import Scheduling, take_scheduling
from supervisor.errors import SupervisorError


def test_body_fields_are_taken_off_and_parsed() -> None:
    payload = {"model": "m", "keep_alive": "5m", "x_priority": 3, "x_client_id": "batch-7", "stream": True}
    assert take_scheduling(payload, {}) == Scheduling(300.0, 3, "batch-7")
    assert payload == {"model": "m", "stream": True}


def test_headers_stand_in_for_missing_body_fields() -> None:
    headers = {"X-Priority": "-2", "X-Client-Id": "ui"}
    assert take_scheduling({"model": "m"}, headers) == Scheduling(None, -2, "ui")
    assert take_scheduling({"model": "m", "x_priority": 1}, headers).priority == 1  # the body wins


def test_keep_alive_forever() -> None:
    assert take_scheduling({"keep_alive": -1}, {}).keep_alive == math.inf


@pytest.mark.parametrize(
    ("payload", "headers", "complaint"),
    [
        ({"x_priority": "high"}, {}, "x_priority must be an integer"),
        ({"x_priority": True}, {}, "x_priority must be an integer"),
        ({"x_priority": 1.5}, {}, "x_priority must be an integer"),
        ({}, {"X-Priority": "urgent"}, "X-Priority must be an integer"),
        ({"x_client_id": 42}, {}, "x_client_id must be a string"),
        ({"x_client_id": "x" * 201}, {}, "at most 200"),
        ({"keep_alive": "soon"}, {}, "not a duration"),
    ],
)
def test_bad_values_are_a_400_that_names_the_field(
    payload: dict[str, object], headers: dict[str, str], complaint: str
) -> None:
    with pytest.raises(SupervisorError, match=complaint) as caught:
        take_scheduling(payload, headers)
    assert caught.value.status == 400
