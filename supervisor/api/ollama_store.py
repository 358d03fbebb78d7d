"""Ollama's store routes on the Hugging Face cache: pull (with progress, reconnect, cancel) and delete;
and Ollama's routes that make or publish models, refused with what to do instead."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any, Final

import structlog
from aiohttp import web

from supervisor import errors
from supervisor.api.context import CATALOG, PULLS, SCHEDULER, STORE
from supervisor.bodies import parse_object
from supervisor.errors import SupervisorError
from supervisor.ollama_translate import dump_line
from supervisor.pulls import Event, Pull, PullState

log = structlog.get_logger("api")
routes = web.RouteTableDef()
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}
PLAN_WAIT_S = 5.0  # how long a streamed pull's answer waits for its files to be chosen


def _model_field(body: dict[str, Any]) -> str:
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model.strip():
        raise errors.bad_request("'model' is required: e.g. hf.co/org/repo:Q4_K_M")
    return model.strip()


async def _stream(
    request: web.Request, first: Event, events: AsyncGenerator[Event, None]
) -> web.StreamResponse:
    """NDJSON progress; the pull goes on if the client goes away (only this stream ends, quietly)."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
        await response.write(dump_line(first))
        async for event in events:
            await response.write(dump_line(event))
        await response.write_eof()
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the client went away
        log.debug("pull_watcher_gone", path=request.path)
    return response


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    """Start (or join) a pull; streams Ollama's progress lines, or with `stream: false` answers at the end.

    An error found before any download (bad reference, no such repo or quant) is an HTTP error; one
    found later ends the stream with `{"error": ...}`.
    """
    body = parse_object(await request.read())
    stream = body.get("stream", True)
    if stream is not None and not isinstance(stream, bool):  # as /api/chat: "false" or 0 is no boolean
        raise errors.bad_request(f"stream must be true or false, not {stream!r}")
    job = request.app[PULLS].start(_model_field(body))
    if stream is False:
        return await _final(job)
    async with contextlib.aclosing(job.events()) as events:
        first = await anext(events)
        # The files are chosen in a moment, and a failure to (no such repo or quant) is an HTTP error. A hub
        # slow to list the repo does not hold the client in silence: after PLAN_WAIT_S the stream begins
        # (with heartbeats), and a failure then is its last line.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PLAN_WAIT_S):
                await job.planned.wait()
        if job.done.is_set() and job.state != PullState.SUCCESS and job.name is None:
            raise job.error or SupervisorError("pull_failed", "pull failed", 502)
        return await _stream(request, first, events)


async def _final(job: Pull) -> web.Response:
    await asyncio.shield(job.done.wait())
    if job.state == PullState.SUCCESS:
        return web.json_response({"status": "success"})
    raise job.error or SupervisorError("pull_failed", "pull failed", 502)


@routes.get("/api/pull/status/{model:.+}")
async def pull_status(request: web.Request) -> web.StreamResponse:
    """Reconnect to a pull: its progress from now on, or how a recent one ended (one line). With
    `?stream=false`, one object: its state and bytes and files done, totalled over all its files."""
    stream = request.query.get("stream", "true").lower()
    if stream not in _BOOLEANS:
        raise errors.bad_request(f"stream must be true or false, not {stream!r}")
    job = request.app[PULLS].find(request.match_info["model"])
    if job is None:
        raise SupervisorError(
            "pull_not_found", f"no pull of '{request.match_info['model']}' is running or recent", 404
        )
    if not _BOOLEANS[stream]:
        return web.json_response(job.progress())
    async with contextlib.aclosing(job.events()) as events:
        first = await anext(events)
        return await _stream(request, first, events)


@routes.delete("/api/pull/{model:.+}")
async def cancel_pull(request: web.Request) -> web.Response:
    """Cancel a running pull; answers once its partial files are removed (200), or 202 if it is still
    stopping after a while, or 409 if it finished first."""
    model = request.match_info["model"]
    job = await request.app[PULLS].cancel(model)
    if job is None:
        raise SupervisorError("pull_not_found", f"no pull of '{model}' is running", 404)
    if job.state == PullState.CANCELLED:
        return web.json_response({"status": "cancelled", "model": job.ref.key})
    if not job.done.is_set():
        return web.json_response({"status": "cancelling", "model": job.ref.key}, status=202)
    raise SupervisorError(
        "pull_finished", f"the pull of '{model}' already finished ({job.state}); nothing to cancel", 409
    )


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    """Remove a pulled model: its record and generated manifest, and the files the daemon downloaded for
    it that nothing else uses (files it adopted from the cache, or that a configured model, another
    record or another snapshot uses, stay). Not while it is loaded or being pulled; a model from a
    manifest file is deleted by editing that file."""
    name = _model_field(parse_object(await request.read()))
    store = request.app[STORE]
    scheduler = request.app[SCHEDULER]
    catalog = request.app[CATALOG]
    async with catalog.lock:  # no pull's or SIGHUP's refresh in between
        stored = await asyncio.to_thread(store.find, name)
        registry = (
            None if stored is None else await asyncio.to_thread(catalog.registry, leaving_out=stored.name)
        )
        # From here to the reload nothing is awaited: no load or pull can begin between check and reload.
        manifest = scheduler.registry.resolve(name)
        if manifest is not None:
            source = scheduler.registry.sources.get(manifest.name)
            if source is not None and source.parent != store.records_dir:
                raise SupervisorError(
                    "model_in_manifest",
                    f"model '{name}' is defined by the manifest file {source}; remove it there and reload",
                    409,
                )
        if stored is None or registry is None:
            raise errors.model_not_found(name)
        if request.app[PULLS].pulling(stored.repo):
            raise SupervisorError(
                "model_busy",
                f"model '{name}': a pull from hf.co/{stored.repo} is running; wait for it or cancel it first",
                409,
            )
        slot = scheduler.resolve(stored.manifest_name)
        if slot is not None and slot.in_use:
            raise SupervisorError(
                "model_busy",
                f"model '{name}' is loaded (state {slot.state}); "
                "unload it first (a request with keep_alive 0)",
                409,
            )
        catalog.apply(registry)  # unregistered before its files go
        # Under the lock: no reload can add a manifest that uses a file between the check and the unlink.
        # A pull of the repo asked for meanwhile waits for the files to be gone, then downloads them anew.
        with request.app[PULLS].deleting(stored.repo):
            try:
                await asyncio.to_thread(catalog.delete, stored)
            except (OSError, ValueError) as exc:  # its record is gone: deleted, but some files stay
                log.warning("store_files_left", model=stored.name, error=str(exc))
    log.info("store_model_deleted", model=stored.name, downloaded=stored.downloaded)
    return web.json_response({"status": "success"})


# Ollama's routes that make, copy or publish models. Answered 501 with what to do here instead: their
# 404 "no route" read like a wrong base URL or a missing model.
_NOT_SUPPORTED: Final = {
    "/api/copy": "to serve a model under another name too, add that name to `aliases` in its manifest",
    "/api/create": "models are defined by manifest files (models_dir), or pulled from Hugging Face with "
    "/api/pull",
    "/api/push": "this server does not publish models; it pulls them from Hugging Face with /api/pull",
    "/api/blobs": "blobs are uploaded for /api/create, which this server does not have: put the weights "
    "on disk and name them in a manifest, or pull them with /api/pull",
}


@routes.post("/api/copy")
@routes.post("/api/create")
@routes.post("/api/push")
@routes.post("/api/blobs/{digest}")
@routes.head("/api/blobs/{digest}")
async def not_supported(request: web.Request) -> web.StreamResponse:
    """Ollama's copy, create, push and blob upload: a 501 that says what to do instead."""
    route = "/api/blobs" if request.path.startswith("/api/blobs/") else request.path
    raise SupervisorError(
        "not_supported", f"{route} is not supported by this server: {_NOT_SUPPORTED[route]}", 501
    )
