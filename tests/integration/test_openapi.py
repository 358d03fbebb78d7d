"""Schemathesis over the whole /openapi.json of a live daemon: no request causes a 5xx, every status is
one the document declares for its route, and every JSON answer matches the document's schema.

Cases are drawn up front (hypothesis with a fixed seed, no shrinking, no database), positive and
negative, for every operation, then sent one by one: @given does not drive async fixtures. Every other
body and path parameter that names a model is pointed at one that exists, so that cases reach past "no
such model" into loads, generation and the admin actions. The daemon is a throwaway: a case may unload,
pin or delete; no case depends on what another did.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.fakehub import FakeHub, point_daemons_at
from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon

SEED = 13
EXAMPLES = 30  # per operation and generation mode
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]
# Ollama's routes this server does not have: a 501 by design (documented), whatever the request.
NOT_SUPPORTED = {"/api/copy", "/api/create", "/api/push", "/api/blobs/{digest}"}
# An event stream never ends by itself (tests/integration/test_events.py follows it).
NEVER_ENDS = {("GET", "/v1/admin/events")}
EMBEDDING_ROUTES = {"/v1/embeddings", "/api/embed", "/api/embeddings"}
RERANK_ROUTES = {"/v1/rerank", "/rerank"}
PULL_ROUTES = {"/api/pull", "/api/pull/status/{model}", "/api/pull/{model}"}
# The fake hub has no repositories: a pull of this fails at once with 404.
MISSING_REPO = "hf.co/test-org/missing:Q4_K_M"
# What every other case names, by route (else the chat model).
REAL_MODEL = {
    **dict.fromkeys(EMBEDDING_ROUTES, "embed"),
    **dict.fromkeys(RERANK_ROUTES, "rank"),
    **dict.fromkeys(PULL_ROUTES, MISSING_REPO),
}
AnyCase = Case[Any]


@pytest.fixture
async def described(
    make_daemon: MakeDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    """A chat model that writes at most 4 tokens, an embeddings model, a reranker, and an empty hub to
    pull from."""
    hub = FakeHub()
    point_daemons_at(monkeypatch, await hub.start(), tmp_path / "hf")
    daemon = await make_daemon(
        models={
            "demo": {"max_output_tokens": 4},
            "embed": {"ctx_size": 512, "vram_mib": 256, "args": ["--embeddings", "--pooling", "mean"]},
            "rank": {"ctx_size": 512, "vram_mib": 256, "args": ["--reranking"]},
        }
    )
    yield daemon
    await hub.close()


def _steer(case: AnyCase, turn: int) -> None:
    """Point every other case at a real model (or at the missing repo, for pulls). Keep-alive fields are
    left out, since a tiny one only makes the next case wait for a load, and a load asks for one replica;
    a log is never followed, since that stream ends when the child does."""
    path = case.operation.path
    real = REAL_MODEL.get(path, "demo")
    if isinstance(case.body, dict):
        case.body.pop("keep_alive", None)
        if isinstance(case.body.get("replicas"), int):
            case.body["replicas"] = 1  # each more would only cost a child's start-up here
        if turn % 2 == 0 and "model" in case.body:
            case.body["model"] = real
    for name in ("name", "model"):
        if turn % 2 == 0 and case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = real
    if case.query:
        case.query.pop("follow", None)


def operations(schema: OpenApiSchema) -> list[APIOperation[Any, Any, Any, Any]]:
    """Every operation of the document; one schemathesis cannot read fails the test."""
    found = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()
        found.append(result.ok())
    return found


def draw_cases(schema: OpenApiSchema) -> list[AnyCase]:
    cases: list[AnyCase] = []
    for operation in operations(schema):
        if (operation.method.upper(), operation.path) in NEVER_ENDS:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @seed(SEED)
            @settings(
                max_examples=EXAMPLES,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(operation.as_strategy(generation_mode=mode))
            def collect(case: AnyCase) -> None:
                cases.append(case)

            try:
                collect()
            except Unsatisfiable:  # nothing to make wrong: no parameters and no body
                assert mode == GenerationMode.NEGATIVE
    for turn, case in enumerate(cases):
        _steer(case, turn)
    return cases


def _described(case: AnyCase, exc: FailureGroup | Failure) -> str:
    """What failed, in a few lines: the request, and each check that failed with what it saw."""
    found = exc.exceptions if isinstance(exc, FailureGroup) else (exc,)
    checks = "\n  ".join(sorted({f"{failure.title}: {failure.message}"[:400] for failure in found}))
    return f"{case.operation.method.upper()} {case.formatted_path} {case.body!r:.300}\n  {checks}"


async def test_every_route_answers_as_its_document_says(described: Daemon) -> None:
    # No NUL in strings: the body parser refuses one anywhere (tests/integration/test_fuzz.py sends them).
    config = schemathesis.Config.from_dict({"generation": {"allow-x00": False}})
    schema = await asyncio.to_thread(
        schemathesis.openapi.from_url, described.url + "/openapi.json", config=config
    )
    cases = await asyncio.to_thread(draw_cases, schema)
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for case in cases:
        try:
            response = await asyncio.to_thread(
                case.call_and_validate,
                base_url=described.url,
                checks=CHECKS[1:] if case.operation.path in NOT_SUPPORTED else CHECKS,
                timeout=60,
            )
            statuses[response.status_code] += 1
        except (FailureGroup, Failure) as exc:
            failures.append(_described(case, exc))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n\n".join(failures[:20])

    documented = {(operation.method.upper(), operation.path) for operation in operations(schema)}
    assert {(c.operation.method.upper(), c.operation.path) for c in cases} == documented - NEVER_ENDS
    assert described.events("handler_error") == []
    # The cases reached past the parsers: many were served, many refused.
    assert statuses[200] > 200, statuses
    assert statuses[400] > 200, statuses


async def test_the_document_needs_no_key(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={}, config={"api_key": "k" * 32})
    status, document = await daemon.get("/openapi.json")
    assert status == 200
    assert document["openapi"] == "3.1.0"
    assert document["paths"]["/openapi.json"]["get"]["security"] == []
    assert (await daemon.get("/v1/models"))[0] == 401
