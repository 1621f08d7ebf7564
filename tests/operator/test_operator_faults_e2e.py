"""The operator against an API server that misbehaves (tests/operator/faults.py): refused,
conflicting, slow and cut off requests, and watch streams that are cut or expire.

Each row of FAULTS gets a namespace of its own, arms one fault there, makes one change (a new
resource, a new image, a hand edit of its Deployment) and checks that:

- the resource ends with the children `render` gives it and a status that reports no fault
  (Degraded False, the generation observed);
- the fault was met exactly as often as armed: the retries stop once it clears;
- the children got the writes the change needs plus one per refused attempt, no more; the
  resource itself (our status, kopf's bookkeeping) at most three per attempt; no other
  resource any;
- nothing is written once it has converged.

One operator serves every row, with retries from 0.25 s doubling to 2 s and calls that time
out after 1.5 s, so that a row takes seconds.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import EmulatedCluster, wait_for
from tests.operator.faults import Fault, Faults
from tidegate.operator.handlers import OperatorOptions
from tidegate.operator.kube import KINDS, object_path
from tidegate.operator.reconcile import is_subset
from tidegate.operator.render import render
from tidegate.operator.spec import API_VERSION, KIND

OPTIONS = OperatorOptions(retry_seconds=0.25, max_retry_seconds=2.0, api_timeout_s=1.5)
API_VERSION_OF = {kind: api_version for api_version, kind in KINDS}
SPEC = {
    "model": {"name": "tiny", "source": {"pvc": {"claimName": "models", "path": "tiny"}}},
    "image": "tidegate/engine-cpu:1",
}
CHILD_COLLECTIONS = r"(configmaps|services|deployments|poddisruptionbudgets)"
# A row converges within the longest retry delay of its faults and a few passes.
CONVERGED_S = 30.0


@dataclass(frozen=True)
class Row:
    """One fault: `arm` it in namespace `ns` (the resource is named after it too), make
    `change`, and expect it met `hits` times; the refused or repeated writes (each a
    `METHOD path`, `extra(ns)`) are the only child writes beyond what the change needs.

    A lasting fault (`clear_after_s`) is met as often as the retries come in that time:
    `hits` is then the most it may be met."""

    arm: Callable[[Faults, str], Fault]
    change: str  # "create", "image", "drift" (a hand edit) or "delete" (of the PDB)
    hits: int
    extra: Callable[[str], str] | None = None
    clear_after_s: float | None = None


def _post(kind: str) -> Callable[[str], str]:
    return lambda ns: f"POST {object_path(API_VERSION_OF[kind], kind, ns)}"


def _patch(kind: str) -> Callable[[str], str]:
    return lambda ns: f"PATCH {object_path(API_VERSION_OF[kind], kind, ns, ns)}"


FAULTS: dict[str, Row] = {
    # An outage while the children are created: the first create fails three passes running.
    "refused-creates": Row(
        lambda f, ns: f.refuse("POST", rf"/namespaces/{ns}/{CHILD_COLLECTIONS}$", 500, times=3),
        "create",
        hits=3,
        extra=_post("ConfigMap"),
    ),
    # Someone else's write got in first: the apply of a new image is refused twice.
    "conflicts-on-apply": Row(
        lambda f, ns: f.refuse("PATCH", rf"/namespaces/{ns}/deployments/{ns}$", 409, times=2),
        "image",
        hits=2,
        extra=_patch("Deployment"),
    ),
    # Someone deletes a child, and its create is answered 409 while it is not there (still
    # being deleted, then gone): created on retry, not taken for one that exists.
    "conflict-on-create-of-a-missing-object": Row(
        lambda f, ns: f.refuse("POST", rf"/namespaces/{ns}/poddisruptionbudgets$", 409),
        "delete",
        hits=1,
        extra=_post("PodDisruptionBudget"),
    ),
    # The status write is refused (kopf's own status.kopf writes are in its path too): the
    # children, in place already, are not written again.
    "refused-status": Row(
        lambda f, ns: f.refuse(
            "PATCH", rf"/namespaces/{ns}/llmdeployments/{ns}/status$", 500, times=2
        ),
        "create",
        hits=2,
    ),
    # Reading the resource fails: retried after the operator's delay, not kopf's minute.
    "refused-reads": Row(
        lambda f, ns: f.refuse("GET", rf"/namespaces/{ns}/llmdeployments/{ns}$", 503, times=2),
        "create",
        hits=2,
    ),
    # A create answered after the client gave up (6 s against 1.5 s), which lands all the
    # same, after the retry has created it: one Deployment.
    "slow-create-past-the-timeout": Row(
        lambda f, ns: f.delay("POST", rf"/namespaces/{ns}/deployments$", 6.0),
        "create",
        hits=1,
        extra=_post("Deployment"),
    ),
    # A refusal that lasts 8 s: retried less and less often (after 0.25, 0.5, 1, then 2 s),
    # not in a loop: 7 attempts at most; then the apply goes through. kopf may run the
    # handler once more at once, an 8th: it reads the event of our status write as one it
    # has not handled, since the emulator keeps no resourceVersion to order it before kopf's
    # own write.
    "lasting-refusal-of-apply": Row(
        lambda f, ns: f.refuse("PATCH", rf"/namespaces/{ns}/deployments/{ns}$", 500, times=None),
        "image",
        hits=8,
        extra=_patch("Deployment"),
        clear_after_s=8.0,
    ),
    # A hand edit undone by a pass that no kopf handler retries (a child's event): it is
    # retried all the same.
    "refusals-undoing-a-hand-edit": Row(
        lambda f, ns: f.refuse("PATCH", rf"/namespaces/{ns}/deployments/{ns}$", 500, times=2),
        "drift",
        hits=2,
        extra=_patch("Deployment"),
    ),
    # The resources' watch is cut where it would deliver the new spec: kopf watches again,
    # sees the spec it has not handled, and applies it.
    "watch-cut-on-a-spec-change": Row(
        lambda f, ns: f.cut_watch(rf"^/apis/{API_VERSION}/llmdeployments$"),
        "image",
        hits=1,
    ),
    # The same, the stream ending with 410 Gone (resourceVersion too old): kopf lists again.
    "watch-gone-on-a-spec-change": Row(
        lambda f, ns: f.cut_watch(rf"^/apis/{API_VERSION}/llmdeployments$", gone=True),
        "image",
        hits=1,
    ),
    # The Deployments' watch is cut where it would deliver a hand edit: on watching again
    # every Deployment is seen anew, its owner reconciled, and the edit undone.
    "watch-cut-on-a-hand-edit": Row(
        lambda f, ns: f.cut_watch(r"^/apis/apps/v1/deployments$"),
        "drift",
        hits=1,
    ),
}


@pytest.fixture(scope="module")
def operator_options() -> OperatorOptions:
    return OPTIONS


@pytest.mark.parametrize("row", FAULTS)
def test_the_operator_converges_through_the_fault_with_bounded_writes(
    cluster: EmulatedCluster, operator: KopfRunner, row: str
) -> None:
    fault = FAULTS[row]
    ns = row
    resource = _llmd(ns, SPEC)
    if fault.change != "create":
        cluster.create(resource)
        wait_for(lambda: _converged(cluster, resource), CONVERGED_S, "the resource")
        _quiet(cluster, ns)
    mark = cluster.request_count()
    armed = fault.arm(cluster.faults, ns)
    if fault.change == "create":
        cluster.create(resource)
    elif fault.change == "image":
        resource = _edit(cluster, ns, {**SPEC, "image": "tidegate/engine-cpu:2"})
    elif fault.change == "drift":
        cluster.patch("apps/v1", "Deployment", ns, {"spec": {"replicas": 5}}, namespace=ns)
    else:
        cluster.delete("policy/v1", "PodDisruptionBudget", ns, namespace=ns)
    if fault.clear_after_s is not None:
        time.sleep(fault.clear_after_s)  # the fault lasts: an observation window
        degraded = _conditions(cluster, ns)["Degraded"]
        assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
        assert "injected" in degraded["message"]  # the API server's words
        cluster.faults.clear()
    wait_for(lambda: _converged(cluster, resource), CONVERGED_S, f"convergence after {row}")
    _quiet(cluster, ns)
    if fault.clear_after_s is None:
        assert armed.hits == fault.hits
    else:
        # A slow machine only spaces the attempts further: fewer hits, longer waits. Each
        # wait but a rerun at once is a retry's delay, and they grow to the cap.
        assert armed.hits <= fault.hits
        waits = [b - a for a, b in pairwise(armed.hit_at)][1:]
        assert min(waits) >= 0.9 * OPTIONS.retry_seconds, waits
        assert max(waits) >= 0.9 * OPTIONS.max_retry_seconds, waits

    writes = [w for w in cluster.writes(since=mark) if f"/namespaces/{ns}/" in w]
    assert len(writes) == len(cluster.writes(since=mark)), "writes about other resources"
    children = Counter(w for w in writes if "/llmdeployments/" not in w)
    needed = _needed(resource, fault.change)
    if fault.extra is not None:
        needed[fault.extra(ns)] += armed.hits
    assert children == needed
    # Per attempt at most our status patch and kopf's bookkeeping of the handler (its
    # progress, then its diff-base or retry), whether the attempt failed or not.
    own = [w for w in writes if "/llmdeployments/" in w]
    assert len(own) <= 3 * (armed.hits + 1), own
    assert _writes_within(cluster, ns, seconds=1.5) == []


def _llmd(ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": ns, "namespace": ns, "uid": f"uid-{ns}", "generation": 1}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": copy.deepcopy(spec)}


def _edit(cluster: EmulatedCluster, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A new spec, with the generation bumped as the API server does."""
    live = cluster.get(API_VERSION, KIND, ns, ns)
    generation = live["metadata"]["generation"] + 1
    cluster.patch(API_VERSION, KIND, ns, {"metadata": {"generation": generation}, "spec": spec}, ns)
    return {**_llmd(ns, spec), "metadata": {**live["metadata"], "generation": generation}}


def _converged(cluster: EmulatedCluster, resource: dict[str, Any]) -> bool:
    """Every child as `render` has it (the fields it sets), and a status with no fault."""
    meta = resource["metadata"]
    for obj in render(resource).objects:
        name = obj["metadata"]["name"]
        if not is_subset(obj, cluster.get(obj["apiVersion"], obj["kind"], name, meta["namespace"])):
            return False
    status = (cluster.get(API_VERSION, KIND, meta["name"], meta["namespace"]) or {}).get("status")
    conditions = {c["type"]: c for c in (status or {}).get("conditions", [])}
    return (
        status is not None
        and status.get("observedGeneration") == meta["generation"]
        and conditions.get("Degraded", {}).get("status") == "False"
        and status.get("phase") == "Progressing"  # no pod runs: the emulator has no kubelet
    )


def _conditions(cluster: EmulatedCluster, ns: str) -> dict[str, dict[str, Any]]:
    status = (cluster.get(API_VERSION, KIND, ns, ns) or {}).get("status") or {}
    return {c["type"]: c for c in status.get("conditions", [])}


def _needed(resource: dict[str, Any], change: str) -> Counter[str]:
    """The child writes a change needs when nothing fails."""
    meta = resource["metadata"]
    if change == "create":
        return Counter(
            f"POST {object_path(o['apiVersion'], o['kind'], meta['namespace'])}"
            for o in render(resource).objects
        )
    if change == "delete":
        return Counter(
            [f"POST {object_path('policy/v1', 'PodDisruptionBudget', meta['namespace'])}"]
        )
    # A new image or a hand edit of the replicas: the Deployment alone.
    return Counter(
        [f"PATCH {object_path('apps/v1', 'Deployment', meta['namespace'], meta['name'])}"]
    )


def _writes_within(cluster: EmulatedCluster, ns: str, seconds: float) -> list[str]:
    """The operator's writes in `ns` during `seconds` in which nobody changes anything."""
    start = cluster.request_count()
    time.sleep(seconds)  # an observation window, not a wait for an event
    return [w for w in cluster.writes(since=start) if f"/namespaces/{ns}/" in w]


def _quiet(cluster: EmulatedCluster, ns: str, quiet_s: float = 1.0) -> None:
    """Wait until the operator has written nothing in `ns` for `quiet_s`."""
    deadline = time.monotonic() + CONVERGED_S
    while time.monotonic() < deadline:
        if not _writes_within(cluster, ns, quiet_s):
            return
    raise AssertionError(f"the operator kept writing in {ns}")
