"""GET /api/status: the whole daemon in one JSON document, for people at a terminal and for scripts.

/health answers an orchestrator's yes/no, /metrics feeds Prometheus; this one says, per model, what it is
doing and when it will go, what each GPU holds, and what the store is downloading.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from supervisor import access, secrets
from supervisor.api.context import PULLS, SCHEDULER, STORE

routes = web.RouteTableDef()

_STARTED = time.time()


@routes.get("/api/status")
async def status(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    now = time.time()
    models: dict[str, dict[str, Any]] = {}
    for name, info in scheduler.describe().items():
        slot = scheduler.slots[name]
        entry: dict[str, Any] = {"engine": slot.manifest.engine, **info}
        expires = scheduler.expires_at(slot)
        if slot.state in ("loading", "ready"):
            # None: pinned or keep_alive -1, so it stays until evicted or stopped.
            entry["unloads_in_s"] = None if expires is None else round(max(0.0, expires - now), 1)
        lease = scheduler.leases.get(slot.key)
        if lease is not None:
            entry["lease_mib"] = {str(gpu): mib for gpu, mib in lease.mib_by_gpu.items()}
        models[name] = entry
    memory = await scheduler.gpu_memory()
    document: dict[str, Any] = {
        "accepting": scheduler.accepting,
        "uptime_s": round(now - _STARTED, 1),
        "queued": scheduler.queued,
        "max_queue": scheduler.settings.max_queue,
        "models": models,
        "gpus": [
            {
                key: gpu[key]
                for key in (
                    "index",
                    "name",
                    "simulated",
                    "total_mib",
                    "used_mib",
                    "leased_mib",
                    "leasable_mib",
                )
            }
            | {"leases": _by_model(gpu["leases"])}
            for gpu in memory["gpus"]
        ],
        "gpu_source": memory["source"],
        "pulls": request.app[PULLS].describe(),
        "store": {
            "path": str(request.app[STORE].cache_dir),
            "bytes": await asyncio.to_thread(request.app[STORE].disk_usage),
        },
    }
    # Failure reasons, stderr tails and pull errors can hold paths, hub URLs and what an engine printed.
    return web.json_response(secrets.shown(document, access.caller(request).sees_internals))


def _by_model(leases: list[dict[str, Any]]) -> dict[str, int]:
    """MiB per model; a model restarting by a reload briefly holds two leases (old child, new one)."""
    totals: dict[str, int] = {}
    for lease in leases:
        totals[lease["model"]] = totals.get(lease["model"], 0) + lease["mib"]
    return totals
