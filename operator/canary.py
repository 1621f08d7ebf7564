"""Whether a canary serves as well as the stable replicas: a statistical test, not one sample.

Pure functions of what the pods' `/metrics` say over a window: the increase of the TTFT and
ITL histograms (operator/pool_metrics.py `increase`) and of the finished and failed request
counts, for the canary replica and for the stable ones. The rollout controller calls
`compare` at each look (`CanaryPolicy.looks`) and promotes, rolls back, or waits.

The latency test. For a metric with canary distribution C and stable distribution S, the
statistic is p = P(C > k·S), estimated from the two histograms (values spread evenly within
each bucket, as PromQL's histogram_quantile assumes), where k = 1 + margin. It is the
Mann-Whitney U statistic over n_c·n_s, so under p = 1/2 it is about normal with variance
(n_c + n_s + 1) / (12·n_c·n_s):

- the canary is *worse* when p is above 1/2 with significance `alpha_regression`: it is
  slower than the stable replicas by more than the margin;
- the canary is *good enough* when p is below 1/2 with significance `alpha_promotion`: it is
  not slower than the stable replicas by the margin (a non-inferiority test).

A rank test needs no assumption on the shape of the latencies and is not moved by a few huge
outliers. ITL observations are tokens, and the tokens of one request are not independent
draws: the sample size of the ITL test is the number of requests, not of tokens.

Errors. The canary's failed requests are compared with the stable error rate plus
`error_margin`: when seeing that many failures (or more) is improbable under that rate (an
exact binomial tail below `alpha_regression`), the canary is worse. To be promoted it must
show the converse against a rate clearly worse, the stable one plus twice the margin: seeing
so few failures must be improbable at that rate (below `alpha_promotion`). Errors are rare,
so this is what makes the first promotion wait for a few hundred requests (200 with no failure
at the defaults), and what keeps a canary that fails ten times as often from being promoted
on a lucky first window.

Repeated looks. A controller that tested at every scrape would, sooner or later, see a
"significant" difference between two equal pools. Decisions are taken only at `looks`
points, when the canary's window reaches min_requests, 2x, 4x, ... requests, and each look
tests at alpha / looks (Bonferroni), so the whole procedure keeps its error rates. At the
last look a canary that has not shown it is good enough is rolled back: the stable revision
is what is known to work.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal

Decision = Literal["promote", "rollback", "wait"]
# Each bucket's observations are taken as this many values spread evenly across it.
_POINTS_PER_BUCKET = 16


@dataclass(frozen=True)
class CanaryPolicy:
    """How sure the comparison must be, and of what."""

    # The canary may be this much slower (k = 1 + margin) and still be promoted.
    margin: float = 0.2
    # An error rate this much above the stable one (an absolute share) counts as worse.
    error_margin: float = 0.01
    # Requests the canary must finish before the first look, on either side of the test.
    min_requests: int = 100
    # Looks at min_requests, 2x, 4x, ...; the last one decides whatever it sees.
    looks: int = 4
    alpha_regression: float = 0.01
    alpha_promotion: float = 0.05
    # Closed-loop tuning's proposals trade ITL for throughput within the ITL SLO: with an SLO
    # here, the canary's ITL may be slower than the stable pods' by the headroom the SLO
    # leaves them (SLO over their p90), when that is more than the margin.
    itl_slo_s: float | None = None

    def look_sizes(self) -> list[int]:
        """The canary's request counts at which a decision may be taken."""
        return [self.min_requests * 2**i for i in range(self.looks)]

    def look_index(self, requests: int) -> int | None:
        """The last look this many canary requests reach (None: not the first yet)."""
        reached = [i for i, size in enumerate(self.look_sizes()) if requests >= size]
        return reached[-1] if reached else None


@dataclass(frozen=True)
class Window:
    """What one side (the canary, or the stable replicas together) served over the window.

    `ttft` and `itl` map each bucket's upper bound (+inf included) to the observations at
    or below it, as the cumulative `_bucket` series, taken as increases over the window.
    """

    ttft: Mapping[float, float]
    itl: Mapping[float, float]
    requests: int
    errors: int = 0


@dataclass(frozen=True)
class MetricTest:
    """One metric's comparison."""

    metric: str
    # P(canary > (1 + margin) x stable); 1/2 means as slow as the stable one plus the margin.
    p_slower: float
    z: float
    worse: bool
    good_enough: bool


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    tests: list[MetricTest] = field(default_factory=list)


def compare(canary: Window, stable: Window, policy: CanaryPolicy, look: int) -> Verdict:
    """The decision at look `look` (0-based; `policy.look_index` of the canary's requests)."""
    looks = max(policy.looks, 1)
    last = look >= looks - 1
    if canary.requests < policy.min_requests or stable.requests < policy.min_requests:
        return Verdict(
            "wait",
            f"the canary finished {canary.requests} requests and the stable replicas "
            f"{stable.requests}: {policy.min_requests} each are needed to compare",
        )
    alpha_regression = policy.alpha_regression / looks
    alpha_promotion = policy.alpha_promotion / looks
    stable_rate = stable.errors / stable.requests
    bound = min(stable_rate + policy.error_margin, 1.0)
    tail = binomial_upper_tail(canary.errors, canary.requests, bound)
    if tail < alpha_regression:
        return Verdict(
            "rollback",
            f"the canary failed {canary.errors} of {canary.requests} requests against "
            f"{stable.errors} of {stable.requests} on the stable replicas (P = {tail:.2g} "
            f"at an error rate of {bound:.1%})",
        )
    tests = []
    margins = {}
    for metric, ours, theirs in (
        ("TTFT", canary.ttft, stable.ttft),
        ("ITL", canary.itl, stable.itl),
    ):
        if total(ours) <= 0 or total(theirs) <= 0:
            continue  # no request produced a second token on one side, say
        margins[metric] = _margin(metric, theirs, policy)
        tests.append(
            latency_test(
                metric,
                ours,
                theirs,
                canary.requests,
                stable.requests,
                margins[metric],
                alpha_regression,
                alpha_promotion,
            )
        )
    worse = [t for t in tests if t.worse]
    if worse:
        said = "; ".join(_slower(t, margins[t.metric]) for t in worse)
        return Verdict("rollback", said, tests)
    # Promotion needs evidence that the canary fails less often than a rate clearly worse:
    # the stable one plus twice the margin (a non-inferiority test, as for latency).
    clearly_worse = min(stable_rate + 2 * policy.error_margin, 1.0)
    fails_more = binomial_lower_tail(canary.errors, canary.requests, clearly_worse) >= (
        alpha_promotion
    )
    if tests and all(t.good_enough for t in tests) and not fails_more:
        said = ", ".join(f"{t.metric} P(slower) = {t.p_slower:.2f}" for t in tests)
        slack = margins.get("ITL", policy.margin)
        headroom = (
            f" (ITL within {slack:.0%}: the headroom the ITL SLO leaves the stable pods)"
            if slack > policy.margin
            else ""
        )
        return Verdict(
            "promote",
            f"the canary is within {policy.margin:.0%} of the stable replicas{headroom} over "
            f"{canary.requests} requests ({said}) and fails no more often",
            tests,
        )
    if last and fails_more:
        return Verdict(
            "rollback",
            f"after {canary.requests} requests the canary, which failed {canary.errors}, has "
            f"not shown that it fails less often than {clearly_worse:.1%}",
            tests,
        )
    if last:
        unsure = [t.metric for t in tests if not t.good_enough] or ["latency"]
        return Verdict(
            "rollback",
            f"after {canary.requests} requests the canary has not shown that its "
            f"{' and '.join(unsure)} is within {policy.margin:.0%} of the stable replicas'",
            tests,
        )
    return Verdict("wait", f"not conclusive after {canary.requests} requests", tests)


def _margin(metric: str, stable: Mapping[float, float], policy: CanaryPolicy) -> float:
    """How much slower the canary may be: the policy's margin, or for ITL with an SLO the
    headroom the SLO leaves the stable pods' p90, whichever is larger."""
    if metric != "ITL" or policy.itl_slo_s is None:
        return policy.margin
    p90 = _quantile(stable, 0.9)
    if p90 is None or p90 <= 0:
        return policy.margin
    return max(policy.margin, policy.itl_slo_s / p90 - 1.0)


def _quantile(histogram: Mapping[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear within its bucket."""
    buckets = _buckets(histogram)
    count = sum(n for _, _, n in buckets)
    if count <= 0:
        return None
    rank, below = q * count, 0.0
    for lower, upper, n in buckets:
        if below + n >= rank:
            return lower + (upper - lower) * (rank - below) / n
        below += n
    return buckets[-1][1]


def latency_test(
    metric: str,
    canary: Mapping[float, float],
    stable: Mapping[float, float],
    canary_n: int,
    stable_n: int,
    margin: float,
    alpha_regression: float,
    alpha_promotion: float,
) -> MetricTest:
    """The rank test of one latency metric; `*_n` are the sample sizes (requests)."""
    p = p_slower(canary, stable, 1.0 + margin)
    sigma = math.sqrt((canary_n + stable_n + 1) / (12.0 * canary_n * stable_n))
    z = (p - 0.5) / sigma
    normal = NormalDist()
    return MetricTest(
        metric=metric,
        p_slower=p,
        z=z,
        worse=z > normal.inv_cdf(1 - alpha_regression),
        good_enough=z < -normal.inv_cdf(1 - alpha_promotion),
    )


def p_slower(canary: Mapping[float, float], stable: Mapping[float, float], k: float) -> float:
    """P(C > k·S) for C and S drawn from two cumulative histograms."""
    stable_cdf = _Cdf(stable)
    points = _points(canary)
    mass = sum(weight for _, weight in points)
    return sum(weight * stable_cdf(value / k) for value, weight in points) / mass


def total(histogram: Mapping[float, float]) -> float:
    return max(histogram.values(), default=0.0)


def binomial_upper_tail(successes: int, trials: int, rate: float) -> float:
    """P(X >= successes) for X ~ Binomial(trials, rate)."""
    if successes <= 0:
        return 1.0
    if rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return 1.0
    log_rate, log_rest = math.log(rate), math.log1p(-rate)
    terms = [
        math.lgamma(trials + 1)
        - math.lgamma(k + 1)
        - math.lgamma(trials - k + 1)
        + k * log_rate
        + (trials - k) * log_rest
        for k in range(successes, trials + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def binomial_lower_tail(successes: int, trials: int, rate: float) -> float:
    """P(X <= successes) for X ~ Binomial(trials, rate)."""
    if successes >= trials:
        return 1.0
    return 1.0 - binomial_upper_tail(successes + 1, trials, rate)


def _slower(test: MetricTest, margin: float) -> str:
    return (
        f"the canary's {test.metric} is more than {margin:.0%} slower than the stable "
        f"replicas' (P(slower) = {test.p_slower:.2f}, z = {test.z:.1f})"
    )


def _buckets(histogram: Mapping[float, float]) -> list[tuple[float, float, float]]:
    """(lower, upper, observations) of each bucket, from cumulative counts by upper bound.

    The +inf bucket's observations are put at its lower bound: slower than every finite
    bucket says, by an amount no one knows.
    """
    out = []
    lower, below = 0.0, 0.0
    for upper in sorted(histogram):
        count = histogram[upper] - below
        if count > 0:
            out.append((lower, lower if math.isinf(upper) else upper, count))
        if not math.isinf(upper):
            lower = upper
        below = histogram[upper]
    return out


def _points(histogram: Mapping[float, float]) -> list[tuple[float, float]]:
    """Each bucket's observations as values spread evenly across it, with their weights."""
    points = []
    for lower, upper, count in _buckets(histogram):
        if upper <= lower:
            points.append((lower, count))
            continue
        step = (upper - lower) / _POINTS_PER_BUCKET
        points.extend(
            (lower + (i + 0.5) * step, count / _POINTS_PER_BUCKET)
            for i in range(_POINTS_PER_BUCKET)
        )
    return points


class _Cdf:
    """P(S <= x) of a cumulative histogram, linear within each bucket."""

    def __init__(self, histogram: Mapping[float, float]) -> None:
        self.buckets = _buckets(histogram)
        self.total = sum(count for _, _, count in self.buckets)

    def __call__(self, x: float) -> float:
        below = 0.0
        for lower, upper, count in self.buckets:
            if x >= upper:
                below += count
                continue
            if x > lower:
                below += count * (x - lower) / (upper - lower)
            break
        return below / self.total
