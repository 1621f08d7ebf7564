"""The operator's autoscaler end to end: kopf and the real loop against kmock's emulator.

The emulator has no ReplicaSet controller and no kubelet: tests play them by creating and
deleting Pod objects. Each pod points at a small HTTP server on 127.0.0.1 (its podIP, and
its `http` container port) that serves the Prometheus text the test sets, so the scrape
runs the production path. The loop decides every 0.2 s, and the policies have windows of
a second or none, so that each story takes seconds.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import EmulatedCluster, run_operator, wait_for
from tests.operator.test_operator_e2e import (
    NS,
    conditions,
    edit_spec,
    get,
    llmd,
    settle,
    status,
    tiny_spec,
)
from tidegate.common.local_server import free_port
from tidegate.operator.cluster_scaler import DELETION_COST
from tidegate.operator.handlers import OperatorOptions
from tidegate.operator.kube import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER, object_path
from tidegate.operator.labels import selector_labels
from tidegate.operator.pool_metrics import parse_exposition

PERIOD_S = 0.2
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"


class Exposition:
    """A `/metrics` on 127.0.0.1 that serves whatever `text` holds."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = page.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def operator_options() -> OperatorOptions:
    return OperatorOptions(autoscale_period_s=PERIOD_S, metrics_port=METRICS_PORT)


def engine(running: int, waiting: int = 0) -> str:
    return (
        "# TYPE tidegate:num_requests_running gauge\n"
        f'tidegate:num_requests_running{{engine="0"}} {running}\n'
        "# TYPE tidegate:num_requests_waiting gauge\n"
        f'tidegate:num_requests_waiting{{engine="0"}} {waiting}\n'
    )


@pytest.fixture
def expositions() -> Iterator[list[Exposition]]:
    made: list[Exposition] = []
    yield made
    for page in made:
        page.close()


def serve(expositions: list[Exposition], text: str) -> Exposition:
    page = Exposition(text)
    expositions.append(page)
    return page


def add_pod(
    cluster: EmulatedCluster,
    name: str,
    owner: str,
    role: str,
    page: Exposition,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> None:
    """Play the ReplicaSet and the kubelet: a ready pod of `owner`'s `role` pool, 30 s after
    its creation, serving `page` (with more `labels` and `annotations`, as a canary's)."""
    created = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=30)
    ready = created + datetime.timedelta(seconds=25)
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": selector_labels(owner, role) | (labels or {}),
                "annotations": annotations or {},
                "creationTimestamp": created.strftime(stamp),
            },
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": "tidegate/engine-cpu:1",
                        "ports": [{"name": "http", "containerPort": page.port}],
                    }
                ]
            },
            "status": {
                "podIP": "127.0.0.1",
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "lastTransitionTime": ready.strftime(stamp),
                    }
                ],
            },
        }
    )


METRICS_PORT = free_port()


def replicas(cluster: EmulatedCluster, name: str) -> int:
    return get(cluster, "Deployment", name)["spec"]["replicas"]  # type: ignore[index]


def autoscaling(cluster: EmulatedCluster, name: str, role: str = "unified") -> dict[str, Any]:
    return status(cluster, name).get("autoscaling", {}).get(role) or {}


def events(cluster: EmulatedCluster, name: str) -> list[dict[str, Any]]:
    listed = cluster.http.get(object_path("v1", "Event", NS)).json()  # type: ignore[union-attr]
    return [e for e in listed["items"] if e["involvedObject"]["name"] == name]


def pod_annotations(cluster: EmulatedCluster, name: str) -> dict[str, str]:
    return get(cluster, "Pod", name)["metadata"].get("annotations") or {}  # type: ignore[index]


def test_load_grows_the_pool_and_a_reconcile_keeps_the_autoscalers_replicas(
    cluster: EmulatedCluster, operator: KopfRunner, expositions: list[Exposition]
) -> None:
    policy = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "scaleDown": {"stabilizationWindowSeconds": 0, "periodSeconds": 1},
    }
    spec = tiny_spec(scheduling={"maxNumSeqs": 4}, autoscaling={"unified": policy})
    cluster.create(llmd("grow", spec))
    wait_for(lambda: get(cluster, "Deployment", "grow"), what="the Deployment")
    assert replicas(cluster, "grow") == 1
    busy = serve(expositions, engine(8, 4))
    mark = cluster.request_count()
    add_pod(cluster, "grow-a", "grow", "unified", busy)

    # 12 requests / 4 per replica: 3 replicas, set under the autoscaler's field manager.
    wait_for(lambda: replicas(cluster, "grow") == 3, what="3 replicas")
    (scale,) = [
        r
        for r in cluster.requests("PATCH", f"{DEPLOYMENTS}/grow", since=mark)
        if r.params.get("fieldManager") == AUTOSCALER_FIELD_MANAGER
    ]
    assert r"application/apply-patch+yaml" in scale.headers["Content-Type"]
    assert scale.data == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "grow", "namespace": NS},
        "spec": {"replicas": 3},
    }
    wait_for(lambda: autoscaling(cluster, "grow").get("desired") == 3, what="status")
    entry = autoscaling(cluster, "grow")
    assert entry["current"] == 1
    assert entry["reason"].startswith("1 -> 3: 12 requests / 4 per replica needs 3")
    assert entry["startTimeSeconds"] == 25
    assert entry["lastScaleTime"].endswith("Z")
    (event,) = wait_for(lambda: events(cluster, "grow"), what="an Event")
    assert event["reason"] == "Scaled" and event["type"] == "Normal"
    assert event["message"] == f"unified: {entry['reason']}"
    # The reconcile that the Deployment's change starts reads the autoscaler's replicas.
    wait_for(
        lambda: status(cluster, "grow")["replicas"]["unified"]["desired"] == 3,
        what="status.replicas from the live Deployment",
    )
    metrics = parse_exposition(httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics").text)
    (gauge,) = [s for s in metrics if s.name == "tidegate:autoscaler_desired_replicas"]
    assert gauge.labels == {"namespace": NS, "llmdeployment": "grow", "role": "unified"}
    assert gauge.value == 3

    # A steady load: the loop writes nothing more. A new image: the reconcile applies the
    # Deployment without replicas, and the autoscaler's stay.
    for name in ("grow-b", "grow-c"):
        add_pod(cluster, name, "grow", "unified", busy)
    busy.text = engine(4, 0)  # 12 requests over 3 pods
    mark = settle(cluster)
    edit_spec(cluster, "grow", spec | {"image": "tidegate/engine-cpu:2"})
    wait_for(
        lambda: cluster.requests("PATCH", f"{DEPLOYMENTS}/grow", since=mark),
        what="the reconcile's apply",
    )
    settle(cluster)
    (apply,) = cluster.requests("PATCH", f"{DEPLOYMENTS}/grow", since=mark)
    assert apply.params["fieldManager"] == FIELD_MANAGER
    assert "replicas" not in apply.data["spec"]
    assert replicas(cluster, "grow") == 3
    assert len(events(cluster, "grow")) == 1


def test_a_scale_down_first_prices_the_pods_so_the_idlest_goes(
    cluster: EmulatedCluster, operator: KopfRunner, expositions: list[Exposition]
) -> None:
    policy = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "scaleDown": {"stabilizationWindowSeconds": 0, "periodSeconds": 1},
    }
    spec = tiny_spec(
        topology={"unified": {"replicas": 3}},
        scheduling={"maxNumSeqs": 4},
        autoscaling={"unified": policy},
    )
    # The pods are there first, with 12 requests: the pool holds at 3.
    loads = {"shrink-a": 4, "shrink-b": 4, "shrink-c": 4}
    pages = {name: serve(expositions, engine(n)) for name, n in loads.items()}
    for name, page in pages.items():
        add_pod(cluster, name, "shrink", "unified", page)
    cluster.create(llmd("shrink", spec))
    wait_for(lambda: autoscaling(cluster, "shrink").get("desired") == 3, what="a first decision")
    assert all(DELETION_COST not in pod_annotations(cluster, name) for name in loads)

    # 5 requests left: 2 replicas, the idlest pod priced lowest before the Deployment shrinks.
    mark = cluster.request_count()
    for name, running in {"shrink-a": 3, "shrink-b": 0, "shrink-c": 2}.items():
        pages[name].text = engine(running)
    wait_for(lambda: replicas(cluster, "shrink") == 2, what="2 replicas")
    costs = {name: pod_annotations(cluster, name)[DELETION_COST] for name in loads}
    assert costs == {"shrink-a": "3", "shrink-b": "0", "shrink-c": "2"}
    pods = "/api/v1/namespaces/default/pods"
    scaled = cluster.requests("PATCH", f"{DEPLOYMENTS}/shrink", since=mark)[0]
    priced = [cluster.requests("PATCH", f"{pods}/{name}", since=mark)[0] for name in loads]
    assert all(p.id < scaled.id for p in priced)
    wait_for(
        lambda: autoscaling(cluster, "shrink")["reason"].startswith("3 -> 2: 5 requests"),
        what="the reason in status",
    )


def test_an_idle_pool_goes_to_zero_and_held_requests_wake_it(
    cluster: EmulatedCluster, operator: KopfRunner, expositions: list[Exposition]
) -> None:
    policy = {"minReplicas": 0, "maxReplicas": 2, "idleBeforeZeroSeconds": 1}
    cluster.create(llmd("nap", tiny_spec(autoscaling={"unified": policy})))
    wait_for(lambda: get(cluster, "Deployment", "nap-router"), what="the router in front")
    router = serve(expositions, 'tidegate:router_pending_requests{pool="unified"} 0\n')
    add_pod(cluster, "nap-router-a", "nap", "router", router)
    add_pod(cluster, "nap-a", "nap", "unified", serve(expositions, engine(0)))

    wait_for(lambda: replicas(cluster, "nap") == 0, timeout=10, what="zero after idle")
    wait_for(
        lambda: autoscaling(cluster, "nap")["reason"].startswith("1 -> 0: no request for"),
        what="the reason in status",
    )
    cluster.delete("v1", "Pod", "nap-a")  # the ReplicaSet's part

    # A request arrives at the router, which holds it: the pool wakes at once.
    router.text = 'tidegate:router_pending_requests{pool="unified"} 2\n'
    wait_for(lambda: replicas(cluster, "nap") == 1, what="woken")
    wait_for(
        lambda: autoscaling(cluster, "nap")["reason"].startswith("0 -> 1: wake from zero"),
        what="the reason in status",
    )
    reasons = [e["message"] for e in events(cluster, "nap")]
    assert [r.split(":")[1].strip() for r in reasons] == ["1 -> 0", "0 -> 1"]


def test_a_refused_policy_is_degraded_and_nothing_scales(
    cluster: EmulatedCluster, operator: KopfRunner
) -> None:
    # minReplicas above maxReplicas (CEL refuses it; the emulator does not run CEL).
    policy = {"minReplicas": 3, "maxReplicas": 2}
    cluster.create(llmd("refused", tiny_spec(autoscaling={"unified": policy})))
    wait_for(lambda: status(cluster, "refused").get("phase") == "Degraded", what="Degraded")
    degraded = conditions(cluster, "refused")["Degraded"]
    assert degraded["reason"] == "InvalidSpec"
    assert "minReplicas" in degraded["message"]
    settle(cluster)
    assert get(cluster, "Deployment", "refused") is None
    assert "autoscaling" not in status(cluster, "refused")


def test_a_restarted_operator_resumes_from_status(tmp_path: Path) -> None:
    """The scale-down window's recommendations are in status: a new operator holds the pool
    instead of shrinking it at once."""
    policy = {"minReplicas": 1, "maxReplicas": 3, "scaleDown": {"stabilizationWindowSeconds": 30}}
    spec = tiny_spec(scheduling={"maxNumSeqs": 4}, autoscaling={"unified": policy})
    with EmulatedCluster(tmp_path) as cluster:
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        options = OperatorOptions(autoscale_period_s=PERIOD_S)
        page = Exposition(engine(8, 4))
        try:
            with run_operator(cluster, options) as runner:
                cluster.create(llmd("resume", spec))
                wait_for(lambda: get(cluster, "Deployment", "resume"), what="the Deployment")
                add_pod(cluster, "resume-a", "resume", "unified", page)
                wait_for(lambda: replicas(cluster, "resume") == 3, what="3 replicas")
                for name in ("resume-b", "resume-c"):
                    add_pod(cluster, name, "resume", "unified", page)
                wait_for(
                    lambda: (
                        autoscaling(cluster, "resume").get("reason", "").startswith("stay at 3")
                    ),
                    what="the pool held at 3",
                )
            assert runner.exception is None
            page.text = engine(1)  # the load is gone while no operator runs

            with run_operator(cluster, options) as runner:
                wait_for(
                    lambda: "window holds 3" in autoscaling(cluster, "resume")["reason"],
                    what="the window holding the pool",
                )
                assert replicas(cluster, "resume") == 3
            assert runner.exception is None
        finally:
            page.close()
