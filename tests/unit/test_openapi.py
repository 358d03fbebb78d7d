"""The OpenAPI document: every route of the app is in it, and its body schemas say what the daemon's own
checks (supervisor/bodies.py, supervisor/ollama_translate.py) accept, no more and no less."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel
from schemathesis.core.result import Err, Ok

from supervisor import access, bodies
from supervisor import ollama_translate as translate
from supervisor.api import openapi
from supervisor.api import openapi_document as doc
from supervisor.api import schemas as s
from supervisor.app import build_app
from supervisor.config import Settings
from supervisor.errors import SupervisorError
from supervisor.keys import KeyRing
from supervisor.manifests import Registry


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> web.Application:
    state = tmp_path_factory.mktemp("state")
    return build_app(Settings(state_dir=state, store_dir=Path(state, "store")), Registry(), KeyRing([]))


@pytest.fixture(scope="module")
def document(app: web.Application) -> dict[str, Any]:
    read: dict[str, Any] = json.loads(json.dumps(doc.build_document(app.router)))  # as a client reads it
    return read


def _operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item}


def test_every_route_of_the_app_is_described(app: web.Application, document: dict[str, Any]) -> None:
    assert doc.undocumented(app.router) == [], "add the new route to doc.OPERATIONS"
    served = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
    }
    # aiohttp answers HEAD beside every GET; the document names HEAD only where clients rely on it.
    assert _operations(document) == {key for key in served if key[0] != "HEAD" or key in doc.OPERATIONS}
    assert not set(doc.OPERATIONS) - _operations(document), "OPERATIONS names a route the app lacks"


def test_the_document_loads_as_openapi_3_1(document: dict[str, Any]) -> None:
    schema = schemathesis.openapi.from_dict(document)
    results = list(schema.get_all_operations())
    assert all(isinstance(result, Ok) for result in results), [r.err() for r in results if isinstance(r, Err)]
    assert len(results) == len(_operations(document))
    for name, component in document["components"]["schemas"].items():
        jsonschema_rs.Draft202012Validator({**component, "components": document["components"]})
        assert name.isidentifier()


def test_open_routes_need_no_key_and_the_others_name_both_ways_to_send_one(document: dict[str, Any]) -> None:
    assert access.required_role("GET", "/openapi.json", metrics_public=False) is None
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schemes["bearer"]["description"],
    }
    assert schemes["apiKey"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    for method, path in _operations(document):
        operation = document["paths"][path][method.lower()]
        is_open = access.required_role(method, path, metrics_public=False) is None
        assert ("security" in operation and operation["security"] == []) == is_open, (method, path)
        assert ("401" in operation["responses"]) != is_open, (method, path)


def test_errors_have_the_shape_of_their_api(document: dict[str, Any]) -> None:
    for method, path in _operations(document):
        for status, answer in document["paths"][path][method.lower()]["responses"].items():
            if int(status) < 400 or path in ("/health", "/health/ready"):
                continue
            shape = "OllamaError" if path.startswith("/api/") else "OpenAIError"
            assert answer["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{shape}"
            }, (method, path, status)


def test_admin_action_bodies_refuse_unknown_fields(document: dict[str, Any]) -> None:
    components = document["components"]["schemas"]
    fields = {
        "LoadRequest": {"overrides", "replicas", "wait", "keep_alive", "restart"},
        "UnloadRequest": {"queued"},
        "PinRequest": {"wait"},
        "UnpinRequest": set(),
    }
    for name, expected in fields.items():
        assert components[name]["additionalProperties"] is False
        assert set(components[name].get("properties", {})) == expected
    assert components["LoadRequest"]["properties"]["replicas"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 64,
    }
    assert components["UnloadRequest"]["properties"]["queued"]["enum"] == ["serve", "cancel"]
    assert s.LoadRequest.model_validate({}).wait is True
    with pytest.raises(ValueError, match="Extra inputs"):
        s.UnpinRequest.model_validate({"wait": True})


# --- the body schemas against the daemon's checks ------------------------------------------------------


def _validator(document: dict[str, Any], model: type[BaseModel]) -> jsonschema_rs.Validator:
    return jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{model.__name__}", "components": document["components"]}
    )


CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCALARS: list[Any] = [
    None, True, 0, -1, -2, 1, 2.0, 1.5, 128, 129, 65536, 65537, 2**31 - 1, 2**31, 2**63, 2**64 - 1, 2**64,
    -(2**63) - 1, "", "x", [], {}, ["x"], [1], [[1]], [{}], {"a": 1}, {"a": "x"},
    {"include_usage": True}, {"include_usage": "x"},
]  # fmt: skip
MESSAGES: list[Any] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user"}],
    [{"content": "hi"}],
    [{"role": 1, "content": "hi"}],
    [{"role": "user", "content": 1}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"text": "hi"}]}],
    [{"role": "user", "content": ["hi"]}],
    [{"role": "user", "content": "hi", "name": None}],
    [{"role": "user", "content": "hi", "name": "n"}],
    [{"role": "tool", "content": "x", "tool_call_id": None}],
    [{"role": "assistant", "reasoning_content": None}],
    [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
    [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}],
    [{"role": "assistant", "tool_calls": [{"function": CALL["function"]}]}],
    [{"role": "assistant", "tool_calls": [{**CALL, "type": "other"}]}],
    [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
    [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
    [{"role": "assistant", "tool_calls": [{**CALL, "id": 3}]}],
    [{"role": "assistant", "tool_calls": [{}]}],
    ["hi"],
]
TOOLS: list[Any] = [
    [TOOL],
    [{"type": "function"}],
    [{"function": {"name": "f"}}],
    [{"type": "function", "function": {}}],
    [{"type": "other", "function": {"name": "f"}}],
    [{}],
    ["x"],
]
PROMPTS: list[Any] = [
    "hi", "", [], ["a"], [1, 2], ["a", 2], [[1, 2]], [[]], [[-1]], [[1], "a"], [[1], 2], [True], [None],
    [{"prompt_string": "x"}], [{"prompt_string": "x", "multimodal_data": []}], [{"a": 1}],
    {"prompt_string": "x"}, [2**31],
]  # fmt: skip
PROBES: dict[str, list[Any]] = {"messages": MESSAGES, "tools": TOOLS, "prompt": PROMPTS, "input": PROMPTS}
OPENAI_BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/embeddings": {"model": "m", "input": "hi"},
}


def _daemon_accepts_openai(path: str, body: dict[str, Any]) -> bool:
    try:
        bodies.check_openai_fields(path, bodies.parse_body(json.dumps(body).encode()))
    except SupervisorError:
        return False
    return True


@pytest.mark.parametrize("path", sorted(OPENAI_BASES))
def test_openai_body_schemas_accept_what_the_field_checks_accept(path: str, document: dict[str, Any]) -> None:
    model = doc.OPERATIONS[("POST", path)].body
    assert model is not None
    validator = _validator(document, model)
    fields, _ = bodies._ROUTE_FIELDS[path]
    assert set(fields) <= set(model.model_fields), "a checked field the document does not name"
    disagreements = []
    for name in fields:
        for value in [*SCALARS, *PROBES.get(name, [])]:
            body = {**OPENAI_BASES[path], name: value}
            daemon, document_says = _daemon_accepts_openai(path, body), validator.is_valid(body)
            if daemon != document_says:
                disagreements.append(f"{name}={value!r}: daemon {daemon}, document {document_says}")
    assert not disagreements, "\n".join(disagreements)


OLLAMA_ROUTES: dict[str, tuple[type[BaseModel], tuple[str, ...]]] = {
    "chat": (s.OllamaChatRequest, ("options", "format", "think", "messages", "tools")),
    "generate": (s.OllamaGenerateRequest, ("options", "format", "think", "prompt", "system", "raw")),
    "embed": (s.OllamaEmbedRequest, ("options", "input", "truncate", "dimensions")),
    "embeddings": (s.OllamaEmbeddingsRequest, ("options", "prompt")),
}
# Checked for their content beyond their type (base64 pictures; features refused unless empty), so the
# document is looser there: images, template, suffix, context.
OLLAMA_PROBES: dict[str, list[Any]] = {
    "format": ["json", "", "xml", {"type": "object"}],
    "think": ["low", "high", "max"],
    "messages": [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi", "images": "x"}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
        [{"role": "assistant", "tool_calls": ["x"]}],
        [{"role": "tool", "content": "x", "tool_name": 1}],
        [{"content": "hi"}],
        ["hi"],
    ],
    "tools": [
        [TOOL],
        [{"function": {"name": "f"}}],
        [{"type": "other", "function": {"name": "f"}}],
        [{}],
        ["x"],
    ],
    "input": [["a", "b"], ["a", 1]],
}


def _ollama_options() -> list[dict[str, Any]]:
    names = [*translate._INTEGER_OPTIONS, *translate._NUMBER_OPTIONS, *translate._BOOLEAN_OPTIONS, "stop"]
    return [{name: value} for name in names for value in SCALARS]


@pytest.mark.parametrize("route", sorted(OLLAMA_ROUTES))
def test_ollama_body_schemas_accept_what_the_checks_accept(route: str, document: dict[str, Any]) -> None:
    model, fields = OLLAMA_ROUTES[route]
    validator = _validator(document, model)
    disagreements = []
    for name in fields:
        values = [*SCALARS, *OLLAMA_PROBES.get(name, [])] + (_ollama_options() if name == "options" else [])
        for value in values:
            body = {"model": "m", name: value}
            try:
                translate.check_request(route, body)
                daemon = True
            except translate.TranslationError:
                daemon = False
            if daemon != validator.is_valid(body):
                disagreements.append(f"{name}={value!r}: daemon {daemon}, document {not daemon}")
    assert not disagreements, "\n".join(disagreements)


async def test_the_route_builds_the_document_once_and_answers_it_as_json() -> None:
    app = web.Application()
    app.add_routes(openapi.routes)
    async with TestClient(TestServer(app)) as client:
        first = await client.get("/openapi.json")
        assert first.status == 200
        assert first.content_type == "application/json"
        body = await first.read()
        assert openapi._DOCUMENTS[app] == body
        assert await (await client.get("/openapi.json")).read() == body
    assert set(json.loads(body)["paths"]) == {"/openapi.json"}
