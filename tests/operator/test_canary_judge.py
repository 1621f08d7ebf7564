"""The canary's windows and verdicts over pods (operator/canary_judge.py): what the rollout
controller and `tidegate up` share, on loads made up here."""

from __future__ import annotations

import math

from tidegate.operator.canary import CanaryPolicy, Window, compare
from tidegate.operator.canary_judge import CANARY_WARMUP_REQUESTS, CanaryState, Reading, SideWindow
from tidegate.operator.pool_metrics import EngineLoad

POLICY = CanaryPolicy(min_requests=40, looks=2)
WARM = CANARY_WARMUP_REQUESTS
BOUNDS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, math.inf)


def load(requests: int, itl_s: float, ttft_s: float = 0.1, failed: int = 0) -> EngineLoad:
    """A pod's cumulative counters after `requests` requests near the given latencies."""

    def histogram(centre: float, per: int) -> dict[float, float]:
        values = [centre * (0.9 + 0.02 * (i % 11)) for i in range(requests * per)]
        return {bound: float(sum(v <= bound for v in values)) for bound in BOUNDS}

    return EngineLoad(
        ttft_buckets=histogram(ttft_s, 1),
        itl_buckets=histogram(itl_s, 4),
        finished=float(requests),
        failed=float(failed),
    )


def judge(state: CanaryState, canary: dict, stable: dict, **kwargs):
    options = {"restarted": [], "elapsed_s": 10.0, "timeout_s": 3600.0} | kwargs
    return state.judge(POLICY, {"unified": Reading(canary, stable)}, **options)


def test_a_stable_pod_counts_from_its_first_reading_and_a_canary_pod_after_its_warm_up() -> None:
    stable, canary = SideWindow(canary=False), SideWindow(canary=True)
    assert stable.window({"s": load(500, 0.04)}).requests == 0
    assert stable.window({"s": load(650, 0.04)}).requests == 150
    # The canary's first requests are its warm-up: not in its latency window, failures are.
    warming = canary.window({"c": load(CANARY_WARMUP_REQUESTS - 1, 0.5, failed=1)})
    assert (warming.requests, warming.errors) == (0, 1)
    assert canary.window({"c": load(CANARY_WARMUP_REQUESTS + 3, 0.5, failed=1)}).requests == 0
    grown = canary.window({"c": load(CANARY_WARMUP_REQUESTS + 33, 0.04, failed=1)})
    assert (grown.requests, grown.errors) == (30, 1)
    # A restarted pod's counters fall: what it counted since is all new.
    assert stable.window({"s": load(20, 0.04)}).requests == 20


def grown(after: EngineLoad) -> Window:
    """A window from nothing to `after`."""
    side = SideWindow(canary=False)
    side.window({"pod": EngineLoad()})
    return side.window({"pod": after})


def test_the_look_waits_for_the_stable_side_too() -> None:
    state = CanaryState("r", 0.0)
    judge(state, {"c": load(WARM, 0.04)}, {"s": load(0, 0.04)})
    verdict, analysis = judge(state, {"c": load(WARM + 50, 0.04)}, {"s": load(10, 0.04)})
    assert verdict.decision == "wait" and "the stable pods finished 10 requests" in verdict.reason
    assert "look" not in analysis["roles"]["unified"]
    # The look was not spent: it is taken once the stable side has its 40.
    verdict, analysis = judge(state, {"c": load(WARM + 60, 0.04)}, {"s": load(200, 0.04)})
    assert verdict.decision in ("promote", "wait") and analysis["roles"]["unified"]["look"] == 1


def test_a_doubled_itl_is_rolled_back_at_the_first_look() -> None:
    state = CanaryState("r", 0.0)
    judge(state, {"c": load(WARM, 0.08)}, {"s": load(0, 0.04)})
    verdict, analysis = judge(state, {"c": load(WARM + 45, 0.08)}, {"s": load(300, 0.04)})
    assert verdict.decision == "rollback" and "ITL" in verdict.reason
    assert [t["metric"] for t in analysis["tests"]] == ["TTFT", "ITL"]


def test_a_restart_or_the_timeout_rolls_back() -> None:
    verdict, _ = judge(CanaryState("r", 0.0), {}, {}, restarted=["c restarted 1 time(s)"])
    assert verdict.decision == "rollback" and "restarted" in verdict.reason
    verdict, _ = judge(CanaryState("r", 0.0), {"c": load(3, 0.04)}, {}, elapsed_s=4000.0)
    assert verdict.decision == "rollback" and "timeoutSeconds 3600" in verdict.reason


def test_every_changed_role_must_be_promoted() -> None:
    state = CanaryState("r", 0.0)
    same = Reading({"c": load(WARM, 0.04)}, {"s": load(0, 0.04)})
    slow = Reading({"c2": load(WARM, 0.04)}, {"s2": load(0, 0.04)})
    state.judge(POLICY, {"prefill": same, "decode": slow}, restarted=[], elapsed_s=1, timeout_s=9)
    readings = {
        "prefill": Reading({"c": load(WARM + 60, 0.04)}, {"s": load(400, 0.04)}),
        "decode": Reading({"c2": load(WARM + 60, 0.12)}, {"s2": load(400, 0.04)}),
    }
    verdict, _ = state.judge(POLICY, readings, restarted=[], elapsed_s=2, timeout_s=9)
    assert verdict.decision == "rollback" and verdict.reason.startswith("decode: ")


def test_a_tuning_proposal_may_use_the_headroom_the_itl_slo_leaves() -> None:
    # Stable ITL about 40 ms (p90 about 72 ms in these buckets), canary three times that.
    # Against the plain margin that is a rollback; with an ITL SLO of 500 ms it is within
    # the headroom the SLO leaves.
    plain = CanaryPolicy(min_requests=40, looks=1)
    tuned = CanaryPolicy(min_requests=40, looks=1, itl_slo_s=0.5)
    canary, stable = load(300, 0.12), load(600, 0.04)
    window_c, window_s = grown(canary), grown(stable)
    assert compare(window_c, window_s, plain, 0).decision == "rollback"
    verdict = compare(window_c, window_s, tuned, 0)
    assert verdict.decision == "promote" and "headroom the ITL SLO leaves" in verdict.reason
    # Past the SLO's headroom it is rolled back all the same.
    slow = grown(load(300, 0.6))
    assert compare(slow, window_s, tuned, 0).decision == "rollback"
