"""Closed-loop tuning, measuring and fitting: what a step costs, from the engines' own counters.

`operator/tuning.py` sizes each role's chunks from a stated cost model (FLOPs and memory
bandwidth). This module sizes them from what the engines measured: each engine core counts its
steps by the prompt tokens and decodes they carried (engine/metrics.py, the `tidegate:step_*`
metrics), and an operator that scrapes the pods of a role twice can fit

    step seconds = base + per_decode x decodes + per_token x prompt tokens

to the window between the scrapes, then turn the fit into the role's
`longPrefillTokenThreshold` and `maxNumBatchedTokens` the way tuning.py's `_itl_chunk` does:
the prompt tokens a step with the usual number of decodes may carry and still meet the ITL
SLO.

What the engine exports, per engine core (`engine` label), per class of prompt tokens
(`prompt_tokens`: "0", "1-64", "65-256", ...) and of decodes (`decodes`: "0", "1-4", ...):
`tidegate:step_count_total`, `tidegate:step_seconds_total`,
`tidegate:step_prompt_tokens_total` and `tidegate:step_decodes_total`; and
`tidegate:step_duration_seconds{kind}`, a histogram by kind (`decode`, `mixed`, `prefill`).

The pieces, all pure (no HTTP, no kopf; the caller fetches the text):
- `step_totals` / `parse_step_totals`: one scrape of one pod, summed over its engine cores;
- `pod_increase` and `window`: the steps between two scrapes, summed over pods; a pod whose
  counters went down restarted and counts from zero, as in pool_metrics.increase, and a pod
  absent from the first scrape started in the window and counts from zero too;
- `fit_steps`: weighted least squares of the class means (weights: step counts), no
  coefficient negative; it says why when the window cannot tell the terms apart;
- `propose`: the threshold and budget the fit gives for an ITL SLO, in whole blocks within
  tuning.py's bounds, with a reason that shows the fitted numbers and the arithmetic, or no
  change (within a block or 10% of the current value, or a fit not to be trusted). The fit
  predicts a step's mean, while the SLO holds at p90 (as the autoscaler reads it): the mean a
  mixed step may take is the SLO, less a 10% headroom, over the spread the window's mixed
  steps showed (their p90 over their mean: chunks deep into a long prompt attend to more keys
  and cost more than the average chunk, which a per-token cost does not say);
- `slo_attainment`: the share of decode and mixed steps over the SLO, from the histogram.

Why class means and not every step: counters are what Prometheus and a scraping operator
have, they add over pods and over time, and the means of a class obey the same linear model
as its steps. What they lose is the spread within a class; the decode classes keep enough of
the decode counts' spread to tell per_decode from base when the load varied. When it did not
(every step carried about the same number of decodes), per_decode is not fitted and base
holds the decodes' cost at the window's usual count; the reason says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from tidegate.common.linear import determinant, solve
from tidegate.operator.pool_metrics import Sample, parse_exposition
from tidegate.operator.pool_metrics import quantile as histogram_quantile
from tidegate.operator.tuning import MAX_UNIFIED_CHUNK_TOKENS, chunk_bounds, step_budget

STEP_COUNT = "tidegate:step_count_total"
STEP_SECONDS = "tidegate:step_seconds_total"
STEP_PROMPT_TOKENS = "tidegate:step_prompt_tokens_total"
STEP_DECODES = "tidegate:step_decodes_total"
STEP_DURATION = "tidegate:step_duration_seconds"
_SUMS = {STEP_COUNT: 0, STEP_SECONDS: 1, STEP_PROMPT_TOKENS: 2, STEP_DECODES: 3}

# A class needs this many steps in the window to count as measured (to separate the terms).
MIN_CLASS_STEPS = 5
# Cells (prompt class x decode class) with fewer steps are left out of the fit: one odd step
# (the first of a pod, a warm-up) must not decide a coefficient.
MIN_CELL_STEPS = 3
# Two terms whose columns' normalized Gram determinant falls below this cannot be told apart
# in the window (a decode count that hardly varied, say): the fit keeps fewer terms.
MIN_INDEPENDENCE = 0.01
# A prompt token's fitted cost must add at least this share to the steps that carry the most
# prompt tokens, or the window shows no measurable cost of them.
MIN_PROMPT_SHARE = 0.01
# The SLO holds at this quantile of the mixed steps (p90, as the autoscaler reads latency), and
# the proposal aims that far under it: the fit is of means, and the next window is noisy.
SLO_QUANTILE = 0.9
HEADROOM = 0.10
# Mixed steps needed to read their spread (their p90 over their mean) from the histogram.
MIN_TAIL_STEPS = 10
# No change unless the threshold moves by more than a block and by more than this share of
# the current value: the loop settles instead of chasing noise.
HYSTERESIS = 0.10

TERMS = ("base", "per_decode", "per_token")


# --- one scrape, and the window between two -------------------------------------------------


@dataclass(frozen=True)
class ClassSums:
    """The steps of one class: how many, their seconds, prompt tokens and decodes, summed."""

    steps: float = 0.0
    seconds: float = 0.0
    prompt_tokens: float = 0.0
    decodes: float = 0.0

    def values(self) -> tuple[float, float, float, float]:
        return (self.steps, self.seconds, self.prompt_tokens, self.decodes)

    def __add__(self, other: ClassSums) -> ClassSums:
        return ClassSums(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def __sub__(self, other: ClassSums) -> ClassSums:
        return ClassSums(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))


# A class: (prompt_tokens label, decodes label), e.g. ("257-1024", "5-16").
ClassKey = tuple[str, str]


@dataclass(frozen=True)
class StepTotals:
    """Step counters of one pod (or, summed, of a pool): sums per class, and the duration
    histogram per kind as cumulative counts by upper bound (`le`)."""

    classes: Mapping[ClassKey, ClassSums] = field(default_factory=dict)
    durations: Mapping[str, Mapping[float, float]] = field(default_factory=dict)

    @property
    def steps(self) -> float:
        return sum(sums.steps for sums in self.classes.values())


def step_totals(samples: Iterable[Sample]) -> StepTotals:
    """The step counters of one scrape, summed over engine cores (and models)."""
    sums: dict[ClassKey, list[float]] = {}
    durations: dict[str, dict[float, float]] = {}
    for sample in samples:
        index = _SUMS.get(sample.name)
        if index is not None:
            key = (sample.labels.get("prompt_tokens", ""), sample.labels.get("decodes", ""))
            sums.setdefault(key, [0.0] * 4)[index] += sample.value
        elif sample.name == STEP_DURATION + "_bucket":
            kind = durations.setdefault(sample.labels.get("kind", ""), {})
            bound = float(sample.labels.get("le", "+Inf"))
            kind[bound] = kind.get(bound, 0.0) + sample.value
    return StepTotals({key: ClassSums(*values) for key, values in sums.items()}, durations)


def parse_step_totals(text: str) -> StepTotals:
    """`step_totals` of a Prometheus text exposition (one pod's `/metrics`)."""
    return step_totals(parse_exposition(text))


def pod_increase(before: StepTotals | None, after: StepTotals) -> StepTotals:
    """One pod's steps between two scrapes. A counter that went down means the pod restarted:
    its counts since then are all the window has of it, as PromQL's increase() counts; a pod
    not scraped before (None) started in the window and counts from zero too."""
    if before is None or _went_down(before, after):
        return after
    classes = {
        key: sums - before.classes.get(key, ClassSums()) for key, sums in after.classes.items()
    }
    durations = {
        kind: {
            bound: count - before.durations.get(kind, {}).get(bound, 0.0)
            for bound, count in buckets.items()
        }
        for kind, buckets in after.durations.items()
    }
    return StepTotals(classes, durations)


def _went_down(before: StepTotals, after: StepTotals) -> bool:
    for key, old in before.classes.items():
        new = after.classes.get(key, ClassSums())
        if any(n < o for n, o in zip(new.values(), old.values(), strict=True)):
            return True
    for kind, buckets in before.durations.items():
        new_buckets = after.durations.get(kind, {})
        if any(new_buckets.get(bound, 0.0) < count for bound, count in buckets.items()):
            return True
    return False


def add_totals(totals: Iterable[StepTotals]) -> StepTotals:
    """Several pods' (or windows') steps together."""
    classes: dict[ClassKey, ClassSums] = {}
    durations: dict[str, dict[float, float]] = {}
    for one in totals:
        for key, sums in one.classes.items():
            classes[key] = classes.get(key, ClassSums()) + sums
        for kind, buckets in one.durations.items():
            summed = durations.setdefault(kind, {})
            for bound, count in buckets.items():
                summed[bound] = summed.get(bound, 0.0) + count
    return StepTotals(classes, durations)


def window(before: Mapping[str, StepTotals], after: Mapping[str, StepTotals]) -> StepTotals:
    """A role's steps between two scrapes of its pods (by pod name): each pod's increase,
    summed. A pod gone by the second scrape is left out: its last steps are unknown."""
    return add_totals(pod_increase(before.get(pod), totals) for pod, totals in after.items())


# --- SLO attainment from the histogram ------------------------------------------------------


@dataclass(frozen=True)
class Attainment:
    """Steps of one kind in the window, and the share of them over the SLO."""

    kind: str
    steps: float
    over: float

    @property
    def share_over(self) -> float | None:
        return self.over / self.steps if self.steps > 0 else None

    def describe(self, slo_ms: float) -> str:
        share = self.share_over
        if share is None:
            return f"no {self.kind} steps"
        return f"{share:.1%} of {self.steps:.0f} {self.kind} steps over {slo_ms:g} ms"


def share_over(buckets: Mapping[float, float], limit_s: float) -> tuple[float, float]:
    """(observations, those above `limit_s`) of a cumulative histogram; within the bucket that
    holds the limit, observations are taken as spread evenly (as histogram_quantile does)."""
    bounds = sorted(buckets)
    if not bounds:
        return 0.0, 0.0
    total = buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if limit_s <= bound:
            if math.isinf(bound):
                within = lower_count  # beyond the last finite bound: all above it count over
            else:
                part = (
                    (limit_s - lower_bound) / (bound - lower_bound) if bound > lower_bound else 1.0
                )
                within = lower_count + (count - lower_count) * part
            return total, max(0.0, total - within)
        lower_bound, lower_count = bound, count
    return total, max(0.0, total - lower_count)


def slo_attainment(totals: StepTotals, itl_slo_ms: float) -> dict[str, Attainment]:
    """Per kind (decode, mixed, prefill), the window's steps and how many were over the SLO.

    A decode or mixed step over the ITL SLO is a token late for every stream in it; a prefill
    step (no decode) delays no stream, and is reported for completeness."""
    result = {}
    for kind in ("decode", "mixed", "prefill"):
        steps, over = share_over(totals.durations.get(kind, {}), itl_slo_ms / 1000)
        result[kind] = Attainment(kind, steps, over)
    return result


# --- the fit --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassMean:
    """One class's mean step in the window, and what the fit predicts for it."""

    prompt_class: str
    decode_class: str
    steps: float
    seconds: float  # mean seconds of its steps
    prompt_tokens: float  # mean prompt tokens
    decodes: float  # mean decodes
    predicted: float | None = None  # seconds; None for a class left out of the fit


@dataclass(frozen=True)
class StepFit:
    """step seconds = base + per_decode x decodes + per_token x prompt tokens, fitted to a
    window, or why it could not be (`ok` False, the reason says why)."""

    ok: bool
    reason: str
    base_s: float = 0.0
    per_decode_s: float = 0.0
    per_token_s: float = 0.0
    # The terms the fit kept (per_decode is folded into base when decodes hardly varied).
    terms: tuple[str, ...] = ()
    steps: float = 0.0  # steps in the window
    classes: tuple[ClassMean, ...] = ()
    # Mean decodes of the steps that carried a prompt chunk beside decodes (else of the decode
    # steps): the usual decodes a chunk shares a step with.
    typical_decodes: float = 0.0
    rms_error_s: float = 0.0  # weighted RMS of the class means' errors
    totals: StepTotals = field(default_factory=StepTotals, repr=False)

    def predict(self, decodes: float, prompt_tokens: float) -> float:
        """Seconds of a step with this many decodes and prompt tokens, by the fit."""
        return self.base_s + self.per_decode_s * decodes + self.per_token_s * prompt_tokens

    def describe(self) -> str:
        """The fitted model and its figures, as reasons show it."""
        decode = (
            f" + {_ms(self.per_decode_s)} x decodes"
            if "per_decode" in self.terms
            else f" (per_decode not told apart: base holds about {self.typical_decodes:.3g} "
            "decodes' cost)"
        )
        return (
            f"fit over {self.steps:.0f} steps in {sum(c.predicted is not None for c in self.classes)}"
            f" classes: step = {_ms(self.base_s)}{decode} + {_us(self.per_token_s)} x prompt "
            f"tokens (RMS error {_ms(self.rms_error_s)})"
        )


def fit_steps(
    totals: StepTotals,
    min_class_steps: int = MIN_CLASS_STEPS,
    min_cell_steps: int = MIN_CELL_STEPS,
) -> StepFit:
    """Weighted least squares of the class means (weights: their step counts) for base,
    per_decode and per_token, none negative.

    It needs two prompt-token classes (the "0" class of decode-only steps counts) with at least
    `min_class_steps` steps each: one class alone cannot tell a prompt token's cost from the
    rest. base and per_token are always fitted; per_decode too when the decode counts varied
    enough to tell it from base (MIN_INDEPENDENCE), more classes than terms were measured, and
    it comes out non-negative; else base holds the decodes' cost at the window's usual count.
    A fit whose prompt tokens show no measurable cost (MIN_PROMPT_SHARE) is not to be trusted.
    """
    means = []
    for (prompt_class, decode_class), sums in sorted(totals.classes.items(), key=_class_order):
        if sums.steps <= 0:
            continue
        means.append(
            ClassMean(
                prompt_class,
                decode_class,
                sums.steps,
                sums.seconds / sums.steps,
                sums.prompt_tokens / sums.steps,
                sums.decodes / sums.steps,
            )
        )
    steps = sum(m.steps for m in means)
    typical = _typical_decodes(means)
    kept = [m for m in means if m.steps >= min_cell_steps]
    per_prompt_class: dict[str, float] = {}
    for m in kept:
        per_prompt_class[m.prompt_class] = per_prompt_class.get(m.prompt_class, 0.0) + m.steps
    measured = sorted(c for c, n in per_prompt_class.items() if n >= min_class_steps)
    base = StepFit(
        False, "", steps=steps, classes=tuple(means), typical_decodes=typical, totals=totals
    )
    if len(measured) < 2:
        seen = ", ".join(f"{c}: {n:.0f}" for c, n in sorted(per_prompt_class.items())) or "none"
        return replace(
            base,
            reason=f"no fit: {steps:.0f} steps in the window, and a prompt token's cost needs "
            f"at least {min_class_steps} steps in each of two prompt-token classes "
            f"(steps by class: {seen})",
        )
    rows = [(m.steps, (1.0, m.decodes, m.prompt_tokens), m.seconds) for m in kept]
    # base and per_token always; per_decode too when the window tells it from base (the decode
    # counts varied), has a class to spare for it, and it comes out non-negative.
    subsets = [(0, 2)]
    if len(kept) > len(TERMS) and _independent(rows, (0, 1)) and _independent(rows, (0, 1, 2)):
        subsets.insert(0, (0, 1, 2))
    best: tuple[float, tuple[int, ...], list[float]] | None = None
    for subset in subsets:
        solution = _least_squares(rows, subset)
        if solution is None:
            continue
        coefficients = [0.0, 0.0, 0.0]
        for index, value in zip(subset, solution, strict=True):
            coefficients[index] = value
        residual = sum(w * (y - _dot(coefficients, x)) ** 2 for w, x, y in rows)
        best = (residual, subset, coefficients)
        if min(solution) >= 0.0:
            break
    if best is None:
        return replace(base, reason="no fit: the classes cannot tell the costs apart")
    residual, subset, (b, d, t) = best
    weight = sum(w for w, _, _ in rows)
    classes = tuple(
        replace(m, predicted=b + d * m.decodes + t * m.prompt_tokens)
        if any(m is k for k in kept)
        else m
        for m in means
    )
    fit = StepFit(
        ok=False,
        reason="",
        base_s=b,
        per_decode_s=d,
        per_token_s=t,
        terms=tuple(TERMS[i] for i in subset),
        steps=steps,
        classes=classes,
        typical_decodes=typical,
        rms_error_s=math.sqrt(residual / weight) if weight else 0.0,
        totals=totals,
    )
    if b < 0.0:
        return replace(
            fit, reason=f"no fit: {fit.describe()}; a step cannot cost less than nothing"
        )
    # A prompt token's cost must show: at least 1% of the steps that carry the most of them.
    fullest = max(kept, key=lambda m: m.prompt_tokens)
    if t * fullest.prompt_tokens < MIN_PROMPT_SHARE * fullest.seconds:
        return replace(
            fit,
            reason=f"no fit: {fit.describe()}; prompt tokens showed no measurable cost (under "
            f"{MIN_PROMPT_SHARE:.0%} of the {fullest.prompt_class}-token steps), so the chunk "
            "size cannot be derived from it",
        )
    return replace(fit, ok=True, reason=fit.describe())


def _typical_decodes(means: list[ClassMean]) -> float:
    mixed = [m for m in means if m.prompt_tokens > 0 and m.decodes > 0]
    pool = mixed or [m for m in means if m.decodes > 0]
    steps = sum(m.steps for m in pool)
    return sum(m.decodes * m.steps for m in pool) / steps if steps else 0.0


def _class_order(item: tuple[ClassKey, ClassSums]) -> tuple[int, int]:
    prompt_class, decode_class = item[0]
    return _class_start(prompt_class), _class_start(decode_class)


def _class_start(label: str) -> int:
    digits = label.split("-")[0].rstrip("+")
    return int(digits) if digits.isdigit() else -1


Row = tuple[float, tuple[float, float, float], float]  # weight, features (1, d, p), seconds


def _gram(rows: list[Row], subset: tuple[int, ...]) -> list[list[float]]:
    return [[sum(w * x[i] * x[j] for w, x, _ in rows) for j in subset] for i in subset]


def _independent(rows: list[Row], subset: tuple[int, ...]) -> bool:
    """The columns of `subset` can be told apart: their Gram matrix, normalized to a unit
    diagonal, has a determinant of at least MIN_INDEPENDENCE (1 when orthogonal)."""
    gram = _gram(rows, subset)
    diagonal = math.prod(gram[k][k] for k in range(len(subset)))
    if diagonal <= 0.0:
        return False
    return determinant(gram) >= MIN_INDEPENDENCE * diagonal


def _least_squares(rows: list[Row], subset: tuple[int, ...]) -> list[float] | None:
    gram = _gram(rows, subset)
    moments = [sum(w * x[i] * y for w, x, y in rows) for i in subset]
    return solve(gram, moments)


def _dot(coefficients: list[float], x: tuple[float, float, float]) -> float:
    return sum(c * v for c, v in zip(coefficients, x, strict=True))


# --- the proposal ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Proposal:
    """The chunk threshold and step budget a fit gives for an ITL SLO.

    `change` False: keep the current values (`threshold` and `budget` are then the current
    ones); the reason says why (within the hysteresis band, or no fit to trust)."""

    change: bool
    threshold: int | str
    budget: int
    reason: str
    # The threshold the SLO arithmetic gave, in whole blocks within the bounds (None: no fit).
    fitted_threshold: int | None = None
    # Predicted seconds of a step with the typical decodes and a full chunk of `fitted_threshold`
    # (its mean), and the window's spread of mixed steps the SLO's quantile was read with: the
    # quantile predicted is predicted_step_s x spread.
    predicted_step_s: float | None = None
    spread: float = 1.0
    attainment: Mapping[str, Attainment] = field(default_factory=dict)


def propose(
    fit: StepFit,
    itl_slo_ms: float,
    current_threshold: int | str,
    current_budget: int,
    max_num_seqs: int,
    block_size: int,
    typical_decodes: float | None = None,
    max_model_len: int | None = None,
    max_chunk_tokens: int = MAX_UNIFIED_CHUNK_TOKENS,
    quantile: float | None = SLO_QUANTILE,
    headroom: float = HEADROOM,
    hysteresis: float = HYSTERESIS,
) -> Proposal:
    """The `longPrefillTokenThreshold` and `maxNumBatchedTokens` of a role whose steps carry
    decodes (unified, decode) for an ITL SLO, by the fitted step cost.

    As tuning.py's `_itl_chunk`: the prompt tokens a step with `typical_decodes` decodes (by
    default the window's usual count beside a chunk) may carry and still meet the SLO, in
    whole blocks, from MIN_CHUNK_BLOCKS blocks up to `max_chunk_tokens` or `max_model_len`;
    an SLO even the smallest chunk misses gets the floor, and says so. The fit predicts a
    step's mean, and the SLO holds at a quantile (p90, as the autoscaler reads it): the mean
    a mixed step may take is the SLO, less `headroom`, over the window's spread of mixed
    steps (their `quantile` over their mean, from the histogram; 1 with fewer than
    MIN_TAIL_STEPS of them or with `quantile` None). The budget is the threshold plus a
    decode token for each of `max_num_seqs` requests. No change when the fit is not to be
    trusted, or the new threshold is within a block and `hysteresis` of the current one.
    """
    attainment = slo_attainment(fit.totals, itl_slo_ms)
    measured = "; measured: " + ", ".join(
        attainment[kind].describe(itl_slo_ms) for kind in ("decode", "mixed")
    )
    if not fit.ok:
        return Proposal(
            False,
            current_threshold,
            current_budget,
            f"no change from threshold {current_threshold}: {fit.reason}{measured}",
            attainment=attainment,
        )
    decodes = fit.typical_decodes if typical_decodes is None else typical_decodes
    lower, upper, upper_name = chunk_bounds(block_size, max_model_len, max_chunk_tokens)
    decode_step = fit.base_s + fit.per_decode_s * decodes
    decode_why = (
        f"{_ms(fit.base_s)} + {decodes:.3g} decodes x {_ms(fit.per_decode_s)}"
        if "per_decode" in fit.terms
        else f"base, at the window's {fit.typical_decodes:.3g} decodes"
    )
    spread, spread_why = tail_spread(fit, quantile)
    target = itl_slo_ms / 1000 * (1.0 - headroom) / spread
    # How the SLO becomes the mean a step may take (nothing to say when it is the SLO itself).
    held = ""
    if headroom:
        held += f" less {headroom:.0%} headroom"
    if quantile is not None:
        held += f" at p{quantile * 100:g} ({spread_why})"
    aim = f"ITL {itl_slo_ms:g} ms"
    if held:
        aim += f"{held}: a step may average {_ms(target)}; {_ms(target)}"
    left = target - decode_step
    if left <= 0:
        tokens = lower
        why = (
            f"{fit.describe()}; ITL {itl_slo_ms:g} ms is out of reach: the decode step alone "
            f"takes {_ms(decode_step)} ({decode_why})"
        )
        if held:
            why += f", and a step may average {_ms(target)} (the SLO{held})"
        why += f"; chose the floor of {lower} tokens"
    else:
        count = int(left / fit.per_token_s)
        tokens = count - count % block_size
        body = (
            f"{fit.describe()}; {aim} - decode step {_ms(decode_step)} ({decode_why}) leaves "
            f"{_ms(left)}: {count} prompt tokens at {_us(fit.per_token_s)} each"
        )
        if tokens < lower:
            why = (
                f"{body}; ITL {itl_slo_ms:g} ms is out of reach: chose the floor of {lower} tokens"
            )
            tokens = lower
        elif tokens > upper:
            why, tokens = f"{body}, clamped to {upper_name}", upper
        else:
            why = (
                body if tokens == count else f"{body}, {tokens} in whole {block_size}-token blocks"
            )
    budget = step_budget(tokens, max_num_seqs, block_size)
    predicted = fit.predict(decodes, tokens)
    why += f" (predicted step {_ms(predicted)}"
    why += f", p{quantile * 100:g} {_ms(predicted * spread)})" if quantile is not None else ")"
    if isinstance(current_threshold, int) and current_threshold > 0:
        band = max(block_size, hysteresis * current_threshold)
        if abs(tokens - current_threshold) <= band:
            return Proposal(
                False,
                current_threshold,
                current_budget,
                f"no change: {tokens} is within {band:g} tokens (a {block_size}-token block or "
                f"{hysteresis:.0%}) of threshold {current_threshold}; {why}{measured}",
                tokens,
                predicted,
                spread,
                attainment,
            )
    return Proposal(
        True,
        tokens,
        int(budget.value),
        f"threshold {current_threshold} -> {tokens}: {why}; maxNumBatchedTokens "
        f"{current_budget} -> {budget.value} ({budget.reason}){measured}",
        tokens,
        predicted,
        spread,
        attainment,
    )


def tail_spread(fit: StepFit, quantile: float | None) -> tuple[float, str]:
    """The window's mixed steps' `quantile` over their mean (at least 1), and how it was read;
    1 when `quantile` is None or fewer than MIN_TAIL_STEPS mixed steps were measured."""
    if quantile is None:
        return 1.0, "sized for the mean"
    mixed = [c for c in fit.classes if c.prompt_tokens > 0 and c.decodes > 0]
    steps = sum(c.steps for c in mixed)
    buckets = fit.totals.durations.get("mixed", {})
    tail = histogram_quantile(buckets, quantile) if buckets else None
    if steps < MIN_TAIL_STEPS or not tail:
        return 1.0, (
            f"{steps:.0f} mixed steps too few to read their spread (at least {MIN_TAIL_STEPS}), "
            "sized for the mean"
        )
    mean = sum(c.seconds * c.steps for c in mixed) / steps
    spread = max(1.0, tail / mean)
    return spread, (
        f"the window's {steps:.0f} mixed steps ran to {_ms(tail)} at p{quantile * 100:g}, "
        f"{spread:.2f}x their mean {_ms(mean)}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"
