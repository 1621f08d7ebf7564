"""A pool's load read from real engine and router expositions, and latency over a period."""

from __future__ import annotations

import math

import pytest

from tidegate.engine.messages import SchedulerStats
from tidegate.engine.metrics import TTFT_BUCKETS, PrometheusMetrics
from tidegate.operator.pool_metrics import (
    EngineLoad,
    PoolReading,
    engine_load,
    increase,
    parse_exposition,
    quantile,
    router_pending,
    served_adapters,
)


def test_samples_and_labels_are_parsed_with_escapes_and_comments_skipped() -> None:
    text = (
        "# HELP x a help line\n# TYPE x gauge\n"
        'x{a="1",b="with \\"quotes\\""} 2.5\n'
        "y 7 1700000000\n"
        "not a sample line\n"
        'z{le="+Inf"} NaN\n'
    )
    samples = parse_exposition(text)
    assert [(s.name, dict(s.labels)) for s in samples[:2]] == [
        ("x", {"a": "1", "b": 'with "quotes"'}),
        ("y", {}),
    ]
    assert samples[0].value == 2.5 and samples[1].value == 7
    assert math.isnan(samples[2].value)


def _stats(running: int, waiting: int, usage: float) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=waiting,
        num_total_blocks=100,
        num_free_blocks=round(100 * (1 - usage)),
        kv_cache_usage=usage,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )


def test_an_engine_exposition_gives_its_load() -> None:
    # The exposition of the engine's own metrics module, with two data-parallel engine cores
    # and its vllm: copies, which must not count twice.
    metrics = PrometheusMetrics("m", compat="vllm", num_engines=2)
    metrics.record_scheduler_stats(_stats(3, 1, 0.25), engine=0)
    metrics.record_scheduler_stats(_stats(2, 4, 0.75), engine=1)
    metrics.record_first_token(0.03, engine=0)
    load = engine_load(parse_exposition(metrics.render()[0].decode()))
    assert (load.running, load.waiting) == (5, 5)
    assert load.kv_cache_usage == 0.75  # the fullest core's
    assert set(load.ttft_buckets) == {*TTFT_BUCKETS, math.inf}
    assert load.ttft_buckets[0.04] == 1 and load.ttft_buckets[0.02] == 0


def test_the_router_pending_gauge_is_read_per_pool() -> None:
    text = (
        'tidegate:router_pending_requests{pool="prefill"} 3\n'
        'tidegate:router_pending_requests{pool="decode"} 1\n'
    )
    samples = parse_exposition(text)
    assert router_pending(samples, "prefill") == 3
    assert router_pending(samples, "unified") == 0


def test_quantile_interpolates_within_the_bucket_as_promql() -> None:
    buckets = {0.1: 0.0, 0.2: 50.0, 0.4: 100.0, math.inf: 100.0}
    assert quantile(buckets, 0.5) == pytest.approx(0.2)
    assert quantile(buckets, 0.9) == pytest.approx(0.36)
    assert quantile({0.1: 0.0, math.inf: 4.0}, 0.9) == 0.1  # beyond the last finite bound
    assert quantile({0.1: 0.0, math.inf: 0.0}, 0.9) is None


def test_increase_counts_from_zero_after_a_restart() -> None:
    assert increase({0.1: 2, math.inf: 5}, {0.1: 3, math.inf: 9}) == {0.1: 1, math.inf: 4}
    assert increase({0.1: 2, math.inf: 5}, {0.1: 1, math.inf: 1}) == {0.1: 1, math.inf: 1}


def _load(running: int, slow: int, fast: int) -> EngineLoad:
    cumulative = {0.05: float(fast), 1.0: float(fast + slow), math.inf: float(fast + slow)}
    return EngineLoad(running=running, kv_cache_usage=0.5, ttft_buckets=cumulative)


def test_latency_is_that_of_the_period_not_of_the_pods_life() -> None:
    reading = PoolReading()
    # A first scrape has no period before it: no latency yet.
    first = reading.signals("unified", {"a": _load(1, slow=0, fast=100)}, pending=1)
    assert (first.ready, first.pending, first.latency_p90_s) == (1, 1, None)
    # Then 10 slow requests: the p90 of the period is slow though the pod's life is fast.
    second = reading.signals("unified", {"a": _load(2, slow=10, fast=100)}, pending=0)
    assert second.latency_p90_s is not None and second.latency_p90_s > 0.5
    # A new pod joins: its first scrape counts from the next period.
    loads = {"a": _load(2, slow=10, fast=110), "b": _load(3, slow=50, fast=0)}
    third = reading.signals("unified", loads, pending=0, router_held=2, start_time_s=4.0)
    assert third.latency_p90_s is not None and third.latency_p90_s < 0.05
    assert (third.running, third.router_pending, third.start_time_s) == (5, 2, 4.0)
    assert third.kv_cache_usage == 0.5


def test_the_adapters_an_engine_serves_are_read_from_its_exposition() -> None:
    # The engine's own metrics module: one series per adapter it serves, none for the others.
    metrics = PrometheusMetrics("m", compat="vllm", num_engines=2)
    metrics.enable_lora(max_loras=2)
    metrics.record_lora_adapters(["sql", "chat"])
    assert served_adapters(parse_exposition(metrics.render()[0].decode())) == {"sql", "chat"}
    metrics.record_lora_adapters(["chat"])  # sql unloaded: its series goes
    assert served_adapters(parse_exposition(metrics.render()[0].decode())) == {"chat"}


def test_an_adapter_is_served_only_where_every_series_of_it_says_1() -> None:
    text = (
        'tidegate:lora_adapter_ready{adapter="a"} 1\n'
        'tidegate:lora_adapter_ready{adapter="b"} 0\n'
        'tidegate:lora_adapter_ready{adapter="c",engine="0"} 1\n'
        'tidegate:lora_adapter_ready{adapter="c",engine="1"} 0\n'
        "tidegate:lora_adapter_ready 1\n"
        'tidegate:num_requests_running{adapter="d"} 1\n'
    )
    assert served_adapters(parse_exposition(text)) == {"a"}
    assert served_adapters(parse_exposition("")) == frozenset()
