"""Prometheus metrics as a scraper reads them: parsed from the rendered /metrics body."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidegate.engine.messages import SchedulerStats
from tidegate.engine.metrics import METRICS, PrometheusMetrics


def scrape(metrics: PrometheusMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of a render, keyed by sample name and labels."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels` (model "m", engine "0" by default)."""
    wanted = {"model_name": "m", "engine": "0", **labels}.items()
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    assert len(found) == 1, f"{len(found)} samples of {name} with {labels}"
    return found[0]


def stats(**overrides) -> SchedulerStats:
    fields = dict(
        num_running=3,
        num_waiting=2,
        num_total_blocks=100,
        num_free_blocks=60,
        kv_cache_usage=0.4,
        prefix_cache_queries=1000,
        prefix_cache_hits=250,
        num_preemptions=1,
        num_batched_tokens=0,
    )
    return SchedulerStats(**{**fields, **overrides})


def test_gauges_show_the_latest_scheduler_stats():
    metrics = PrometheusMetrics("m")
    metrics.record_scheduler_stats(stats())
    metrics.record_scheduler_stats(
        stats(num_running=7, num_waiting=0, kv_cache_usage=0.85, kv_cache_usage_peak=0.9)
    )
    samples = scrape(metrics)
    assert value(samples, "tidegate:num_requests_running") == 7
    assert value(samples, "tidegate:num_requests_waiting") == 0
    assert value(samples, "tidegate:kv_cache_usage_perc") == pytest.approx(0.85)
    assert value(samples, "tidegate:kv_cache_usage_peak_perc") == pytest.approx(0.9)


def test_counters_follow_the_engine_totals_and_survive_an_engine_restart():
    metrics = PrometheusMetrics("m")
    metrics.record_scheduler_stats(stats(prefix_cache_queries=1000, prefix_cache_hits=250))
    metrics.record_scheduler_stats(stats(prefix_cache_queries=1600, prefix_cache_hits=400))
    samples = scrape(metrics)
    assert value(samples, "tidegate:prefix_cache_queries_total") == 1600
    assert value(samples, "tidegate:prefix_cache_hits_total") == 400

    # A restarted engine reports totals from 0 again: the counter keeps growing from 1600.
    metrics.record_scheduler_stats(
        stats(prefix_cache_queries=300, prefix_cache_hits=100, num_preemptions=0)
    )
    metrics.record_scheduler_stats(
        stats(prefix_cache_queries=500, prefix_cache_hits=120, num_preemptions=2)
    )
    samples = scrape(metrics)
    assert value(samples, "tidegate:prefix_cache_queries_total") == 2100
    assert value(samples, "tidegate:prefix_cache_hits_total") == 520
    assert value(samples, "tidegate:num_preemptions_total") == 3


def test_iteration_tokens_are_observed_only_for_stats_that_follow_a_step():
    metrics = PrometheusMetrics("m")
    metrics.record_scheduler_stats(stats(num_batched_tokens=256))
    metrics.record_scheduler_stats(stats(num_batched_tokens=0))
    metrics.record_scheduler_stats(stats(num_batched_tokens=3))
    samples = scrape(metrics)
    assert value(samples, "tidegate:iteration_tokens_total_count") == 2
    assert value(samples, "tidegate:iteration_tokens_total_sum") == 259
    assert value(samples, "tidegate:iteration_tokens_total_bucket", le="4.0") == 1


def test_tokens_latencies_and_finished_requests_are_recorded():
    metrics = PrometheusMetrics("m")
    metrics.record_tokens(prompt_tokens=100, generation_tokens=1)
    metrics.record_tokens(prompt_tokens=0, generation_tokens=5)
    metrics.record_first_token(0.05)
    for itl in (0.01, 0.02, 0.03):
        metrics.record_inter_token(itl)
    metrics.record_finished("stop", 1.5, 0.1, prompt_tokens=100, generation_tokens=6)
    metrics.record_finished("length", 3.0, None, prompt_tokens=20, generation_tokens=64)
    samples = scrape(metrics)

    assert value(samples, "tidegate:prompt_tokens_total") == 100
    assert value(samples, "tidegate:generation_tokens_total") == 6
    assert value(samples, "tidegate:time_to_first_token_seconds_count") == 1
    assert value(samples, "tidegate:inter_token_latency_seconds_count") == 3
    assert value(samples, "tidegate:inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(samples, "tidegate:e2e_request_latency_seconds_count") == 2
    assert value(samples, "tidegate:e2e_request_latency_seconds_sum") == pytest.approx(4.5)
    # Queue time is only known for requests that were queued.
    assert value(samples, "tidegate:request_queue_time_seconds_count") == 1
    assert value(samples, "tidegate:request_prompt_tokens_sum") == 120
    assert value(samples, "tidegate:request_generation_tokens_bucket", le="8.0") == 1
    assert value(samples, "tidegate:request_generation_tokens_bucket", le="64.0") == 2
    success = "tidegate:request_success_total"
    assert value(samples, success, finished_reason="stop") == 1
    assert value(samples, success, finished_reason="length") == 1
    assert value(samples, success, finished_reason="abort") == 0


def test_every_metric_is_exported_at_zero_before_anything_happens():
    samples = scrape(PrometheusMetrics("m"))
    assert value(samples, "tidegate:num_requests_waiting") == 0
    assert value(samples, "tidegate:generation_tokens_total") == 0
    assert value(samples, "tidegate:time_to_first_token_seconds_count") == 0


def test_vllm_names_appear_only_with_vllm_compat_and_match_tidegate_values():
    def exercised(compat: str) -> dict:
        metrics = PrometheusMetrics("m", compat=compat)
        metrics.record_scheduler_stats(stats(num_batched_tokens=64))
        metrics.record_tokens(10, 2)
        metrics.record_first_token(0.2)
        metrics.record_inter_token(0.02)
        metrics.record_finished("abort", 2.0, 0.5, prompt_tokens=10, generation_tokens=2)
        return scrape(metrics)

    plain = exercised("none")
    assert not any(name.startswith("vllm:") for name, _ in plain)

    both = exercised("vllm")
    # The step metrics are Tidegate's own (no vLLM server has them): no vllm: copy.
    tidegate = {
        (name.removeprefix("tidegate:"), labels): v
        for (name, labels), v in both.items()
        if name.startswith("tidegate:")
        and not name.endswith("_created")
        and not name.startswith("tidegate:step_")
    }
    vllm = {
        (name.removeprefix("vllm:"), labels): v
        for (name, labels), v in both.items()
        if name.startswith("vllm:") and not name.endswith("_created")
    }
    assert vllm == tidegate
    # The names KEDA scalers and the Inference Extension query.
    for name in (
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:iteration_tokens_total_count",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert any(n == name for n, _ in both), name


def test_every_series_carries_the_served_model_name_and_engine_index():
    metrics = PrometheusMetrics("llama-3-8b", compat="vllm", engine_index=1)
    metrics.record_finished("stop", 1.0, 0.1, prompt_tokens=5, generation_tokens=5)
    samples = scrape(metrics)
    names = {name.split(":", 1)[1] for name, _ in samples}
    for spec in METRICS:
        assert any(n.startswith(spec.name) for n in names), spec.name
    for _, labels in samples:
        assert ("model_name", "llama-3-8b") in labels
        assert ("engine", "1") in labels


def test_an_unknown_compat_mode_is_refused():
    with pytest.raises(ValueError, match="allowed"):
        PrometheusMetrics("m", compat="sglang")  # type: ignore[arg-type]
