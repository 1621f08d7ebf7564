"""The engine's step metrics: every executed step reaches the stats with its wall seconds,
decodes and prompt tokens, and the `tidegate:step_*` series they make fit a step cost
(operator/step_fit.py) on the tiny model."""

from __future__ import annotations

import statistics

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.messages import SchedulerStats, StepTime
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.operator.step_fit import fit_steps, parse_step_totals, slo_attainment


# Long prompts chunked at 128 tokens beside streams that decode: steps of three kinds.
def prompts(first: int) -> list[list[int]]:
    """Six short prompts and six of 500-600 tokens, none sharing a block with another call's."""
    short = [[first + i, 7, 8, 9] for i in range(6)]
    return short + [[first + 6 + i, *range(200, 200 + 500 + 20 * i)] for i in range(6)]


PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def stats(**overrides) -> SchedulerStats:
    fields = dict(
        num_running=1,
        num_waiting=0,
        num_total_blocks=10,
        num_free_blocks=5,
        kv_cache_usage=0.5,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )
    return SchedulerStats(**{**fields, **overrides})


def series(text: str, name: str) -> dict[frozenset, float]:
    """Every sample called `name` in an exposition, by its labels."""
    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_the_steps_of_scheduler_stats_move_the_step_counters_of_their_engine() -> None:
    metrics = PrometheusMetrics("m", num_engines=2)
    steps = [StepTime(0.02, 16, 0), StepTime(0.05, 16, 256), StepTime(0.01, 0, 300)]
    metrics.record_scheduler_stats(stats(steps=steps), engine=1)
    metrics.record_scheduler_stats(stats(steps=[StepTime(0.03, 16, 0)]), engine=1)
    text = metrics.render()[0].decode()
    count = series(text, "tidegate:step_count_total")

    def cell(prompt_tokens: str, decodes: str, engine: str = "1") -> frozenset:
        labels = {"model_name": "m", "engine": engine}
        return frozenset({**labels, "prompt_tokens": prompt_tokens, "decodes": decodes}.items())

    def kind(name: str, engine: str = "1") -> frozenset:
        return frozenset({"model_name": "m", "engine": engine, "kind": name}.items())

    assert count == {cell("0", "5-16"): 2, cell("65-256", "5-16"): 1, cell("257-1024", "0"): 1}
    seconds = series(text, "tidegate:step_seconds_total")
    assert seconds[cell("0", "5-16")] == pytest.approx(0.05)
    assert series(text, "tidegate:step_decodes_total")[cell("0", "5-16")] == 32
    assert series(text, "tidegate:step_prompt_tokens_total")[cell("257-1024", "0")] == 300
    durations = series(text, "tidegate:step_duration_seconds_count")
    assert durations[kind("decode")] == 2
    assert durations[kind("mixed")] == 1
    assert durations[kind("prefill")] == 1
    # Engine 0 ran no step: its histogram series read 0, and it has no counter series yet.
    assert durations[kind("decode", engine="0")] == 0
    assert not any(("engine", "0") in labels for labels in count)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_step_of_the_tiny_model_is_counted_and_fits(tiny_llama_dir, async_scheduling):
    with LLM(
        str(tiny_llama_dir),
        long_prefill_token_threshold=128,
        max_num_batched_tokens=256,
        async_scheduling=async_scheduling,
        # One thread: on a busy machine, a parallel region waits for its slowest thread and
        # steps stall by tens of ms; the fit is judged on the model's times, not on those.
        num_threads=1,
    ) as llm:
        # Warm up: the first steps of each batch shape are slow (and would be outliers).
        llm.generate(prompts(first=20), PARAMS)
        llm.engine.scheduler_stats()  # ... and left out
        llm.generate(prompts(first=50), PARAMS)
        taken = llm.engine.scheduler_stats()
        assert llm.engine.scheduler_stats().steps == []  # handed over once
        assert "steps" not in llm.stats()
    steps = taken.steps
    assert all(step.seconds > 0 for step in steps)
    # Every prompt token computed once (no prefix shared, nothing preempted), and every
    # output token past the first (sampled at a prompt's end) by a decode.
    assert sum(step.prompt_tokens for step in steps) == sum(map(len, prompts(first=50)))
    assert sum(step.decodes for step in steps) == 12 * (PARAMS.max_tokens - 1)
    assert max(step.prompt_tokens for step in steps) <= 256
    metrics = PrometheusMetrics("m")
    metrics.record_scheduler_stats(taken)
    totals = parse_step_totals(metrics.render()[0].decode())
    assert totals.steps == len(steps)
    fit = fit_steps(totals)
    assert fit.ok, fit.reason
    assert fit.base_s > 0 and fit.per_token_s > 0
    # Sensible: the fit predicts the usual decode step and the usual mixed step within a factor
    # of two (medians: a class mean may carry an odd slow step, a collection or a first shape).
    for kind in (lambda s: s.prompt_tokens == 0, lambda s: s.prompt_tokens and s.decodes):
        chosen = [s for s in steps if kind(s)]
        median = statistics.median(s.seconds for s in chosen)
        decodes = statistics.fmean(s.decodes for s in chosen)
        tokens = statistics.fmean(s.prompt_tokens for s in chosen)
        assert median / 2 < fit.predict(decodes, tokens) < median * 2, fit.reason
    attainment = slo_attainment(totals, 1000)
    assert attainment["decode"].steps > 0 and attainment["mixed"].steps > 0
    assert attainment["decode"].over == 0  # no tiny-model step takes a second
