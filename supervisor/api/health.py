"""Probes for orchestrators and scrapes for ops."""

from __future__ import annotations

from aiohttp import web

from supervisor import access, secrets
from supervisor.api.context import METRICS, SCHEDULER

routes = web.RouteTableDef()


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 with every slot's state while serving; 503 once the daemon is draining for shutdown."""
    scheduler = request.app[SCHEDULER]
    serving = scheduler.accepting
    body = {
        "status": "ok" if serving else "draining",
        # A failed model's reason and stderr can hold paths and whatever the engine printed.
        "models": secrets.shown(scheduler.describe(), access.caller(request).sees_internals),
        "gpus": scheduler.leases.snapshot(),
        "queued": scheduler.queued,
    }
    return web.json_response(body, status=200 if serving else 503)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )
