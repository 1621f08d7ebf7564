"""The canary comparison on synthetic metric streams: its false-promotion and false-rollback
rates, with and without a real regression, over the whole sequence of looks.

Each trial draws requests for a canary and for stable replicas with twice its traffic: TTFT
log-normal per request; ITL a per-request level (log-normal) with tokens scattered around it,
as a batch's load moves a request's pace. They are binned into the engine's own buckets and
the controller's procedure is run as it would be: a look at each size of
`CanaryPolicy.look_sizes`, the windows growing, the first decision that is not "wait" taken.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from tidegate.engine.metrics import ITL_BUCKETS, TTFT_BUCKETS
from tidegate.operator.canary import (
    CanaryPolicy,
    Window,
    binomial_upper_tail,
    compare,
    latency_test,
    p_slower,
)

POLICY = CanaryPolicy()
TRIALS = 200
TOKENS = 8  # ITL observations per request


@dataclass(frozen=True)
class Serving:
    """How one side serves: medians, spreads and an error rate."""

    ttft_s: float = 0.2
    itl_s: float = 0.04
    errors: float = 0.005


def cumulative(values: np.ndarray, bounds: tuple[float, ...]) -> dict[float, float]:
    edges = np.array(bounds)
    counts = np.bincount(np.searchsorted(edges, values, side="left"), minlength=len(edges) + 1)
    running = np.cumsum(counts)
    out = {bound: float(running[i]) for i, bound in enumerate(bounds)}
    out[math.inf] = float(running[-1])
    return out


class Side:
    """One side's requests, drawn once per trial; windows are their prefixes."""

    def __init__(self, rng: np.random.Generator, serving: Serving, requests: int) -> None:
        self.ttft = serving.ttft_s * rng.lognormal(0.0, 0.5, requests)
        level = serving.itl_s * rng.lognormal(0.0, 0.3, requests)
        self.itl = level[:, None] * rng.lognormal(0.0, 0.2, (requests, TOKENS))
        self.failed = rng.random(requests) < serving.errors

    def window(self, requests: int) -> Window:
        return Window(
            ttft=cumulative(self.ttft[:requests], TTFT_BUCKETS),
            itl=cumulative(self.itl[:requests].ravel(), ITL_BUCKETS),
            requests=requests,
            errors=int(self.failed[:requests].sum()),
        )


def procedure(rng: np.random.Generator, canary: Serving, stable: Serving) -> str:
    """The decision the controller reaches for one trial."""
    sizes = POLICY.look_sizes()
    ours = Side(rng, canary, sizes[-1])
    theirs = Side(rng, stable, 2 * sizes[-1])
    for look, size in enumerate(sizes):
        verdict = compare(ours.window(size), theirs.window(2 * size), POLICY, look)
        if verdict.decision != "wait":
            return verdict.decision
    raise AssertionError("the last look must decide")


def rates(canary: Serving, stable: Serving = Serving(), seed: int = 0) -> Counter[str]:
    rng = np.random.default_rng(seed)
    decisions = Counter(procedure(rng, canary, stable) for _ in range(TRIALS))
    return Counter({k: v / TRIALS for k, v in decisions.items()})


def test_an_unchanged_canary_is_promoted_and_rarely_rolled_back() -> None:
    found = rates(Serving())
    assert found["rollback"] <= 0.03, found  # false rollbacks
    assert found["promote"] >= 0.97, found


def test_a_canary_slower_within_the_margin_is_promoted() -> None:
    found = rates(Serving(ttft_s=0.21, itl_s=0.042))  # 5% slower, margin 20%
    assert found["promote"] >= 0.9, found


def test_an_improvement_is_promoted() -> None:
    assert rates(Serving(ttft_s=0.14, itl_s=0.028))["promote"] >= 0.97


@pytest.mark.parametrize(
    "canary",
    [Serving(itl_s=0.08), Serving(ttft_s=0.3), Serving(errors=0.05)],
    ids=["ITL doubled", "TTFT x1.5", "errors x10"],
)
def test_a_real_regression_is_rolled_back_and_never_promoted(canary: Serving) -> None:
    found = rates(canary)
    assert found["promote"] <= 0.01, found  # false promotions
    assert found["rollback"] >= 0.99, found


def test_a_doubled_itl_is_caught_at_the_first_look_with_its_reason() -> None:
    rng = np.random.default_rng(1)
    size = POLICY.min_requests
    ours = Side(rng, Serving(itl_s=0.08), size).window(size)
    theirs = Side(rng, Serving(), 2 * size).window(2 * size)
    verdict = compare(ours, theirs, POLICY, look=0)
    assert verdict.decision == "rollback"
    assert "ITL is more than 20% slower" in verdict.reason
    (itl,) = [t for t in verdict.tests if t.metric == "ITL"]
    assert itl.worse and itl.p_slower > 0.8


def test_the_itl_sample_size_is_the_requests_not_the_tokens() -> None:
    """A canary 30% slower on ITL over 100 requests: not yet decisive at 100 samples, though
    it would look so if each of its 800 tokens counted as one."""
    rng = np.random.default_rng(2)
    ours = Side(rng, Serving(itl_s=0.052), 100).window(100)
    theirs = Side(rng, Serving(), 200).window(200)
    verdict = compare(ours, theirs, POLICY, look=0)
    assert verdict.decision == "wait"
    (itl,) = [t for t in verdict.tests if t.metric == "ITL"]
    assert not itl.worse and not itl.good_enough
    alpha = POLICY.alpha_regression / POLICY.looks
    by_tokens = latency_test("ITL", ours.itl, theirs.itl, 800, 1600, 0.2, alpha, alpha)
    assert by_tokens.worse


def test_too_few_requests_wait_whatever_they_show() -> None:
    rng = np.random.default_rng(3)
    ours = Side(rng, Serving(itl_s=0.4, errors=0.5), 50).window(50)
    theirs = Side(rng, Serving(), 500).window(500)
    verdict = compare(ours, theirs, POLICY, look=0)
    assert verdict.decision == "wait" and "100 each are needed" in verdict.reason


def test_the_last_look_rolls_back_what_it_cannot_show_is_good_enough() -> None:
    rng = np.random.default_rng(4)
    # 20% slower: exactly the margin, neither worse nor good enough with any certainty.
    ours = Side(rng, Serving(ttft_s=0.24, itl_s=0.048), 100).window(100)
    theirs = Side(rng, Serving(), 200).window(200)
    early = compare(ours, theirs, POLICY, look=0)
    late = compare(ours, theirs, POLICY, look=POLICY.looks - 1)
    assert early.decision == "wait"
    assert late.decision == "rollback" and "has not shown" in late.reason


def test_looks_double_from_the_minimum() -> None:
    assert POLICY.look_sizes() == [100, 200, 400, 800]
    assert [POLICY.look_index(n) for n in (99, 100, 399, 400, 5000)] == [None, 0, 1, 2, 3]


def test_p_slower_of_equal_histograms_is_a_half_and_moves_with_the_factor() -> None:
    values = np.random.default_rng(5).lognormal(math.log(0.05), 0.4, 5000)
    histogram = cumulative(values, ITL_BUCKETS)
    assert p_slower(histogram, histogram, 1.0) == pytest.approx(0.5, abs=0.01)
    assert p_slower(histogram, histogram, 1.2) < 0.45
    doubled = cumulative(2 * values, ITL_BUCKETS)
    assert p_slower(doubled, histogram, 1.0) > 0.85


def test_observations_past_the_last_bucket_count_as_slower_than_all() -> None:
    stable = {0.1: 10.0, 1.0: 10.0, math.inf: 10.0}
    canary = {0.1: 0.0, 1.0: 0.0, math.inf: 10.0}
    assert p_slower(canary, stable, 1.2) == 1.0


def test_binomial_tail_matches_the_sum() -> None:
    n, rate = 40, 0.1
    exact = sum(math.comb(n, k) * rate**k * (1 - rate) ** (n - k) for k in range(7, n + 1))
    assert binomial_upper_tail(7, n, rate) == pytest.approx(exact, rel=1e-9)
    assert binomial_upper_tail(0, n, rate) == 1.0
    assert binomial_upper_tail(1, n, 0.0) == 0.0
