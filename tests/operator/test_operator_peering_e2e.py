"""Two operators on one cluster (`tidegate operator --peering NAME`): kopf's peering lets the
one started first reconcile while the other stands by, and the other takes over when the first
stops or is killed, finishing what it left half done.

Each operator logs in with a token of its own (`EmulatedCluster.kubeconfig_for`), which tells
their requests apart. Their only writes that are not the reconcile's are kopf's keep-alives in
the peering object.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kopf.testing import KopfRunner

from tests.operator.cluster import EmulatedCluster, wait_for
from tidegate.operator.handlers import OperatorOptions, build_registry
from tidegate.operator.kube import object_path
from tidegate.operator.reconcile import is_subset
from tidegate.operator.render import render
from tidegate.operator.spec import API_VERSION, KIND

PEERING = "tidegate"
PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"
# A killed operator's successor waits this long for its keep-alive to lapse.
LIFETIME_S = 3
OPTIONS = OperatorOptions(peering=PEERING, peering_lifetime_s=LIFETIME_S)
NS = "default"
SPEC = {
    "model": {"name": "tiny", "source": {"pvc": {"claimName": "models", "path": "tiny"}}},
    "image": "tidegate/engine-cpu:1",
}
# Subprocess start-up (imports) on a busy machine, and a takeover after a lapsed keep-alive.
START_S = 90.0


def test_one_of_two_operators_reconciles_and_the_other_takes_over_when_it_stops(
    tmp_path: Path,
) -> None:
    with EmulatedCluster(tmp_path) as cluster, contextlib.ExitStack() as stack:
        _create_peering(cluster)
        with _operator(cluster, "first"):
            cluster.create(_llmd("one"))
            wait_for(lambda: _complete(cluster, "one"), START_S, "one, by the first operator")
            stack.enter_context(_operator(cluster, "second"))
            wait_for(lambda: len(_peers(cluster)) == 2, START_S, "both operators in the peering")
            cluster.create(_llmd("two"))
            wait_for(lambda: _complete(cluster, "two"), START_S, "two")
            _settle(cluster)
            assert _reconciling_writes(cluster, "second") == []
            created = [w for w in _reconciling_writes(cluster, "first") if w.startswith("POST")]
            assert sorted(created) == sorted(_creates("one") + _creates("two"))

        # The first has stopped, and its keep-alive said so: the second resumes both resources,
        # finds them as they should be, and serves the next change.
        stopped = cluster.request_count()
        assert len(_peers(cluster)) == 1
        cluster.patch(API_VERSION, KIND, "two", {"metadata": {"generation": 2}, "spec": _image(2)})
        wait_for(
            lambda: _deployment_image(cluster, "two") == "tidegate/engine-cpu:2",
            START_S,
            "the new image, applied by the second operator",
        )
        _settle(cluster)
        assert _reconciling_writes(cluster, "first", since=stopped) == []
        children = [
            w
            for w in _reconciling_writes(cluster, "second", since=stopped)
            if "/llmdeployments/" not in w
        ]
        assert children == [f"PATCH {object_path('apps/v1', 'Deployment', NS, 'two')}"]


def test_a_killed_operators_half_done_reconcile_is_finished_by_its_successor(
    tmp_path: Path,
) -> None:
    with EmulatedCluster(tmp_path) as cluster, contextlib.ExitStack() as stack:
        _create_peering(cluster)
        first = stack.enter_context(_operator_process(cluster, "first", tmp_path / "first.log"))
        wait_for(lambda: len(_peers(cluster)) == 1, START_S, "the first operator's keep-alive")
        stack.enter_context(_operator(cluster, "second"))
        wait_for(lambda: len(_peers(cluster)) == 2, START_S, "both operators in the peering")

        # The first creates the ConfigMap, then its create of the Deployment hangs: it is
        # killed there, with the Service and the PodDisruptionBudget not made yet.
        held = cluster.faults.hold("POST", rf"/namespaces/{NS}/deployments$", token="first")
        cluster.create(_llmd("half"))
        assert held.reached.wait(START_S), (tmp_path / "first.log").read_text()[-3000:]
        assert cluster.get("v1", "ConfigMap", "half-config") is not None
        assert cluster.get("v1", "Service", "half") is None
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        held.release()  # answered 503: the request never reached storage

        # The second takes over once the first's keep-alive lapses, and makes the rest.
        wait_for(lambda: _complete(cluster, "half"), START_S, "the rest, by the second operator")
        _settle(cluster)
        by_first = _reconciling_writes(cluster, "first")
        by_second = _reconciling_writes(cluster, "second")
        assert by_first == [
            f"POST {object_path('v1', 'ConfigMap', NS)}",
            f"POST {object_path('apps/v1', 'Deployment', NS)}",  # held, then refused
        ]
        created = [w for w in by_second if w.startswith("POST ")]
        assert sorted(created) == sorted(_creates("half")[1:])  # all but the ConfigMap
        # Nothing twice: each child once, with the one owner; the ConfigMap kept as made.
        for obj in render(_llmd("half")).objects:
            live = cluster.get(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
            assert live["metadata"]["ownerReferences"] == obj["metadata"]["ownerReferences"]
        assert not [w for w in by_second if w.startswith("PATCH") and "/configmaps/" in w]


def _llmd(name: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": dict(SPEC)}


def _creates(name: str) -> list[str]:
    """The creates of a resource's children, in the order the reconcile makes them."""
    return [
        f"POST {object_path(o['apiVersion'], o['kind'], NS)}" for o in render(_llmd(name)).objects
    ]


def _image(tag: int) -> dict[str, Any]:
    return {**SPEC, "image": f"tidegate/engine-cpu:{tag}"}


def _create_peering(cluster: EmulatedCluster) -> None:
    """The ClusterKopfPeering the operators share (the chart makes it)."""
    body = {
        "apiVersion": "kopf.dev/v1",
        "kind": "ClusterKopfPeering",
        "metadata": {"name": PEERING},
    }
    response = cluster.http.post(PEERINGS, json=body)  # type: ignore[union-attr]
    assert response.is_success, response.text


def _peers(cluster: EmulatedCluster) -> dict[str, Any]:
    """The live operators' keep-alives: kopf's identity -> priority, lifetime, last seen."""
    response = cluster.http.get(f"{PEERINGS}/{PEERING}")  # type: ignore[union-attr]
    return {k: v for k, v in (response.json().get("status") or {}).items() if v["lifetime"] > 0}


@contextlib.contextmanager
def _operator(cluster: EmulatedCluster, token: str) -> Iterator[KopfRunner]:
    """An operator in a thread, peering, logged in with `token`; it is running (its keep-alive
    is in the peering) when this returns."""
    before = set(_peers(cluster))
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig_for(token))
    runner = KopfRunner(
        ["run", "--peering", PEERING, "--all-namespaces"],
        registry=build_registry(OPTIONS),
        timeout=60,
    )
    with runner:
        wait_for(lambda: set(_peers(cluster)) - before, START_S, f"the {token} keep-alive")
        yield runner
    assert runner.exception is None, runner.output[-3000:]


@contextlib.contextmanager
def _operator_process(
    cluster: EmulatedCluster, token: str, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`tidegate operator --peering` as a process, which a test can kill."""
    command = [sys.executable, "-m", "tidegate.cli", "operator", "--peering", PEERING]
    command += ["--peering-lifetime", str(LIFETIME_S), "--liveness", "", "--metrics-port", "0"]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig_for(token))}
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def _complete(cluster: EmulatedCluster, name: str) -> bool:
    """Every child as `render` has it, and a status that reports the generation and no fault."""
    resource = cluster.get(API_VERSION, KIND, name) or {}
    for obj in render(_llmd(name) | {"spec": resource.get("spec", SPEC)}).objects:
        if not is_subset(obj, cluster.get(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])):
            return False
    status = resource.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
    return (
        status.get("observedGeneration") == resource["metadata"]["generation"]
        and conditions.get("Degraded") == "False"
    )


def _deployment_image(cluster: EmulatedCluster, name: str) -> str | None:
    deployment = cluster.get("apps/v1", "Deployment", name) or {}
    containers = (deployment.get("spec") or {}).get("template", {}).get("spec", {})
    return (containers.get("containers") or [{}])[0].get("image")


def _reconciling_writes(cluster: EmulatedCluster, token: str, since: int = 0) -> list[str]:
    """The writes of the operator logged in with `token`, but its peering keep-alives."""
    return [w for w in cluster.writes(since=since, token=token) if PEERINGS not in w]


def _settle(cluster: EmulatedCluster, quiet_s: float = 1.5) -> None:
    """Wait until neither operator has reconciled anything for `quiet_s`."""

    def quiet() -> bool:
        mark = cluster.request_count()
        time.sleep(quiet_s)  # an observation window
        return not [w for w in cluster.writes(since=mark) if PEERINGS not in w]

    wait_for(quiet, START_S, "the operators to be quiet")
