"""Metrics: what a request's Trace becomes (histograms, token counters, Server-Timing), the gauges read at
scrape time, the engine's token counts found at the end of a body, and a Grafana dashboard that names
only series the daemon exports."""

from __future__ import annotations

import bisect
import gc
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from supervisor import proxy
from supervisor.leases import LeaseMap
from supervisor.metrics import EVICTION_REASONS, Metrics, ScrapedScheduler, Trace, _bucket, _ms
from supervisor.vram_attribution import GpuUsage

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


class FakeInventory:
    def __init__(self, used: dict[int, int] | None) -> None:
        self.has_nvml = used is not None
        self._used = used or {}
        self.last_usage: dict[int, GpuUsage] = {}

    def usage(self) -> dict[int, GpuUsage]:
        self.last_usage = {gpu: GpuUsage(mib, {}) for gpu, mib in self._used.items()}
        return self.last_usage


def _slot(state: str = "ready", inflight: int = 0) -> SimpleNamespace:
    return SimpleNamespace(state=state, inflight=inflight, requests_waiting=0, replica=0)


def fake_scheduler(models: int, gpus: int, used: dict[int, int] | None = None) -> ScrapedScheduler:
    """What the scrape reads of a scheduler: slots, leases, the inventory and the queue count."""
    leases = LeaseMap([SimpleNamespace(index=i, total_mib=24576) for i in range(gpus)], 512)  # type: ignore[misc]
    slots = {f"m{i}": _slot() for i in range(models)}
    return cast(
        "ScrapedScheduler",
        SimpleNamespace(
            slots=slots,
            group=lambda name: [slots[name]],  # one replica each
            leases=leases,
            inventory=FakeInventory(used),
            queued=0,
        ),
    )


def scrape(metrics: Metrics) -> dict[str, Any]:
    """Families by name (counters without `_total`), as Prometheus would read them."""
    return {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_garbage_collections_are_timed_by_generation_while_watched() -> None:
    metrics = Metrics()
    full = "llm_supervisor_gc_pause_seconds_count"
    assert sample(metrics, full, generation="2") == 0  # the series are there from the start
    stop = metrics.time_gc()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        stop()
    counted = sample(metrics, full, generation="2") or 0
    assert counted >= 1  # and any the allocations above started on their own
    assert (sample(metrics, full, generation="0") or 0) >= 1
    assert (sample(metrics, "llm_supervisor_gc_pause_seconds_sum", generation="2") or 0) > 0
    stop()  # a second stop does nothing
    gc.collect()  # no longer watched
    assert sample(metrics, full, generation="2") == counted


@given(st.floats(0, 0.001) | st.just(0.00005) | st.just(0.0))
def test_a_wait_of_a_few_microseconds_reads_as_the_rounding_has_it(seconds: float) -> None:
    """_ms answers a wait under 0.05 ms without arithmetic: it must say what the rounding says."""
    tenths = str(int(seconds * 10_000 + 0.5))
    assert _ms(seconds) == (tenths[:-1] + "." + tenths[-1] if len(tenths) > 1 else "0." + tenths)


def test_server_timing_says_queue_and_load_then_ttft_and_total_when_known() -> None:
    trace = Trace("abc", arrived=100.0)
    trace.waited(queue_s=0.002, load_s=1.5)
    assert trace.server_timing() == "queue;dur=2.0, load;dur=1500.0"
    trace.first_token = 101.75
    assert (
        trace.server_timing(total_s=2.0)
        == "queue;dur=2.0, load;dur=1500.0, ttft;dur=1750.0, total;dur=2000.0"
    )


def test_a_second_acquire_adds_to_the_waits() -> None:
    trace = Trace("abc", arrived=0.0)
    trace.waited(0.5, 0.0)
    trace.waited(0.0, 2.0)
    assert (trace.queue_s, trace.load_s, trace.acquired) == (0.5, 2.0, True)


def test_tokens_per_second_without_the_engines_figure_runs_from_the_first_token() -> None:
    trace = Trace("abc", arrived=0.0)
    trace.first_token = 1.0
    trace.counted(prompt=10, output=40, rate=None, end=3.0)
    assert trace.tokens_per_s == 20.0
    trace.counted(prompt=10, output=40, rate=55.5, end=3.0)
    assert trace.tokens_per_s == 55.5


def test_an_answered_request_fills_every_series_of_its_model() -> None:
    metrics = Metrics()
    trace = Trace("abc", arrived=10.0)
    trace.waited(0.25, 3.0)
    trace.first_token = 13.5
    trace.counted(prompt=26, output=8, rate=40.0, end=14.0)
    metrics.answered("demo", 200, trace, duration_s=4.0)
    assert sample(metrics, "llm_supervisor_requests_total", model="demo", status="200") == 1
    assert sample(metrics, "llm_supervisor_queue_wait_seconds_sum", model="demo") == 0.25
    assert sample(metrics, "llm_supervisor_load_wait_seconds_sum", model="demo") == 3.0
    assert sample(metrics, "llm_supervisor_time_to_first_token_seconds_sum", model="demo") == 3.5
    assert sample(metrics, "llm_supervisor_request_duration_seconds_sum", model="demo") == 4.0
    assert sample(metrics, "llm_supervisor_output_tokens_per_second_sum", model="demo") == 40.0
    assert sample(metrics, "llm_supervisor_prompt_tokens_total", model="demo") == 26
    assert sample(metrics, "llm_supervisor_output_tokens_total", model="demo") == 8


def test_a_request_that_never_held_a_ticket_is_counted_not_timed() -> None:
    metrics = Metrics()
    metrics.answered("demo", 503, Trace("abc", arrived=0.0), duration_s=15.0)
    metrics.answered("demo", 503, None, duration_s=15.0)
    assert sample(metrics, "llm_supervisor_requests_total", model="demo", status="503") == 2
    assert sample(metrics, "llm_supervisor_request_duration_seconds_count", model="demo") is None


def test_a_request_served_at_once_is_in_queue_wait_but_not_in_load_wait() -> None:
    metrics = Metrics()
    trace = Trace("abc", arrived=0.0)
    trace.waited(0.0, 0.0)
    metrics.answered("demo", 200, trace, duration_s=0.1)
    assert sample(metrics, "llm_supervisor_queue_wait_seconds_count", model="demo") == 1
    assert not sample(metrics, "llm_supervisor_load_wait_seconds_count", model="demo")


def test_evictions_are_counted_by_model_and_reason() -> None:
    metrics = Metrics()
    metrics.evicted("a", "room")
    metrics.evicted("a", "room")
    metrics.evicted("b", "keep_alive")
    assert sample(metrics, "llm_supervisor_evictions_total", model="a", reason="room") == 2
    assert sample(metrics, "llm_supervisor_evictions_total", model="b", reason="keep_alive") == 1


def test_a_registered_models_event_counters_start_at_zero_and_go_with_it() -> None:
    """Born at their first event with the value 1, the first crash of each model (often the only one)
    never showed in increase() or rate(), which need two samples."""
    metrics = Metrics()
    metrics.register("demo")
    assert sample(metrics, "llm_supervisor_model_crashes_total", model="demo") == 0
    for result in ("ok", "failed"):
        assert sample(metrics, "llm_supervisor_model_loads_total", model="demo", result=result) == 0
    assert sample(metrics, "llm_supervisor_model_load_seconds_count", model="demo") == 0
    for reason in EVICTION_REASONS:
        assert sample(metrics, "llm_supervisor_evictions_total", model="demo", reason=reason) == 0
    metrics.evicted("demo", "room")
    assert sample(metrics, "llm_supervisor_evictions_total", model="demo", reason="room") == 1
    metrics.forget("demo")
    assert 'model="demo"' not in metrics.render().decode()


def test_scrape_reads_leases_per_model_and_per_gpu_and_counts_replica_starts() -> None:
    metrics = Metrics()
    scheduler = fake_scheduler(models=2, gpus=2)
    scheduler.leases.take("m0#1", {0: 1000, 1: 1000})
    scheduler.leases.take("leaked:m1#2", {1: 300})
    metrics.loads.labels("m0", "ok").inc()
    metrics.loads.labels("m0", "failed").inc()
    metrics.watch(lambda: scheduler)
    assert sample(metrics, "llm_supervisor_model_leased_mib", model="m0") == 2000
    assert sample(metrics, "llm_supervisor_model_leased_mib", model="m1") == 0  # leaked has its own gauge
    assert sample(metrics, "llm_supervisor_gpu_leased_mib", gpu="1") == 1300
    assert sample(metrics, "llm_supervisor_gpu_leaked_mib", gpu="1") == 300
    assert sample(metrics, "llm_supervisor_replica_starts_total", model="m0") == 1
    assert sample(metrics, "llm_supervisor_gpu_used_mib", gpu="0") is None  # simulated: nobody measures it


def test_used_memory_per_gpu_comes_from_nvml() -> None:
    metrics = Metrics()
    scheduler = fake_scheduler(models=1, gpus=2, used={0: 5000, 1: 12})
    metrics.watch(lambda: scheduler)
    scheduler.inventory.usage()  # what the /metrics route does in a thread before rendering
    assert sample(metrics, "llm_supervisor_gpu_used_mib", gpu="0") == 5000
    assert sample(metrics, "llm_supervisor_gpu_used_mib", gpu="1") == 12


# --- the engine's counts, found at the end of a body -------------------------------------------------------

LLAMA_WHOLE = (
    b'{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant","content":"a b"}}],'
    b'"object":"chat.completion","usage":{"completion_tokens":5,"prompt_tokens":26,"total_tokens":31},'
    b'"id":"chatcmpl-x","timings":{"prompt_n":26,"prompt_ms":0.86,"predicted_n":5,"predicted_ms":250.0,'
    b'"predicted_per_second":20.0}}'
)


def test_an_engines_infinite_or_missing_numbers_count_as_unknown() -> None:
    body = (
        b'{"usage":{"completion_tokens":5,"prompt_tokens":26},'
        b'"timings":{"predicted_ms":-Infinity,"predicted_per_second":NaN}}'
    )
    assert proxy.engine_counts(body) == (26, 5, None, None)
    trace = Trace("abc", arrived=0.0)
    trace.waited(queue_s=0.0, load_s=0.0)
    proxy.count(trace, body, sent=0.0, whole=True)
    assert trace.first_token is None
    assert "ttft" not in trace.server_timing(0.5)


def test_server_timing_writes_what_it_cannot_round_as_it_is() -> None:
    trace = Trace("abc", arrived=0.0)
    trace.waited(queue_s=float("inf"), load_s=float("nan"))
    assert trace.server_timing() == "queue;dur=inf, load;dur=nan"


def test_counts_of_a_llama_server_answer() -> None:
    assert proxy.engine_counts(LLAMA_WHOLE) == (26, 5, 20.0, 250.0)


def test_counts_of_a_stream_whose_last_events_carry_timings_and_usage() -> None:
    tail = (
        b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"timings":{"prompt_n":1,'
        b'"predicted_n":5,"predicted_ms":0.25,"predicted_per_second":20000.0}}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":5,"prompt_tokens":26,"total_tokens":31}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert proxy.engine_counts(tail) == (26, 5, 20000.0, 0.25)


def test_a_stream_without_usage_counts_the_prompt_its_cache_served_too() -> None:
    """llama-server's timings count what it computed (prompt_n) apart from what its cache served
    (cache_n); its usage counts both. A stream that asked for no usage counted 1 of a 26-token prompt."""
    tail = (
        b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"timings":{"cache_n":25,'
        b'"prompt_n":1,"predicted_n":5,"predicted_ms":0.25}}\n\ndata: [DONE]\n\n'
    )
    assert proxy.engine_counts(tail)[:2] == (26, 5)


def test_a_vllm_stream_without_usage_counts_nothing() -> None:
    tail = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\ndata: [DONE]\n\n'
    assert proxy.engine_counts(tail) == (None, None, None, None)


def test_counts_of_the_responses_api() -> None:
    tail = (
        b'event: response.completed\ndata: {"type":"response.completed","response":{"output":[],'
        b'"usage":{"input_tokens":9,"output_tokens":4,"total_tokens":13}}}\n\n'
    )
    assert proxy.engine_counts(tail)[:2] == (9, 4)


def test_counts_are_read_by_name_in_pretty_printed_json_and_past_nested_objects() -> None:
    body = (
        b'{"response": {"usage": {"input_tokens" : 9, "input_tokens_details": {"cached_tokens": 3},\n'
        b'  "output_tokens":\t4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}}}'
    )
    assert proxy.engine_counts(body) == (9, 4, None, None)


def test_a_count_that_is_not_a_number_is_unknown_and_the_next_name_is_tried() -> None:
    body = (
        b'{"usage":{"prompt_tokens":null,"completion_tokens":"5"},'
        b'"timings":{"prompt_n":26,"predicted_n":5,"predicted_ms":"fast","predicted_per_second":1e400}}'
    )
    assert proxy.engine_counts(body) == (26, 5, None, None)


def test_text_that_mentions_usage_is_not_taken_for_it() -> None:
    body = b'{"choices":[{"message":{"content":"the \\"usage\\": {\\"prompt_tokens\\": 99}"}}]}'
    assert proxy.engine_counts(body) == (None, None, None, None)


@given(
    number=st.integers(0, 10**20)
    | st.integers(-(10**6), -1)
    | st.floats(allow_nan=False, allow_infinity=False),
    before=st.sampled_from(["", " ", "\n\t"]),
    after=st.sampled_from(["", "}", ",", " }", "\n"]),
)
def test_a_count_reads_as_jsons_own_number(number: float, before: str, after: str) -> None:
    """A short run of digits is added up as it is read, anything longer or with a point, a sign or an
    exponent goes to float(): both give what json.loads reads."""
    text = json.dumps(number)
    read = float(json.loads(text))
    body = f'{{"usage":{{"prompt_tokens":{before}{text}{after}'.encode()
    assert proxy.engine_counts(body)[0] == int(read)
    body = f'{{"timings":{{"predicted_ms":{before}{text}{after}'.encode()
    assert proxy.engine_counts(body)[3] == read


def test_a_count_of_more_digits_than_a_float_holds_is_read_by_float() -> None:
    """Digits are added up only as far as a float holds them exactly; a longer run is float()'s, which
    reads a run past float64's range as infinite: no count."""
    assert proxy.engine_counts(b'{"usage":{"prompt_tokens":' + b"1" * 100_000 + b"}}")[0] is None
    assert proxy.engine_counts(b'{"usage":{"prompt_tokens":' + b"9" * 16 + b"}}")[0] == int(float("9" * 16))


_VECTORS = ",".join(["0.123456"] * 100_000)  # an answer far longer than the ends that are searched


def _counted_whole(body: str) -> Trace:
    trace = Trace("abc", arrived=0.0)
    proxy.count(trace, body.encode(), sent=0.0, whole=True)
    return trace


def test_a_long_answers_usage_is_read_from_its_end_first() -> None:
    trace = _counted_whole(
        f'{{"usage":{{"prompt_tokens":1}},"data":[{_VECTORS}],"usage":{{"prompt_tokens":7,"total_tokens":7}}}}'
    )
    assert trace.prompt_tokens == 7


def test_an_embedding_with_its_usage_first_is_counted_without_reading_all_of_it() -> None:
    trace = _counted_whole(
        f'{{"model":"e","object":"list","usage":{{"prompt_tokens":7,"total_tokens":7}},"data":[{_VECTORS}]}}'
    )
    assert trace.prompt_tokens == 7
    assert trace.output_tokens is None


@pytest.mark.parametrize(
    "body",
    [
        f'{{"model":"e","object":"list","usage":{{"prompt_tokens":7,"total_tokens":7}},"data":[{_VECTORS}]}}',
        f'{{"object":"list","data":[{_VECTORS}],"model":"e","usage":{{"prompt_tokens":7,"total_tokens":7}}}}',
        f'{{"data":[{_VECTORS[:1009]}],"usage":{{"prompt_tokens": 7}}}}',  # the key across _HEAD's end
        '{"data":[],"usage":{"prompt_tokens":7}}',
    ],
    ids=["llama-server", "vllm", "across-head", "small"],
)
def test_an_embeddings_list_is_counted_where_its_engine_puts_its_usage(body: str) -> None:
    trace = Trace("abc", arrived=0.0)
    proxy.count(trace, body.encode(), sent=0.0, whole=True, embeddings=True)
    assert (trace.prompt_tokens, trace.output_tokens, trace.tokens_per_s) == (7, None, None)


def test_an_embeddings_list_without_usage_counts_nothing() -> None:
    assert proxy.embedding_prompt_tokens(f'{{"data":[{_VECTORS}]}}'.encode()) is None
    assert proxy.embedding_prompt_tokens(b'{"data":[],"usage":null}') is None


def test_a_whole_answer_dates_its_first_token_by_the_engines_generation_time() -> None:
    trace = Trace("abc", arrived=0.0)
    proxy.count(trace, LLAMA_WHOLE, sent=0.0, whole=True)
    assert trace.first_token is not None
    assert trace.tokens_per_s == 20.0
    assert (trace.prompt_tokens, trace.output_tokens) == (26, 5)


# --- the Grafana dashboard -------------------------------------------------------------------------------

_SERIES = re.compile(r"\bllm_supervisor_[a-z_]+\b")
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def exported_series(metrics: Metrics) -> set[str]:
    """Every series name a scrape can hold: each family's name, and its samples' names by type."""
    names: set[str] = set()
    for name, family in scrape(metrics).items():
        names.add(name)
        names.update(name + suffix for suffix in _SUFFIXES.get(family.type, ()))
    return names


def dashboard_queries(node: object) -> list[str]:
    """Every PromQL string in the dashboard: panel targets' `expr` and template variables' queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                found.append(value["query"])
            else:
                found.extend(dashboard_queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(dashboard_queries(item))
    return found


def test_the_dashboard_names_only_series_the_daemon_exports() -> None:
    metrics = Metrics()
    metrics.watch(lambda: fake_scheduler(models=2, gpus=2))
    exported = exported_series(metrics)
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) > 20
    named = {name for query in queries for name in _SERIES.findall(query)}
    assert named, "the dashboard names no llm_supervisor series"
    assert named <= exported, f"not exported: {sorted(named - exported)}"


@pytest.mark.parametrize(
    "series",
    [
        "llm_supervisor_requests_total",
        "llm_supervisor_queue_wait_seconds_bucket",
        "llm_supervisor_load_wait_seconds_bucket",
        "llm_supervisor_time_to_first_token_seconds_bucket",
        "llm_supervisor_request_duration_seconds_bucket",
        "llm_supervisor_output_tokens_per_second_bucket",
        "llm_supervisor_output_tokens_total",
        "llm_supervisor_gpu_leased_mib",
        "llm_supervisor_gpu_used_mib",
        "llm_supervisor_evictions_total",
        "llm_supervisor_model_loads_total",
    ],
)
def test_the_dashboard_graphs(series: str) -> None:
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert any(series in query for query in queries)


def test_every_percentile_panel_is_a_histogram_quantile_over_buckets() -> None:
    for query in dashboard_queries(json.loads(DASHBOARD.read_text())):
        if "histogram_quantile" in query:
            assert re.search(r"rate\(llm_supervisor_\w+_bucket\{", query), query
            assert "by (le" in query, query


def test_a_value_on_a_bucket_bound_is_in_that_bucket_and_buckets_are_cumulative() -> None:
    """The request histograms are our own lists (cheaper than prometheus_client's): same semantics."""
    metrics = Metrics()
    for duration_s in (0.01, 0.011, 1000.0):
        trace = Trace("abc", arrived=0.0)
        trace.waited(0.0, 0.0)
        metrics.answered("demo", 200, trace, duration_s=duration_s)
    name = "llm_supervisor_request_duration_seconds_bucket"
    assert sample(metrics, name, model="demo", le="0.01") == 1
    assert sample(metrics, name, model="demo", le="0.05") == 2
    assert sample(metrics, name, model="demo", le="600.0") == 2
    assert sample(metrics, name, model="demo", le="+Inf") == 3
    assert sample(metrics, "llm_supervisor_request_duration_seconds_count", model="demo") == 3
    assert sample(metrics, "llm_supervisor_request_duration_seconds_sum", model="demo") == 1000.021


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=20).map(sorted),
    st.floats() | st.sampled_from([0.0, 0.005, math.inf, -math.inf]),
)
def test_the_compiled_bucket_search_is_bisect_left(bounds: list[float], value: float) -> None:
    bounds = [*bounds, math.inf]
    assert _bucket(bounds, value) == bisect.bisect_left(bounds, value)
    for bound in bounds:  # on a bound: its own bucket (le="bound" counts it), as bisect_left has it
        assert _bucket(bounds, bound) == bisect.bisect_left(bounds, bound)
