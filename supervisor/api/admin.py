"""Operator routes: what the GPUs hold and who leased it."""

from __future__ import annotations

from aiohttp import web

from supervisor.api.context import SCHEDULER
from supervisor.errors import SupervisorError
from supervisor.gpus import DEFAULT_SIMULATED_MIB

routes = web.RouteTableDef()


@routes.get("/v1/admin/gpu-memory")
async def gpu_memory(request: web.Request) -> web.Response:
    """Per GPU: total, used, free, margin, leases (model, MiB, state, pid) and, with NVML, processes."""
    scheduler = request.app[SCHEDULER]
    if scheduler.inventory.assumed:
        raise SupervisorError(
            "no_gpu_inventory",
            "no NVIDIA GPU was found through NVML and no `gpus` are declared in the daemon config; the "
            f"scheduler is assuming one simulated {DEFAULT_SIMULATED_MIB} MiB GPU. Declare "
            "`gpus: [{index: 0, total_mib: ...}]` to make the budget explicit.",
            503,
        )
    return web.json_response(await scheduler.gpu_memory())
