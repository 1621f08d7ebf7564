"""The operator's autoscaler over an in-memory API: what it reads, writes, and in which order."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from tidegate.operator.autoscaler import PoolSignals, ScaleEvent, ScalerState, decide, pool_targets
from tidegate.operator.cluster_scaler import (
    DELETION_COST,
    ClusterAutoscaler,
    metrics_url,
    restored_state,
    start_time_s,
    status_entry,
    window_peaks,
)
from tidegate.operator.kube import AUTOSCALER_FIELD_MANAGER
from tidegate.operator.labels import selector_labels
from tidegate.operator.spec import AutoscalingPolicy

NS = "ml"


class MemoryKube:
    """The calls the autoscaler makes, over a dict of objects; every write is recorded."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, Any]] = []

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (k, _), obj in self.objects.items()
            if k == kind and labels.items() <= obj["metadata"].get("labels", {}).items()
        ]

    async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        self.writes.append(("apply", field_manager, copy.deepcopy(obj)))
        live = self.objects[(obj["kind"], obj["metadata"]["name"])]
        live["spec"].update(obj["spec"])
        return copy.deepcopy(live)

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes.append(("patch", f"{kind}/{name}", copy.deepcopy(patch)))
        meta = self.objects[(kind, name)]["metadata"]
        meta.setdefault("annotations", {}).update(patch["metadata"]["annotations"])
        return {}

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes.append(("status", name, copy.deepcopy(status)))
        live = self.objects[(kind, name)].setdefault("status", {})
        for key, value in status.items():
            if value is None:
                live.pop(key, None)
            elif isinstance(value, dict):
                merged = live.setdefault(key, {})
                for inner, inner_value in value.items():
                    if inner_value is None:
                        merged.pop(inner, None)
                    else:
                        merged[inner] = {k: v for k, v in inner_value.items() if v is not None}
            else:
                live[key] = value
        return {}

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("create", obj["kind"], copy.deepcopy(obj)))
        return obj


def resource(policy: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": NS, "uid": "uid-llm"},
        "spec": {
            "model": {"name": "tiny", "source": {"hostPath": {"path": "/models/tiny"}}},
            "scheduling": {"maxNumSeqs": 4},
            "autoscaling": {"unified": policy},
        },
    }


def deployment(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": NS},
        "spec": {"replicas": replicas},
    }


def pod(index: int, *, ready: bool = True, cost: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"llm-{index}",
        "namespace": NS,
        "labels": selector_labels("llm", "unified"),
        "creationTimestamp": "2026-01-01T00:00:00Z",
    }
    if cost is not None:
        meta["annotations"] = {DELETION_COST: cost}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]
        },
        "status": {
            "podIP": f"10.0.0.{index}",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": "2026-01-01T00:00:42Z",
                }
            ],
        },
    }


def exposition(running: int, waiting: int = 0) -> str:
    return (
        "# TYPE tidegate:num_requests_running gauge\n"
        f'tidegate:num_requests_running{{engine="0"}} {running}\n'
        f'tidegate:num_requests_waiting{{engine="0"}} {waiting}\n'
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def scaler(kube: MemoryKube, answers: dict[str, str | None], clock: Clock) -> ClusterAutoscaler:
    async def fetch(url: str) -> str | None:
        return answers.get(url)

    return ClusterAutoscaler(kube, period_s=1, fetch=fetch, clock=clock)  # type: ignore[arg-type]


def url(index: int) -> str:
    return f"http://10.0.0.{index}:8000/metrics"


def test_a_pod_is_scraped_at_its_ip_and_http_port() -> None:
    assert metrics_url(pod(3)) == "http://10.0.0.3:8000/metrics"
    six = pod(1)
    six["status"]["podIP"] = "fd00::7"
    assert metrics_url(six) == "http://[fd00::7]:8000/metrics"
    unscheduled = pod(2)
    del unscheduled["status"]["podIP"]
    assert metrics_url(unscheduled) is None


def test_start_time_runs_from_creation_to_readiness() -> None:
    assert start_time_s(pod(1)) == 42.0
    assert start_time_s(pod(1, ready=False)) is None


def test_load_grows_the_pool_under_the_autoscalers_field_manager() -> None:
    kube, clock = MemoryKube(), Clock()
    kube.objects[("LLMDeployment", "llm")] = resource({"minReplicas": 1, "maxReplicas": 4})
    kube.objects[("Deployment", "llm")] = deployment(1)
    kube.objects[("Pod", "llm-1")] = pod(1)
    autoscaler = scaler(kube, {url(1): exposition(4, 8)}, clock)

    assert asyncio.run(autoscaler.step(kube.objects[("LLMDeployment", "llm")]))
    applies = [w for w in kube.writes if w[0] == "apply"]
    assert applies == [
        (
            "apply",
            AUTOSCALER_FIELD_MANAGER,
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "llm", "namespace": NS},
                "spec": {"replicas": 3},
            },
        )
    ]
    (event,) = [w[2] for w in kube.writes if w[0] == "create"]
    assert event["reason"] == "Scaled"
    assert event["involvedObject"]["uid"] == "uid-llm"
    assert event["message"].startswith("unified: 1 -> 3: 12 requests / 4 per replica")
    entry = kube.objects[("LLMDeployment", "llm")]["status"]["autoscaling"]["unified"]
    assert (entry["desired"], entry["current"]) == (3, 1)
    assert entry["startTimeSeconds"] == 42
    assert entry["scaleEvents"] == [{"at": 1_800_000_000, "from": 1, "to": 3}]
    gauge = autoscaler.registry.get_sample_value(
        "tidegate:autoscaler_desired_replicas",
        {"namespace": NS, "llmdeployment": "llm", "role": "unified"},
    )
    assert gauge == 3


def test_status_is_written_only_when_the_decision_or_its_reason_changes() -> None:
    kube, clock = MemoryKube(), Clock()
    kube.objects[("LLMDeployment", "llm")] = resource({"minReplicas": 1, "maxReplicas": 4})
    kube.objects[("Deployment", "llm")] = deployment(2)
    kube.objects[("Pod", "llm-1")] = pod(1)
    kube.objects[("Pod", "llm-2")] = pod(2)
    answers = {url(1): exposition(4), url(2): exposition(4)}
    autoscaler = scaler(kube, answers, clock)

    async def periods(count: int) -> None:
        for _ in range(count):
            clock.now += 15
            await autoscaler.step(kube.objects[("LLMDeployment", "llm")])

    asyncio.run(periods(3))
    assert [w[0] for w in kube.writes] == ["status"]  # the first decision; then the same
    answers[url(2)] = exposition(3)
    asyncio.run(periods(1))
    assert [w[0] for w in kube.writes] == ["status", "status"]  # 7 requests: a new reason


def test_a_scale_down_sets_deletion_costs_first_so_the_idlest_pod_goes() -> None:
    kube, clock = MemoryKube(), Clock()
    policy = {"minReplicas": 1, "maxReplicas": 4, "scaleDown": {"stabilizationWindowSeconds": 0}}
    kube.objects[("LLMDeployment", "llm")] = resource(policy)
    kube.objects[("Deployment", "llm")] = deployment(3)
    for index in (1, 2, 3):
        kube.objects[("Pod", f"llm-{index}")] = pod(index, cost="2" if index == 3 else None)
    answers = {url(1): exposition(3), url(2): exposition(0), url(3): exposition(2)}
    autoscaler = scaler(kube, answers, clock)

    asyncio.run(autoscaler.step(kube.objects[("LLMDeployment", "llm")]))
    writes = [w for w in kube.writes if w[0] in ("patch", "apply")]
    # Costs first (pod 3 already carries its cost: not written again), then the replicas.
    assert writes[:2] == [
        ("patch", "Pod/llm-1", {"metadata": {"annotations": {DELETION_COST: "3"}}}),
        ("patch", "Pod/llm-2", {"metadata": {"annotations": {DELETION_COST: "0"}}}),
    ]
    assert writes[2][0] == "apply" and writes[2][2]["spec"] == {"replicas": 2}


def test_a_pod_that_does_not_answer_counts_as_pending_and_holds_the_pool() -> None:
    kube, clock = MemoryKube(), Clock()
    policy = {"minReplicas": 1, "maxReplicas": 4, "scaleDown": {"stabilizationWindowSeconds": 0}}
    kube.objects[("LLMDeployment", "llm")] = resource(policy)
    kube.objects[("Deployment", "llm")] = deployment(3)
    for index in (1, 2, 3):
        kube.objects[("Pod", f"llm-{index}")] = pod(index)
    answers = {url(1): exposition(0), url(2): exposition(0), url(3): None}
    autoscaler = scaler(kube, answers, clock)

    asyncio.run(autoscaler.step(kube.objects[("LLMDeployment", "llm")]))
    assert not [w for w in kube.writes if w[0] in ("patch", "apply")]
    entry = kube.objects[("LLMDeployment", "llm")]["status"]["autoscaling"]["unified"]
    assert "no scale-down while 1 pods are pending" in entry["reason"]


def test_a_pool_dropped_from_the_policies_loses_its_status_and_gauge() -> None:
    kube, clock = MemoryKube(), Clock()
    kube.objects[("LLMDeployment", "llm")] = resource({"minReplicas": 1, "maxReplicas": 4})
    kube.objects[("Deployment", "llm")] = deployment(1)
    kube.objects[("Pod", "llm-1")] = pod(1)
    autoscaler = scaler(kube, {url(1): exposition(1)}, clock)
    asyncio.run(autoscaler.step(kube.objects[("LLMDeployment", "llm")]))
    assert "autoscaling" in kube.objects[("LLMDeployment", "llm")]["status"]

    del kube.objects[("LLMDeployment", "llm")]["spec"]["autoscaling"]
    assert not asyncio.run(autoscaler.step(kube.objects[("LLMDeployment", "llm")]))
    assert "autoscaling" not in kube.objects[("LLMDeployment", "llm")]["status"]
    labels = {"namespace": NS, "llmdeployment": "llm", "role": "unified"}
    assert (
        autoscaler.registry.get_sample_value("tidegate:autoscaler_desired_replicas", labels) is None
    )


# -- what a restarted operator resumes -------------------------------------------------------


def test_window_peaks_keep_what_may_still_be_the_windows_highest() -> None:
    history = ((0.0, 5), (10.0, 3), (20.0, 4), (30.0, 2), (40.0, 2))
    assert window_peaks(history) == [(0.0, 5), (20.0, 4), (40.0, 2)]
    for now in (100.0, 315.0, 325.0, 335.0):
        inside = [r for t, r in history if now - t <= 300]
        peaks = [r for t, r in window_peaks(history) if now - t <= 300]
        assert max(inside, default=None) == max(peaks, default=None)


def test_a_restarted_operator_does_not_shrink_at_once() -> None:
    policy = AutoscalingPolicy.model_validate({"minReplicas": 1, "maxReplicas": 8})
    targets = pool_targets(policy, "unified", 4, 1000, 100)
    busy = PoolSignals(ready=4, running=16)
    state = ScalerState(events=(ScaleEvent(0.0, 2, 4),))
    decision = decide(policy, targets, busy, state, 100.0)
    assert decision.desired == 4
    entry = status_entry(decision, policy, 40.0, 100.0)

    # The operator restarts 10 minutes later: the load has gone. The window (300 s) counts
    # from the restart, so the pool holds, as the operator that kept running would have.
    later = 700.0
    restored = restored_state(entry, later)
    idle = PoolSignals(ready=4, running=1)
    held = decide(policy, targets, idle, restored, later + 15)
    assert held.desired == 4 and "scale-down window holds 4" in held.reason
    shrunk = decide(policy, targets, idle, held.state, later + 301)
    assert shrunk.desired == 3  # then as usual: one pod per 60 s
    assert restored.events == (ScaleEvent(0.0, 2, 4),)


@pytest.mark.parametrize("idle", [None, 120.0])
def test_the_idle_clock_survives_a_restart(idle: float | None) -> None:
    policy = AutoscalingPolicy.model_validate({"minReplicas": 0, "maxReplicas": 2})
    state = ScalerState(recommendations=((idle or 0.0, 1),), idle_since=idle)
    targets = pool_targets(policy, "unified", 4, 1000, 100)
    decision = decide(policy, targets, PoolSignals(ready=1), state, 130.0)
    restored = restored_state(status_entry(decision, policy, None, 130.0), 140.0)
    assert restored.idle_since == (idle if idle is not None else 130.0)


def test_an_entry_left_by_a_policy_dropped_while_no_operator_ran_is_cleared() -> None:
    kube, clock = MemoryKube(), Clock()
    obj = resource({"minReplicas": 1, "maxReplicas": 4})
    del obj["spec"]["autoscaling"]
    obj["status"] = {"autoscaling": {"unified": {"desired": 2, "current": 2, "reason": "x"}}}
    kube.objects[("LLMDeployment", "llm")] = obj
    autoscaler = ClusterAutoscaler(kube, period_s=0.01, clock=clock)  # type: ignore[arg-type]

    async def run() -> None:
        autoscaler.watch(obj)
        await asyncio.wait_for(asyncio.gather(*autoscaler.tasks.values()), timeout=5)
        autoscaler.watch(kube.objects[("LLMDeployment", "llm")])  # nothing left: no task
        assert not autoscaler.tasks
        await autoscaler.close()

    asyncio.run(run())
    assert "autoscaling" not in kube.objects[("LLMDeployment", "llm")]["status"]
