"""Ollama's store routes on the Hugging Face cache: pull (with progress, reconnect, cancel) and delete."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from supervisor import errors
from supervisor.api.context import CATALOG, PULLS, SCHEDULER, STORE
from supervisor.errors import SupervisorError
from supervisor.pulls import Event, Pull, PullState
from supervisor.slots import SlotState

routes = web.RouteTableDef()


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise errors.bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise errors.bad_request("the body must be a JSON object")
    return body


def _model_field(body: dict[str, Any]) -> str:
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model.strip():
        raise errors.bad_request("'model' is required: e.g. hf.co/org/repo:Q4_K_M")
    return model.strip()


async def _stream(
    request: web.Request, first: Event, events: AsyncGenerator[Event, None]
) -> web.StreamResponse:
    """NDJSON progress; the pull goes on if the client goes away (only this stream ends)."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    await response.write(json.dumps(first).encode() + b"\n")
    async for event in events:
        await response.write(json.dumps(event).encode() + b"\n")
    await response.write_eof()
    return response


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    """Start (or join) a pull; streams Ollama's progress lines, or with `stream: false` answers at the end.

    An error found before any download (bad reference, no such repo or quant) is an HTTP error; one
    found later ends the stream with `{"error": ...}`.
    """
    body = await _body(request)
    job = request.app[PULLS].start(_model_field(body))
    events = job.events()
    first = await anext(events)
    await job.planned.wait()
    if job.done.is_set() and job.state != PullState.SUCCESS and job.name is None:
        await events.aclose()
        raise job.error or SupervisorError("pull_failed", "pull failed", 502)
    if body.get("stream", True) is False:
        await events.aclose()
        return await _final(job)
    return await _stream(request, first, events)


async def _final(job: Pull) -> web.Response:
    await asyncio.shield(job.done.wait())
    if job.state == PullState.SUCCESS:
        return web.json_response({"status": "success"})
    raise job.error or SupervisorError("pull_failed", "pull failed", 502)


@routes.get("/api/pull/status/{model:.+}")
async def pull_status(request: web.Request) -> web.StreamResponse:
    """Reconnect to a pull: its progress from now on, or how a recent one ended (one line)."""
    job = request.app[PULLS].find(request.match_info["model"])
    if job is None:
        raise SupervisorError(
            "pull_not_found", f"no pull of '{request.match_info['model']}' is running or recent", 404
        )
    events = job.events()
    first = await anext(events)
    return await _stream(request, first, events)


@routes.delete("/api/pull/{model:.+}")
async def cancel_pull(request: web.Request) -> web.Response:
    """Cancel a running pull; answers once its partial files are removed."""
    model = request.match_info["model"]
    job = await request.app[PULLS].cancel(model)
    if job is None:
        raise SupervisorError("pull_not_found", f"no pull of '{model}' is running", 404)
    return web.json_response({"status": "cancelled", "model": job.ref.key})


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    """Remove a pulled model: its files in the HF cache and its generated manifest. Not while it is
    loaded or being pulled; a model from a manifest file is deleted by editing that file."""
    name = _model_field(await _body(request))
    store = request.app[STORE]
    scheduler = request.app[SCHEDULER]
    stored = await asyncio.to_thread(store.find, name)
    manifest = scheduler.registry.resolve(name)
    if manifest is not None:
        source = scheduler.registry.sources.get(manifest.name)
        if source is not None and source.parent != store.records_dir:
            raise SupervisorError(
                "model_in_manifest",
                f"model '{name}' is defined by the manifest file {source}; remove it there and reload",
                409,
            )
    if stored is None:
        raise errors.model_not_found(name)
    if request.app[PULLS].pulling(stored.name):
        raise SupervisorError("model_busy", f"model '{name}' is being pulled; cancel the pull first", 409)
    slot = scheduler.resolve(stored.manifest_name)
    if slot is not None and (slot.state not in (SlotState.UNLOADED, SlotState.FAILED) or slot.load_task):
        raise SupervisorError(
            "model_busy",
            f"model '{name}' is loaded (state {slot.state}); unload it first (a request with keep_alive 0)",
            409,
        )
    store.forget(stored)
    request.app[CATALOG].refresh()  # unregistered before its files go
    await asyncio.to_thread(store.remove_files, stored.repo, stored.commit, [f.path for f in stored.files])
    return web.json_response({"status": "success"})
