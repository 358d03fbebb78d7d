"""The fleet's parts for one daemon, built and closed together: the Redis link, the shared-GPU adapter
the scheduler leases through, the node publisher and the fleet view. Only with `redis_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from supervisor.fleet.forwarded import Forwarded
from supervisor.fleet.nodes import FleetView, NodePublisher
from supervisor.fleet.redis_link import FleetUnavailable, RedisLink
from supervisor.fleet.shared_gpus import SharedGpus
from supervisor.gpus import Gpu
from supervisor.metrics import Metrics

if TYPE_CHECKING:
    from supervisor.config import Settings
    from supervisor.scheduler import Scheduler

log = structlog.get_logger("fleet")


class Fleet:
    def __init__(self, settings: Settings, metrics: Metrics, gpus: Sequence[Gpu]) -> None:
        assert settings.redis_url is not None
        self.settings = settings
        self.link = RedisLink(settings.redis_url.get_secret_value(), metrics.registry)
        self.shared = SharedGpus(
            self.link,
            gpus,
            settings.shared_gpu_indices(),
            settings.gpu_host,
            settings.gpu_margin_mib,
            settings.node_id,
            settings.fleet_ttl_s,
        )
        self.publisher: NodePublisher | None = None
        self.view: FleetView | None = None
        self.forwarded = Forwarded()

    async def start(self, scheduler: Scheduler) -> None:
        """Join: check Redis, register shared GPUs, publish this node, start watching the others."""
        await self.link.start()
        # Read on each poll, so a SIGHUP that changes external_priority applies.
        self.shared.external_priority = lambda: scheduler.settings.external_priority
        await self.shared.start(scheduler.evict_for_external, scheduler.lease_lost)
        self.publisher = NodePublisher(self.link, self.settings, scheduler)
        self.publisher.start()
        self.view = FleetView(self.link, self.publisher.record)
        self.view.start()
        log.info(
            "fleet_joined" if self.link.healthy else "fleet_join_deferred",
            node_id=self.settings.node_id,
            url=self.settings.advertised_url(),
            shared_gpus=sorted(self.shared.keys.values()),
            ttl_s=self.settings.fleet_ttl_s,
        )

    async def leaving(self) -> None:
        """Shutdown began: publish this node's record now (healthy: false), so that the other nodes stop
        routing to it within a view refresh, not a third of a TTL later; then drain the requests this
        node forwarded, as the scheduler drains its own (Forwarded.abandon() cuts it short)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout_s  # the scheduler's drain ends then too
        if self.publisher is not None and self.link.healthy:
            with contextlib.suppress(FleetUnavailable):
                await self.publisher.publish()
        await self.forwarded.drain(max(0.0, deadline - loop.time()))

    async def close(self) -> None:
        """Leave: after the scheduler's shutdown has released our shared leases."""
        if self.view is not None:
            await self.view.close()
        if self.publisher is not None:
            await self.publisher.close()
        await self.shared.close()
        await self.link.close()
