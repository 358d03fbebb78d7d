"""Reranking (`/v1/rerank`, `/rerank`): Jina's and Cohere's API, as llama-server started with
`--reranking` serves it and as RAG tools (Open WebUI's external reranker, LangChain's) call it, against a
real daemon and real llama-server children. The demo model's random weights give arbitrary scores; what
is checked is the routing, the checks and the accounting, on both of the daemon's servers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon
from tests.integration.test_observability import scrape, value

RERANK = {"model": "ranker", "query": "where is the cat?", "documents": ["the cat sat", "a dog", "rain"]}


@pytest.fixture
async def served(make_daemon: MakeDaemon) -> Daemon:
    return await make_daemon(
        models={"ranker": {"args": ["--reranking"], "ctx_size": 512, "parallel": 1}, "demo": {}}
    )


async def _http_1_0(daemon: Daemon, path: str, body: dict[str, Any]) -> tuple[bytes, Any]:
    """HTTP/1.0 clients are served by aiohttp's relay (proxy.forward), not the front."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(payload)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
async def test_a_reranker_ranks_the_documents_on_both_servers(served: Daemon, path: str) -> None:
    status, answer, headers = await served.post(path, {**RERANK, "top_n": 2})
    assert status == 200, answer
    assert answer["model"] == "ranker"
    assert len(answer["results"]) == 2  # top_n kept the best two
    scores = [result["relevance_score"] for result in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    assert {result["index"] for result in answer["results"]} <= {0, 1, 2}
    assert headers["X-Request-Id"]

    status_line, whole = await _http_1_0(served, path, RERANK)
    assert b" 200 " in status_line, status_line
    assert sorted(result["index"] for result in whole["results"]) == [0, 1, 2]


async def test_a_reranking_is_counted_with_its_prompt_tokens(served: Daemon) -> None:
    status, answer, _ = await served.post("/v1/rerank", RERANK)
    assert status == 200, answer
    text = await scrape(served)
    assert value(text, "llm_supervisor_requests_total", model="ranker", status="200") == 1
    prompt_tokens = value(text, "llm_supervisor_prompt_tokens_total", model="ranker")
    assert prompt_tokens == answer["usage"]["prompt_tokens"]
    assert served.events("request", model="ranker", path="/v1/rerank", status=200)


async def test_a_model_that_does_not_rerank_is_refused_before_it_loads(served: Daemon) -> None:
    status, body, _ = await served.post("/v1/rerank", {**RERANK, "model": "demo"})
    assert (status, body["error"]["code"]) == (400, "rerank_unsupported")
    assert "--reranking" in body["error"]["message"]
    assert not served.children()  # nothing was started for it


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": None}, "query: is required"),
        ({"documents": []}, "documents: must not be an empty list"),
        ({"documents": "one"}, "documents: must be a list"),
        ({"documents": ["a", 7]}, "documents[1]: must be a string or an object"),
        ({"top_n": -1}, "top_n"),
        ({"return_documents": "yes"}, "return_documents"),
    ],
)
async def test_a_malformed_reranking_is_a_400_naming_the_field(
    served: Daemon, change: dict[str, Any], message: str
) -> None:
    body = {key: val for key, val in {**RERANK, **change}.items() if val is not None}
    status, answer, _ = await served.post("/v1/rerank", body)
    assert (status, answer["error"]["code"]) == (400, "invalid_request"), answer
    assert message in answer["error"]["message"]
    assert not served.children()


async def test_a_reranker_is_listed_with_its_capability(served: Daemon) -> None:
    status, card, _ = await served.post("/api/show", {"model": "ranker"})
    assert status == 200
    assert "rerank" in card["capabilities"]
    assert "embedding" not in card["capabilities"]  # llama-server's rank pooling gives scores, not vectors
