"""The autoscaler's decision function, rule by rule and over recorded load traces.

The traces drive a fluid model of a pool: a replica completes CAPACITY requests per second,
each request stays SERVICE_S seconds (so a full replica runs CAPACITY * SERVICE_S of them),
and a pod asked for becomes ready START_S seconds later. Every TICK seconds (the HPA's sync
period) the pool's signals go to `decide` and its answer is applied. Time is a number here:
nothing sleeps.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tidegate.operator.autoscaler import (
    TOLERANCE,
    Decision,
    PoolSignals,
    PoolTargets,
    ScaleEvent,
    ScalerState,
    decide,
    pool_targets,
    starting_replicas,
)
from tidegate.operator.spec import AutoscalingPolicy, parse_spec

CAPACITY = 1.0  # requests per second one replica completes
SERVICE_S = 8.0  # seconds one request runs
START_S = 60.0  # seconds from asking for a pod to its readiness
TICK = 15.0
PER_REPLICA = 6  # running + waiting requests one replica should carry (a full one runs 8)
POLICY = AutoscalingPolicy(min_replicas=1, max_replicas=20)
TARGETS = PoolTargets(
    requests_per_replica=PER_REPLICA,
    waiting_per_replica=2,
    kv_cache_usage=0.8,
    latency_slo_s=0.8,
)


def policy(**changes: object) -> AutoscalingPolicy:
    """POLICY with CRD-named fields changed (scaleDown={...} and the like)."""
    return AutoscalingPolicy.model_validate({"maxReplicas": 20, **changes})


# -- the fleet model ---------------------------------------------------------------------------


@dataclass
class Pool:
    """A fluid model of one pool: load in requests per second, pods that take START_S to serve."""

    ready: int
    capacity: float = CAPACITY
    service_s: float = SERVICE_S
    start_s: float = START_S
    starting: list[float] = field(default_factory=list)  # when each pending pod is ready
    waiting: float = 0.0
    running: float = 0.0
    held: float = 0.0  # requests the router holds while no replica is ready

    @property
    def slots(self) -> float:
        return self.ready * self.capacity * self.service_s

    def advance(self, now: float, rate: float, dt: float) -> None:
        """`dt` seconds of arrivals at `rate`; pods whose start time has passed turn ready."""
        self.ready += sum(1 for at in self.starting if at <= now)
        self.starting = [at for at in self.starting if at > now]
        if not self.ready:
            self.held += rate * dt
            self.running = self.waiting = 0.0
            return
        self.waiting += self.held
        self.held = 0.0
        self.waiting = max(0.0, self.waiting + (rate - self.ready * self.capacity) * dt)
        self.running = self.slots if self.waiting else min(self.slots, rate * self.service_s)

    def signals(self, **extra: object) -> PoolSignals:
        """What the operator would scrape from this pool."""
        ready = self.ready
        queue_s = self.waiting / (ready * self.capacity) if ready else 0.0
        return PoolSignals(
            ready=ready,
            pending=len(self.starting),
            running=round(self.running),
            waiting=round(self.waiting),
            kv_cache_usage=0.9 * self.running / self.slots if ready else None,
            latency_p90_s=0.2 + queue_s if ready else None,
            router_pending=math.ceil(self.held),
            start_time_s=self.start_s,
            **extra,
        )

    def scale(self, now: float, desired: int) -> None:
        """Pods asked for start now; pods removed go pending first, as a Deployment does."""
        current = self.ready + len(self.starting)
        if desired > current:
            self.starting += [now + self.start_s] * (desired - current)
        for _ in range(current - desired):
            if self.starting:
                self.starting.pop()
            else:
                self.ready -= 1


@dataclass
class Run:
    """One trace through the pool: each tick's time, load, decision and ready replicas."""

    times: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)

    @property
    def events(self) -> list[Decision]:
        return [d for d in self.decisions if d.changed]

    def reversals(self) -> int:
        """Changes of direction: growth after a shrink or a shrink after growth."""
        signs = [1 if d.desired > d.current else -1 for d in self.events]
        return sum(1 for a, b in itertools.pairwise(signs) if a != b)

    def reaction_s(self, since: float, needed: int) -> float:
        """Seconds from `since` until `needed` replicas are ready."""
        for t, ready in zip(self.times, self.ready, strict=True):
            if t >= since and ready >= needed:
                return t - since
        return math.inf


def needed(rate: float) -> int:
    """The fewest replicas that carry `rate` at the target concurrency, within the tolerance."""
    return math.ceil(rate * SERVICE_S / PER_REPLICA / (1 + TOLERANCE) - 1e-9)


def simulate(
    trace: Callable[[float], float],
    duration_s: float,
    pool: Pool | None = None,
    the_policy: AutoscalingPolicy = POLICY,
    targets: PoolTargets = TARGETS,
) -> Run:
    """Run `decide` every TICK over `trace` (requests per second at each time)."""
    pool = pool or Pool(ready=needed(trace(0.0)) or 1)
    state, run, now = ScalerState(), Run(), 0.0
    while now < duration_s:
        rate = trace(now)
        pool.advance(now, rate, TICK)
        decision = decide(the_policy, targets, pool.signals(), state, now)
        state = decision.state
        pool.scale(now, decision.desired)
        run.times.append(now)
        run.rates.append(rate)
        run.decisions.append(decision)
        run.ready.append(pool.ready)
        now += TICK
    return run


def step(t: float) -> float:
    return 2.0 if t < 600 else 10.0


def ramp(t: float) -> float:
    return 1.0 + 11.0 * min(max(t - 300, 0.0), 1200.0) / 1200.0


def spike(t: float) -> float:
    return 12.0 if 600 <= t < 660 else 3.0


def diurnal(t: float) -> float:
    return 6.0 + 5.0 * math.sin(2 * math.pi * t / 3600)


_noise = random.Random(7)
NOISE = [_noise.uniform(0.8, 1.2) for _ in range(1000)]


def noisy_flat(t: float) -> float:
    return 6.0 * NOISE[int(t // TICK) % len(NOISE)]


TRACES = {"step": step, "ramp": ramp, "spike": spike, "diurnal": diurnal, "noisy-flat": noisy_flat}


# -- over the traces ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRACES)
def test_replicas_stay_within_min_and_max_at_every_step(name: str) -> None:
    run = simulate(TRACES[name], 7200)
    for decision in run.decisions:
        assert POLICY.min_replicas <= decision.desired <= POLICY.max_replicas, decision.reason


# Why these bounds: growth at least doubles per period (pods 4 or 100%), so one rise of load
# needs at most log2(max / min) + 1 = 6 growths, and a slow rise (ramp, diurnal) one growth per
# replica it adds; shrinking makes at most one event per replica of overshoot, so at most
# max - min = 19 per fall. Flapping shows as reversals (a shrink then a growth or the
# reverse): the 300 s scale-down window keeps one load change to at most one, and the
# diurnal trace (two days' shape in two hours: needs of 2 to 15 replicas) to one per peak
# and one per trough.
EVENT_BOUNDS = {
    "step": (6, 19, 1),  # (growths, shrinks, reversals) over 7,200 s
    "ramp": (15, 19, 1),
    "spike": (6, 19, 1),
    "diurnal": (2 * 14, 2 * 14, 4),
    "noisy-flat": (1, 0, 0),  # +-20% around a flat load: one growth to cover the peaks
}


@pytest.mark.parametrize("name", TRACES)
def test_scale_events_stay_bounded(name: str) -> None:
    run = simulate(TRACES[name], 7200)
    growths = sum(1 for d in run.events if d.desired > d.current)
    shrinks = len(run.events) - growths
    growths_max, shrinks_max, reversals_max = EVENT_BOUNDS[name]
    reasons = [d.reason for d in run.events]
    assert growths <= growths_max and shrinks <= shrinks_max, reasons
    assert run.reversals() <= reversals_max, reasons


def test_no_shrink_follows_a_growth_within_the_scale_down_window() -> None:
    for trace in TRACES.values():
        run = simulate(trace, 7200)
        last_growth = -math.inf
        for t, decision in zip(run.times, run.decisions, strict=True):
            if decision.desired > decision.current:
                last_growth = t
            elif decision.desired < decision.current:
                assert t - last_growth >= POLICY.scale_down.stabilization_window_seconds


def test_a_step_is_served_within_two_ticks_and_a_start_time() -> None:
    run = simulate(step, 1800)
    # The first tick after the step sees it, growth doubles per period, the pods take START_S.
    reaction = run.reaction_s(600, needed(10.0))
    assert reaction <= 2 * TICK + START_S, reaction


def test_a_ramp_is_followed_within_a_start_time_and_a_tick() -> None:
    run = simulate(ramp, 1800)
    lags = [
        run.reaction_s(t, needed(rate))
        for t, rate in zip(run.times, run.rates, strict=True)
        if 300 <= t <= 1500
    ]
    assert max(lags) <= START_S + 2 * TICK, max(lags)


def test_a_spike_is_absorbed_and_the_pool_settles_back() -> None:
    run = simulate(spike, 3600)
    assert max(run.ready) > needed(3.0)  # it grew for the spike
    assert run.ready[-1] <= needed(3.0) + 1  # and came back down
    assert run.reaction_s(600, needed(12.0)) <= 2 * TICK + START_S


def test_a_noisy_flat_load_is_left_alone_once_sized() -> None:
    run = simulate(noisy_flat, 7200)
    assert [d.reason for d in run.events if d.desired < d.current] == []
    assert len(run.events) <= 1  # at most one growth, to cover the noise's peaks
    assert run.ready[-1] >= needed(6.0 * 1.2)


def test_diurnal_load_is_tracked_up_and_down() -> None:
    run = simulate(diurnal, 7200)
    peak, trough = needed(11.0), needed(1.0)
    assert max(run.ready) >= peak
    assert min(run.ready[len(run.ready) // 2 :]) <= trough + 3  # the shrink lags by the window


# -- prefill and decode: each pool on its own signals -------------------------------------------


def test_decode_grows_on_kv_usage_and_itl_while_prefill_stays_flat() -> None:
    decode_targets = PoolTargets(64, 2, 0.8, latency_slo_s=0.05, latency_name="ITL")
    prefill, decode = ScalerState(), ScalerState()
    prefill_replicas = decode_replicas = 2
    decode_reasons = []
    for minute in range(30):
        now = minute * 60.0
        # Longer answers: the same prompts, so prefill's load is flat, while decode's KV
        # cache fills (spread over however many decode replicas there are).
        kv = min(0.95, 0.4 + minute * 0.05) * 2 / decode_replicas
        itl = 0.03 if kv < 0.8 else 0.08
        prefill_signals = PoolSignals(
            ready=prefill_replicas, running=12, kv_cache_usage=0.7, latency_p90_s=0.3
        )
        decode_signals = PoolSignals(
            ready=decode_replicas, running=128, kv_cache_usage=kv, latency_p90_s=itl
        )
        p = decide(POLICY, TARGETS, prefill_signals, prefill, now)
        d = decide(POLICY, decode_targets, decode_signals, decode, now)
        prefill, decode = p.state, d.state
        prefill_replicas, decode_replicas = p.desired, d.desired
        decode_reasons += [d.reason] if d.changed else []
    assert prefill_replicas == 2
    assert decode_replicas >= 3
    assert decode_reasons and all("KV cache" in r or "ITL" in r for r in decode_reasons)


def test_prefill_grows_on_ttft_and_its_queue_while_decode_stays_flat() -> None:
    decode_targets = PoolTargets(64, 2, 0.8, latency_slo_s=0.05, latency_name="ITL")
    prefill_signals = PoolSignals(ready=2, running=12, waiting=30, latency_p90_s=2.4)
    decode_signals = PoolSignals(ready=2, running=40, kv_cache_usage=0.5, latency_p90_s=0.03)
    p = decide(POLICY, TARGETS, prefill_signals, ScalerState(), 0.0)
    d = decide(POLICY, decode_targets, decode_signals, ScalerState(), 0.0)
    assert p.desired > 2 and d.desired == 2
    assert "2 -> " in p.reason


# -- scale to zero and back -------------------------------------------------------------------


def test_an_idle_pool_goes_to_zero_after_idle_before_zero_and_wakes_on_router_demand() -> None:
    zero = policy(minReplicas=0, idleBeforeZeroSeconds=600)
    pool = Pool(ready=2)

    def trace(t: float) -> float:
        return 3.0 if t < 300 or t >= 2400 else 0.0

    run = simulate(trace, 3000, pool=pool, the_policy=zero)
    zero_at = next(t for t, d in zip(run.times, run.decisions, strict=True) if d.desired == 0)
    idle_from = 300  # the first tick that sees no request
    assert idle_from + 600 <= zero_at <= idle_from + 600 + 2 * TICK
    assert "no request for" in next(d.reason for d in run.decisions if d.desired == 0)
    woke = next(d for t, d in zip(run.times, run.decisions, strict=True) if t >= 2400 and d.changed)
    assert woke.current == 0 and woke.desired >= 1 and "wake from zero" in woke.reason
    assert run.times[run.decisions.index(woke)] - 2400 <= TICK


def test_predictive_growth_meets_a_ramp_sooner_and_stays_off_by_default() -> None:
    # A steep ramp: 1 to 12 req/s in 2 minutes. Growing ahead of the rise reaches the
    # replicas of the ramp's upper part sooner than growing on demand as it is (at the top,
    # the latency votes of both catch up).
    def steep(t: float) -> float:
        return 1.0 + 11.0 * min(max(t - 300, 0.0), 120.0) / 120.0

    plain = simulate(steep, 1200)
    ahead = simulate(steep, 1200, the_policy=policy(scaleUp={"predictive": True}))
    upper = needed(8.0)
    assert ahead.reaction_s(300, upper) < plain.reaction_s(300, upper) < math.inf
    reasons = [d.reason for d in ahead.events if d.desired > d.current]
    assert any("rising" in reason for reason in reasons), reasons
    assert not any("rising" in d.reason for d in plain.decisions)
    # And never above maxReplicas or below minReplicas, ahead or not.
    assert all(1 <= d.desired <= 20 for d in ahead.decisions)


def test_an_idle_pool_goes_to_zero_though_its_kv_cache_is_not_empty() -> None:
    # An idle engine's cache may still hold blocks; after idleBeforeZero that keeps no pod.
    zero = policy(minReplicas=0, idleBeforeZeroSeconds=60)
    state = ScalerState()
    for now in range(0, 70, 5):
        signals = PoolSignals(ready=1, kv_cache_usage=0.3)
        decision = decide(zero, TARGETS, signals, state, float(now))
        state = decision.state
        if decision.changed:
            break
    assert (now, decision.desired) == (60, 0) and "no request for 60 s" in decision.reason


def test_a_pool_at_zero_stays_there_without_requests() -> None:
    zero = policy(minReplicas=0)
    decision = decide(zero, TARGETS, PoolSignals(ready=0), ScalerState(), 0.0)
    assert (decision.desired, decision.current) == (0, 0)


def test_min_one_never_goes_to_zero() -> None:
    run = simulate(lambda t: 0.0, 3600, pool=Pool(ready=3))
    assert min(d.desired for d in run.decisions) == 1


def test_wake_from_zero_is_sized_to_the_held_requests() -> None:
    zero = policy(minReplicas=0)
    decision = decide(zero, TARGETS, PoolSignals(ready=0, router_pending=30), ScalerState(), 0.0)
    assert decision.desired == 5  # 30 requests / 6 per replica; no window, no rate limit


# -- rule by rule -----------------------------------------------------------------------------


def test_demand_over_target_grows_the_pool() -> None:
    decision = decide(POLICY, TARGETS, PoolSignals(ready=2, running=24), ScalerState(), 0.0)
    assert decision.desired == 4
    assert decision.reason == "2 -> 4: 24 requests / 6 per replica needs 4"


def test_a_ratio_within_ten_percent_moves_nothing() -> None:
    decision = decide(POLICY, TARGETS, PoolSignals(ready=5, running=32), ScalerState(), 0.0)
    assert not decision.changed and "within 10%" in decision.reason


def test_the_queue_over_its_target_adds_replicas_for_the_excess() -> None:
    # 2 replicas, 12 running and 20 waiting: 16 over the 2-per-replica target, 6 per replica.
    lenient = PoolTargets(64, 2, 0.8, None)
    decision = decide(
        POLICY, lenient, PoolSignals(ready=2, running=12, waiting=20), ScalerState(), 0.0
    )
    assert decision.desired == 2 + math.ceil(16 / 64)


def test_kv_usage_above_target_grows_and_below_target_shrinks() -> None:
    lenient = PoolTargets(1000, 100, 0.8, None)
    grow = decide(POLICY, lenient, PoolSignals(ready=4, kv_cache_usage=0.96), ScalerState(), 0.0)
    assert grow.desired == 5 and "KV cache 96% / 80%" in grow.reason
    quick = policy(scaleDown={"stabilizationWindowSeconds": 0, "pods": 4})
    shrink = decide(quick, lenient, PoolSignals(ready=4, kv_cache_usage=0.2), ScalerState(), 0.0)
    assert shrink.desired == 1


def test_latency_over_its_slo_grows_and_under_it_says_nothing() -> None:
    lenient = PoolTargets(1000, 100, 1.0, latency_slo_s=0.5)
    late = PoolSignals(ready=2, running=10, latency_p90_s=1.0)
    assert decide(POLICY, lenient, late, ScalerState(), 0.0).desired == 4
    on_time = PoolSignals(ready=2, running=10, latency_p90_s=0.1)
    decision = decide(
        policy(scaleDown={"stabilizationWindowSeconds": 0}), lenient, on_time, ScalerState(), 0.0
    )
    assert decision.desired == 1  # demand alone decides the shrink
    assert "TTFT" not in decision.reason


def test_the_slo_target_can_be_switched_off() -> None:
    off = policy(targets={"slo": False})
    targets = pool_targets(off, "unified", max_num_seqs=1000, ttft_ms=500, itl_ms=50)
    late = PoolSignals(ready=2, running=10, latency_p90_s=5.0)
    assert targets.latency_slo_s is None
    decision = decide(off, targets, late, ScalerState(), 0.0)
    assert "TTFT" not in decision.reason and decision.desired == 1


def test_shrinking_waits_for_the_highest_recommendation_of_the_window() -> None:
    state = ScalerState()
    busy, quiet = PoolSignals(ready=4, running=24), PoolSignals(ready=4, running=6)
    state = decide(POLICY, TARGETS, busy, state, 0.0).state
    held = decide(POLICY, TARGETS, quiet, state, 299.0)
    assert not held.changed and "300 s scale-down window holds 4" in held.reason
    state = held.state
    moved = decide(POLICY, TARGETS, quiet, state, 301.0)
    assert (moved.current, moved.desired) == (4, 3)  # one pod a minute


def test_a_scale_up_window_grows_to_its_lowest_recommendation() -> None:
    slow = policy(scaleUp={"stabilizationWindowSeconds": 60})
    state = decide(slow, TARGETS, PoolSignals(ready=2, running=12), ScalerState(), 0.0).state
    burst = decide(slow, TARGETS, PoolSignals(ready=2, running=36), state, 15.0)
    assert not burst.changed and "60 s scale-up window holds 2" in burst.reason
    later = decide(slow, TARGETS, PoolSignals(ready=2, running=36), burst.state, 61.0)
    assert later.desired == 6


def test_growth_per_period_is_at_most_pods_or_percent_whichever_is_more() -> None:
    big = PoolSignals(ready=10, running=600)  # wants 100
    first = decide(POLICY, TARGETS, big, ScalerState(), 0.0)
    assert first.desired == 20  # 100% of 10 beats 4 pods; maxReplicas 20 anyway
    small = PoolSignals(ready=1, running=60)
    assert decide(POLICY, TARGETS, small, ScalerState(), 0.0).desired == 5  # 4 pods beat 100%
    # Within the period the pool may not grow again past the period's allowance.
    state = ScalerState(events=(ScaleEvent(0.0, 1, 5),))
    again = decide(POLICY, TARGETS, PoolSignals(ready=5, running=120), state, 10.0)
    assert not again.changed and "rate limit" in again.reason
    assert decide(POLICY, TARGETS, PoolSignals(ready=5, running=120), state, 15.0).changed


def test_shrinking_per_period_is_at_most_pods_or_percent() -> None:
    gentle = policy(scaleDown={"stabilizationWindowSeconds": 0, "pods": 2, "percent": 50})
    decision = decide(gentle, TARGETS, PoolSignals(ready=10, running=6), ScalerState(), 0.0)
    assert decision.desired == 5  # 50% of 10 beats 2 pods
    state = decision.state
    again = decide(gentle, TARGETS, PoolSignals(ready=5, running=6), state, 30.0)
    assert not again.changed  # this period's allowance is spent
    assert decide(gentle, TARGETS, PoolSignals(ready=5, running=6), state, 60.0).desired == 3


@pytest.mark.parametrize(
    ("busy", "says"),
    [({"pending": 1}, "1 pods are pending"), ({"rollout": True}, "a rollout runs")],
)
def test_no_shrink_while_pods_are_pending_or_a_rollout_runs(busy: dict, says: str) -> None:
    quick = policy(scaleDown={"stabilizationWindowSeconds": 0})
    signals = PoolSignals(ready=4, running=6, **busy)
    decision = decide(quick, TARGETS, signals, ScalerState(), 0.0)
    assert not decision.changed and f"no scale-down while {says}" in decision.reason
    # Growth is not held back by either.
    grow = PoolSignals(ready=4, running=60, **busy)
    assert decide(quick, TARGETS, grow, ScalerState(), 0.0).changed


def test_after_growth_lagging_signals_wait_for_a_start_time() -> None:
    lenient = PoolTargets(1000, 100, 0.8, latency_slo_s=0.5)
    state = ScalerState(events=(ScaleEvent(0.0, 2, 4),))
    late = PoolSignals(ready=2, pending=2, running=10, latency_p90_s=2.0, start_time_s=90)
    cooling = decide(POLICY, lenient, late, state, 60.0)
    assert not cooling.changed and "waiting for the pods starting" in cooling.reason
    late_and_ready = PoolSignals(ready=4, running=10, latency_p90_s=2.0, start_time_s=90)
    # Cooled down, latency grows it: to 16, by the rate limit's 4 pods or 100% at a time.
    assert decide(POLICY, lenient, late_and_ready, state, 91.0).desired == 8


def test_demand_still_grows_the_pool_while_it_cools_down() -> None:
    state = ScalerState(events=(ScaleEvent(0.0, 2, 4),))
    surge = PoolSignals(ready=2, pending=2, running=60, start_time_s=90)
    assert decide(POLICY, TARGETS, surge, state, 20.0).desired == 8  # wants 10; rate limit


def test_a_pool_outside_its_bounds_is_brought_back_at_once() -> None:
    bounded = policy(minReplicas=3, maxReplicas=5)
    assert decide(bounded, TARGETS, PoolSignals(ready=1), ScalerState(), 0.0).desired == 3
    above = decide(bounded, TARGETS, PoolSignals(ready=9), ScalerState(), 0.0)
    assert above.desired == 5 and "outside 3-5" in above.reason


def test_demand_over_max_is_capped_and_says_so() -> None:
    decision = decide(
        policy(maxReplicas=3), TARGETS, PoolSignals(ready=3, running=60), ScalerState(), 0.0
    )
    assert not decision.changed and "maxReplicas 3" in decision.reason


def test_every_reason_names_current_and_desired() -> None:
    for trace in TRACES.values():
        for decision in simulate(trace, 3600).decisions:
            head = f"{decision.current} -> {decision.desired}: "
            assert decision.reason.startswith(
                head if decision.changed else f"stay at {decision.current}: "
            )


def test_state_is_bounded_by_the_windows() -> None:
    run = simulate(diurnal, 7200)
    window = POLICY.scale_down.stabilization_window_seconds
    assert len(run.decisions[-1].state.recommendations) <= window / TICK + 1


def test_targets_come_from_the_spec_per_role() -> None:
    spec = parse_spec(
        {
            "model": {"name": "m", "source": {"hostPath": {"path": "/m"}}},
            "topology": {"mode": "disaggregated", "prefill": {}, "decode": {}},
            "scheduling": {"maxNumSeqs": 48, "slo": {"ttftMs": 500, "itlMs": 40}},
            "autoscaling": {
                "prefill": {"maxReplicas": 4, "targets": {"requestsPerReplica": 8}},
                "decode": {"maxReplicas": 8},
            },
        }
    )
    assert spec.autoscaling is not None
    policies = spec.autoscaling.policies()
    prefill = pool_targets(policies["prefill"], "prefill", 48, 500, 40)
    decode = pool_targets(policies["decode"], "decode", 48, 500, 40)
    assert (prefill.requests_per_replica, prefill.latency_slo_s, prefill.latency_name) == (
        8,
        0.5,
        "TTFT",
    )
    assert (decode.requests_per_replica, decode.latency_slo_s, decode.latency_name) == (
        48,
        0.04,
        "ITL",
    )


def test_a_new_pool_starts_from_topology_replicas_within_the_bounds() -> None:
    bounded = policy(minReplicas=2, maxReplicas=6)
    assert [starting_replicas(bounded, n) for n in (0, 1, 4, 9)] == [2, 2, 4, 6]
