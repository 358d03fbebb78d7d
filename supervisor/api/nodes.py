"""GET /v1/admin/nodes: the fleet as this node sees it (read only)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from supervisor.api.context import FLEET, SCHEDULER

routes = web.RouteTableDef()


@routes.get("/v1/admin/nodes")
async def nodes(request: web.Request) -> web.Response:
    """Every live node's record; without redis_url, or while Redis is away, this node alone."""
    from supervisor.fleet.nodes import node_record, weights_on_disk  # the fleet's modules, on first use

    fleet = request.app.get(FLEET)
    if fleet is None or fleet.view is None:
        scheduler = request.app[SCHEDULER]
        settings = scheduler.settings
        on_disk = await asyncio.to_thread(weights_on_disk, scheduler)
        record = node_record(scheduler, settings, scheduler.accepting, on_disk)
        return web.json_response({"nodes": [record], "fleet": False, "degraded": False})
    return web.json_response(
        {
            "nodes": [node.record for node in fleet.view.nodes()],
            "fleet": True,
            "degraded": not fleet.link.healthy,
        }
    )
