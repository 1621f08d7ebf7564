"""Who sets an autoscaled pool's replicas: the reconcile at creation, its driver afterwards."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

from tidegate.operator.kube import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER
from tidegate.operator.reconcile import reconcile
from tidegate.operator.render import RenderOptions

NS = "ml"
LOGGER = logging.getLogger("tests.reconcile")


class ApplyingKube:
    """Objects by kind/name; create, apply (a merge, as kmock does) and status, recorded."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str, dict[str, Any]]] = []

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        found = self.objects.get(f"{kind}/{name}")
        return copy.deepcopy(found) if found is not None else None

    async def list(self, *_: Any) -> list[dict[str, Any]]:
        return []

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        self.writes.append(("create", FIELD_MANAGER, key, copy.deepcopy(obj)))
        self.objects[key] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    async def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER) -> Any:
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        self.writes.append(("apply", field_manager, key, copy.deepcopy(obj)))
        live = self.objects[key]
        live["spec"] = {**live.get("spec", {}), **obj["spec"]}
        return copy.deepcopy(live)

    async def patch_status(self, *_: Any) -> dict[str, Any]:
        return {}


def resource(policy: dict[str, Any] | None, replicas: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"hostPath": {"path": "/models/tiny"}}},
        "topology": {"unified": {"replicas": replicas}},
    }
    if policy is not None:
        spec["autoscaling"] = {"unified": policy}
    return {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": NS, "uid": "uid-llm", "generation": 1},
        "spec": spec,
    }


def run(kube: ApplyingKube, obj: dict[str, Any]) -> Any:
    return asyncio.run(reconcile(kube, obj, RenderOptions(), LOGGER))  # type: ignore[arg-type]


def test_an_autoscaled_pool_is_created_at_its_start_and_then_left_to_the_autoscaler() -> None:
    kube = ApplyingKube()
    scaled = resource({"minReplicas": 2, "maxReplicas": 6})
    run(kube, scaled)
    assert kube.objects["Deployment/llm"]["spec"]["replicas"] == 2  # topology's 1, within 2-6

    # The autoscaler grows the pool; a reconcile (a new image) applies without replicas.
    kube.objects["Deployment/llm"]["spec"]["replicas"] = 5
    scaled["spec"]["image"] = "tidegate/engine:2"
    kube.writes.clear()
    outcome = run(kube, scaled)
    assert outcome.applied == ["Deployment/llm"]
    (apply,) = [w for w in kube.writes if w[2] == "Deployment/llm"]
    assert "replicas" not in apply[3]["spec"]
    assert apply[3]["spec"]["template"]["spec"]["containers"][0]["image"] == "tidegate/engine:2"
    assert kube.objects["Deployment/llm"]["spec"]["replicas"] == 5

    # An unchanged resource: the autoscaler's replicas are no difference to undo.
    kube.writes.clear()
    run(kube, scaled)
    assert kube.writes == []


def test_status_desires_what_the_autoscaler_set() -> None:
    kube = ApplyingKube()
    scaled = resource({"minReplicas": 1, "maxReplicas": 6})
    run(kube, scaled)
    kube.objects["Deployment/llm"]["spec"]["replicas"] = 4
    recorded: list[dict[str, Any]] = []

    async def patch_status(*args: Any) -> dict[str, Any]:
        recorded.append(args[-1])
        return {}

    kube.patch_status = patch_status  # type: ignore[method-assign]
    run(kube, scaled)
    assert recorded[-1]["replicas"]["unified"]["desired"] == 4
    assert recorded[-1]["ready"] == "0/4"


def test_a_fixed_pool_that_gets_a_policy_hands_its_replicas_to_the_autoscaler() -> None:
    """On a real API server our applies own a fixed pool's replicas; an apply that leaves
    them out would drop the field (back to 1) unless another manager holds it first."""
    kube = ApplyingKube()
    run(kube, resource(None, replicas=3))
    kube.objects["Deployment/llm"]["metadata"]["managedFields"] = [
        {
            "manager": FIELD_MANAGER,
            "operation": "Apply",
            "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}},
        }
    ]
    kube.writes.clear()
    run(kube, resource({"minReplicas": 1, "maxReplicas": 6}, replicas=3))
    deployment_writes = [
        (w[0], w[1], w[3]["spec"]) for w in kube.writes if w[2] == "Deployment/llm"
    ]
    handoff, release = deployment_writes
    assert handoff == ("apply", AUTOSCALER_FIELD_MANAGER, {"replicas": 3})
    assert release[:2] == ("apply", FIELD_MANAGER) and "replicas" not in release[2]


def test_a_pool_whose_policy_goes_returns_to_the_topology_replicas() -> None:
    kube = ApplyingKube()
    run(kube, resource({"minReplicas": 1, "maxReplicas": 6}, replicas=2))
    kube.objects["Deployment/llm"]["spec"]["replicas"] = 5
    run(kube, resource(None, replicas=2))
    assert kube.objects["Deployment/llm"]["spec"]["replicas"] == 2
