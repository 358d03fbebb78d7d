"""Typed app keys: how routes reach the long-lived parts of the daemon."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from supervisor.metrics import Metrics
from supervisor.scheduler import Scheduler

SCHEDULER = web.AppKey("scheduler", Scheduler)
UPSTREAM = web.AppKey("upstream", aiohttp.ClientSession)
METRICS = web.AppKey("metrics", Metrics)
# The model a request resolved to, for the access log and the request counter.
REQUEST_MODEL = "llm_supervisor.model"
# The client id a request named (x_client_id or X-Client-Id), for the access log.
REQUEST_CLIENT = "llm_supervisor.client_id"
