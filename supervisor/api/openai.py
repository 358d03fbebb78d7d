"""OpenAI-compatible routes: inference passed through to the model's child, and the model list."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from supervisor import errors, proxy
from supervisor.api.context import REQUEST_MODEL, SCHEDULER, UPSTREAM
from supervisor.durations import parse_keep_alive

routes = web.RouteTableDef()

# Fields of ours that clients may add to a request; removed before the body reaches the engine.
_OUR_FIELDS = ("keep_alive",)


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object with a string `model`, or a 400 that says what is wrong."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise errors.bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise errors.bad_request("request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("'model' is required: a string naming the model (GET /v1/models)")
    return payload


async def _inference(request: web.Request) -> web.StreamResponse:
    request[REQUEST_MODEL] = "(unresolved)"  # counted and logged even when it fails before a model is known
    body = await request.read()
    payload = parse_body(body)
    keep_alive = None
    if any(field in payload for field in _OUR_FIELDS):
        if (raw := payload.pop("keep_alive", None)) is not None:
            try:
                keep_alive = parse_keep_alive(raw)
            except ValueError as exc:
                raise errors.bad_request(str(exc)) from None
        body = json.dumps(payload).encode()
    scheduler = request.app[SCHEDULER]
    ticket = await scheduler.acquire(payload["model"], keep_alive)
    request[REQUEST_MODEL] = ticket.slot.name
    try:
        stream = payload.get("stream") is True
        return await proxy.forward(
            request.app[UPSTREAM], request, ticket.slot.port, body, ticket.slot.name, stream
        )
    finally:
        ticket.release()


for _path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
    routes.post(_path)(_inference)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """Every configured model and alias, with the state of the model behind it."""
    scheduler = request.app[SCHEDULER]
    created = int(time.time())
    data: list[dict[str, Any]] = []
    for name, slot in scheduler.slots.items():
        entry = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "llm-supervisor",
            "state": str(slot.state),
            "engine": slot.manifest.engine,
            "aliases": list(slot.manifest.aliases),
        }
        data.append(entry)
        data.extend({**entry, "id": alias, "alias_of": name} for alias in slot.manifest.aliases)
    return web.json_response({"object": "list", "data": data})
