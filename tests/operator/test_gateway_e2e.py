"""spec.gateway end to end: kopf running the operator against kmock's emulator.

The InferencePool is created, owned by the resource and pruned once the spec no longer asks
for it; on a cluster without the Gateway API Inference Extension's CRD the rest of the
resource is applied and the condition says what to install.
"""

from __future__ import annotations

from pathlib import Path

from kopf.testing import KopfRunner

from tests.operator.cluster import INFERENCE_POOLS, EmulatedCluster, run_operator, wait_for
from tests.operator.test_operator_e2e import (
    LLMD,
    conditions,
    config_of,
    edit_spec,
    get,
    llmd,
    settle,
    status,
    tiny_spec,
)
from tidegate.operator.labels import COMPONENT_LABEL

POOL_API = "inference.networking.k8s.io/v1"
NOT_INSTALLED = (
    "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed; install the "
    "Gateway API Inference Extension"
)


def pool_of(cluster: EmulatedCluster, name: str) -> dict | None:
    return get(cluster, "InferencePool", name)


def test_the_pool_is_created_owned_and_pruned(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    spec = tiny_spec(
        topology={"mode": "disaggregated", "prefill": {}, "decode": {}, "router": {"replicas": 2}},
        gateway={"inferencePool": True, "failureMode": "FailOpen"},
    )
    cluster.create(llmd("gw", spec))
    pool = wait_for(lambda: pool_of(cluster, "gw"), what="the InferencePool")
    assert pool["metadata"]["ownerReferences"] == [
        {
            "apiVersion": LLMD,
            "kind": "LLMDeployment",
            "name": "gw",
            "uid": "uid-gw",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pool["spec"]["selector"]["matchLabels"][COMPONENT_LABEL] == "decode"
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["name"], picker["port"], picker["failureMode"]) == (
        "gw-epp",
        {"number": 9002},
        "FailOpen",
    )
    epp = wait_for(lambda: get(cluster, "Service", "gw-epp"), what="the picker's Service")
    assert epp["spec"]["selector"][COMPONENT_LABEL] == "router"
    assert get(cluster, "Deployment", "gw-router")["spec"]["replicas"] == 2  # type: ignore[index]
    assert config_of(cluster, "gw", "router")["epp-port"] == 9002
    assert config_of(cluster, "gw", "decode")["prefill-via-header"] is True

    # Someone edits the pool's picker: the operator puts it back.
    cluster.patch(POOL_API, "InferencePool", "gw", {"spec": {"endpointPickerRef": {"name": "x"}}})
    wait_for(
        lambda: pool_of(cluster, "gw")["spec"]["endpointPickerRef"]["name"] == "gw-epp",
        what="the picker restored",
    )

    # The pool off: the pool and the picker's Service go, the router stays (P/D needs it).
    edit_spec(cluster, "gw", {**spec, "gateway": {"inferencePool": False}})
    wait_for(lambda: pool_of(cluster, "gw") is None, what="the InferencePool pruned")
    wait_for(lambda: get(cluster, "Service", "gw-epp") is None, what="the picker's Service pruned")
    assert get(cluster, "Deployment", "gw-router") is not None
    wait_for(lambda: "epp-port" not in config_of(cluster, "gw", "router"), what="no picker")


def test_a_unified_pool_gets_its_picker_and_loses_it_with_the_pool(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("gw-uni", tiny_spec(gateway={"inferencePool": True})))
    pool = wait_for(lambda: pool_of(cluster, "gw-uni"), what="the InferencePool")
    assert pool["spec"]["selector"]["matchLabels"][COMPONENT_LABEL] == "unified"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    wait_for(lambda: get(cluster, "Deployment", "gw-uni-router"), what="the router")
    assert config_of(cluster, "gw-uni", "unified")["kv-events-port"] == 5557

    edit_spec(cluster, "gw-uni", tiny_spec())
    wait_for(lambda: pool_of(cluster, "gw-uni") is None, what="the InferencePool pruned")
    wait_for(lambda: get(cluster, "Deployment", "gw-uni-router") is None, what="router pruned")
    wait_for(
        lambda: get(cluster, "Service", "gw-uni")["spec"]["selector"][COMPONENT_LABEL] == "unified",
        what="the public Service on the unified pool",
    )
    assert "kv-events-port" not in config_of(cluster, "gw-uni", "unified")


def test_without_the_crd_the_rest_is_applied_and_the_condition_says_what_to_install(
    tmp_path: Path,
) -> None:
    with EmulatedCluster(tmp_path, missing=frozenset({INFERENCE_POOLS})) as cluster:
        with run_operator(cluster) as runner:
            cluster.create(llmd("bare", tiny_spec(gateway={"inferencePool": True})))
            wait_for(
                lambda: conditions(cluster, "bare")["Degraded"]["status"] == "True",
                what="Degraded",
            )
            degraded = conditions(cluster, "bare")["Degraded"]
            assert (degraded["reason"], degraded["message"]) == ("CRDNotInstalled", NOT_INSTALLED)
            assert status(cluster, "bare")["phase"] == "Degraded"
            # Everything else is there, the picker included, for when the CRD comes.
            for kind, name in [
                ("ConfigMap", "bare-config"),
                ("Deployment", "bare"),
                ("Deployment", "bare-router"),
                ("Service", "bare"),
                ("Service", "bare-epp"),
                ("PodDisruptionBudget", "bare-router"),
            ]:
                assert get(cluster, kind, name) is not None, (kind, name)

            # Without the pool, nothing is missing.
            edit_spec(cluster, "bare", tiny_spec())
            wait_for(
                lambda: conditions(cluster, "bare")["Degraded"]["status"] == "False",
                what="no longer Degraded",
            )
            settle(cluster)
        assert runner.exception is None, runner.output[-3000:]
