"""Canary rollouts end to end: kopf running the operator against kmock's emulator.

A change of a role's pods under `rollout.strategy: canary` first runs on a one-pod canary
Deployment beside the untouched stable one; the rollout controller compares the canary pod's
`/metrics` with the stable pods' and promotes the change (the stable Deployment takes the new
template, the canary goes) or rolls it back (the canary goes, the stable pods stay, the same
change is not tried again), with the reason in status and an Event. The emulator has no
kubelet: tests play it with Pod objects whose `/metrics` are small servers on 127.0.0.1.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import EmulatedCluster, wait_for
from tests.operator.test_autoscaler_e2e import Exposition, add_pod, serve
from tests.operator.test_operator_e2e import (
    LLMD,
    conditions,
    config_of,
    edit_spec,
    get,
    llmd,
    roll_out,
    settle,
    status,
    tiny_spec,
)
from tests.operator.test_step_fit import run_steps
from tidegate.engine.metrics import ITL_BUCKETS, TTFT_BUCKETS, PrometheusMetrics
from tidegate.operator.canary_judge import CANARY_WARMUP_REQUESTS as WARM
from tidegate.operator.handlers import OperatorOptions
from tidegate.operator.labels import CANARY_TRACK, TRACK_LABEL
from tidegate.operator.rollout import CANARY_ANNOTATION, CANARY_REVISION

PERIOD_S = 0.2
CANARY = {"strategy": "canary", "canary": {"minRequests": 40, "looks": 2}}
HASH = "tidegate.dev/spec-hash"


@pytest.fixture(scope="module")
def operator_options() -> OperatorOptions:
    return OperatorOptions(rollout_period_s=PERIOD_S)


def page(requests: int, ttft_s: float, itl_s: float, failed: int = 0) -> str:
    """An engine's /metrics after `requests` requests, each with one TTFT and four ITLs spread
    around the given values (a tenth either way), and `failed` of them failed."""
    lines = []
    for name, bounds, centre, per in (
        ("time_to_first_token_seconds", TTFT_BUCKETS, ttft_s, 1),
        ("inter_token_latency_seconds", ITL_BUCKETS, itl_s, 4),
    ):
        values = [centre * (0.9 + 0.2 * (i % 11) / 10) for i in range(requests) for _ in range(per)]
        for bound in (*bounds, math.inf):
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            count = sum(1 for v in values if v <= bound)
            lines.append(f'tidegate:{name}_bucket{{engine="0",le="{le}"}} {count}')
    lines.append(f'tidegate:request_success_total{{finished_reason="stop"}} {requests - failed}')
    lines.append(f'tidegate:request_success_total{{finished_reason="error"}} {failed}')
    return "\n".join(lines) + "\n"


@pytest.fixture
def pages() -> Iterator[list[Exposition]]:
    made: list[Exposition] = []
    yield made
    for exposition in made:
        exposition.close()


def spec(**extra: Any) -> dict[str, Any]:
    return tiny_spec(rollout=CANARY, **extra)


def spec_hash(cluster: EmulatedCluster, name: str) -> str | None:
    deployment = get(cluster, "Deployment", name)
    return (
        None
        if deployment is None
        else deployment["spec"]["template"]["metadata"]["annotations"][HASH]
    )


def rollout(cluster: EmulatedCluster, name: str) -> dict[str, Any]:
    return status(cluster, name).get("rollout") or {}


def events(cluster: EmulatedCluster, name: str) -> list[dict[str, Any]]:
    response = cluster.http.get("/api/v1/namespaces/default/events")  # type: ignore[union-attr]
    items = response.json().get("items", [])
    return [e for e in items if e.get("involvedObject", {}).get("name") == name]


def start_canary(
    cluster: EmulatedCluster, name: str, new_spec: dict[str, Any], pages: list[Exposition]
) -> tuple[Exposition, Exposition]:
    """Edit the spec, wait for its canary, and play the kubelet: one stable pod and one canary
    pod, each serving a page that has seen nothing yet."""
    stable_before = spec_hash(cluster, name)
    edit_spec(cluster, name, new_spec)
    wait_for(lambda: get(cluster, "Deployment", f"{name}-canary"), what="the canary Deployment")
    wait_for(lambda: rollout(cluster, name).get("phase") == "Canary", what="phase Canary")
    revision = rollout(cluster, name)["canary"]["revision"]
    assert spec_hash(cluster, name) == stable_before, "the stable pods must not roll yet"
    for deployment in (name, f"{name}-router", f"{name}-canary"):
        roll_out(cluster, deployment, replicas=1, updated=1, available=1)
    stable = serve(pages, page(0, 0.2, 0.04))
    # Past its warm-up: the canary's window begins at the first reading.
    canary = serve(pages, page(WARM, 0.2, 0.04))
    add_pod(cluster, f"{name}-s-{revision}", name, "unified", stable)
    add_pod(
        cluster,
        f"{name}-c-{revision}",
        name,
        "unified",
        canary,
        labels={TRACK_LABEL: CANARY_TRACK},
        annotations={CANARY_REVISION: revision},
    )
    wait_for(
        lambda: (
            status(cluster, name)["canaryAnalysis"]["roles"]["unified"]
            == {
                "canaryPods": 1,
                "stablePods": 1,
                "canaryRequests": 0,
                "canaryFailed": 0,
                "stableRequests": 0,
                "stableFailed": 0,
            }
        ),
        what="a first comparison of both pods",
    )
    return stable, canary


def test_a_change_that_doubles_itl_is_rolled_back_and_not_tried_again(
    cluster: EmulatedCluster, operator: KopfRunner, pages: list[Exposition]
) -> None:
    cluster.create(llmd("slow", spec()))
    wait_for(lambda: rollout(cluster, "slow").get("phase") == "Stable", what="a stable spec")
    assert rollout(cluster, "slow")["stableSpec"]["rollout"]["strategy"] == "canary"
    # The canary strategy puts the router in front: it gives the canary its share.
    assert get(cluster, "Deployment", "slow-router") is not None
    stable_hash = spec_hash(cluster, "slow")

    changed = spec(scheduling={"maxNumSeqs": 64})
    stable, canary = start_canary(cluster, "slow", changed, pages)
    # The canary reads its own config file: the new flags, its track and its share.
    canary_config = config_of(cluster, "slow", "unified-canary")
    assert canary_config["max-num-seqs"] == 64
    assert canary_config["track"] == "canary" and canary_config["traffic-weight"] == 0.1
    assert config_of(cluster, "slow", "unified").get("max-num-seqs") != 64
    deployment = get(cluster, "Deployment", "slow-canary")
    assert deployment is not None and deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["selector"]["matchLabels"][TRACK_LABEL] == CANARY_TRACK
    wait_for(
        lambda: conditions(cluster, "slow")["Progressing"]["reason"] == "CanaryRunning",
        what="Progressing: CanaryRunning",
    )
    assert conditions(cluster, "slow")["Ready"]["status"] == "False"
    # Progressing says CanaryRunning from the phase on; the canary Deployment's ready pod is
    # counted by the reconcile after the one that sees it (a step behind under load).
    wait_for(
        lambda: rollout(cluster, "slow")["canary"]["ready"] == 1, what="the canary counted ready"
    )

    stable.text = page(300, 0.2, 0.04)
    canary.text = page(WARM + 60, 0.2, 0.08)  # ITL doubled
    wait_for(lambda: rollout(cluster, "slow").get("phase") == "RolledBack", what="a rollback")
    reason = rollout(cluster, "slow")["rolledBack"]["reason"]
    assert "ITL" in reason and "slower" in reason
    wait_for(lambda: get(cluster, "Deployment", "slow-canary") is None, what="the canary gone")
    assert spec_hash(cluster, "slow") == stable_hash
    degraded = conditions(cluster, "slow")["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "CanaryRolledBack"
    rolled = [e for e in events(cluster, "slow") if e["reason"] == "CanaryRolledBack"]
    assert len(rolled) == 1 and rolled[0]["type"] == "Warning" and "ITL" in rolled[0]["message"]
    analysis = status(cluster, "slow")["canaryAnalysis"]
    assert analysis["decision"] == "rollback"
    assert analysis["roles"]["unified"]["canaryRequests"] == 60

    # Nothing changes: nothing is written, however long the operator runs.
    mark = settle(cluster)
    settle(cluster, quiet_s=10 * PERIOD_S)
    assert cluster.writes(since=mark) == []

    # An unrelated edit keeps the same change of the pods: it is not tried again.
    edit_spec(cluster, "slow", spec(scheduling={"maxNumSeqs": 64}, service={"port": 8080}))
    settle(cluster)
    assert get(cluster, "Deployment", "slow-canary") is None
    assert rollout(cluster, "slow")["phase"] == "RolledBack"


def test_a_change_as_fast_as_the_stable_pods_is_promoted_and_rolls_them(
    cluster: EmulatedCluster, operator: KopfRunner, pages: list[Exposition]
) -> None:
    cluster.create(llmd("fast", spec()))
    wait_for(lambda: rollout(cluster, "fast").get("phase") == "Stable", what="a stable spec")
    changed = spec(scheduling={"maxNumSeqs": 128})
    stable, canary = start_canary(cluster, "fast", changed, pages)
    canary_hash = spec_hash(cluster, "fast-canary")

    # Not enough requests: the controller waits, and says for what.
    canary.text = page(WARM + 20, 0.2, 0.04)
    stable.text = page(100, 0.2, 0.04)
    wait_for(
        lambda: (
            "finished 20 requests; the next look is at 40"
            in status(cluster, "fast")["canaryAnalysis"]["reason"]
        ),
        what="a wait for the first look",
    )
    assert rollout(cluster, "fast")["phase"] == "Canary"

    canary.text = page(WARM + 200, 0.19, 0.037)
    stable.text = page(600, 0.2, 0.04)
    wait_for(lambda: rollout(cluster, "fast").get("phase") == "Stable", what="a promotion")
    assert rollout(cluster, "fast")["stableSpec"]["scheduling"]["maxNumSeqs"] == 128
    assert "within 20%" in rollout(cluster, "fast")["lastPromoted"]["reason"]
    wait_for(lambda: get(cluster, "Deployment", "fast-canary") is None, what="the canary gone")
    # The stable Deployment now rolls to the new flags (the canary's template, less its track).
    assert config_of(cluster, "fast", "unified")["max-num-seqs"] == 128
    assert spec_hash(cluster, "fast") not in (None, canary_hash)
    promoted = [e for e in events(cluster, "fast") if e["reason"] == "CanaryPromoted"]
    assert len(promoted) == 1 and promoted[0]["type"] == "Normal"
    assert conditions(cluster, "fast")["Degraded"]["status"] == "False"


def test_the_annotation_aborts_a_canary_and_promotes_a_rolled_back_change(
    cluster: EmulatedCluster, operator: KopfRunner, pages: list[Exposition]
) -> None:
    cluster.create(llmd("manual", spec()))
    wait_for(lambda: rollout(cluster, "manual").get("phase") == "Stable", what="a stable spec")
    changed = spec(scheduling={"maxNumSeqs": 32})
    start_canary(cluster, "manual", changed, pages)

    def annotate(action: str) -> None:
        cluster.patch(
            LLMD,
            "LLMDeployment",
            "manual",
            {"metadata": {"annotations": {CANARY_ANNOTATION: action}}},
        )

    def annotation() -> str | None:
        return (
            (get(cluster, "LLMDeployment", "manual") or {})["metadata"]
            .get("annotations", {})
            .get(CANARY_ANNOTATION)
        )

    annotate("abort")
    wait_for(lambda: rollout(cluster, "manual").get("phase") == "RolledBack", what="an abort")
    assert "by hand" in rollout(cluster, "manual")["rolledBack"]["reason"]
    wait_for(lambda: annotation() is None, what="the annotation removed")
    wait_for(lambda: get(cluster, "Deployment", "manual-canary") is None, what="the canary gone")

    annotate("promote")
    wait_for(lambda: rollout(cluster, "manual").get("phase") == "Stable", what="a promotion")
    assert rollout(cluster, "manual")["stableSpec"]["scheduling"]["maxNumSeqs"] == 32
    assert config_of(cluster, "manual", "unified")["max-num-seqs"] == 32
    wait_for(lambda: annotation() is None, what="the annotation removed")
    reasons = [e["reason"] for e in events(cluster, "manual")]
    assert reasons.count("CanaryRolledBack") == 1 and reasons.count("CanaryPromoted") == 1


def test_closed_loop_tuning_proposes_a_fitted_threshold_and_promotes_it_through_a_canary(
    cluster: EmulatedCluster, operator: KopfRunner, pages: list[Exposition]
) -> None:
    tuned = spec(
        tuning={"mode": "closed-loop", "windowSeconds": 10},
        scheduling={"slo": {"ttftMs": 2000, "itlMs": 50}},
    )
    cluster.create(llmd("tuned", tuned))
    wait_for(lambda: rollout(cluster, "tuned").get("phase") == "Stable", what="a stable spec")
    for deployment in ("tuned", "tuned-router"):
        roll_out(cluster, deployment, replicas=1, updated=1, available=1)
    assert config_of(cluster, "tuned", "unified")["long-prefill-token-threshold"] == "auto"
    metrics = PrometheusMetrics("tiny", num_engines=1)
    stable = serve(pages, metrics.render()[0].decode())
    add_pod(cluster, "tuned-s", "tuned", "unified", stable)
    time.sleep(10 * PERIOD_S)  # the window's first reading: no step yet
    # 20 ms + 0.5 ms per decode + 0.2 ms per prompt token: about 64 prompt tokens fit in the
    # 50 ms SLO beside the usual decodes.
    run_steps(metrics, random.Random(0), 4000)
    stable.text = metrics.render()[0].decode()
    wait_for(
        lambda: status(cluster, "tuned").get("tuning", {}).get("lastFit", {}).get("unified"),
        timeout=40,
        what="a fit after the window",
    )
    fit = status(cluster, "tuned")["tuning"]["lastFit"]["unified"]
    assert fit["steps"] == 4000
    assert fit["fit"]["baseMs"] == pytest.approx(20, rel=0.15)
    assert fit["fit"]["perTokenUs"] == pytest.approx(200, rel=0.15)
    wait_for(lambda: rollout(cluster, "tuned").get("phase") == "Canary", what="a tuning canary")
    proposed = status(cluster, "tuned")["tuning"]["proposed"]["unified"]
    threshold = proposed["longPrefillTokenThreshold"]
    assert threshold % 16 == 0 and 16 <= threshold <= 128, proposed
    assert "ITL 50 ms" in proposed["reason"] or "50 ms" in proposed["reason"], proposed
    # The canary runs the proposal; the stable pods keep auto.
    assert (
        config_of(cluster, "tuned", "unified-canary")["long-prefill-token-threshold"] == threshold
    )
    assert config_of(cluster, "tuned", "unified")["long-prefill-token-threshold"] == "auto"
    assert any(e["reason"] == "TuningProposed" for e in events(cluster, "tuned"))

    revision = rollout(cluster, "tuned")["canary"]["revision"]
    canary = serve(pages, page(WARM, 0.2, 0.04))
    stable.text = page(0, 0.2, 0.04)  # the stable pod restarted, say: it counts from zero
    add_pod(
        cluster,
        "tuned-c",
        "tuned",
        "unified",
        canary,
        labels={TRACK_LABEL: CANARY_TRACK},
        annotations={CANARY_REVISION: revision},
    )
    time.sleep(10 * PERIOD_S)
    canary.text = page(WARM + 200, 0.2, 0.038)
    stable.text = page(600, 0.2, 0.04)
    wait_for(lambda: rollout(cluster, "tuned").get("phase") == "Stable", what="a promotion")
    tuning = status(cluster, "tuned")["tuning"]
    assert tuning["applied"]["unified"]["longPrefillTokenThreshold"] == threshold
    assert "proposed" not in tuning
    wait_for(
        lambda: config_of(cluster, "tuned", "unified")["long-prefill-token-threshold"] == threshold,
        what="the stable pods on the promoted threshold",
    )
    reasons = status(cluster, "tuned")["effective"]["reasons"]
    assert any(
        r.startswith(f"unified.longPrefillTokenThreshold={threshold}: closed-loop") for r in reasons
    )
