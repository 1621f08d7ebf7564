"""A pool over several nodes end to end: kopf running the operator against kmock's emulator.

A spec whose replicas span nodes becomes a LeaderWorkerSet instead of a Deployment, its status
follows the LeaderWorkerSet's, and a spec that fits one node again becomes a Deployment. The
emulator has no LWS controller: the tests play it by writing the LeaderWorkerSet's status. On
a cluster without LWS's CRD the rest is applied and the condition says what to install.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kopf.testing import KopfRunner

from tests.operator.cluster import LEADER_WORKER_SETS, EmulatedCluster, run_operator, wait_for
from tests.operator.test_operator_e2e import (
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
from tidegate.operator.labels import COMPONENT_LABEL
from tidegate.operator.render import LWS_API_VERSION, WORKER_INDEX_LABEL

TWO_NODES = {"pipelineParallelSize": 2, "nodesPerReplica": 2}
NOT_INSTALLED = (
    "the LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1) is not installed; install "
    "LeaderWorkerSet (kubernetes-sigs/lws), which runs a replica over several nodes"
)


def group_status(
    cluster: EmulatedCluster, name: str, *, replicas: int, updated: int, ready: int
) -> None:
    """Play LWS's controller: its status counts groups (ready: all of a group's pods are)."""
    live = get(cluster, "LeaderWorkerSet", name)
    assert live is not None
    body = {
        "status": {
            "observedGeneration": live["metadata"].get("generation", 1),
            "replicas": replicas,
            "updatedReplicas": updated,
            "readyReplicas": ready,
        }
    }
    cluster.patch(LWS_API_VERSION, "LeaderWorkerSet", name, body, subresource="status")


def test_a_spec_over_two_nodes_is_a_group_set_until_it_fits_one_node(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    spec = tiny_spec(topology={"unified": {"replicas": 2}}, parallelism=TWO_NODES)
    cluster.create(llmd("mn", spec))
    lws = wait_for(lambda: get(cluster, "LeaderWorkerSet", "mn"), what="the LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (group["size"], group["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-mn"
    assert get(cluster, "Deployment", "mn") is None
    service = wait_for(lambda: get(cluster, "Service", "mn"), what="the Service")
    assert service["spec"]["selector"][WORKER_INDEX_LABEL] == "0"  # the leaders alone
    config = config_of(cluster, "mn", "unified")
    assert (config["pipeline-parallel-size"], config["nnodes"]) == (2, 2)

    # Not ready while no group is; the effective tuning says why two nodes.
    wait_for(lambda: status(cluster, "mn").get("phase") == "Progressing", what="Progressing")
    effective = status(cluster, "mn")["effective"]["roles"]["unified"]
    assert (effective["pipelineParallelSize"], effective["nodesPerReplica"]) == (2, 2)
    group_status(cluster, "mn", replicas=2, updated=2, ready=1)
    wait_for(
        lambda: (
            "1 of 2 groups of 2 pods run the current spec"
            in conditions(cluster, "mn")["Ready"]["message"]
        ),
        what="one group of two ready",
    )
    group_status(cluster, "mn", replicas=2, updated=2, ready=2)
    wait_for(lambda: status(cluster, "mn").get("phase") == "Ready", what="Ready")
    assert status(cluster, "mn")["ready"] == "2/2"
    revisions = status(cluster, "mn")["revisions"]
    hash_key = "tidegate.dev/spec-hash"
    current = group["leaderTemplate"]["metadata"]["annotations"][hash_key]
    assert revisions == [
        {"role": "unified", "revision": current, "replicas": 2, "ready": 2, "current": True}
    ]

    # Someone edits the group size: the operator puts it back.
    edited = {"spec": {"leaderWorkerTemplate": {"size": 3}}}
    cluster.patch(LWS_API_VERSION, "LeaderWorkerSet", "mn", edited)
    wait_for(
        lambda: get(cluster, "LeaderWorkerSet", "mn")["spec"]["leaderWorkerTemplate"]["size"] == 2,
        what="the size restored",
    )

    # One node again: a Deployment, the LeaderWorkerSet gone, the Service on every pod.
    edit_spec(cluster, "mn", tiny_spec(topology={"unified": {"replicas": 2}}))
    wait_for(lambda: get(cluster, "Deployment", "mn"), what="the Deployment")
    wait_for(lambda: get(cluster, "LeaderWorkerSet", "mn") is None, what="the LWS pruned")
    wait_for(
        lambda: WORKER_INDEX_LABEL not in get(cluster, "Service", "mn")["spec"]["selector"],
        what="the Service on every pod of the pool",
    )
    assert get(cluster, "Service", "mn")["spec"]["selector"][COMPONENT_LABEL] == "unified"
    assert "nnodes" not in config_of(cluster, "mn", "unified")
    roll_out(cluster, "mn", replicas=2, updated=2, available=2)
    wait_for(lambda: status(cluster, "mn").get("phase") == "Ready", what="Ready again")


def test_what_a_group_set_cannot_do_yet_is_refused_and_what_runs_stays(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    spec = tiny_spec(parallelism=TWO_NODES)
    cluster.create(llmd("mn-scaled", spec))
    wait_for(lambda: get(cluster, "LeaderWorkerSet", "mn-scaled"), what="the LeaderWorkerSet")
    before = copy.deepcopy(get(cluster, "LeaderWorkerSet", "mn-scaled"))
    mark = settle(cluster)

    scaled: dict[str, Any] = {**spec, "autoscaling": {"unified": {"maxReplicas": 3}}}
    edit_spec(cluster, "mn-scaled", scaled)
    wait_for(lambda: status(cluster, "mn-scaled").get("phase") == "Degraded", what="Degraded")
    degraded = conditions(cluster, "mn-scaled")["Degraded"]
    assert degraded["reason"] == "TuningRefused"
    assert degraded["message"].startswith(
        "autoscaling.unified: the unified pool spans 2 nodes per replica (a LeaderWorkerSet), "
        "and autoscaling such a pool is not supported yet"
    )
    settle(cluster)
    assert [w for w in cluster.writes(since=mark) if "/status" not in w] == []
    assert get(cluster, "LeaderWorkerSet", "mn-scaled") == before


def test_without_the_crd_the_rest_is_applied_and_the_condition_says_what_to_install(
    tmp_path: Path,
) -> None:
    with EmulatedCluster(tmp_path, missing=frozenset({LEADER_WORKER_SETS})) as cluster:
        with run_operator(cluster) as runner:
            cluster.create(llmd("bare", tiny_spec(parallelism=TWO_NODES)))
            wait_for(
                lambda: conditions(cluster, "bare")["Degraded"]["status"] == "True",
                what="Degraded",
            )
            degraded = conditions(cluster, "bare")["Degraded"]
            assert (degraded["reason"], degraded["message"]) == ("CRDNotInstalled", NOT_INSTALLED)
            for kind, name in [
                ("ConfigMap", "bare-config"),
                ("Service", "bare"),
                ("PodDisruptionBudget", "bare"),
            ]:
                assert get(cluster, kind, name) is not None, (kind, name)

            # One node: nothing is missing.
            edit_spec(cluster, "bare", tiny_spec())
            wait_for(lambda: get(cluster, "Deployment", "bare"), what="the Deployment")
            wait_for(
                lambda: conditions(cluster, "bare")["Degraded"]["status"] == "False",
                what="no longer Degraded",
            )
            settle(cluster)
        assert runner.exception is None, runner.output[-3000:]
