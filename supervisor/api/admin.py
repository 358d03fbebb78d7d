"""Operator routes: what the GPUs hold, each model's state, load/unload/pin, live events and child logs.

Routes read slots to answer and ask the scheduler to act; they never change a slot themselves.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any, TypeVar
from urllib.parse import quote

import structlog
from aiohttp import web
from pydantic import BaseModel, ValidationError

from supervisor import access, secrets
from supervisor import overrides as load_overrides
from supervisor.api import fleet_view
from supervisor.api.admin_bodies import LoadRequest, PinRequest, UnloadRequest, UnpinRequest
from supervisor.api.context import ACCESS, EVENTS, SCHEDULER, STORE
from supervisor.api.ollama_models import describe
from supervisor.bodies import parse_object
from supervisor.capabilities import capabilities
from supervisor.durations import parse_keep_alive
from supervisor.errors import SupervisorError, bad_request
from supervisor.events import vram_source
from supervisor.gpus import DEFAULT_SIMULATED_MIB
from supervisor.model_info import catalog_for
from supervisor.scheduler import Scheduler
from supervisor.slots import ModelSlot, SlotState, aggregate_state

log = structlog.get_logger("api.admin")
routes = web.RouteTableDef()
T = TypeVar("T")
Action = TypeVar("Action", bound=BaseModel)

HEARTBEAT_S = 15.0  # an idle event or log stream sends a comment this often (proxies close silent ones)
_RUNNING = (SlotState.LOADING, SlotState.READY, SlotState.DRAINING, SlotState.STOPPING)
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx would otherwise hold events back
}


@routes.get("/v1/admin/gpu-memory")
async def gpu_memory(request: web.Request) -> web.Response:
    """Per GPU: total, used, free, margin, leases (model, MiB, state, pid) and, with NVML, processes."""
    return web.json_response(await _gpu_report(request.app[SCHEDULER]))


async def _gpu_report(scheduler: Scheduler) -> dict[str, Any]:
    """The GPU memory report, and for an assumed GPU why (here and in the events' snapshot)."""
    report = await scheduler.gpu_memory()
    if scheduler.inventory.assumed:
        # The GPU the scheduler budgets against, as /health, /metrics and the events show it, with why
        # (a 503 here left the dashboard's GPU panel an error on the quick start's machine).
        report["assumed"] = True
        report["warning"] = (
            "no NVIDIA GPU was found through NVML and no `gpus` are declared in the daemon config; the "
            f"scheduler is assuming one simulated {DEFAULT_SIMULATED_MIB} MiB GPU. Declare "
            "`gpus: [{index: 0, total_mib: ...}]` to make the budget explicit."
        )
    return report


# --- models -----------------------------------------------------------------------------------------


@routes.get("/v1/admin/models")
async def models(request: web.Request) -> web.Response:
    """Every model served, loaded or not, as `model_document` describes it."""
    return web.json_response({"models": await _documents(request)})


@routes.get("/v1/admin/models/{name}")
async def model(request: web.Request) -> web.Response:
    """One model; with `?overrides={...}` (JSON), its vram_estimate is what a load with them would lease."""
    slot = request.app[SCHEDULER].slot_for(request.match_info["name"])
    preview = None
    if "overrides" in request.query:
        try:
            raw = parse_object(request.query["overrides"].encode())
        except SupervisorError as exc:
            raise SupervisorError("invalid_load_request", f"overrides: {exc.message}", 400) from None
        preview = await asyncio.to_thread(load_overrides.parse_overrides, slot.manifest, raw)
    return web.json_response(await model_document(request, slot, preview))


@routes.post("/v1/admin/models/{name}/load")
async def load(request: web.Request) -> web.Response:
    """Load now: 200 once READY, or 202 at once with `wait: false`; concurrent calls share one load."""
    scheduler = request.app[SCHEDULER]
    slot = scheduler.slot_for(request.match_info["name"])
    options = await _options(request, "invalid_load_request", LoadRequest)
    overrides = None
    if "overrides" in options.model_fields_set:  # reads the model's metadata: not on the event loop
        overrides = await asyncio.to_thread(load_overrides.parse_overrides, slot.manifest, options.overrides)
    keep_alive = None
    if options.keep_alive is not None:
        try:
            keep_alive = parse_keep_alive(options.keep_alive)
        except ValueError as exc:
            raise SupervisorError("invalid_load_request", f"keep_alive: {exc}", 400) from None
    await scheduler.load(
        slot.name,
        keep_alive,
        options.wait,
        options.replicas,
        overrides,
        options.restart,
        scale_down=options.replicas is not None,  # the operator's count: a target, not a minimum
    )
    return await _after_load(request, slot.name, options.wait)


@routes.post("/v1/admin/models/{name}/unload")
async def unload(request: web.Request) -> web.Response:
    """Unload: 200 once UNLOADED. `queued`: "serve" (default) answers waiting requests first, "cancel"
    answers them 503 model_unloading. In-flight requests finish, for up to drain_timeout_s."""
    scheduler = request.app[SCHEDULER]
    slot = scheduler.slot_for(request.match_info["name"])
    options = await _options(request, "invalid_unload_request", UnloadRequest)
    await scheduler.unload_model(slot.name, cancel_queued=options.queued == "cancel")
    return await _document_response(request, slot.name)


@routes.post("/v1/admin/models/{name}/pin")
async def pin(request: web.Request) -> web.Response:
    """Pin until unpin or restart (loads it; never evicted or idled out): 200 once READY, 202 with
    `wait: false`. A failed load answers 503 and leaves the pin, whose keeper retries after the back-off."""
    scheduler = request.app[SCHEDULER]
    slot = scheduler.slot_for(request.match_info["name"])
    options = await _options(request, "invalid_pin_request", PinRequest)
    scheduler.pin(slot.name)
    if options.wait:
        try:
            await scheduler.load(slot.name)
        except SupervisorError as exc:
            # The pin stays, and its keeper retries: said, since a bare failure reads as nothing done.
            raise SupervisorError(
                exc.code,
                f"{exc.message}; it stays pinned and is retried after the back-off "
                f"(POST /v1/admin/models/{slot.name}/unpin to stop)",
                exc.status,
                exc.retry_after,
            ) from None
    return await _after_load(request, slot.name, options.wait)


@routes.post("/v1/admin/models/{name}/unpin")
async def unpin(request: web.Request) -> web.Response:
    """Drop the pin (a manifest's too, until restart): keep-alive and eviction apply again."""
    scheduler = request.app[SCHEDULER]
    slot = scheduler.slot_for(request.match_info["name"])
    await _options(request, "invalid_unpin_request", UnpinRequest)
    scheduler.unpin(slot.name)
    return await _document_response(request, slot.name)


async def model_document(
    request: web.Request, slot: ModelSlot, preview: load_overrides.Overrides | None = None
) -> dict[str, Any]:
    """One model as operators see it: state, its replicas, queue, keep-alive, pin, VRAM estimate (with
    `preview` overrides: what a load with them would lease), capabilities, the overrides it accepts and
    runs with, and its manifest (secrets masked; paths cut unless the caller sees internals)."""
    scheduler = request.app[SCHEDULER]
    sees_internals = access.caller(request).sees_internals
    manifest = slot.manifest
    info = await describe(catalog_for(scheduler.settings.state_dir), manifest)
    group = scheduler.group(slot.name) or [slot]
    override = scheduler.overrides.get(slot.name)
    leased = any(scheduler.leases.get(s.key) is not None for s in group)
    source = scheduler.registry.sources.get(manifest.name)
    records = request.app[STORE].records_dir
    errors_seen = [s.last_error for s in group if s.last_error is not None]
    error = max(errors_seen, key=lambda e: e.at) if errors_seen else None
    document: dict[str, Any] = {
        "name": manifest.name,
        "engine": manifest.engine,
        "aliases": list(manifest.aliases),
        "source": "store" if source is not None and source.is_relative_to(records) else "manifest",
        "state": str(aggregate_state(group)),
        # A load under way that has no lease yet (waiting for room) leaves the state `unloaded`.
        "load_pending": any(s.load_task is not None for s in group),
        "replicas": [_replica(scheduler, s) for s in group],
        "replica_limit": manifest.replica_limit,
        "inflight": sum(s.inflight for s in group),
        "queue_depth": slot.queued,
        "last_error": None if error is None else {**error.as_dict(), "at": error.at},
        "keep_alive": None if math.isinf(slot.keep_alive_s) else slot.keep_alive_s,
        "expires_at": scheduler.expires_at(slot),
        "pinned": slot.pinned,
        "pin_source": "manifest" if slot.pin_override is None else "runtime",
        "priority": manifest.priority,
        "vram_estimate": await (
            _estimate(scheduler, slot, False, preview)
            if preview
            else _estimate(scheduler, slot, leased, override)
        ),
        "capabilities": capabilities(manifest, info),
        "load_constraints": await asyncio.to_thread(load_overrides.load_constraints, manifest),
        "load_override": load_overrides.describe(override),
    }
    # Failure reasons and stderr tails can hold paths and whatever an engine printed.
    shown: dict[str, Any] = secrets.shown(document, sees_internals)
    shown["definition"] = secrets.manifest_document(manifest, sees_internals)
    return shown


def _replica(scheduler: Scheduler, slot: ModelSlot) -> dict[str, Any]:
    lease = scheduler.leases.get(slot.key)
    process = slot.process if slot.state in _RUNNING else None
    return {
        "id": slot.replica_id,
        "state": str(slot.state),
        "pid": process.pid if process is not None else None,
        "gpus": lease.gpu_indices if lease is not None else [],
        "vram_mib": sum(lease.mib_by_gpu.values()) if lease is not None else None,
        "inflight": slot.inflight,
        "queued": len(slot.admission),
        "since": round(slot.entered_wall, 3),
    }


async def _estimate(
    scheduler: Scheduler, slot: ModelSlot, leased: bool, override: load_overrides.Overrides | None
) -> dict[str, Any]:
    """The figure its lease was sized by while it holds one, else what a load would lease now (with the
    active overrides)."""
    estimate = slot.estimate if leased else None
    if estimate is None:
        try:
            estimate = await scheduler.vram_estimate(slot.manifest, override)
        except SupervisorError as exc:
            return {"mib": None, "source": "unavailable", "detail": exc.message}
        except Exception as exc:  # odd weights must not break the listing of the other models
            log.warning("vram_estimate_failed", model=slot.name, error=repr(exc))
            return {"mib": None, "source": "unavailable", "detail": f"estimate failed: {exc!r}"}
    return {"mib": estimate.mib, "source": vram_source(estimate.source), "detail": estimate.detail}


async def _documents(request: web.Request) -> list[dict[str, Any]]:
    slots = list(request.app[SCHEDULER].slots.values())
    documents = await asyncio.gather(*(model_document(request, s) for s in slots))
    fleet = fleet_view.nodes(request.app)
    return [fleet_view.annotate(d, s.name, fleet) for d, s in zip(documents, slots, strict=True)]


async def _document_response(request: web.Request, name: str, status: int = 200) -> web.Response:
    slot = request.app[SCHEDULER].slot_for(name)  # a reload may have removed it meanwhile
    # Quoted whole: a pulled model's name (hf.co/org/repo:Q4_K_M) holds slashes, which the route's
    # {name} takes only encoded.
    headers = {"Location": f"/v1/admin/models/{quote(slot.name, safe='')}"} if status == 202 else None
    return web.json_response(await model_document(request, slot), status=status, headers=headers)


async def _after_load(request: web.Request, name: str, waited: bool) -> web.Response:
    if not waited:
        await asyncio.sleep(0)  # the load's task takes its first step, so the 202 shows it pending
    return await _document_response(request, name, 200 if waited else 202)


async def _options(request: web.Request, code: str, model: type[Action]) -> Action:
    """The optional JSON object body of an action, validated by its pydantic model (the one
    /openapi.json documents); a wrong or unknown field is a 400 naming it."""
    raw = (await request.read()).strip()
    try:
        payload = {} if raw in (b"", b"null") else parse_object(raw)
    except SupervisorError as exc:
        raise SupervisorError(code, exc.message, 400) from None
    try:
        return model.model_validate(payload, strict=True)  # strict: "true" is not a bool
    except ValidationError as exc:
        found = exc.errors()
        first = found[0]
        # The field, not pydantic's path into its type: `keep_alive.float` was a union's first branch.
        named = first["loc"][:1] if first["loc"] and first["loc"][0] in model.model_fields else first["loc"]
        field = ".".join(str(part) for part in named) or "body"
        if first["type"] == "extra_forbidden":
            accepted = ", ".join(model.model_fields) or "no fields"
            raise bad_request(f"{field}: unknown field; this action accepts {accepted}", code) from None
        # Each branch of a union refused it: say what each wanted.
        said = dict.fromkeys(e["msg"] for e in found if e["loc"][:1] == first["loc"][:1])
        raise bad_request(f"{field}: {'; or '.join(said)}", code) from None


# --- live events and logs -----------------------------------------------------------------------------


@routes.get("/v1/admin/events")
async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a `snapshot` (models, gpus), then each change as it happens, and `: ping`
    every HEARTBEAT_S. A follower too slow to keep up is dropped: its stream ends, it reconnects."""
    scheduler = request.app[SCHEDULER]
    sees_internals = access.caller(request).sees_internals
    # Subscribed before the snapshot is built: a change made meanwhile follows it, none is lost.
    subscription = request.app[EVENTS].subscribe()
    response = web.StreamResponse(headers=_SSE_HEADERS)
    try:
        # The GPU report whole, an assumed GPU's warning included, not only its `gpus`.
        snapshot = {"models": await _documents(request), **await _gpu_report(scheduler)}
        await response.prepare(request)
        await _send(response, "snapshot", snapshot)
        async for event in _with_pings(request, response, subscription):
            await _send(response, event.type, secrets.shown(event.data, sees_internals))
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the follower went away
        pass
    finally:
        subscription.close()
    return response


@routes.get("/v1/admin/models/{name}/logs")
async def logs(request: web.Request) -> web.StreamResponse:
    """The child's last stdout/stderr lines (`tail`, default all the ring buffer holds) as JSON, or with
    `follow=1` as server-sent `log` events, then each new line until the child exits or the client leaves.
    Once the child has stopped (a crash, a failed start, an unload) its lines stay until the next starts:
    they are what an operator looks at after a crash."""
    scheduler = request.app[SCHEDULER]
    slot = _replica_slot(scheduler, request)
    sees_internals = access.caller(request).sees_internals
    tail = _tail(request.query.get("tail"))
    process = slot.process if slot.process is not None else slot.last_child
    if not _follow(request.query.get("follow")):
        lines = [entry.line for entry in process.output()] if process is not None else []
        if tail is not None:
            lines = lines[max(0, len(lines) - tail) :] if tail else []
        return web.json_response(
            {
                "model": slot.name,
                "pid": process.pid if process is not None else None,
                "running": process is not None and process is slot.process and process.returncode is None,
                "exit_code": process.returncode if process is not None else None,
                "lines": [_shown_line(line, sees_internals) for line in lines],
            }
        )
    if process is None:
        raise SupervisorError(
            "model_not_running",
            f"model '{slot.name}' has not run a child since the daemon started; load it first",
            409,
        )
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    follow = process.follow(backlog=len(process.output()) if tail is None else tail)
    try:
        async for entry in _with_pings(request, response, follow):
            await _send(
                response, "log", {"line": _shown_line(entry.line, sees_internals), "stream": entry.stream}
            )
    except ConnectionResetError:
        pass
    finally:
        follow.close()
    return response


async def _with_pings(
    request: web.Request, response: web.StreamResponse, items: AsyncIterator[T]
) -> AsyncIterator[T]:
    """`items` as they come, and a `: ping` comment on the stream after each HEARTBEAT_S without one, so
    proxies and clients keep a quiet stream open. The stream ends once its key no longer opens the route
    (a SIGHUP removed it, or its admin role): checked before each item and each ping."""
    gate = request.app[ACCESS]
    while True:
        try:
            async with asyncio.timeout(HEARTBEAT_S):
                item = await anext(items, None)
        except TimeoutError:
            if not gate.still_admits(request):
                return
            await response.write(b": ping\n\n")
            continue
        if item is None or not gate.still_admits(request):
            return
        yield item


def _replica_slot(scheduler: Scheduler, request: web.Request) -> ModelSlot:
    """The model's replica that `?replica=N` names (default 0): only replica 0's log could be read, and
    a crash of another, or of one that scale-up started, could not be looked at."""
    model = scheduler.slot_for(request.match_info["name"])
    asked = request.query.get("replica")
    if asked is None:
        return model
    found = next((s for s in scheduler.group(model.name) if str(s.replica) == asked), None)
    if found is None:
        running = ", ".join(str(s.replica) for s in scheduler.group(model.name)) or "0"
        raise SupervisorError(
            "invalid_request",
            f"replica: model '{model.name}' has no replica {asked[:20]!r} (it has {running})",
            400,
        )
    return found


def _tail(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        lines = int(value)
    except ValueError:
        lines = -1
    if lines < 0:
        raise SupervisorError("invalid_request", f"tail must be a count of lines, not {value!r}", 400)
    return lines


def _follow(value: str | None) -> bool:
    """`?follow=`: a value read as false would answer a follower with one JSON document and end, which
    looks like a log that stopped; a value that is neither is refused instead."""
    if value is None or value.lower() in ("0", "false", "no"):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    message = f"follow must be 1 or 0 (true or false), not {value[:20]!r}"
    raise SupervisorError("invalid_request", message, 400)


def _shown_line(line: str, sees_internals: bool) -> str:
    return secrets.scrub(line) if sees_internals else secrets.hide_internals(secrets.scrub(line))


async def _send(response: web.StreamResponse, event: str, data: Any) -> None:
    await response.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())


async def end_event_streams(app: web.Application) -> None:
    """on_shutdown: end every event stream, so that the server's wait for open handlers is short."""
    if EVENTS in app:
        app[EVENTS].close()
