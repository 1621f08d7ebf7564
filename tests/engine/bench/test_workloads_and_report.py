"""Workloads are seeded and exact; the report's percentiles, goodput and arrival windows."""

from __future__ import annotations

import pytest

from tidegate.engine.bench.load import RequestRecord, arrival_times
from tidegate.engine.bench.report import (
    arrival_windows,
    parse_slo,
    percentiles,
    steady_gaps,
    steady_gaps_in_span,
    steady_span,
    summarize,
)
from tidegate.engine.bench.workloads import (
    long_prompt_arrival_workload,
    parse_range,
    random_workload,
    shared_prefix_workload,
)


def test_workloads_are_reproducible_and_have_the_lengths_asked_for():
    a = random_workload(20, (5, 9), (3, 4), seed=1)
    b = random_workload(20, (5, 9), (3, 4), seed=1)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert all(5 <= len(r.prompt) <= 9 and 3 <= r.max_tokens <= 4 for r in a.requests)
    shared = shared_prefix_workload(6, 2, 50, (4, 4), (2, 2), seed=0)
    prefixes = {tuple(r.prompt[:50]) for r in shared.requests}
    assert len(prefixes) == 2 and all(len(r.prompt) == 54 for r in shared.requests)
    arrival = long_prompt_arrival_workload(3, 8, 20, (100, 100), [1.0, 2.5], 4, seed=0)
    assert [r.group for r in arrival.requests] == ["steady"] * 3 + ["long"] * 2
    assert [r.send_at for r in arrival.requests] == [0.0, 0.0, 0.0, 1.0, 2.5]
    with pytest.raises(ValueError, match="LOW-HIGH"):
        parse_range("9-3")


def test_arrival_times_follow_the_rate_and_honour_fixed_send_times():
    requests = random_workload(2000, (1, 1), (1, 1), seed=0).requests
    times = arrival_times(requests, request_rate=10.0, seed=3)
    assert times == sorted(times)
    assert 180 < times[-1] < 220  # 2000 arrivals at 10/s
    assert set(arrival_times(requests[:5], float("inf"), 0)) == {0.0}


def record(group: str, sent: float, chunks: list[float], tokens: int) -> RequestRecord:
    r = RequestRecord(group, prompt_len=10, max_tokens=tokens, sent=sent, ok=True)
    r.chunk_times, r.output_tokens, r.finished = chunks, tokens, chunks[-1]
    return r


def test_summary_latencies_throughput_and_goodput():
    fast = record("main", 0.0, [0.1, 0.12, 0.14], 3)
    slow = record("main", 0.0, [1.0, 1.5, 2.0], 3)
    summary = summarize([fast, slow], duration=2.0, slo=parse_slo("ttft_ms=500,itl_ms=100"))
    assert summary["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(20.0)
    assert summary["tpot_ms"]["p99"] == pytest.approx(500.0)
    assert summary["output_token_throughput"] == 3.0
    assert summary["goodput"] == 0.5 and summary["good_fraction"] == 0.5
    assert percentiles([]) is None
    with pytest.raises(ValueError, match="unknown SLO"):
        parse_slo("tpot=3")


def test_arrival_window_splits_steady_gaps_before_and_during_the_long_prefill():
    steady = record("steady", 0.0, [0.1, 0.2, 0.3, 1.3, 1.4, 2.5, 2.6], 7)
    long = record("long", 0.35, [1.2, 1.25], 2)
    result = arrival_windows([steady, long], {"long prompt 0": 0.35})
    assert result["window_s"] == [0.35, 1.2]
    assert result["steady_itl_before_ms"]["count"] == 2  # gaps ending before 0.35 s
    # The 1 s gap that straddles the long prompt's prefill is "during".
    assert result["steady_itl_during_ms"]["p99"] == pytest.approx(1000.0)


def test_steady_gaps_of_a_run_without_arrivals_over_another_runs_window():
    # The streams alone: the window comes from the run with the long prompts.
    alone = record("steady", 0.0, [0.1, 0.2, 0.3, 0.5, 0.8, 1.3, 1.4], 7)
    stray = record("long", 0.0, [0.2, 0.9], 2)  # only steady streams count
    before, during = steady_gaps([alone, stray], 0.35, 1.2)
    assert before == pytest.approx([0.1, 0.1])
    assert during == pytest.approx([0.2, 0.3, 0.5])  # gaps that overlap [0.35, 1.2)


def test_the_streams_alone_are_compared_over_the_same_tokens_as_the_window():
    # With the long prompts, only the gap before token 3 overlapped [0.35, 1.2).
    steady = record("steady", 0.0, [0.1, 0.2, 0.3, 1.3, 1.4], 5)
    assert steady_span([steady], 0.35, 1.2) == (3, 3)
    assert steady_span([steady], 5.0, 6.0) is None
    # Alone, the same stream ran faster: its tokens 2..3 are still the same contexts.
    alone = record("steady", 0.0, [0.1, 0.15, 0.2, 0.26, 0.3], 5)
    assert steady_gaps_in_span([alone], (2, 3)) == pytest.approx([0.05, 0.06])
