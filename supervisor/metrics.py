"""Prometheus metrics: counters the code increments, plus slot and lease gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from supervisor.scheduler import Scheduler

# `_created` series double the output and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]


class Metrics:
    """One registry per daemon (not the process-global one), so several daemons can live in one test."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llm_supervisor_requests",
            "Requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=self.registry,
        )
        self.loads = Counter(
            "llm_supervisor_model_loads",
            "Model loads, by result.",
            ["model", "result"],
            registry=self.registry,
        )
        self.load_seconds = Histogram(
            "llm_supervisor_model_load_seconds",
            "Time from load start to ready.",
            ["model"],
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.crashes = Counter(
            "llm_supervisor_model_crashes",
            "Children that exited while serving.",
            ["model"],
            registry=self.registry,
        )

    def watch(self, scheduler: Callable[[], Scheduler]) -> None:
        self.registry.register(_SchedulerCollector(scheduler))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    def __init__(self, scheduler: Callable[[], Scheduler]) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler()
        state = GaugeMetricFamily(
            "llm_supervisor_slot_state", "1 for the state each model is in.", labels=["model", "state"]
        )
        inflight = GaugeMetricFamily(
            "llm_supervisor_inflight_requests", "Requests being served.", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "llm_supervisor_model_queued_requests",
            "Requests waiting for this model: to load, or for a turn under max_inflight.",
            labels=["model"],
        )
        for name, slot in scheduler.slots.items():
            state.add_metric([name, str(slot.state)], 1)
            inflight.add_metric([name], slot.inflight)
            waiting.add_metric([name], slot.waiters + len(slot.admission))
        leased = GaugeMetricFamily("llm_supervisor_gpu_leased_mib", "MiB leased on each GPU.", labels=["gpu"])
        capacity = GaugeMetricFamily(
            "llm_supervisor_gpu_capacity_mib", "MiB leasable on each GPU.", labels=["gpu"]
        )
        leaked = GaugeMetricFamily(
            "llm_supervisor_gpu_leaked_mib",
            "MiB a stopped child has not given back, still leased (leaked:<model>) until NVML shows it free.",
            labels=["gpu"],
        )
        for gpu, cap in scheduler.leases.capacity_mib.items():
            leased.add_metric([str(gpu)], scheduler.leases.leased_mib(gpu))
            capacity.add_metric([str(gpu)], cap)
            leaked.add_metric([str(gpu)], scheduler.leases.leaked_mib(gpu))
        queued = GaugeMetricFamily(
            "llm_supervisor_queued_requests", "Requests waiting for a model.", value=scheduler.queued
        )
        yield from (state, inflight, waiting, leased, capacity, leaked, queued)
