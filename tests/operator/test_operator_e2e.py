"""The operator end to end: kopf running our handlers against kmock's Kubernetes emulator.

The emulator has no Deployment controller; tests play it by writing Deployment status, and
play the API server's generation counter by bumping metadata.generation with each spec edit.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import yaml
from kopf.testing import KopfRunner

from tests.operator.cluster import KOPF_LOG, EmulatedCluster, run_operator, wait_for
from tidegate.operator.kube import KINDS
from tidegate.operator.labels import COMPONENT_LABEL, child_labels

LLMD = "tidegate.dev/v1alpha1"
API_VERSION_OF = {kind: api_version for api_version, kind in KINDS}
NS = "default"


def llmd(name: str, spec: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": LLMD,
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": uid or f"uid-{name}", "generation": 1},
        "spec": spec,
    }


def tiny_spec(**extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"hostPath": {"path": "/models/tiny"}}},
        "image": "tidegate/engine-cpu:1",
    }
    spec.update(extra)
    return spec


GPU_SPEC = {
    "model": {
        "name": "llama-8b",
        "source": {"pvc": {"claimName": "models", "path": "llama-3-8b"}},
        "parameterCount": 8.0e9,
        "numKeyValueHeads": 8,
        "numAttentionHeads": 32,
    },
    "image": "tidegate/engine:1",
    "accelerator": {"resource": "nvidia.com/gpu", "count": 2, "memoryGiB": 80},
    "scheduling": {"slo": {"ttftMs": 800, "itlMs": 50}},
}


def get(cluster: EmulatedCluster, kind: str, name: str) -> dict[str, Any] | None:
    return cluster.get(API_VERSION_OF[kind], kind, name)


def status(cluster: EmulatedCluster, name: str) -> dict[str, Any]:
    return (get(cluster, "LLMDeployment", name) or {}).get("status") or {}


def conditions(cluster: EmulatedCluster, name: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status(cluster, name).get("conditions", [])}


def edit_spec(cluster: EmulatedCluster, name: str, spec: dict[str, Any]) -> None:
    """Replace the spec as `kubectl apply` would, bumping the generation as the API server does."""
    live = get(cluster, "LLMDeployment", name)
    assert live is not None
    generation = live["metadata"].get("generation", 1) + 1
    # The emulator merges JSON: null out keys that the new spec drops.
    patch_spec = {key: None for key in live["spec"] if key not in spec} | spec
    cluster.patch(
        LLMD, "LLMDeployment", name, {"metadata": {"generation": generation}, "spec": patch_spec}
    )


def roll_out(
    cluster: EmulatedCluster, name: str, *, replicas: int, updated: int, available: int
) -> None:
    """Play the Deployment controller: report pods of the current and older templates."""
    live = get(cluster, "Deployment", name)
    assert live is not None
    generation = live["metadata"].get("generation", 1)
    cluster.patch(
        "apps/v1",
        "Deployment",
        name,
        {
            "status": {
                "observedGeneration": generation,
                "replicas": replicas,
                "updatedReplicas": updated,
                "readyReplicas": available,
                "availableReplicas": available,
            }
        },
        subresource="status",
    )


def config_of(cluster: EmulatedCluster, name: str, role: str) -> dict[str, Any]:
    config_map = get(cluster, "ConfigMap", f"{name}-config")
    assert config_map is not None
    return yaml.safe_load(config_map["data"][f"{role}.yaml"])


def settle(cluster: EmulatedCluster, quiet_s: float = 1.0, timeout: float = 30.0) -> int:
    """Wait until the operator neither wrote nor handled anything for `quiet_s`.

    Returns the request count at the start of that quiet spell, for `cluster.writes(since=)`.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mark = cluster.request_count()
        writes, lines = len(cluster.writes()), len(KOPF_LOG.lines)
        time.sleep(quiet_s)
        if len(cluster.writes()) == writes and len(KOPF_LOG.lines) == lines:
            return mark
    raise AssertionError("the operator kept working")


def test_unified_resource_gets_its_children_and_status(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("uni", tiny_spec()))
    deployment = wait_for(lambda: get(cluster, "Deployment", "uni"), what="the Deployment")
    assert wait_for(lambda: get(cluster, "PodDisruptionBudget", "uni"), what="the PDB")
    service = get(cluster, "Service", "uni")
    assert service is not None and service["spec"]["selector"][COMPONENT_LABEL] == ("unified")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["serve", "--config", "/etc/tidegate/unified.yaml"]
    config = config_of(cluster, "uni", "unified")
    assert config["model"] == "/model"
    assert config["served-model-name"] == ["tiny"]
    assert config["tensor-parallel-size"] == 1
    assert config["long-prefill-token-threshold"] == "auto"  # CPU: the engine tunes online
    for kind, name in [
        ("ConfigMap", "uni-config"),
        ("Deployment", "uni"),
        ("Service", "uni"),
        ("PodDisruptionBudget", "uni"),
    ]:
        owners = get(cluster, kind, name)["metadata"]["ownerReferences"]  # type: ignore[index]
        assert owners == [
            {
                "apiVersion": LLMD,
                "kind": "LLMDeployment",
                "name": "uni",
                "uid": "uid-uni",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], kind

    # Not ready until the pods run.
    wait_for(lambda: status(cluster, "uni").get("phase") == "Progressing", what="Progressing")
    assert conditions(cluster, "uni")["Ready"]["status"] == "False"
    assert status(cluster, "uni")["endpoint"] == "http://uni.default.svc:8000/v1"
    assert status(cluster, "uni")["effective"]["roles"]["unified"]["tensorParallelSize"] == 1
    assert status(cluster, "uni")["observedGeneration"] == 1

    roll_out(cluster, "uni", replicas=1, updated=1, available=1)
    wait_for(lambda: status(cluster, "uni").get("phase") == "Ready", what="Ready")
    ready = conditions(cluster, "uni")["Ready"]
    assert ready["status"] == "True" and ready["reason"] == "AllRolesReady"
    assert status(cluster, "uni")["ready"] == "1/1"
    assert conditions(cluster, "uni")["Progressing"]["status"] == "False"
    assert conditions(cluster, "uni")["Degraded"]["status"] == "False"


def test_disaggregated_resource_gets_pools_router_and_headless_services(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    spec = tiny_spec(
        topology={
            "mode": "disaggregated",
            "prefill": {"replicas": 1},
            "decode": {"replicas": 2},
            "router": {"replicas": 1},
        }
    )
    cluster.create(llmd("pd", spec))
    for name in ("pd-prefill", "pd-decode", "pd-router"):
        wait_for(lambda name=name: get(cluster, "Deployment", name), what=name)
        wait_for(lambda name=name: get(cluster, "PodDisruptionBudget", name), what=f"{name} PDB")
    assert get(cluster, "Deployment", "pd-decode")["spec"]["replicas"] == 2  # type: ignore[index]
    public = wait_for(lambda: get(cluster, "Service", "pd"), what="the public Service")
    assert public["spec"]["selector"][COMPONENT_LABEL] == "router"
    for role in ("prefill", "decode"):
        headless = wait_for(lambda role=role: get(cluster, "Service", f"pd-{role}"), what=role)
        assert headless["spec"]["clusterIP"] == "None"
    assert config_of(cluster, "pd", "prefill")["kv-role"] == "producer"
    assert config_of(cluster, "pd", "decode")["kv-role"] == "consumer"
    router = config_of(cluster, "pd", "router")
    assert router["prefill"] == ["http://pd-prefill.default.svc:8000"]
    assert router["decode"] == ["http://pd-decode.default.svc:8000"]
    assert get(cluster, "Deployment", "pd") is None  # no unified pool
    # The prefill pods' KV ports are open to this resource's decode pods only.
    policy = wait_for(lambda: get(cluster, "NetworkPolicy", "pd-kv"), what="the KV policy")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-pd"
    assert policy["spec"]["podSelector"]["matchLabels"][COMPONENT_LABEL] == ("prefill")
    (_, kv_rule, events_rule) = policy["spec"]["ingress"]
    (peer,) = kv_rule["from"]
    assert peer["podSelector"]["matchLabels"][COMPONENT_LABEL] == "decode"
    # ... and their KV-cache events to the router's.
    (peer,) = events_rule["from"]
    assert peer["podSelector"]["matchLabels"][COMPONENT_LABEL] == "router"
    assert events_rule["ports"] == [{"protocol": "TCP", "port": 5557}]
    wanted_ingress = policy["spec"]["ingress"]
    # Someone opens the KV ports to everyone: the operator closes them again.
    cluster.patch("networking.k8s.io/v1", "NetworkPolicy", "pd-kv", {"spec": {"ingress": [{}]}})
    wait_for(
        lambda: get(cluster, "NetworkPolicy", "pd-kv")["spec"]["ingress"] == wanted_ingress,
        what="the KV policy restored",
    )

    for name, replicas in [("pd-prefill", 1), ("pd-decode", 2), ("pd-router", 1)]:
        roll_out(cluster, name, replicas=replicas, updated=replicas, available=replicas)
    wait_for(lambda: status(cluster, "pd").get("phase") == "Ready", what="Ready")
    assert status(cluster, "pd")["ready"] == "4/4"
    assert set(status(cluster, "pd")["replicas"]) == {"prefill", "decode", "router"}
    assert set(status(cluster, "pd")["effective"]["roles"]) == {"prefill", "decode"}


def replica_set(name: str, role: str, revision: str, replicas: int, created: str) -> dict:
    """What the Deployment controller makes for one pod template of a role: the template's
    labels, and its own hash."""
    labels = {**child_labels(name, role), "pod-template-hash": revision[:10]}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": f"{name}-{revision[:10]}",
            "namespace": "default",
            "labels": labels,
            "creationTimestamp": created,
        },
        "spec": {
            "replicas": replicas,
            "template": {"metadata": {"annotations": {"tidegate.dev/spec-hash": revision}}},
        },
        "status": {"replicas": replicas, "readyReplicas": replicas},
    }


def test_status_lists_each_revision_with_its_pods_until_the_old_ones_are_gone(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("revs", copy.deepcopy(GPU_SPEC)))
    deployment = wait_for(lambda: get(cluster, "Deployment", "revs"), what="the Deployment")
    current = deployment["spec"]["template"]["metadata"]["annotations"]["tidegate.dev/spec-hash"]
    # A rollout half way: one pod of an older template still serves beside the new one.
    cluster.create(replica_set("revs", "unified", "0ldrevision0000", 1, "2026-11-01T00:00:00Z"))
    cluster.create(replica_set("revs", "unified", current, 1, "2026-11-02T00:00:00Z"))
    roll_out(cluster, "revs", replicas=2, updated=1, available=2)
    wanted = [
        {"role": "unified", "revision": current, "replicas": 1, "ready": 1, "current": True},
        {
            "role": "unified",
            "revision": "0ldrevision0000",
            "replicas": 1,
            "ready": 1,
            "current": False,
        },
    ]
    wait_for(lambda: status(cluster, "revs").get("revisions") == wanted, what="two revisions")
    assert status(cluster, "revs")["phase"] == "Progressing"
    # The old pod goes: only the current revision is left, and the resource is Ready.
    cluster.patch("apps/v1", "ReplicaSet", "revs-0ldrevisio", {"spec": {"replicas": 0}})
    cluster.patch(
        "apps/v1",
        "ReplicaSet",
        "revs-0ldrevisio",
        {"status": {"replicas": 0, "readyReplicas": 0}},
        subresource="status",
    )
    roll_out(cluster, "revs", replicas=1, updated=1, available=1)
    wait_for(lambda: status(cluster, "revs").get("revisions") == wanted[:1], what="one revision")
    wait_for(lambda: status(cluster, "revs").get("phase") == "Ready", what="Ready")


def test_spec_changes_patch_only_the_objects_they_concern(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("edit", copy.deepcopy(GPU_SPEC)))
    wait_for(lambda: status(cluster, "edit").get("phase"), what="first status")
    roll_out(cluster, "edit", replicas=1, updated=1, available=1)
    wait_for(lambda: status(cluster, "edit").get("phase") == "Ready", what="Ready")
    hash_before = get(cluster, "Deployment", "edit")["spec"]["template"]["metadata"][  # type: ignore[index]
        "annotations"
    ]["tidegate.dev/spec-hash"]
    threshold_before = config_of(cluster, "edit", "unified")["long-prefill-token-threshold"]

    # Replicas: only the Deployment changes, and its pods do not roll.
    mark = settle(cluster)
    edit_spec(cluster, "edit", GPU_SPEC | {"topology": {"unified": {"replicas": 3}}})
    wait_for(lambda: get(cluster, "Deployment", "edit")["spec"]["replicas"] == 3, what="replicas")
    settle(cluster)
    writes = cluster.writes(since=mark)
    assert [w for w in writes if "/status" not in w] == [
        "PATCH /apis/apps/v1/namespaces/default/deployments/edit"
    ]
    deployment = get(cluster, "Deployment", "edit")
    assert (
        deployment["spec"]["template"]["metadata"]["annotations"][  # type: ignore[index]
            "tidegate.dev/spec-hash"
        ]
        == hash_before
    )
    assert status(cluster, "edit")["phase"] == "Progressing"  # 1 of 3 pods so far

    # A tighter ITL SLO: smaller chunks in the ConfigMap, and the pods roll to read them.
    mark = settle(cluster)
    spec = copy.deepcopy(GPU_SPEC) | {"topology": {"unified": {"replicas": 3}}}
    spec["scheduling"] = {"slo": {"ttftMs": 800, "itlMs": 25}}
    edit_spec(cluster, "edit", spec)
    wait_for(
        lambda: (
            config_of(cluster, "edit", "unified")["long-prefill-token-threshold"] < threshold_before
        ),
        what="a smaller chunk threshold",
    )
    settle(cluster)
    writes = [w for w in cluster.writes(since=mark) if "/status" not in w]
    assert sorted(writes) == [
        "PATCH /api/v1/namespaces/default/configmaps/edit-config",
        "PATCH /apis/apps/v1/namespaces/default/deployments/edit",
    ]
    deployment = get(cluster, "Deployment", "edit")
    assert (
        deployment["spec"]["template"]["metadata"]["annotations"][  # type: ignore[index]
            "tidegate.dev/spec-hash"
        ]
        != hash_before
    )
    reasons = status(cluster, "edit")["effective"]["reasons"]
    assert any("longPrefillTokenThreshold" in r for r in reasons)

    # A new image: only the Deployment.
    mark = settle(cluster)
    edit_spec(cluster, "edit", spec | {"image": "tidegate/engine:2"})
    wait_for(
        lambda: (
            get(cluster, "Deployment", "edit")["spec"]["template"]["spec"]["containers"][0]["image"]
            == "tidegate/engine:2"
        ),
        what="the new image",
    )
    settle(cluster)
    writes = [w for w in cluster.writes(since=mark) if "/status" not in w]
    assert writes == ["PATCH /apis/apps/v1/namespaces/default/deployments/edit"]
    assert status(cluster, "edit")["observedGeneration"] == 4


def test_rollout_with_old_pods_still_serving_is_not_ready(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("roll", tiny_spec(topology={"unified": {"replicas": 2}})))
    wait_for(lambda: get(cluster, "Deployment", "roll"), what="the Deployment")
    roll_out(cluster, "roll", replicas=2, updated=2, available=2)
    wait_for(lambda: status(cluster, "roll").get("phase") == "Ready", what="Ready")

    # A new image; the controller has started one new pod, both old ones still serve.
    edit_spec(cluster, "roll", tiny_spec(topology={"unified": {"replicas": 2}}, image="x:2"))
    wait_for(
        lambda: (
            get(cluster, "Deployment", "roll")["spec"]["template"]["spec"]["containers"][0]["image"]
            == "x:2"
        ),
        what="the new image",
    )
    roll_out(cluster, "roll", replicas=3, updated=1, available=2)
    wait_for(lambda: "old pod" in conditions(cluster, "roll")["Ready"]["message"], what="message")
    ready = conditions(cluster, "roll")["Ready"]
    assert ready["status"] == "False"
    assert "0 of 2 pods run the current spec, 2 old pods still serving" in ready["message"]
    assert conditions(cluster, "roll")["Progressing"]["status"] == "True"
    assert status(cluster, "roll")["phase"] == "Progressing"

    # The new pod is up; one old pod is left: still not Ready.
    roll_out(cluster, "roll", replicas=3, updated=2, available=3)
    wait_for(
        lambda: "1 old pod still" in conditions(cluster, "roll")["Ready"]["message"],
        what="one old pod left",
    )
    assert conditions(cluster, "roll")["Ready"]["status"] == "False"

    roll_out(cluster, "roll", replicas=2, updated=2, available=2)
    wait_for(lambda: status(cluster, "roll").get("phase") == "Ready", what="Ready again")
    assert status(cluster, "roll")["ready"] == "2/2"


def test_a_stuck_rollout_is_degraded(cluster: EmulatedCluster, operator: KopfRunner) -> None:
    cluster.create(llmd("stuck", tiny_spec()))
    wait_for(lambda: get(cluster, "Deployment", "stuck"), what="the Deployment")
    cluster.patch(
        "apps/v1",
        "Deployment",
        "stuck",
        {
            "status": {
                "replicas": 1,
                "updatedReplicas": 1,
                "availableReplicas": 0,
                "conditions": [
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": 'ReplicaSet "stuck-5d4" has timed out progressing.',
                    }
                ],
            }
        },
        subresource="status",
    )
    wait_for(lambda: status(cluster, "stuck").get("phase") == "Degraded", what="Degraded")
    degraded = conditions(cluster, "stuck")["Degraded"]
    assert degraded["reason"] == "RolloutStuck"
    assert "timed out progressing" in degraded["message"]


def test_a_spec_the_operator_refuses_is_reported_and_keeps_what_runs(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("bad", copy.deepcopy(GPU_SPEC)))
    wait_for(lambda: get(cluster, "Deployment", "bad"), what="the Deployment")
    settle(cluster)
    before = get(cluster, "Deployment", "bad")

    # More tensor parallelism than the pod has accelerators (the CRD cannot see this).
    mark = settle(cluster)
    edit_spec(cluster, "bad", GPU_SPEC | {"parallelism": {"tensorParallelSize": 4}})
    wait_for(lambda: status(cluster, "bad").get("phase") == "Degraded", what="Degraded")
    degraded = conditions(cluster, "bad")["Degraded"]
    assert degraded["reason"] == "TuningRefused"
    assert "accelerator" in degraded["message"]
    assert conditions(cluster, "bad")["Ready"]["status"] == "False"
    settle(cluster)
    assert get(cluster, "Deployment", "bad") == before  # the running pods are left alone
    assert [w for w in cluster.writes(since=mark) if "/status" not in w] == []

    # A spec that even the schema would refuse, had it been checked (the emulator does not).
    edit_spec(cluster, "bad", GPU_SPEC | {"topology": {"mode": "disaggregated"}})
    wait_for(
        lambda: conditions(cluster, "bad")["Degraded"]["reason"] == "InvalidSpec",
        what="InvalidSpec",
    )
    assert "prefill and decode are required" in conditions(cluster, "bad")["Degraded"]["message"]

    # Fixing the spec recovers.
    edit_spec(cluster, "bad", copy.deepcopy(GPU_SPEC))
    wait_for(lambda: conditions(cluster, "bad")["Degraded"]["status"] == "False", what="fixed")


def test_edits_to_owned_fields_are_undone_and_others_kept(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("drift", tiny_spec()))
    wait_for(lambda: get(cluster, "Deployment", "drift"), what="the Deployment")
    settle(cluster)
    # Someone scales by hand and adds their own annotation.
    cluster.patch(
        "apps/v1",
        "Deployment",
        "drift",
        {"metadata": {"annotations": {"team.example.com/owner": "ml"}}, "spec": {"replicas": 5}},
    )
    wait_for(
        lambda: get(cluster, "Deployment", "drift")["spec"]["replicas"] == 1,
        what="replicas restored",
    )
    annotations = get(cluster, "Deployment", "drift")["metadata"]["annotations"]  # type: ignore[index]
    assert annotations["team.example.com/owner"] == "ml"

    # Someone deletes a child: it comes back.
    cluster.delete("v1", "Service", "drift")
    wait_for(lambda: get(cluster, "Service", "drift"), what="the Service back")


def test_switching_mode_removes_what_the_other_mode_wanted(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("switch", tiny_spec()))
    wait_for(lambda: get(cluster, "Deployment", "switch"), what="the unified Deployment")
    edit_spec(
        cluster,
        "switch",
        tiny_spec(topology={"mode": "disaggregated", "prefill": {}, "decode": {}}),
    )
    wait_for(lambda: get(cluster, "Deployment", "switch-decode"), what="the decode pool")
    wait_for(lambda: get(cluster, "Deployment", "switch") is None, what="unified pool removed")
    wait_for(lambda: get(cluster, "PodDisruptionBudget", "switch") is None, what="its PDB removed")
    public = get(cluster, "Service", "switch")
    assert public is not None
    assert public["spec"]["selector"][COMPONENT_LABEL] == "router"
    assert wait_for(lambda: get(cluster, "NetworkPolicy", "switch-kv"), what="the KV policy")

    # And back: the split pools, their Services, PDBs and the KV policy go.
    edit_spec(cluster, "switch", tiny_spec())
    wait_for(lambda: get(cluster, "NetworkPolicy", "switch-kv") is None, what="KV policy removed")
    for kind, name in [
        ("Deployment", "switch-prefill"),
        ("Deployment", "switch-decode"),
        ("Deployment", "switch-router"),
        ("Service", "switch-prefill"),
        ("PodDisruptionBudget", "switch-router"),
    ]:
        wait_for(lambda kind=kind, name=name: get(cluster, kind, name) is None, what=name)
    wait_for(lambda: get(cluster, "Deployment", "switch"), what="the unified pool back")
    wait_for(
        lambda: get(cluster, "Service", "switch")["spec"]["selector"][COMPONENT_LABEL] == "unified",
        what="the public Service on the unified pool",
    )


def test_the_driver_objects_follow_the_policy_and_the_driver(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    policy = {"minReplicas": 1, "maxReplicas": 3}
    cluster.create(llmd("driven", tiny_spec(autoscaling={"driver": "hpa", "unified": policy})))
    hpa = wait_for(lambda: get(cluster, "HorizontalPodAutoscaler", "driven"), what="the HPA")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "driven"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "uid-driven"

    # KEDA, and a pool that may reach zero: a ScaledObject, and a router in front.
    keda = {
        "driver": "keda",
        "prometheus": {"serverAddress": "http://prometheus.monitoring.svc:9090"},
        "unified": {**policy, "minReplicas": 0},
    }
    edit_spec(cluster, "driven", tiny_spec(autoscaling=keda))
    scaled = wait_for(lambda: get(cluster, "ScaledObject", "driven"), what="the ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0
    wait_for(lambda: get(cluster, "HorizontalPodAutoscaler", "driven") is None, what="HPA gone")
    wait_for(lambda: get(cluster, "Deployment", "driven-router"), what="the router")
    wait_for(
        lambda: get(cluster, "Service", "driven")["spec"]["selector"][COMPONENT_LABEL] == "router",
        what="the public Service on the router",
    )
    assert get(cluster, "Service", "driven-unified")["spec"]["clusterIP"] == "None"

    # No policy: the pool is served directly again, and nothing scales it.
    edit_spec(cluster, "driven", tiny_spec())
    wait_for(lambda: get(cluster, "ScaledObject", "driven") is None, what="ScaledObject gone")
    wait_for(lambda: get(cluster, "Deployment", "driven-router") is None, what="router gone")
    wait_for(
        lambda: get(cluster, "Service", "driven")["spec"]["selector"][COMPONENT_LABEL] == "unified",
        what="the public Service on the unified pool",
    )


def test_deleting_the_resource_leaves_children_to_the_garbage_collector(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    cluster.create(llmd("gone", tiny_spec(), uid="uid-gone"))
    wait_for(lambda: get(cluster, "PodDisruptionBudget", "gone"), what="children")
    settle(cluster)
    cluster.delete(LLMD, "LLMDeployment", "gone")
    wait_for(lambda: get(cluster, "LLMDeployment", "gone") is None, what="deletion")
    # No finalizer held the resource, and every child names it as controller owner.
    for kind, name in [
        ("ConfigMap", "gone-config"),
        ("Deployment", "gone"),
        ("Service", "gone"),
        ("PodDisruptionBudget", "gone"),
    ]:
        child = get(cluster, kind, name)
        assert child is not None
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-gone"


def test_a_second_reconcile_of_an_unchanged_resource_writes_nothing(
    tmp_path: Path,
) -> None:
    log = KOPF_LOG
    with EmulatedCluster(tmp_path) as cluster:
        with run_operator(cluster) as runner:
            cluster.create(llmd("same", copy.deepcopy(GPU_SPEC)))
            cluster.create(
                llmd(
                    "same-pd",
                    tiny_spec(topology={"mode": "disaggregated", "prefill": {}, "decode": {}}),
                )
            )
            # With an InferencePool, its picker's Service and a router of two replicas.
            gateway = {"inferencePool": True, "failureMode": "FailOpen"}
            topology = {"router": {"replicas": 2}}
            cluster.create(llmd("same-gw", tiny_spec(topology=topology, gateway=gateway)))
            wait_for(lambda: get(cluster, "NetworkPolicy", "same-pd-kv"), what="children")
            wait_for(lambda: get(cluster, "InferencePool", "same-gw"), what="the InferencePool")
            roll_out(cluster, "same", replicas=1, updated=1, available=1)
            wait_for(lambda: status(cluster, "same").get("phase") == "Ready", what="Ready")
            settle(cluster)
            # A child event makes the operator reconcile the owner again: nothing to write.
            mark = cluster.request_count()
            runs = log.count("Handler 'child-deployment' succeeded")
            roll_out(cluster, "same", replicas=1, updated=1, available=1)
            wait_for(
                lambda: log.count("Handler 'child-deployment' succeeded") > runs,
                what="a reconcile after the child event",
            )
            settle(cluster)
            assert cluster.writes(since=mark) == []
        assert runner.exception is None

        # A restarted operator resumes every resource: reads, and writes nothing.
        mark = cluster.request_count()
        resumed = log.count("reconcile_resource' succeeded")
        with run_operator(cluster) as runner:
            # Every resource resumed: each read its children and wrote nothing.
            wait_for(
                lambda: log.count("reconcile_resource' succeeded") >= resumed + 3,
                what="every resource to be resumed",
            )
            settle(cluster)
        assert runner.exception is None
        assert cluster.writes(since=mark) == []
