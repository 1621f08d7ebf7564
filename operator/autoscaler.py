"""The autoscaler's decision: how many replicas one pool should run now, and why.

`decide` is pure: the pool's policy, what the pool shows at time `now` (`PoolSignals`) and
what earlier decisions left (`ScalerState`) go in; the desired replicas, a reason and the
next state come out. The operator's autoscaler (`operator/cluster_scaler.py`) and
`tidegate up` (`operator/up_scaler.py`) call it with what they scrape; the trace tests and
`benchmarks/autoscaling.py` call it with a simulated fleet.

One decision:

1. Each signal votes for a replica count. Demand (running, waiting and router-held
   requests over `requestsPerReplica`) and KV-cache usage are proportional to load and vote
   both ways; the queue (waiting requests above `waitingRequestsPerReplica`) and latency
   against the SLO only vote to grow: below their target they say nothing about how few
   replicas would do. A ratio within 10% of its target votes for the pool as it is (the
   HPA's tolerance). The recommendation is the largest vote, within minReplicas and
   maxReplicas; it is 0 only when minReplicas is 0 and no request came for
   `idleBeforeZeroSeconds`.
2. Stabilization, as the HPA: the pool grows to the lowest recommendation of the scale-up
   window and shrinks to the highest of the scale-down window.
3. Guards: no shrinking while pods are pending or a rollout runs; after growing, for the
   measured start time of a pod, the lagging votes (KV usage and latency, which stay high
   until the new pods serve) may hold the pool but not grow it, while demand still may;
   each period may add or remove at most `pods` or `percent` of the pool at the period's
   start, whichever is more.
4. Zero: a pool at zero with requests held by the router wakes at once, sized to them and
   skipping the windows; a pool idle for `idleBeforeZeroSeconds` goes to zero at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tidegate.operator.spec import AutoscalingPolicy

# The HPA's tolerance: a ratio this close to 1 is noise, not a reason to move.
TOLERANCE = 0.1
# The cooldown when the start time of a pod has not been measured yet.
DEFAULT_START_TIME_S = 60.0


@dataclass(frozen=True)
class PoolTargets:
    """A policy's targets resolved for one role: every value the decision needs, in SI units."""

    requests_per_replica: int
    waiting_per_replica: int
    kv_cache_usage: float  # a fraction, as the engine's kv_cache_usage_perc gauge
    latency_slo_s: float | None  # TTFT (prefill, unified) or ITL (decode); None: not a target
    latency_name: str = "TTFT"


def pool_targets(
    policy: AutoscalingPolicy, role: str, max_num_seqs: int, ttft_ms: int, itl_ms: int
) -> PoolTargets:
    """The targets of `policy` for `role`, with the spec's maxNumSeqs and SLOs filled in."""
    targets = policy.targets
    latency_ms, name = (itl_ms, "ITL") if role == "decode" else (ttft_ms, "TTFT")
    return PoolTargets(
        requests_per_replica=targets.requests_per_replica or max_num_seqs,
        waiting_per_replica=targets.waiting_requests_per_replica,
        kv_cache_usage=targets.kv_cache_usage_percent / 100,
        latency_slo_s=latency_ms / 1000 if targets.slo else None,
        latency_name=name,
    )


@dataclass(frozen=True)
class PoolSignals:
    """What one pool shows: its pods, its load summed over ready replicas, its latency."""

    ready: int
    pending: int = 0  # pods asked for that are not ready yet
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None  # mean over ready replicas, 0 to 1
    latency_p90_s: float | None = None  # TTFT or ITL, as the role's PoolTargets says
    router_pending: int = 0  # requests the router holds for this pool
    rollout: bool = False
    start_time_s: float | None = None  # measured, from a pod's creation to its readiness

    @property
    def current(self) -> int:
        """The replicas the pool is set to."""
        return self.ready + self.pending

    @property
    def demand(self) -> int:
        """Requests the pool has or is owed."""
        return self.running + self.waiting + self.router_pending


@dataclass(frozen=True)
class ScaleEvent:
    """One change of the pool's replicas."""

    at: float
    before: int
    after: int


@dataclass(frozen=True)
class ScalerState:
    """What one decision leaves for the next: recommendations, changes, the idle clock."""

    recommendations: tuple[tuple[float, int], ...] = ()
    events: tuple[ScaleEvent, ...] = ()
    idle_since: float | None = None
    demand: tuple[float, int] | None = None  # (when, requests) at the last decision


@dataclass(frozen=True)
class Decision:
    """The desired replicas, the replicas before, why, and the state for the next call."""

    desired: int
    current: int
    reason: str
    state: ScalerState = field(repr=False)

    @property
    def changed(self) -> bool:
        """Whether the pool is to be scaled."""
        return self.desired != self.current


@dataclass(frozen=True)
class _Vote:
    replicas: int
    why: str
    lagging: bool = False  # a signal that stays high until new pods serve


def votes(targets: PoolTargets, signals: PoolSignals) -> list[_Vote]:
    """What each signal asks for (a vote for the pool as it is when within tolerance)."""
    current, ready = signals.current, signals.ready
    per = targets.requests_per_replica
    demand = signals.demand
    found = [_proportional(current, demand / per, f"{demand} requests / {per} per replica")]
    excess = signals.waiting - targets.waiting_per_replica * ready
    if ready and excess > 0:
        extra = math.ceil(excess / per)
        found.append(_Vote(ready + extra, f"{signals.waiting} waiting, {excess} over the target"))
    if ready and signals.kv_cache_usage is not None:
        usage = signals.kv_cache_usage
        wanted = ready * usage / targets.kv_cache_usage
        text = f"KV cache {usage:.0%} / {targets.kv_cache_usage:.0%} on {ready} ready"
        found.append(replace(_proportional(ready, wanted, text), lagging=True))
    slo, latency = targets.latency_slo_s, signals.latency_p90_s
    if ready and slo is not None and latency is not None and latency > slo * (1 + TOLERANCE):
        text = f"p90 {targets.latency_name} {latency * 1000:.0f} ms > SLO {slo * 1000:.0f} ms"
        found.append(_Vote(math.ceil(ready * latency / slo), text, lagging=True))
    return found


def _trend(
    targets: PoolTargets, signals: PoolSignals, state: ScalerState, now: float
) -> _Vote | None:
    """Demand as it will be when a pod asked for now serves, if it keeps rising as since the
    last decision: a pod takes its start time to help, and a ramp does not wait for it."""
    if state.demand is None or not signals.ready:
        return None
    then, before = state.demand
    elapsed = now - then
    rise = signals.demand - before
    per = targets.requests_per_replica
    if elapsed <= 0 or rise <= 0:
        return None
    start = signals.start_time_s if signals.start_time_s is not None else DEFAULT_START_TIME_S
    ahead = signals.demand + rise * min(start, elapsed) / elapsed
    why = (
        f"{signals.demand} requests, rising {rise} in {elapsed:.0f} s: {ahead:.0f} in {start:.0f} s"
    )
    return _proportional(signals.current, ahead / per, f"{why} / {per} per replica")


def _proportional(base: int, wanted: float, why: str) -> _Vote:
    """ceil(wanted), or `base` when wanted is within tolerance of it."""
    if base and abs(wanted / base - 1) <= TOLERANCE:
        return _Vote(base, f"{why} (within {TOLERANCE:.0%})")
    return _Vote(math.ceil(wanted - 1e-9), why)


def decide(
    policy: AutoscalingPolicy,
    targets: PoolTargets,
    signals: PoolSignals,
    state: ScalerState,
    now: float,
) -> Decision:
    """The replicas the pool should run at time `now` (seconds), with the reason."""
    current = signals.current
    idle_since = None if signals.demand else (now if state.idle_since is None else state.idle_since)
    idle_s = now - idle_since if idle_since is not None else 0.0
    # Zero is allowed once idle for long enough, and a pool already at zero stays there.
    zero = policy.min_replicas == 0 and (idle_s >= policy.idle_before_zero_seconds or not current)
    floor = policy.min_replicas if zero or policy.min_replicas else 1
    found = votes(targets, signals)
    trend = _trend(targets, signals, state, now) if policy.scale_up.predictive else None
    if trend is not None:
        found.append(trend)
    top = _chosen(found, current, _cooling(state, signals, now))
    recommended = min(max(top.replicas, floor), policy.max_replicas)
    why = _bounded(top, recommended, floor, policy)
    if zero and current and idle_s >= policy.idle_before_zero_seconds:
        # Idle long enough: what is left in the KV cache (or a stale latency) keeps no pod.
        recommended = 0
    history = (*_kept(state.recommendations, now, policy), (now, recommended))
    state = replace(
        state, recommendations=history, idle_since=idle_since, demand=(now, signals.demand)
    )

    if current < policy.min_replicas or current > policy.max_replicas:
        # Back to the nearest bound at once (the bounds changed, or someone scaled by hand);
        # the windows and rate limits take over from there.
        bound = min(max(current, policy.min_replicas), policy.max_replicas)
        return _scale(
            state,
            now,
            current,
            bound,
            f"outside {policy.min_replicas}-{policy.max_replicas}; {why}",
        )
    if current == 0 and signals.router_pending:
        # The router holds requests while nothing serves them: no window may delay the wake.
        return _scale(state, now, 0, max(recommended, 1), f"wake from zero: {why}")
    if recommended == 0 and current:
        # No request for idleBeforeZeroSeconds says more than any window would.
        if signals.pending or signals.rollout:
            return _hold(state, current, f"no scale to zero while {_busy(signals)}")
        return _scale(state, now, current, 0, f"no request for {idle_s:.0f} s")

    up = min(r for t, r in history if now - t <= policy.scale_up.stabilization_window_seconds)
    down = max(r for t, r in history if now - t <= policy.scale_down.stabilization_window_seconds)
    if up > current:
        desired = min(up, _rate_limit(state, now, current, policy, growing=True))
        if desired == current:
            return _hold(state, current, f"{why}; the rate limit holds growth this period")
        reason = why if up == recommended else f"{why}; lowest of the scale-up window {up}"
        if desired < up:
            reason += f"; the rate limit allows {desired} this period"
        return _scale(state, now, current, desired, reason)
    if down < current:
        if signals.pending or signals.rollout:
            return _hold(state, current, f"{why}; no scale-down while {_busy(signals)}")
        desired = max(down, _rate_limit(state, now, current, policy, growing=False))
        if desired == current:
            return _hold(state, current, f"{why}; the rate limit holds the shrink this period")
        reason = why if down == recommended else f"{why}; highest of the scale-down window {down}"
        if desired > down:
            reason += f"; the rate limit allows {desired} this period"
        return _scale(state, now, current, desired, reason)
    if recommended < current:
        window = policy.scale_down.stabilization_window_seconds
        return _hold(state, current, f"{why}; the {window} s scale-down window holds {down}")
    if recommended > current:
        window = policy.scale_up.stabilization_window_seconds
        return _hold(state, current, f"{why}; the {window} s scale-up window holds {up}")
    return _hold(state, current, why)


def _chosen(found: list[_Vote], current: int, cooling: bool) -> _Vote:
    """The largest vote; while new pods start, a lagging vote may hold the pool, not grow it."""
    top = max(found, key=lambda v: v.replicas)
    if not (cooling and top.lagging and top.replicas > current):
        return top
    prompt = max((v for v in found if not v.lagging), key=lambda v: v.replicas)
    if prompt.replicas > current:
        return prompt
    return _Vote(current, f"{top.why} (wants {top.replicas}; waiting for the pods starting)")


def _busy(signals: PoolSignals) -> str:
    return f"{signals.pending} pods are pending" if signals.pending else "a rollout runs"


def _bounded(top: _Vote, recommended: int, floor: int, policy: AutoscalingPolicy) -> str:
    if recommended == top.replicas:
        return f"{top.why} needs {recommended}"
    if recommended == policy.max_replicas and top.replicas > recommended:
        return f"{top.why} needs {top.replicas}, maxReplicas {recommended}"
    if floor > policy.min_replicas:
        return f"{top.why}; 1 until idle for {policy.idle_before_zero_seconds} s"
    return f"{top.why} needs {top.replicas}, minReplicas {recommended}"


def _kept(
    history: tuple[tuple[float, int], ...], now: float, policy: AutoscalingPolicy
) -> tuple[tuple[float, int], ...]:
    """The recommendations still inside the longer stabilization window."""
    window = max(
        policy.scale_up.stabilization_window_seconds,
        policy.scale_down.stabilization_window_seconds,
    )
    return tuple((t, r) for t, r in history if now - t <= window)


def _cooling(state: ScalerState, signals: PoolSignals, now: float) -> bool:
    """Whether the last change grew the pool less than a pod's start time ago."""
    start = signals.start_time_s if signals.start_time_s is not None else DEFAULT_START_TIME_S
    last = state.events[-1] if state.events else None
    return last is not None and last.after > last.before and now - last.at < start


def _rate_limit(
    state: ScalerState, now: float, current: int, policy: AutoscalingPolicy, growing: bool
) -> int:
    """The most (growing) or fewest replicas this period allows."""
    rules = policy.scale_up if growing else policy.scale_down
    # The pool as it was when the period began, counting only changes in this direction
    # (as the HPA does): a shrink after a burst of growth is not refused for the growth.
    moved = sum(
        e.after - e.before
        for e in state.events
        if now - e.at < rules.period_seconds and (e.after > e.before) == growing
    )
    start = current - moved
    if growing:
        return max(start + max(rules.pods, math.ceil(start * rules.percent / 100)), current)
    return min(start - max(rules.pods, math.floor(start * rules.percent / 100)), current)


def _scale(state: ScalerState, now: float, current: int, desired: int, reason: str) -> Decision:
    if desired == current:
        return _hold(state, current, reason)
    horizon = 3600.0  # longer than any period or start time: older events decide nothing
    events = tuple(e for e in state.events if now - e.at < horizon)
    state = replace(state, events=(*events, ScaleEvent(now, current, desired)))
    return Decision(desired, current, f"{current} -> {desired}: {reason}", state)


def _hold(state: ScalerState, current: int, reason: str) -> Decision:
    return Decision(current, current, f"stay at {current}: {reason}", state)


def starting_replicas(policy: AutoscalingPolicy, replicas: int) -> int:
    """The replicas a newly autoscaled pool starts with: topology's, within the bounds."""
    return min(max(replicas, policy.min_replicas), policy.max_replicas)
