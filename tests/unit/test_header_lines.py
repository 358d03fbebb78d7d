"""The fast request's headers (dataplane/front.py `HeaderLines`): read as aiohttp's CIMultiDict of the
same lines would read them, which is what the request's handlers were written against."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from supervisor.dataplane.front import HeaderLines

# How aiohttp reads a header's bytes (its parser), and so the front.
WIRE = ("utf-8", "surrogateescape")

RAW = [
    (b"host", b"Host", b"127.0.0.1:11435"),
    (b"x-request-id", b"X-Request-Id", b"abc-123"),
    (b"x-priority", b"x-PRIORITY", b"5"),
    (b"accept", b"Accept", b"text/event-stream"),
    (b"accept", b"ACCEPT", b"application/json"),
    (b"x-note", b"X-Note", b"caf\xc3\xa9 \xff"),  # UTF-8, and a byte that is not
]


def _reference() -> CIMultiDict[str]:
    return CIMultiDict([(name.decode(*WIRE), value.decode(*WIRE)) for _, name, value in RAW])


@pytest.mark.parametrize(
    "name",
    [
        *("Host", "HOST", "x-request-id", "X-Priority", "Accept", "X-Note", "Origin", "Authorization", ""),
        "X-\u263a",  # not ASCII, and on no line here
        "X-\ud800",  # a name no line can carry: no bytes encode it
    ],
)
def test_lookups_answer_as_a_cimultidict_of_the_same_lines(name: str) -> None:
    headers, reference = HeaderLines(RAW), _reference()
    assert headers.get(name) == reference.get(name)
    assert headers.get(name, "absent") == reference.get(name, "absent")
    assert (name in headers) == (name in reference)
    if name in reference:
        assert headers[name] == reference[name]
    else:
        with pytest.raises(KeyError):
            headers[name]


def test_every_line_is_there_in_order_a_repeated_name_with_each_of_its_values() -> None:
    headers = HeaderLines(RAW)
    assert len(headers) == len(RAW)
    assert list(headers) == [name.decode(*WIRE) for _, name, _ in RAW]
    assert headers.items() == list(_reference().items())
    assert ("ACCEPT", "application/json") in headers.items()


def test_a_name_that_is_not_a_string_is_not_there() -> None:
    names: list[object] = [b"host", None, 1]
    assert not any(name in HeaderLines(RAW) for name in names)
