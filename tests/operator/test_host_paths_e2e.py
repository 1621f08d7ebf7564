"""The operator with a hostPath allow-list, against kmock's emulator: a refused node folder is
reported in a Degraded condition that names the flag, and gets no pod, ConfigMap or Service;
an allowed one is served; a bad edit leaves what runs alone."""

from __future__ import annotations

from typing import Any

import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import EmulatedCluster, wait_for
from tidegate.operator.handlers import OperatorOptions
from tidegate.operator.host_paths import READ_ONLY_FLAG, REASON, HostPathPolicy
from tidegate.operator.kube import KINDS
from tidegate.operator.render import RenderOptions
from tidegate.operator.spec import API_VERSION, KIND

API_VERSION_OF = {kind: api_version for api_version, kind in KINDS}
POLICY = HostPathPolicy(read_only=("/models",), cache=("/var/cache/tidegate",))


def llmd(name: str, path: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default", "uid": f"uid-{name}", "generation": 1}
    spec = {
        "model": {"name": "tiny", "source": {"hostPath": {"path": path}}},
        "image": "tidegate/engine-cpu:1",
    }
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


def get(cluster: EmulatedCluster, kind: str, name: str) -> dict[str, Any] | None:
    return cluster.get(API_VERSION_OF[kind], kind, name)


def degraded(cluster: EmulatedCluster, name: str) -> dict[str, Any] | None:
    resource = get(cluster, "LLMDeployment", name) or {}
    for condition in (resource.get("status") or {}).get("conditions", []):
        if condition["type"] == "Degraded" and condition["status"] == "True":
            return condition
    return None


def set_path(cluster: EmulatedCluster, name: str, path: str) -> None:
    """Edit the source as `kubectl apply` would, bumping the generation."""
    live = get(cluster, "LLMDeployment", name)
    assert live is not None
    source = {"source": {"hostPath": {"path": path}}}
    patch = {"metadata": {"generation": live["metadata"]["generation"] + 1}}
    cluster.patch(API_VERSION, KIND, name, {**patch, "spec": {"model": source}})


@pytest.fixture(scope="module")
def operator_options() -> OperatorOptions:
    return OperatorOptions(render=RenderOptions(host_paths=POLICY))


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("root", "/"),
        ("etc", "/etc"),
        ("sibling", "/models-x/tiny"),
        ("slashes", "//etc"),
        ("tokens", "/var/run/secrets/kubernetes.io/serviceaccount"),
    ],
)
def test_a_refused_folder_is_degraded_and_gets_nothing(
    cluster: EmulatedCluster, operator: KopfRunner, name: str, path: str
) -> None:
    cluster.create(llmd(name, path))
    condition = wait_for(lambda: degraded(cluster, name), what=f"{name} Degraded")
    assert condition["reason"] == REASON
    assert "spec.model.source.hostPath.path" in condition["message"]
    assert READ_ONLY_FLAG in condition["message"] and "allowed: /models" in condition["message"]
    # The pass that wrote the condition created nothing, and later ones do not either.
    for kind, child in [
        ("Deployment", name),
        ("ConfigMap", f"{name}-config"),
        ("Service", name),
        ("PodDisruptionBudget", name),
    ]:
        assert get(cluster, kind, child) is None, (kind, child)


def test_an_allowed_folder_is_served_and_a_bad_edit_keeps_what_runs(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("good", "/models/tiny"))
    wait_for(lambda: get(cluster, "LLMDeployment", "good")["status"]["phase"], what="a status")
    deployment = get(cluster, "Deployment", "good")
    assert deployment is not None
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"path": "/models/tiny", "type": "Directory"} in [v.get("hostPath") for v in volumes]
    assert degraded(cluster, "good") is None

    # An edit to a refused folder is reported; the pods of the allowed one keep running.
    set_path(cluster, "good", "/models/../etc")
    wait_for(lambda: degraded(cluster, "good"), what="good Degraded")
    set_path(cluster, "good", "/etc")
    condition = wait_for(
        lambda: (c := degraded(cluster, "good")) and c["reason"] == REASON and c,
        what="HostPathRefused",
    )
    assert "'/etc'" in condition["message"]
    assert get(cluster, "Deployment", "good")["spec"] == deployment["spec"]

    # Back to an allowed folder (written another way): served again.
    set_path(cluster, "good", "//models/tiny/")
    wait_for(lambda: degraded(cluster, "good") is None, what="good recovered")


def test_a_refused_resource_is_served_once_its_folder_is_allowed(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("fixed", "/srv/tiny"))
    wait_for(lambda: degraded(cluster, "fixed"), what="fixed Degraded")
    assert get(cluster, "Deployment", "fixed") is None
    set_path(cluster, "fixed", "/models/tiny")
    wait_for(lambda: get(cluster, "Deployment", "fixed"), what="fixed's Deployment")
    wait_for(lambda: degraded(cluster, "fixed") is None, what="fixed recovered")
