"""Hypothesis-made request bodies against every JSON route of one live daemon: no body causes a 5xx.

Deep nesting, numbers beyond float64, NaN and Infinity literals, wrong types in every well-known field,
invalid UTF-8, NUL characters and plain garbage: each is answered 2xx or 4xx, the daemon keeps serving,
and no handler ever fails with an unexpected exception (no `handler_error` in its log).

The bodies are drawn up front by a `@given` function that only collects them (hypothesis's engine with a
fixed seed, no shrinking), then sent one by one from the async test: @given does not drive async fixtures.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.fakehub import FakeHub, point_daemons_at
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon

EXAMPLES = 600


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 90, 200)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = _png()
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}

# Placeholders for what a Python value cannot hold; spliced into the JSON text as raw bytes.
RAW = {
    "@HUGE@": b"9" * 400,
    "@NEGHUGE@": b"-" + b"1" * 400,
    "@BIGFLOAT@": b"1e400",
    "@NAN@": b"NaN",
    "@INF@": b"-Infinity",
    "@DEEP@": b"[" * 100_000 + b"]" * 100_000,
    "@DEEPOBJ@": b'{"a":' * 70 + b"1" + b"}" * 70,
    "@BADUTF8@": b'"a\xff\xfeb"',
    "@NUL@": b'"a\\u0000b"',
    "@SURROGATE@": b'"\\udc00x"',
}
ODD: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 1.5, -0.0, 1e308]
WEIRD = st.sampled_from([*ODD, "", "x", "5m", [], {}, ["x"], [1], {"a": 1}, *RAW]) | st.text(max_size=6)


Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]  # (right values, wrong ones)


def field(*good: Any, bad: st.SearchStrategy[Any] = WEIRD) -> Field:
    return st.sampled_from(good), bad


def keep_alive() -> Field:
    # 0 would unload the model between requests: a slow loop, not a different answer.
    return field("5m", 300, "-1", bad=WEIRD.filter(lambda v: v not in (0, "0", "", None)))


def wrong_message() -> st.SearchStrategy[Any]:
    """A message with one odd part: its role, content, images or tool calls."""
    return st.fixed_dictionaries(
        {"role": st.one_of(st.just("user"), WEIRD)},
        optional={
            "content": st.one_of(st.just("hi"), WEIRD, st.lists(WEIRD, max_size=2)),
            "images": st.one_of(WEIRD, st.lists(st.one_of(WEIRD, st.just(PNG)), max_size=3)),
            "tool_calls": st.one_of(WEIRD, st.lists(st.fixed_dictionaries({"function": WEIRD}), max_size=1)),
            "name": WEIRD,
        },
    )


GOOD_MESSAGES = (
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
)
OPENAI_MESSAGES = field(
    *GOOD_MESSAGES,
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    bad=st.one_of(WEIRD, st.lists(wrong_message(), min_size=1, max_size=2)),
)
OLLAMA_MESSAGES = field(
    *GOOD_MESSAGES,
    [{"role": "user", "content": "what is this?", "images": [PNG]}],
    bad=st.one_of(WEIRD, st.lists(wrong_message(), min_size=1, max_size=2)),
)
OPTIONS = field(
    {"temperature": 0.5},
    {"num_ctx": 256, "seed": 7, "top_k": 20},
    {"stop": ["\n"], "mirostat": 0},
    bad=st.one_of(
        WEIRD,
        st.dictionaries(
            st.sampled_from(["num_predict", "num_ctx", "temperature", "seed", "top_k", "stop", "mirostat"]),
            WEIRD,
            min_size=1,
            max_size=2,
        ),
    ),
)
SAMPLING: dict[str, Field] = {
    "max_tokens": field(1, 3),
    "temperature": field(0, 0.7),
    "top_p": field(0.9),
    "frequency_penalty": field(0.1),
    "seed": field(7),
    "n": field(1),
    "stream": field(True, False),
    "stop": field("\n", ["x"]),
    "logit_bias": field({"15": -1}),
    "response_format": field({"type": "json_object"}),
    "keep_alive": keep_alive(),
    "x_unknown": field("anything"),
}
OLLAMA: dict[str, Field] = {
    "stream": field(True, False),
    "options": OPTIONS,
    "keep_alive": keep_alive(),
    "format": field("json", {"type": "object"}),
    "think": field(False),
}
MODEL = field("demo", bad=st.one_of(WEIRD, st.just("no-such-model")))
EMBED_MODEL = field("embed")

# Per route: its fields, and which of them every right body has.
ROUTES: dict[tuple[str, str], tuple[dict[str, Field], tuple[str, ...]]] = {
    ("POST", "/v1/chat/completions"): (
        {**SAMPLING, "model": MODEL, "messages": OPENAI_MESSAGES, "tools": field([WEATHER])},
        ("model", "messages"),
    ),
    ("POST", "/v1/completions"): (
        {**SAMPLING, "model": MODEL, "prompt": field("hi", ["hi"], [1, 2]), "echo": field(False)},
        ("model", "prompt"),
    ),
    ("POST", "/v1/embeddings"): (
        {
            "model": EMBED_MODEL,
            "input": field("hi", ["a", "b"]),
            "encoding_format": field("float"),
            "keep_alive": keep_alive(),
        },
        ("model", "input"),
    ),
    ("POST", "/api/chat"): (
        {**OLLAMA, "model": MODEL, "messages": OLLAMA_MESSAGES, "tools": field([WEATHER])},
        ("model", "messages"),
    ),
    ("POST", "/api/generate"): (
        {
            **OLLAMA,
            "model": MODEL,
            "prompt": field("hi"),
            "system": field("be brief"),
            "raw": field(True, False),
            "images": field([PNG]),
            "suffix": field(""),
        },
        ("model", "prompt"),
    ),
    ("POST", "/api/embed"): (
        {
            "model": EMBED_MODEL,
            "input": field("hi", ["a"]),
            "truncate": field(True),
            "options": OPTIONS,
            "keep_alive": keep_alive(),
        },
        ("model", "input"),
    ),
    ("POST", "/api/embeddings"): (
        {"model": EMBED_MODEL, "prompt": field("hi"), "options": OPTIONS},
        ("model", "prompt"),
    ),
    ("POST", "/api/show"): ({"model": field("demo", "embed"), "verbose": field(False)}, ("model",)),
    ("POST", "/api/pull"): (
        {"model": field("test-org/missing", "hf.co/test-org/missing:Q4_K_M"), "stream": field(False)},
        ("model",),
    ),
    ("DELETE", "/api/delete"): ({"model": field("test-org/missing", "demo")}, ("model",)),
}

GENERATIVE = {"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"}


def encode(route: str, value: Any, damage: str) -> bytes:
    """The body's bytes: JSON with the placeholders spliced in, then perhaps damaged as a whole."""
    if isinstance(value, dict) and route in GENERATIVE:
        # Keep each valid generation short: the demo model would otherwise write until its context is full.
        if route.startswith("/v1/"):
            value.setdefault("max_tokens", 3)
        elif isinstance(value.get("options", {}), dict):
            value["options"] = {"num_predict": 3, **value.get("options", {})}
    data = json.dumps(value).encode()
    for marker, raw in RAW.items():
        data = data.replace(json.dumps(marker).encode(), raw)
    if damage == "truncated":
        return data[: len(data) // 2]
    if damage == "nested":
        return b'{"model": "demo", "messages": ' + b"[" * 100_000 + data
    if damage == "bad_utf8":
        return data[:-1] + b', "\xc3\x28": 1}' if data.endswith(b"}") else b"\xff" + data
    if damage == "not_object":
        return b"[" + data + b"]"
    return data


@st.composite
def route_body(draw: st.DrawFn, route: tuple[str, str]) -> dict[str, Any]:
    """A right body for the route, then up to two of its fields made wrong (or the required ones left out)."""
    fields, required = ROUTES[route]
    names = sorted(fields)
    chosen = set(required) | set(draw(st.lists(st.sampled_from(names), max_size=4)))
    value = {name: draw(fields[name][0]) for name in sorted(chosen)}
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            value.pop(name, None)
        else:
            value[name] = draw(fields[name][1])
    return value


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    method, path = draw(st.sampled_from(sorted(ROUTES)))
    if draw(st.integers(0, 19)) == 0:
        return method, path, draw(st.binary(max_size=40))
    value = draw(route_body((method, path)))
    damage = draw(st.sampled_from(["none"] * 12 + ["truncated", "nested", "bad_utf8", "not_object"]))
    return method, path, encode(path, value, damage)


def draw_requests() -> list[tuple[str, str, bytes]]:
    drawn: list[tuple[str, str, bytes]] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def collect(request: tuple[str, str, bytes]) -> None:
        drawn.append(request)

    collect()
    return drawn


@pytest.fixture
async def fuzzed(
    make_daemon: MakeDaemon, demo_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    """One daemon with a chat model and an embeddings model, both loaded; an empty fake hub to pull from."""
    hub = FakeHub()
    point_daemons_at(monkeypatch, await hub.start(), tmp_path / "hf")
    daemon = await make_daemon(
        models={
            "demo": {},
            "embed": {"ctx_size": 512, "vram_mib": 256, "args": ["--embeddings", "--pooling", "mean"]},
        }
    )
    await daemon.chat("demo", max_tokens=1)  # load both once, up front
    status, _, _ = await daemon.post("/v1/embeddings", {"model": "embed", "input": "hi"})
    assert status == 200
    yield daemon
    await hub.close()


async def send(daemon: Daemon, method: str, path: str, data: bytes) -> int:
    assert daemon.http is not None
    headers = {"Content-Type": "application/json"}
    async with daemon.http.request(method, daemon.url + path, data=data, headers=headers) as response:
        await response.read()  # a streamed answer too: its end is part of the request
        return response.status


async def test_no_body_on_any_route_causes_a_5xx(fuzzed: Daemon) -> None:
    drawn = draw_requests()
    assert len(drawn) > EXAMPLES // 2
    assert {path for _, path, _ in drawn} == {path for _, path in ROUTES}
    failures = []
    statuses: dict[int, int] = {}
    for method, path, data in drawn:
        status = await send(fuzzed, method, path, data)
        statuses[status] = statuses.get(status, 0) + 1
        if not (200 <= status < 300 or 400 <= status < 500):
            failures.append(f"{status} {method} {path} {data[:300]!r}")
    assert not failures, f"{len(failures)} of {len(drawn)} bodies got a 5xx:\n" + "\n".join(failures[:20])
    assert fuzzed.proc is not None
    assert fuzzed.proc.returncode is None
    assert (await fuzzed.get("/health"))[0] == 200
    assert fuzzed.events("handler_error") == []
    # The fuzz reached past the parser: some bodies were valid and answered.
    assert statuses.get(200, 0) > 10, statuses
    assert statuses.get(400, 0) > 10, statuses
