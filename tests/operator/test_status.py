"""Status from children: every rollout situation a user can meet, without a cluster."""

from __future__ import annotations

from typing import Any

import pytest

from tidegate.operator.status import (
    Revision,
    adapter_status,
    compute_status,
    merge_patch,
    role_revisions,
    role_state,
)

NOW, LATER = "2026-11-29T10:00:00Z", "2026-11-29T11:00:00Z"


def deployment(
    *, generation: int = 2, observed: int = 2, replicas: int, updated: int, available: int
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": updated,
            "availableReplicas": available,
        },
    }


def status_of(
    *roles: Any, error: tuple[str, str] | None = None, previous: Any = None, now: str = NOW
) -> dict[str, Any]:
    return compute_status(
        generation=3,
        roles=list(roles),
        effective={"roles": {}, "reasons": []},
        endpoint="http://x.default.svc:8000/v1",
        error=error,
        previous=previous or {},
        now=now,
    )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


@pytest.mark.parametrize(
    ("live", "ready", "phase", "message"),
    [
        (deployment(replicas=2, updated=2, available=2), True, "Ready", None),
        (None, False, "Progressing", "waiting for the Deployment controller"),
        (
            deployment(observed=1, replicas=2, updated=2, available=2),
            False,
            "Progressing",
            "waiting for the Deployment controller",
        ),
        (
            deployment(replicas=2, updated=1, available=1),
            False,
            "Progressing",
            "0 of 2 pods run the current spec, 1 old pod still serving",
        ),
        (
            deployment(replicas=3, updated=1, available=3),
            False,
            "Progressing",
            "1 of 2 pods run the current spec, 2 old pods still serving",
        ),
        (
            deployment(replicas=3, updated=2, available=3),
            False,
            "Progressing",
            "2 of 2 pods run the current spec, 1 old pod still serving",
        ),
        (
            deployment(replicas=2, updated=2, available=1),
            False,
            "Progressing",
            "1 of 2 pods run the current spec",
        ),
    ],
    ids=[
        "done",
        "not-created",
        "generation-not-seen",
        "surge-started",
        "one-new-two-old",
        "all-new-one-old-left",
        "new-pod-not-ready",
    ],
)
def test_ready_only_when_every_pod_runs_the_current_spec(
    live: Any, ready: bool, phase: str, message: str | None
) -> None:
    status = status_of(role_state("unified", 2, live))
    assert status["phase"] == phase
    assert conditions(status)["Ready"]["status"] == ("True" if ready else "False")
    assert conditions(status)["Progressing"]["status"] == ("False" if ready else "True")
    if message:
        assert message in conditions(status)["Ready"]["message"]


def test_one_role_behind_keeps_the_whole_resource_not_ready() -> None:
    status = status_of(
        role_state("prefill", 1, deployment(replicas=1, updated=1, available=1)),
        role_state("decode", 2, deployment(replicas=2, updated=1, available=2)),
        role_state("router", 1, deployment(replicas=1, updated=1, available=1)),
    )
    assert conditions(status)["Ready"]["status"] == "False"
    assert conditions(status)["Ready"]["message"].startswith("decode:")
    assert status["ready"] == "3/4"
    assert status["replicas"]["decode"] == {"desired": 2, "ready": 1, "updated": 1}


def test_an_error_is_degraded_and_says_why() -> None:
    status = status_of(
        role_state("unified", 1, deployment(replicas=1, updated=1, available=1)),
        error=("TuningRefused", "tensorParallelSize 16 needs 16 accelerators"),
    )
    assert status["phase"] == "Degraded"
    degraded = conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "TuningRefused")
    assert conditions(status)["Ready"]["message"] == "tensorParallelSize 16 needs 16 accelerators"


def test_scaled_to_zero_is_not_ready() -> None:
    status = status_of(role_state("unified", 0, deployment(replicas=0, updated=0, available=0)))
    assert conditions(status)["Ready"]["reason"] == "ScaledToZero"
    assert status["phase"] == "Pending"


def test_transition_times_move_only_when_a_condition_flips() -> None:
    done = role_state("unified", 1, deployment(replicas=1, updated=1, available=1))
    first = status_of(done)
    again = status_of(done, previous=first, now=LATER)
    assert again == first  # nothing changed: nothing to write
    assert merge_patch(first, again) == {}
    rolling = role_state("unified", 1, deployment(replicas=2, updated=1, available=1))
    moved = status_of(rolling, previous=first, now=LATER)
    assert conditions(moved)["Ready"]["lastTransitionTime"] == LATER
    assert conditions(moved)["Degraded"]["lastTransitionTime"] == NOW  # still False


def test_merge_patch_removes_what_is_gone_and_keeps_what_is_equal() -> None:
    old = {"effective": {"roles": {"unified": {"a": 1}}}, "phase": "Ready", "endpoint": "e"}
    new = {"effective": {"roles": {"prefill": {"a": 1}}}, "phase": "Ready"}
    assert merge_patch(old, new) == {
        "effective": {"roles": {"unified": None, "prefill": {"a": 1}}},
        "endpoint": None,
    }


# -- status.adapters ---------------------------------------------------------------------------


def test_an_adapter_counts_the_ready_pods_that_serve_it_in_spec_order() -> None:
    pods = [frozenset({"sql", "chat"}), frozenset({"sql"}), frozenset()]
    assert adapter_status(["sql", "chat", "new"], {"unified": pods}) == [
        {"name": "sql", "readyReplicas": 2},
        {"name": "chat", "readyReplicas": 1},
        {"name": "new", "readyReplicas": 0},
    ]


def test_in_p_d_an_adapter_is_as_ready_as_the_scarcer_pool() -> None:
    served = {
        "prefill": [frozenset({"sql"})],
        "decode": [frozenset({"sql", "chat"}), frozenset({"sql", "chat"})],
    }
    assert adapter_status(["sql", "chat"], served) == [
        {"name": "sql", "readyReplicas": 1, "roles": {"prefill": 1, "decode": 2}},
        {"name": "chat", "readyReplicas": 0, "roles": {"prefill": 0, "decode": 2}},
    ]


def test_a_pool_without_ready_pods_serves_no_adapter() -> None:
    assert adapter_status(["sql"], {"unified": []}) == [{"name": "sql", "readyReplicas": 0}]
    assert adapter_status([], {"unified": [frozenset({"sql"})]}) == []


HASH = "tidegate.dev/spec-hash"


def replica_set(revision: str | None, replicas: int, ready: int, created: str) -> dict[str, Any]:
    annotations = {HASH: revision} if revision is not None else {}
    return {
        "metadata": {"creationTimestamp": created},
        "spec": {"template": {"metadata": {"annotations": annotations}}},
        "status": {"replicas": replicas, "readyReplicas": ready},
    }


def test_revisions_list_the_current_template_then_older_ones_with_pods_newest_first() -> None:
    sets = [
        replica_set("a", 0, 0, "2026-11-01T00:00:00Z"),  # history: no pod left
        replica_set("b", 1, 1, "2026-11-02T00:00:00Z"),
        replica_set("c", 2, 2, "2026-11-03T00:00:00Z"),
        replica_set("d", 1, 0, "2026-11-04T00:00:00Z"),  # current, its pod still starting
        replica_set(None, 3, 3, "2026-11-05T00:00:00Z"),  # not ours: no spec hash
    ]
    assert role_revisions("decode", "d", sets, HASH) == [
        Revision("decode", "d", 1, 0, True),
        Revision("decode", "c", 2, 2, False),
        Revision("decode", "b", 1, 1, False),
    ]


def test_the_current_revision_is_listed_before_its_replica_set_exists() -> None:
    sets = [replica_set("old", 2, 2, "2026-11-01T00:00:00Z")]
    assert role_revisions("unified", "new", sets, HASH) == [
        Revision("unified", "new", 0, 0, True),
        Revision("unified", "old", 2, 2, False),
    ]


def test_revisions_go_into_the_status_as_listed() -> None:
    revisions = [Revision("prefill", "p2", 1, 1, True), Revision("prefill", "p1", 1, 1, False)]
    status = compute_status(
        generation=3,
        roles=[],
        effective=None,
        endpoint="",
        error=None,
        previous={},
        now=NOW,
        revisions=revisions,
    )
    assert status["revisions"] == [
        {"role": "prefill", "revision": "p2", "replicas": 1, "ready": 1, "current": True},
        {"role": "prefill", "revision": "p1", "replicas": 1, "ready": 1, "current": False},
    ]
