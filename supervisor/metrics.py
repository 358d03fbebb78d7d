"""Prometheus metrics: counters and histograms the code feeds, plus slot and lease gauges read at scrape time.

Every request gets a `Trace` (its id and where its time went). Routes and the proxy fill it in; the access
log middleware hands it to `Metrics.answered` once the response has ended, and the same figures go out
to the client as a `Server-Timing` header.
"""

from __future__ import annotations

import gc
import itertools
import math
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, Protocol

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from supervisor import __version__
from supervisor.gpus import GpuInventory
from supervisor.leases import LEAKED_PREFIX, LeaseMap

# `_created` series double the output and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]


_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_RATE_BUCKETS = (1, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)


class Trace:
    """One request: its id, and where its time went. Times are `time.perf_counter()` seconds.

    `acquired` is set once the request held a model's ticket: only such requests are timed in the
    histograms. Token counts come from the engine's `usage` (or llama-server's `timings`) when it sent one.
    """

    __slots__ = (
        "acquired",
        "arrived",
        "first_token",
        "load_s",
        "output_tokens",
        "prompt_tokens",
        "queue_s",
        "request_id",
        "tokens_per_s",
    )

    def __init__(self, request_id: str, arrived: float) -> None:
        self.request_id = request_id
        self.arrived = arrived
        self.acquired = False
        self.queue_s = 0.0  # waiting for a turn under max_inflight
        self.load_s = 0.0  # waiting for the model to load (or to start again)
        self.first_token: float | None = None  # perf_counter of the first token (or first streamed chunk)
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.tokens_per_s: float | None = None

    def waited(self, queue_s: float, load_s: float) -> None:
        """The request holds a ticket after these waits (Ticket.queue_s, Ticket.load_s); adds up over a
        second acquire (Scheduler.reacquire)."""
        self.acquired = True
        self.queue_s += queue_s
        self.load_s += load_s

    def counted(self, prompt: int | None, output: int | None, rate: float | None, end: float) -> None:
        """Token counts of the answer that ended at `end`; without the engine's `rate`, the output tokens
        over the time from the first token to the end."""
        self.prompt_tokens = prompt
        self.output_tokens = output
        if rate is None and output and self.first_token is not None and end > self.first_token:
            rate = output / (end - self.first_token)
        self.tokens_per_s = rate

    def server_timing(self, total_s: float | None = None) -> str:
        """The `Server-Timing` value: queue and load, then ttft and total when they are known."""
        parts = ["queue;dur=", _ms(self.queue_s), ", load;dur=", _ms(self.load_s)]
        if self.first_token is not None:
            parts += (", ttft;dur=", _ms(self.first_token - self.arrived))
        if total_s is not None:
            parts += (", total;dur=", _ms(total_s))
        return "".join(parts)


def _ms(seconds: float) -> str:
    """Seconds as milliseconds to a tenth, as f"{ms:.1f}" writes them (bar a tenth, now and then, at a
    half) but in integers: a float format's exact rounding costs more than the rest of the headers. The
    point goes into the tenths' digits: one number made text, not two."""
    if not 0 <= seconds < 1e9:  # also NaN
        return f"{seconds * 1000:.1f}"
    if seconds < 0.00005:  # no wait at all, as a request's queue and load mostly are
        return "0.0"
    digits = str(int(seconds * 10_000 + 0.5))
    return digits[:-1] + "." + digits[-1] if len(digits) > 1 else "0." + digits


# The request's Trace (set by middleware.errors_and_access_log).
TRACE: Final = web.RequestKey("trace", Trace)
# The status a streamed answer ended with, when an error or the client's leaving cut it after its head
# said 200: what the access log and the counters say (api.context and the relays set it).
REQUEST_OUTCOME: Final = "llm_supervisor.outcome"
# The error code a request was answered with (or its stream ended with), and the client's address: what
# the access log says of a failed request besides its status (gate.error_parts and the relays set it).
REQUEST_ERROR: Final = "llm_supervisor.error"
REQUEST_PEER: Final = "llm_supervisor.peer"
CLIENT_GONE: Final = 499  # nginx's "client closed request": what a request whose client left is logged as


def _bucket(bounds: list[float], value: float) -> int:
    """bisect.bisect_left(bounds, value), the same steps compiled: reached from compiled code, the C
    bisect is a generic call that costs more than the search itself (a dozen bounds, four values an
    answer). NaN, like bisect's, lands in the first bucket."""
    low, high = 0, len(bounds)
    while low < high:
        middle = (low + high) // 2
        if bounds[middle] < value:
            low = middle + 1
        else:
            high = middle
    return low


class _Series:
    """One label value's observations per bucket (not cumulative) and their sum: one lookup finds both."""

    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0


class _Histogram:
    """A histogram by one label (the model) in plain lists. prometheus_client's takes a lock per value and
    walks its buckets in Python, which on the request path cost more than the proxying; this one costs a
    bisect. `seeded` label values are there from the start (with no new keys, a scrape never sees the
    dict change size)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        label: str = "model",
        seeded: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self.bounds = [*map(float, buckets), math.inf]
        self._le = [floatToGoString(bound) for bound in self.bounds]  # type: ignore[no-untyped-call]
        self._series: dict[str, _Series] = {}  # label value -> its observations
        for series in seeded:
            self._start(series)

    def observe(self, series: str, value: float) -> None:
        observed = self._series.get(series)
        if observed is None:
            observed = self._start(series)
        observed.counts[_bucket(self.bounds, value)] += 1
        observed.sum += value

    def _start(self, series: str) -> _Series:
        observed = self._series[series] = _Series(len(self.bounds))
        return observed

    def forget(self, series: str) -> None:
        self._series.pop(series, None)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for series, observed in self._series.items():
            buckets = list(zip(self._le, itertools.accumulate(observed.counts), strict=True))
            family.add_metric([series], buckets, observed.sum)
        return family


_GENERATIONS = ("0", "1", "2")
# `Metrics.evicted`'s reasons, a fixed set: each model's series of each exists from its registration.
EVICTION_REASONS: Final = ("room", "keep_alive", "keep_alive_0", "operator", "lease_lost", "external")
_LOAD_RESULTS: Final = ("ok", "failed")


class _GcTimer:
    """A `gc.callbacks` entry. It takes no lock: a collection can start at any allocation, also in a
    thread that holds one."""

    def __init__(self, pauses: _Histogram) -> None:
        self.pauses = pauses
        self.started = 0.0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.pauses.observe(_GENERATIONS[info["generation"]], time.perf_counter() - self.started)


class _Total:
    """One counter series' value, in an object of its own: counting is one lookup, not a lookup and a
    store."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class _Counter:
    """A counter by model (and status) in a plain dict, for the same reason as _Histogram."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ("model",)) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = list(labels)
        self._values: dict[tuple[str, ...], _Total] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1) -> None:
        total = self._values.get(labels)
        if total is None:
            total = self._values[labels] = _Total()
        total.value += amount

    def forget(self, model: str) -> None:
        """Drop every series whose first label (the model) is `model`."""
        for labels in [labels for labels in self._values if labels[0] == model]:
            del self._values[labels]

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, total in self._values.items():
            family.add_metric(list(labels), total.value)
        return family


class _PlainSeries(Collector):
    def __init__(self, *series: _Histogram | _Counter) -> None:
        self._series = series

    def collect(self) -> Iterator[Metric]:
        for one in self._series:
            yield one.family()


class Metrics:
    """One registry per daemon (not the process-global one), so several daemons can live in one test."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The daemon's own CPU, memory and open files (process_*), and which build runs: what a node
        # exporter cannot tell apart from its engines.
        ProcessCollector(registry=self.registry)
        build = Info("llm_supervisor_build", "The daemon's version and Python.", registry=self.registry)
        build.info({"version": __version__, "python": platform.python_version()})
        self.requests = _Counter(
            "llm_supervisor_requests", "Requests answered, by model and HTTP status.", ("model", "status")
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
        self.connections_shed = Counter(
            "llm_supervisor_connections_shed",
            "Client connections past max_connections: an idle kept-alive one closed to make room, or a new "
            "one refused with 503.",
            ["action"],
            registry=self.registry,
        )
        self.crashes = Counter(
            "llm_supervisor_model_crashes",
            "Children that exited while serving.",
            ["model"],
            registry=self.registry,
        )
        self.evictions = Counter(
            "llm_supervisor_evictions",
            "Models unloaded while loaded, by reason: room (for another model), keep_alive (idle timer), "
            "keep_alive_0 (a request's keep_alive 0), operator (an admin unload), lease_lost, external.",
            ["model", "reason"],
            registry=self.registry,
        )
        self.queue_wait = _Histogram(
            "llm_supervisor_queue_wait_seconds",
            "Time a request waited for a turn under max_inflight (0 when it went straight in).",
            (0.0005, *_WAIT_BUCKETS),
        )
        self.load_wait = _Histogram(
            "llm_supervisor_load_wait_seconds",
            "Time a request waited for its model to load; only requests that waited for one.",
            _WAIT_BUCKETS,
        )
        self.ttft = _Histogram(
            "llm_supervisor_time_to_first_token_seconds",
            "Arrival to first token: the first streamed chunk, Ollama's first token, or the engine's "
            "prompt time for a whole answer.",
            _TTFT_BUCKETS,
        )
        self.duration = _Histogram(
            "llm_supervisor_request_duration_seconds",
            "Arrival to the end of the answer, for requests that got a model's turn.",
            _DURATION_BUCKETS,
        )
        self.tokens_per_s = _Histogram(
            "llm_supervisor_output_tokens_per_second",
            "Generation speed of one answer: the engine's own figure, else output tokens over the time "
            "from the first token to the end.",
            _RATE_BUCKETS,
        )
        self.gc_pauses = _Histogram(
            "llm_supervisor_gc_pause_seconds",
            "This process's cyclic garbage collections, by generation: each stops the event loop, and "
            "every request in flight waits for it.",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            label="generation",
            seeded=_GENERATIONS,
        )
        self.prompt_tokens = _Counter(
            "llm_supervisor_prompt_tokens", "Prompt tokens, as the engine counted them."
        )
        self.output_tokens = _Counter(
            "llm_supervisor_output_tokens", "Generated tokens, as the engine counted them."
        )
        self.registry.register(
            _PlainSeries(
                self.requests,
                self.queue_wait,
                self.load_wait,
                self.ttft,
                self.duration,
                self.tokens_per_s,
                self.gc_pauses,
                self.prompt_tokens,
                self.output_tokens,
            )
        )

    def answered(self, model: str, status: int, trace: Trace | None, duration_s: float) -> None:
        """Count one answered request, and time it when it got a model's turn (`trace.acquired`)."""
        self.requests.inc((model, str(status)))
        if trace is None or not trace.acquired:
            return
        self.queue_wait.observe(model, trace.queue_s)
        if trace.load_s > 0:
            self.load_wait.observe(model, trace.load_s)
        if trace.first_token is not None:
            self.ttft.observe(model, trace.first_token - trace.arrived)
        self.duration.observe(model, duration_s)
        if trace.prompt_tokens:
            self.prompt_tokens.inc((model,), trace.prompt_tokens)
        if trace.output_tokens:
            self.output_tokens.inc((model,), trace.output_tokens)
        if trace.tokens_per_s:
            self.tokens_per_s.observe(model, trace.tokens_per_s)

    def register(self, model: str) -> None:
        """A model is served from now on: its load, crash and eviction series start at 0. Born at their
        first event with the value 1, Prometheus' increase() and rate() (which need two samples) never saw
        that first crash, failed load or eviction: often the only one."""
        for result in _LOAD_RESULTS:
            self.loads.labels(model, result)
        self.load_seconds.labels(model)
        self.crashes.labels(model)
        for reason in EVICTION_REASONS:
            self.evictions.labels(model, reason)

    def forget(self, model: str) -> None:
        """Drop every series of `model`, which a reload removed (called once its last request has been
        counted): a fleet renaming models through ConfigMaps would otherwise export every name it ever had."""
        for counter in (self.requests, self.prompt_tokens, self.output_tokens):
            counter.forget(model)
        for histogram in (self.queue_wait, self.load_wait, self.ttft, self.duration, self.tokens_per_s):
            histogram.forget(model)
        for metric in (self.loads, self.load_seconds, self.crashes, self.evictions):
            _remove_model(metric, model)

    def evicted(self, model: str, reason: str) -> None:
        """Count one model unloaded for `reason`, one of EVICTION_REASONS."""
        self.evictions.labels(model, reason).inc()

    def time_gc(self) -> Callable[[], None]:
        """Time this process's garbage collections into `gc_pauses` from now on; returns what stops it.
        The daemon's alone: tests build many Metrics in one process."""
        timer = _GcTimer(self.gc_pauses)
        gc.callbacks.append(timer)

        def stop() -> None:
            if timer in gc.callbacks:  # once, whoever calls
                gc.callbacks.remove(timer)

        return stop

    def watch(self, scheduler: Callable[[], ScrapedScheduler]) -> None:
        self.registry.register(_SchedulerCollector(scheduler, self.loads))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ScrapedSlot(Protocol):
    """What a scrape reads of a replica (slots.ModelSlot)."""

    @property
    def replica(self) -> int: ...
    @property
    def state(self) -> object: ...
    @property
    def inflight(self) -> int: ...
    @property
    def requests_waiting(self) -> int: ...


class ScrapedScheduler(Protocol):
    """What a scrape reads of the scheduler (scheduler.Scheduler). A protocol, not the class: compiled
    (supervisor/native.py), a function checks an argument of a class type, and tests scrape stand-ins."""

    @property
    def slots(self) -> Mapping[str, ScrapedSlot]: ...
    @property
    def leases(self) -> LeaseMap: ...
    @property
    def inventory(self) -> GpuInventory: ...
    @property
    def queued(self) -> int: ...
    def group(self, name: str) -> Sequence[ScrapedSlot]: ...


def _remove_model(metric: Counter | Histogram, model: str) -> None:
    """Remove a prometheus_client metric's series of `model` (its first label), whatever its other labels."""
    names = metric._labelnames  # the label names it was made with: prometheus_client has no public reader
    found = {
        tuple(sample.labels[name] for name in names)
        for family in metric.collect()
        for sample in family.samples
        if sample.labels.get("model") == model and all(name in sample.labels for name in names)
    }
    for labels in found:
        metric.remove(*labels)


class _SchedulerCollector(Collector):
    def __init__(self, scheduler: Callable[[], ScrapedScheduler], loads: Counter) -> None:
        self._scheduler = scheduler
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler()
        state = GaugeMetricFamily(
            "llm_supervisor_slot_state",
            "1 for the state each replica of each model is in.",
            labels=["model", "replica", "state"],
        )
        inflight = GaugeMetricFamily(
            "llm_supervisor_inflight_requests",
            "Requests being served, per replica.",
            labels=["model", "replica"],
        )
        waiting = GaugeMetricFamily(
            "llm_supervisor_model_queued_requests",
            "Requests waiting for this model: to load, or for a turn under max_inflight.",
            labels=["model"],
        )
        model_leased = GaugeMetricFamily(
            "llm_supervisor_model_leased_mib", "MiB leased to each model, over all GPUs.", labels=["model"]
        )
        by_model = dict.fromkeys(scheduler.slots, 0)
        for lease in scheduler.leases.holders():
            if not lease.holder.startswith(LEAKED_PREFIX):  # leaked memory has its own gauge
                name = lease.holder.rpartition("#")[0]
                by_model[name] = by_model.get(name, 0) + sum(lease.mib_by_gpu.values())
        for name in scheduler.slots:
            group = scheduler.group(name)
            for slot in group:
                state.add_metric([name, str(slot.replica), str(slot.state)], 1)
                inflight.add_metric([name, str(slot.replica)], slot.inflight)
            waiting.add_metric([name], sum(s.requests_waiting for s in group))
        for name, mib in by_model.items():
            model_leased.add_metric([name], mib)
        leased = GaugeMetricFamily("llm_supervisor_gpu_leased_mib", "MiB leased on each GPU.", labels=["gpu"])
        capacity = GaugeMetricFamily(
            "llm_supervisor_gpu_capacity_mib", "MiB leasable on each GPU.", labels=["gpu"]
        )
        leaked = GaugeMetricFamily(
            "llm_supervisor_gpu_leaked_mib",
            "MiB a stopped child has not given back, still leased (leaked:<model>) until NVML shows it free.",
            labels=["gpu"],
        )
        used = GaugeMetricFamily(
            "llm_supervisor_gpu_used_mib",
            "MiB in use on each GPU as NVML reports it, by any process; absent for simulated GPUs.",
            labels=["gpu"],
        )
        for gpu, cap in scheduler.leases.capacity_mib.items():
            leased.add_metric([str(gpu)], scheduler.leases.leased_mib(gpu))
            capacity.add_metric([str(gpu)], cap)
            leaked.add_metric([str(gpu)], scheduler.leases.leaked_mib(gpu))
        if scheduler.inventory.has_nvml:
            # Read by the /metrics route in a thread just before rendering: no NVML call on the event loop.
            for gpu, usage in scheduler.inventory.last_usage.items():
                used.add_metric([str(gpu)], usage.used_mib)
        queued = GaugeMetricFamily(
            "llm_supervisor_queued_requests", "Requests waiting for a model.", value=scheduler.queued
        )
        # Each successful load starts one replica (a model's first, or one more of it).
        starts = CounterMetricFamily(
            "llm_supervisor_replica_starts",
            "Replicas started (successful loads), by model.",
            labels=["model"],
        )
        for family in self._loads.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("result") == "ok":
                    starts.add_metric([sample.labels["model"]], sample.value)
        yield from (state, inflight, waiting, model_leased, leased, capacity, leaked, used, queued, starts)
