"""A running canary's windows and verdict, from what its pods and the stable ones served.

Shared by the operator's rollout controller (operator/rollout_controller.py), which reads the
pods through the API server, and `tidegate up` (operator/up_rollout.py), which reads local
processes. Pure: the callers scrape, this counts and decides (operator/canary.py tests).

A stable pod counts from the first time it is read during this canary; a canary pod from
its first reading after its warm-up (CANARY_WARMUP_REQUESTS), its failures from its start. Each
window sums the pods' increases: TTFT and ITL histograms, finished and failed requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tidegate.operator.canary import CanaryPolicy, Verdict, Window, compare
from tidegate.operator.pool_metrics import EngineLoad, increase
from tidegate.operator.spec import LLMDeploymentSpec


def policy_of(spec: LLMDeploymentSpec, tuning: bool = False) -> CanaryPolicy:
    """The comparison's policy from spec.rollout.canary; `tuning`: the canary tries a
    closed-loop proposal, whose ITL may use the headroom the ITL SLO leaves."""
    canary = spec.rollout.canary
    return CanaryPolicy(
        margin=canary.latency_margin_percent / 100,
        error_margin=canary.error_margin_percent / 100,
        min_requests=canary.min_requests,
        looks=canary.looks,
        itl_slo_s=spec.scheduling.slo.itl_ms / 1000 if tuning else None,
    )


# A canary pod's first requests are its warm-up (allocations, caches, compiled kernels of
# new shapes): its latency window starts at the first reading after it finished this many.
CANARY_WARMUP_REQUESTS = 5


@dataclass
class SideWindow:
    """One side's (canary or stable) pods over a canary's life: each pod's counters when the
    window began, so that the window is what they served since.

    A stable pod's window starts at its first reading. A canary pod's (`canary`) starts at
    its first reading after CANARY_WARMUP_REQUESTS finished requests, so that its warm-up
    does not count against it; its failures count from its start all the same.
    """

    canary: bool
    baseline: dict[str, EngineLoad] = field(default_factory=dict)

    def window(self, loads: Mapping[str, EngineLoad]) -> Window:
        """The window's increase summed over the pods that answered now."""
        ttft: dict[float, float] = {}
        itl: dict[float, float] = {}
        requests = failed = 0.0
        for pod, load in loads.items():
            if pod not in self.baseline:
                if not self.canary:
                    self.baseline[pod] = load
                    continue
                if load.finished < CANARY_WARMUP_REQUESTS:
                    failed += load.failed
                    continue
                self.baseline[pod] = replace(load, failed=0.0)
            before = self.baseline[pod]
            restarted = load.finished < before.finished
            for total, now, then in (
                (ttft, load.ttft_buckets, before.ttft_buckets),
                (itl, load.itl_buckets, before.itl_buckets),
            ):
                for bound, count in increase(then, now).items():
                    total[bound] = total.get(bound, 0.0) + count
            requests += load.finished if restarted else load.finished - before.finished
            failed += load.failed if restarted else load.failed - before.failed
        return Window(ttft=ttft, itl=itl, requests=round(requests), errors=round(failed))


@dataclass(frozen=True)
class Reading:
    """One look at one changed role: its canary pods' loads and its stable pods', by pod."""

    canary: Mapping[str, EngineLoad]
    stable: Mapping[str, EngineLoad]


@dataclass
class CanaryState:
    """What the controller keeps of one resource's running canary."""

    revision: str
    started: float
    sides: dict[tuple[str, bool], SideWindow] = field(default_factory=dict)
    looked: int = -1  # the last look compared
    restarts: dict[str, int] = field(default_factory=dict)  # canary pod -> restarts seen first

    def side(self, role: str, canary: bool) -> SideWindow:
        return self.sides.setdefault((role, canary), SideWindow(canary=canary))

    def judge(
        self,
        policy: CanaryPolicy,
        readings: Mapping[str, Reading],
        *,
        restarted: list[str],
        elapsed_s: float,
        timeout_s: float,
    ) -> tuple[Verdict, dict[str, Any]]:
        """The verdict on the change at this look, and the analysis status reports.

        Every changed role must be promoted for the change to be; one rolled back rolls it
        back. A canary pod that restarted rolls it back at once, and so does a canary not
        judged good enough within `timeout_s`.
        """
        verdicts: list[tuple[str, Verdict]] = []
        roles: dict[str, Any] = {}
        for role, reading in readings.items():
            canary_window = self.side(role, True).window(reading.canary)
            stable_window = self.side(role, False).window(reading.stable)
            roles[role] = {
                # Canary pods past their warm-up, whose window has begun.
                "canaryPods": sum(pod in self.side(role, True).baseline for pod in reading.canary),
                "stablePods": len(reading.stable),
                "canaryRequests": canary_window.requests,
                "canaryFailed": canary_window.errors,
                "stableRequests": stable_window.requests,
                "stableFailed": stable_window.errors,
            }
            look = policy.look_index(canary_window.requests)
            if look is not None and stable_window.requests < policy.min_requests:
                # Not a look: the stable side must reach min_requests too.
                waiting = (
                    f"the stable pods finished {stable_window.requests} requests; "
                    f"{policy.min_requests} are needed to compare"
                )
                verdicts.append((role, Verdict("wait", waiting)))
                continue
            if look is None or look <= self.looked:
                verdicts.append((role, Verdict("wait", _waiting(canary_window, policy, look))))
                continue
            verdicts.append((role, compare(canary_window, stable_window, policy, look)))
            roles[role]["look"] = look + 1
        looks = [entry.get("look", 0) for entry in roles.values()]
        if looks and min(looks) > 0:
            self.looked = min(looks) - 1
        verdict = _combine(verdicts)
        if restarted:
            verdict = Verdict("rollback", "the canary pod restarted: " + "; ".join(restarted))
        if verdict.decision == "wait" and elapsed_s > timeout_s:
            verdict = Verdict(
                "rollback",
                f"not judged good enough within timeoutSeconds {timeout_s:g} ({verdict.reason})",
            )
        analysis: dict[str, Any] = {
            "revision": self.revision,
            "roles": roles,
            "decision": verdict.decision,
            "reason": verdict.reason,
        }
        tests = [t for _, v in verdicts for t in v.tests]
        if tests:
            analysis["tests"] = [
                {"metric": t.metric, "pSlower": round(t.p_slower, 3), "z": round(t.z, 2)}
                for t in tests
            ]
        return verdict, analysis


def _combine(verdicts: list[tuple[str, Verdict]]) -> Verdict:
    """One verdict for the change: any role rolled back rolls it back; all must promote."""
    if not verdicts:
        return Verdict("wait", "no changed role to compare")
    for role, verdict in verdicts:
        if verdict.decision == "rollback":
            return Verdict("rollback", f"{role}: {verdict.reason}", verdict.tests)
    if all(verdict.decision == "promote" for _, verdict in verdicts):
        reason = "; ".join(f"{role}: {verdict.reason}" for role, verdict in verdicts)
        return Verdict("promote", reason, [t for _, v in verdicts for t in v.tests])
    reason = "; ".join(f"{role}: {v.reason}" for role, v in verdicts if v.decision == "wait")
    return Verdict("wait", reason, [t for _, v in verdicts for t in v.tests])


def _waiting(window: Window, policy: CanaryPolicy, look: int | None) -> str:
    sizes = policy.look_sizes()
    following = (look + 1) if look is not None else 0
    if following >= len(sizes):
        return f"the canary finished {window.requests} requests; waiting for the last verdict"
    return f"the canary finished {window.requests} requests; the next look is at {sizes[following]}"
