"""operator/step_fit.py: the step cost fitted from the engines' step counters, and the chunk
threshold it gives for an ITL SLO.

Pages are the engine's own exposition (engine/metrics.py's `record_step`), fed with steps
drawn from a known cost model with noise, so the parse reads what a pod really serves.
"""

from __future__ import annotations

import math
import random

import pytest

from tidegate.engine.metrics import PrometheusMetrics
from tidegate.operator.step_fit import (
    ClassSums,
    StepTotals,
    fit_steps,
    parse_step_totals,
    pod_increase,
    propose,
    share_over,
    slo_attainment,
    window,
)
from tidegate.operator.tuning import MAX_UNIFIED_CHUNK_TOKENS, MIN_CHUNK_BLOCKS

BASE, PER_DECODE, PER_TOKEN = 0.020, 0.0005, 0.0002  # 20 ms + 0.5 ms/decode + 0.2 ms/token
# Sized for the fitted mean, with no headroom: tuning.py's arithmetic, which the tests below
# check; the default (p90 of the window's spread, 10% headroom) has a test of its own.
MEAN = {"quantile": None, "headroom": 0.0}


def run_steps(
    metrics: PrometheusMetrics,
    rng: random.Random,
    n: int,
    model: tuple[float, float, float] = (BASE, PER_DECODE, PER_TOKEN),
    chunks: tuple[int, ...] = (32, 128, 512, 2048),
    decodes: tuple[int, int] = (1, 48),
    mixed_share: float = 0.2,
    noise: float = 0.05,
    engine: int = 0,
) -> None:
    """`n` steps of a serving engine: decode steps with a varying number of streams, and a
    share of them carrying a prompt chunk of one of `chunks` tokens (or its remainder)."""
    base, per_decode, per_token = model
    for _ in range(n):
        d = rng.randint(*decodes)
        p = 0
        if rng.random() < mixed_share:
            p = rng.choice(chunks)
            if rng.random() < 0.3:
                p = rng.randint(1, p)  # a prompt's last chunk, or a short prompt
        seconds = (base + per_decode * d + per_token * p) * max(0.2, rng.gauss(1.0, noise))
        metrics.record_step(seconds, d, p, engine)


def page(metrics: PrometheusMetrics) -> str:
    return metrics.render()[0].decode()


def pool(pods: int = 2, engines: int = 2) -> list[PrometheusMetrics]:
    return [PrometheusMetrics("m", num_engines=engines) for _ in range(pods)]


def test_the_fit_recovers_a_known_cost_model_from_two_pods_of_two_engine_cores() -> None:
    rng = random.Random(0)
    pods = pool()
    for metrics in pods:
        for engine in (0, 1):
            run_steps(metrics, rng, 1500, engine=engine)
    totals = {f"pod-{i}": parse_step_totals(page(m)) for i, m in enumerate(pods)}
    fit = fit_steps(window({}, totals))
    assert fit.ok, fit.reason
    assert fit.terms == ("base", "per_decode", "per_token")
    assert fit.steps == 6000
    assert fit.base_s == pytest.approx(BASE, rel=0.1)
    assert fit.per_decode_s == pytest.approx(PER_DECODE, rel=0.1)
    assert fit.per_token_s == pytest.approx(PER_TOKEN, rel=0.05)
    # The reason shows the fitted figures.
    assert (
        "step = 20" in fit.reason and "x decodes" in fit.reason and "x prompt tokens" in fit.reason
    )
    assert fit.predict(16, 256) == pytest.approx(BASE + 16 * PER_DECODE + 256 * PER_TOKEN, rel=0.05)


def test_the_window_is_the_increase_between_two_scrapes() -> None:
    rng = random.Random(1)
    pods = pool(engines=1)
    # Before the first scrape the pods ran another configuration, twice as slow per token.
    for metrics in pods:
        run_steps(metrics, rng, 2000, model=(BASE, PER_DECODE, 2 * PER_TOKEN))
    first = {f"pod-{i}": parse_step_totals(page(m)) for i, m in enumerate(pods)}
    for metrics in pods:
        run_steps(metrics, rng, 2000)
    second = {f"pod-{i}": parse_step_totals(page(m)) for i, m in enumerate(pods)}
    steps = window(first, second)
    assert steps.steps == 4000
    histogram = sum(steps.durations[kind][math.inf] for kind in ("decode", "mixed", "prefill"))
    assert histogram == pytest.approx(4000)
    fit = fit_steps(steps)
    assert fit.per_token_s == pytest.approx(PER_TOKEN, rel=0.05)
    # The whole life of the pods mixes both: their per-token cost lies in between.
    whole = fit_steps(window({}, second))
    assert PER_TOKEN * 1.2 < whole.per_token_s < PER_TOKEN * 1.8


def test_a_restarted_pod_counts_from_zero_and_a_new_pod_whole() -> None:
    rng = random.Random(2)
    a, b = PrometheusMetrics("m"), PrometheusMetrics("m")
    run_steps(a, rng, 3000)
    run_steps(b, rng, 3000)
    first = {"a": parse_step_totals(page(a)), "b": parse_step_totals(page(b))}
    run_steps(a, rng, 500)
    restarted = PrometheusMetrics("m")  # pod b restarted: its counters begin again
    run_steps(restarted, rng, 400)
    new = PrometheusMetrics("m")  # pod c came up during the window
    run_steps(new, rng, 300)
    second = {
        "a": parse_step_totals(page(a)),
        "b": parse_step_totals(page(restarted)),
        "c": parse_step_totals(page(new)),
    }
    assert pod_increase(first["b"], second["b"]) == second["b"]
    assert pod_increase(None, second["c"]) == second["c"]
    assert pod_increase(first["a"], second["a"]).steps == 500
    assert window(first, second).steps == 500 + 400 + 300
    # A pod gone by the second scrape is left out.
    assert window(first, {"a": second["a"]}).steps == 500


def test_a_class_that_appears_in_the_window_counts_from_zero() -> None:
    before = StepTotals({("0", "5-16"): ClassSums(10, 0.2, 0, 120)})
    after = StepTotals(
        {("0", "5-16"): ClassSums(15, 0.3, 0, 180), ("1-64", "5-16"): ClassSums(2, 0.1, 64, 24)}
    )
    increase = pod_increase(before, after)
    assert increase.classes[("0", "5-16")] == ClassSums(5, pytest.approx(0.1), 0, 60)
    assert increase.classes[("1-64", "5-16")] == ClassSums(2, 0.1, 64, 24)


def test_decode_steps_alone_give_no_fit_and_say_why() -> None:
    metrics = PrometheusMetrics("m")
    run_steps(metrics, random.Random(3), 1000, mixed_share=0.0)
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert not fit.ok
    assert "two prompt-token classes" in fit.reason and "0: 1000" in fit.reason
    # A few mixed steps are not enough either.
    for _ in range(3):
        metrics.record_step(0.05, 16, 128)
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert not fit.ok and "65-256" in fit.reason
    proposal = propose(fit, 100, 2048, 2304, 256, 16)
    assert not proposal.change and proposal.threshold == 2048 and proposal.budget == 2304
    assert proposal.reason.startswith("no change from threshold 2048: no fit")


def test_steady_decodes_fold_per_decode_into_base() -> None:
    # 16 streams all along: per_decode cannot be told from base, and is not fitted.
    metrics = PrometheusMetrics("m")
    run_steps(metrics, random.Random(4), 3000, decodes=(16, 16))
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert fit.ok, fit.reason
    assert fit.terms == ("base", "per_token") and fit.per_decode_s == 0
    assert fit.base_s == pytest.approx(BASE + 16 * PER_DECODE, rel=0.05)
    assert fit.per_token_s == pytest.approx(PER_TOKEN, rel=0.05)
    assert fit.typical_decodes == 16
    assert "per_decode not told apart" in fit.reason


def test_no_cost_per_prompt_token_is_no_fit() -> None:
    metrics = PrometheusMetrics("m")
    run_steps(metrics, random.Random(5), 2000, model=(BASE, PER_DECODE, 0.0), noise=0.0)
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert not fit.ok and "no measurable cost" in fit.reason


@pytest.fixture(scope="module")
def fitted():
    metrics = PrometheusMetrics("m")
    run_steps(metrics, random.Random(6), 4000)
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert fit.ok
    return fit


@pytest.mark.parametrize("slo_ms", [50, 60, 100, 250])
def test_a_proposal_meets_the_slo_by_the_fit_in_whole_blocks(fitted, slo_ms) -> None:
    proposal = propose(
        fitted, slo_ms, 2048, 2304, max_num_seqs=64, block_size=16, typical_decodes=16, **MEAN
    )
    threshold = proposal.threshold
    assert proposal.change and isinstance(threshold, int)
    assert threshold % 16 == 0 and threshold >= MIN_CHUNK_BLOCKS * 16
    assert fitted.predict(16, threshold) <= slo_ms / 1000
    assert fitted.predict(16, threshold + 16) > slo_ms / 1000  # the largest such chunk
    # The budget: the chunk plus a decode token for each of maxNumSeqs, in whole blocks.
    assert proposal.budget == threshold + 64
    expected = (slo_ms / 1000 - BASE - 16 * PER_DECODE) / PER_TOKEN
    assert threshold == pytest.approx(expected, abs=0.1 * expected + 16)
    # The reason shows the fit and the arithmetic.
    reason = proposal.reason
    assert reason.startswith(f"threshold 2048 -> {threshold}: fit over 4000 steps")
    assert f"ITL {slo_ms} ms - decode step" in reason and "prompt tokens at" in reason
    assert f"maxNumBatchedTokens 2304 -> {threshold + 64}" in reason
    # ... and what the window measured against the SLO.
    assert "; measured: " in reason and f"decode steps over {slo_ms} ms" in reason


def test_the_proposal_is_clamped_to_the_largest_chunk(fitted) -> None:
    proposal = propose(fitted, 10_000, 256, 512, 64, 16, typical_decodes=16, **MEAN)
    assert proposal.threshold == MAX_UNIFIED_CHUNK_TOKENS
    assert "clamped to the 16384-token maximum" in proposal.reason
    proposal = propose(
        fitted, 10_000, 256, 512, 64, 16, typical_decodes=16, max_model_len=4100, **MEAN
    )
    assert proposal.threshold == 4096 and "clamped to maxModelLen 4100" in proposal.reason


def test_an_slo_out_of_reach_gets_the_floor_and_says_so(fitted) -> None:
    # The decode step alone (about 28 ms at 16 decodes) takes longer than the SLO.
    proposal = propose(fitted, 20, 2048, 2304, 64, 16, typical_decodes=16, **MEAN)
    assert proposal.change and proposal.threshold == MIN_CHUNK_BLOCKS * 16
    assert "ITL 20 ms is out of reach: the decode step alone takes" in proposal.reason
    # A few tokens fit, but fewer than the smallest chunk.
    proposal = propose(fitted, 29.5, 2048, 2304, 64, 16, typical_decodes=16, **MEAN)
    assert proposal.threshold == MIN_CHUNK_BLOCKS * 16
    assert (
        "ITL 29.5 ms is out of reach" in proposal.reason
        and "chose the floor of 64" in proposal.reason
    )


def test_hysteresis_keeps_a_threshold_near_the_proposal(fitted) -> None:
    target = propose(fitted, 100, 2048, 2304, 64, 16, typical_decodes=16, **MEAN).threshold
    assert isinstance(target, int)
    for current in (target - 16, target, target + 16, int(target * 1.09)):
        proposal = propose(fitted, 100, current, current + 64, 64, 16, typical_decodes=16, **MEAN)
        assert not proposal.change, current
        assert (proposal.threshold, proposal.budget) == (current, current + 64)
        assert proposal.reason.startswith("no change:")
    moved = propose(fitted, 100, int(target * 1.2), 0, 64, 16, typical_decodes=16, **MEAN)
    assert moved.change and moved.threshold == target
    # From auto (the engine's own tuner) there is no value to stay near.
    assert propose(fitted, 100, "auto", 2048, 64, 16, typical_decodes=16, **MEAN).change


def test_the_typical_decodes_default_to_those_beside_a_chunk() -> None:
    metrics = PrometheusMetrics("m")
    rng = random.Random(7)
    run_steps(metrics, rng, 2000, decodes=(4, 12), mixed_share=0.0)
    run_steps(metrics, rng, 2000, decodes=(30, 34), mixed_share=0.5)
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert fit.ok and fit.typical_decodes == pytest.approx(32, abs=0.5)
    proposal = propose(fit, 100, 2048, 2304, 64, 16)
    assert proposal.predicted_step_s == pytest.approx(
        fit.predict(fit.typical_decodes, proposal.threshold)
    )


def test_share_over_reads_the_histogram_at_a_bound_or_within_a_bucket() -> None:
    buckets = {0.05: 60.0, 0.1: 80.0, 0.2: 100.0, math.inf: 100.0}
    assert share_over(buckets, 0.1) == (100.0, 20.0)
    assert share_over(buckets, 0.075) == (100.0, pytest.approx(30.0))
    assert share_over(buckets, 0.3) == (100.0, 0.0)
    assert share_over({0.05: 1.0, math.inf: 4.0}, 0.1) == (4.0, 3.0)
    assert share_over({}, 0.1) == (0.0, 0.0)


def test_slo_attainment_counts_decode_and_mixed_steps_over_the_slo() -> None:
    metrics = PrometheusMetrics("m")
    for _ in range(90):
        metrics.record_step(0.03, 16, 0)  # decode steps: 30 ms
    for seconds in (0.04, 0.06, 0.09, 0.2):
        metrics.record_step(seconds, 16, 256)  # mixed
    metrics.record_step(0.5, 0, 2048)  # a prefill step: no stream waits on it
    attainment = slo_attainment(parse_step_totals(page(metrics)), 50)
    assert (attainment["decode"].steps, attainment["decode"].over) == (90, 0)
    assert (attainment["mixed"].steps, attainment["mixed"].over) == (4, 3)
    assert attainment["mixed"].share_over == 0.75
    assert attainment["prefill"].over == 1
    assert attainment["mixed"].describe(50) == "75.0% of 4 mixed steps over 50 ms"


def test_by_default_the_p90_of_mixed_steps_is_sized_under_the_slo_with_headroom() -> None:
    # One chunk size, steps spread +-20% about their mean: the p90 stands about 1.25x above it.
    metrics = PrometheusMetrics("m")
    run_steps(metrics, random.Random(8), 4000, chunks=(256,), decodes=(16, 16), noise=0.2)
    fit = fit_steps(parse_step_totals(page(metrics)))
    proposal = propose(fit, 150, 2048, 2080, 32, 16)
    assert 1.15 < proposal.spread < 1.4
    threshold = proposal.threshold
    assert isinstance(threshold, int) and threshold % 16 == 0
    # The predicted p90 of a step at the threshold within 90% of the SLO; a block more is not.
    assert fit.predict(16, threshold) * proposal.spread <= 0.9 * 0.150
    assert fit.predict(16, threshold + 16) * proposal.spread > 0.9 * 0.150
    assert proposal.predicted_step_s == pytest.approx(fit.predict(16, threshold))
    reason = proposal.reason
    assert "ITL 150 ms less 10% headroom at p90 (the window's" in reason
    assert "x their mean" in reason and "a step may average" in reason
    assert "(predicted step" in reason and ", p90 " in reason
    # Sized for the mean, the same fit allows a larger chunk.
    mean = propose(fit, 150, 2048, 2080, 32, 16, **MEAN)
    assert mean.threshold > threshold and mean.spread == 1.0


def test_too_few_mixed_steps_are_sized_for_the_mean_and_say_so() -> None:
    metrics = PrometheusMetrics("m")
    rng = random.Random(9)
    run_steps(metrics, rng, 500, decodes=(16, 16), mixed_share=0.0)
    for _ in range(6):  # enough for a class, too few for a spread
        metrics.record_step(BASE + 16 * PER_DECODE + 512 * PER_TOKEN, 16, 512)
    fit = fit_steps(parse_step_totals(page(metrics)))
    assert fit.ok, fit.reason
    proposal = propose(fit, 150, 2048, 2080, 32, 16)
    assert proposal.spread == 1.0
    assert "6 mixed steps too few to read their spread" in proposal.reason
    assert fit.predict(16, proposal.threshold) <= 0.9 * 0.150
