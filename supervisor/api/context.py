"""Typed app keys: how routes reach the long-lived parts of the daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from supervisor.access import AccessControl
from supervisor.dataplane.upstream import UpstreamPool
from supervisor.events import EventBus
from supervisor.metrics import REQUEST_OUTCOME as REQUEST_OUTCOME
from supervisor.metrics import Metrics
from supervisor.pulls import Pulls
from supervisor.scheduler import Scheduler
from supervisor.store import Catalog, Store

if TYPE_CHECKING:
    from supervisor.fleet.fleet import Fleet

SCHEDULER = web.AppKey("scheduler", Scheduler)
ACCESS = web.AppKey("access", AccessControl)
UPSTREAM = web.AppKey("upstream", aiohttp.ClientSession)
# The data plane's connections to the children (supervisor/dataplane/upstream.py).
DATA_POOL = web.AppKey("data_pool", UpstreamPool)
METRICS = web.AppKey("metrics", Metrics)
STORE = web.AppKey("store", Store)
PULLS = web.AppKey("pulls", Pulls)
# What changes (slot transitions, loads, crashes, pulls): GET /v1/admin/events follows it.
EVENTS = web.AppKey("events", EventBus)
# The registry served: manifest files as last loaded, plus the store; `refresh()` applies it.
CATALOG = web.AppKey("catalog", Catalog)
# The fleet (Redis), set only with redis_url: node records, the fleet view, shared GPUs.
FLEET: web.AppKey[Fleet] = web.AppKey("fleet")  # the fleet modules (and redis) load only with it
# The model a request resolved to, for the access log and the request counter.
REQUEST_MODEL = "llm_supervisor.model"
# The replica (index and child pid) that served it, for the access log: {"replica": 0, "pid": 123}.
REQUEST_UPSTREAM = "llm_supervisor.upstream"
# The client id a request named (x_client_id or X-Client-Id), for the access log.
REQUEST_CLIENT = "llm_supervisor.client_id"
