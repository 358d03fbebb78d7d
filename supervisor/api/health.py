"""Probes for orchestrators and scrapes for ops.

`/health/live`: the event loop answers (liveness: restart only what is wedged). `/health/ready`: start-up
is done and the daemon accepts requests (readiness: send traffic). `/health`: both, and every slot (with
keys configured, to an admin key only).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from supervisor import access, secrets
from supervisor.api.context import METRICS, SCHEDULER

routes = web.RouteTableDef()


@dataclass
class StartUp:
    """Whether start-up is over: listening, and every pinned model's first load has ended (ready, or
    failed and left to its keeper's retries). Set by app.py; read by `/health/ready`."""

    done: bool = False
    waiting_for: list[str] = field(default_factory=list)  # pinned models whose first load is under way
    pinned_settled: asyncio.Event = field(default_factory=asyncio.Event)  # no first pinned load under way


START_UP = web.AppKey("start_up", StartUp)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 with every slot's state while serving; 503 once the daemon is draining for shutdown. With
    keys configured, a caller without an admin key (a probe needs none) gets the status alone: the slot
    table names every model, pid and engine's last words, which a key's `models` hide elsewhere."""
    scheduler = request.app[SCHEDULER]
    serving = scheduler.accepting
    status = "ok" if serving else "draining"
    caller = access.caller(request)
    if caller.keys_configured and not caller.is_admin:
        return web.json_response({"status": status}, status=200 if serving else 503)
    body = {
        "status": status,
        # A failed model's reason and stderr can hold paths and whatever the engine printed.
        "models": secrets.shown(scheduler.describe(), caller.sees_internals),
        "gpus": scheduler.leases.snapshot(),
        "queued": scheduler.queued,
    }
    return web.json_response(body, status=200 if serving else 503)


@routes.get("/health/live")
async def live(request: web.Request) -> web.Response:
    """200 whenever the event loop gets to answer; it looks at nothing else, so a busy or draining
    daemon is never restarted for being busy."""
    return web.json_response({"status": "alive"})


@routes.get("/health/ready")
async def ready(request: web.Request) -> web.Response:
    """200 once start-up is done and while requests are accepted; 503 before (pinned models still
    loading) and while draining for shutdown. Which pinned models it waits for is said as /health says
    its slots: with keys configured, to an admin key only (a name may be one a key's `models` hide)."""
    start_up = request.app[START_UP]
    if not request.app[SCHEDULER].accepting:
        return web.json_response({"status": "draining"}, status=503)
    if not start_up.done:
        caller = access.caller(request)
        if caller.keys_configured and not caller.is_admin:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "starting", "waiting_for": start_up.waiting_for}, status=503)
    return web.json_response({"status": "ready"})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    inventory = request.app[SCHEDULER].inventory
    if inventory.has_nvml:
        await asyncio.to_thread(inventory.usage)  # fresh used-memory figures for the gauges, off the loop
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )
