"""An LLMDeployment's status, computed from its children: pure, so every case is a unit test.

Ready is true only when every role's pods run the current spec: each Deployment has seen its
latest generation, all its replicas are updated and available, and no pod of an older
template is left (a rollout whose old pods still serve is Progressing, not Ready). A
LeaderWorkerSet pool (replicas over several nodes) is read the same way, counting groups: its
status counts the groups updated and ready, a group being ready when all its pods are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
# A message may quote the resource (say, every unknown field of a spec nobody validated):
# status lives in the same etcd object as that spec, so it must not grow with it.
MAX_MESSAGE_CHARS = 4096


@dataclass(frozen=True)
class RoleState:
    """Where one role's Deployment stands."""

    role: str
    desired: int
    updated: int
    ready: int  # pods of the current template that are available
    old: int  # pods of an older template still running
    observed: bool  # the Deployment controller has seen the latest generation
    stuck: str | None  # message of a ProgressDeadlineExceeded condition
    # What a replica is: a pod, or for a LeaderWorkerSet a group of this many pods.
    group_size: int = 1

    @property
    def done(self) -> bool:
        return self.observed and self.old == 0 and self.updated == self.ready == self.desired

    def units(self, count: int) -> str:
        """`count` replicas, as pods or as groups of pods."""
        if self.group_size == 1:
            return f"{count} pod{'s' if count != 1 else ''}"
        return f"{count} group{'s' if count != 1 else ''} of {self.group_size} pods"


def role_state(
    role: str, desired: int, live: Mapping[str, Any] | None, group_size: int = 1
) -> RoleState:
    """Read a live Deployment (None: not created yet) the way `kubectl rollout status` does;
    with `group_size` above 1, a LeaderWorkerSet of groups that many pods each."""
    if live is None:
        return RoleState(role, desired, 0, 0, 0, False, None, group_size)
    status = live.get("status") or {}
    generation = (live.get("metadata") or {}).get("generation")
    observed = generation is None or status.get("observedGeneration", 0) >= generation
    total = status.get("replicas", 0)
    updated = status.get("updatedReplicas", 0) if observed else 0
    # An LWS counts ready groups (all their pods ready); it has no availability delay.
    available = status.get("readyReplicas" if group_size > 1 else "availableReplicas", 0)
    old = max(total - updated, 0)
    # Available pods of the current template: at least all available minus every old pod.
    ready = min(max(available - old, 0), updated)
    stuck = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == (
            "ProgressDeadlineExceeded"
        ):
            stuck = condition.get("message") or "progress deadline exceeded"
    return RoleState(role, desired, updated, ready, old, observed, stuck, group_size)


@dataclass(frozen=True)
class Revision:
    """One revision of a role's pods: a pod template (by its spec hash) and its pods."""

    role: str
    revision: str
    replicas: int
    ready: int
    current: bool

    def to_status(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "revision": self.revision,
            "replicas": self.replicas,
            "ready": self.ready,
            "current": self.current,
        }


def role_revisions(
    role: str, current: str | None, replica_sets: Sequence[Mapping[str, Any]], hash_key: str
) -> list[Revision]:
    """A role's revisions from its Deployment's ReplicaSets: the current one (the template's
    hash `current`, even before its first pod) then those with pods left, newest first.

    A ReplicaSet's template carries the Deployment's, so its `hash_key` annotation names the
    revision; the Deployment controller keeps old ones at 0 replicas, which are left out.
    """
    found: dict[str, tuple[str, int, int]] = {}
    for replica_set in replica_sets:
        template = (replica_set.get("spec") or {}).get("template") or {}
        revision = ((template.get("metadata") or {}).get("annotations") or {}).get(hash_key)
        if revision is None:
            continue
        status = replica_set.get("status") or {}
        replicas = status.get("replicas", 0)
        ready = status.get("readyReplicas", 0)
        created = (replica_set.get("metadata") or {}).get("creationTimestamp") or ""
        before = found.get(revision)
        if before is not None:  # two ReplicaSets of one template: count both
            created, replicas, ready = (
                max(created, before[0]),
                replicas + before[1],
                ready + before[2],
            )
        found[revision] = (created, replicas, ready)
    out = []
    if current is not None:
        _, replicas, ready = found.pop(current, ("", 0, 0))
        out.append(Revision(role, current, replicas, ready, True))
    for revision, (_, replicas, ready) in sorted(
        found.items(), key=lambda i: i[1][0], reverse=True
    ):
        if replicas > 0:
            out.append(Revision(role, revision, replicas, ready, False))
    return out


def condition(
    kind: str,
    value: bool,
    reason: str,
    message: str,
    generation: int | None,
    previous: list[dict[str, Any]],
    now: str,
) -> dict[str, Any]:
    """A condition; its lastTransitionTime moves only when its status does."""
    status = "True" if value else "False"
    if len(message) > MAX_MESSAGE_CHARS:
        cut = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
    since = now
    for old in previous:
        if old.get("type") == kind and old.get("status") == status:
            since = old.get("lastTransitionTime", now)
    out = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def compute_status(
    *,
    generation: int | None,
    roles: list[RoleState],
    effective: dict[str, Any] | None,
    endpoint: str,
    error: tuple[str, str] | None,
    previous: Mapping[str, Any],
    now: str,
    revisions: Sequence[Revision] = (),
    change: tuple[str, str, bool] | None = None,
) -> dict[str, Any]:
    """The whole status (less kopf's bookkeeping); `error` is (reason, message) or None.

    `change` is a change the canary strategy holds back (reason, message, degraded): a canary
    that runs (Progressing) or one rolled back (Degraded); the spec is not applied meanwhile.
    """
    conditions_before = list(previous.get("conditions") or [])
    rolling = [r for r in roles if not r.done]
    stuck = [r for r in roles if r.stuck]
    empty = [r for r in roles if r.desired == 0]
    ready = not rolling and not empty and error is None and change is None and bool(roles)

    if ready:
        ready_reason, ready_message = "AllRolesReady", "every pod runs the current spec"
    elif error is not None:
        ready_reason, ready_message = error[0], error[1]
    elif change is not None:
        ready_reason, ready_message = change[0], change[1]
    elif empty:
        names = ", ".join(r.role for r in empty)
        ready_reason, ready_message = "ScaledToZero", f"{names} has 0 replicas"
    else:
        ready_reason, ready_message = "RollingOut", _describe_rollout(rolling)

    if rolling:
        progressing = (True, "RollingOut", _describe_rollout(rolling))
    elif change is not None and not change[2]:
        progressing = (True, change[0], change[1])
    else:
        progressing = (False, "RolloutComplete", "every role runs the current spec")

    if error is not None:
        degraded = (True, error[0], error[1])
    elif stuck:
        message = "; ".join(f"{r.role}: {r.stuck}" for r in stuck)
        degraded = (True, "RolloutStuck", message)
    elif change is not None and change[2]:
        degraded = (True, change[0], change[1])
    else:
        degraded = (False, "AsExpected", "nothing is wrong")

    def make(kind: str, value: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(kind, value, reason, message, generation, conditions_before, now)

    conditions = [
        make(READY, ready, ready_reason, ready_message),
        make(PROGRESSING, *progressing),
        make(DEGRADED, *degraded),
    ]
    if degraded[0]:
        phase = "Degraded"
    elif ready:
        phase = "Ready"
    elif rolling or change is not None:
        phase = "Progressing"
    else:
        phase = "Pending"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "endpoint": endpoint,
        "ready": f"{sum(r.ready for r in roles)}/{sum(r.desired for r in roles)}",
        "replicas": {
            r.role: {"desired": r.desired, "ready": r.ready, "updated": r.updated} for r in roles
        },
    }
    if revisions:
        status["revisions"] = [r.to_status() for r in revisions]
    if generation is not None:
        status["observedGeneration"] = generation
    if effective is not None:
        status["effective"] = effective
    elif "effective" in previous:
        status["effective"] = previous["effective"]  # what the pods still run
    return status


def _describe_rollout(rolling: list[RoleState]) -> str:
    parts = []
    for r in rolling:
        if not r.observed:
            controller = "Deployment" if r.group_size == 1 else "LeaderWorkerSet"
            parts.append(f"{r.role}: waiting for the {controller} controller")
            continue
        text = f"{r.role}: {r.ready} of {r.units(r.desired)} run the current spec"
        if r.old:
            text += f", {r.units(r.old).replace(' ', ' old ', 1)} still serving"
        parts.append(text)
    return "; ".join(parts)


def adapter_status(
    names: Sequence[str], served: Mapping[str, Sequence[frozenset[str]]]
) -> list[dict[str, Any]]:
    """status.adapters: for each adapter of the spec, in its order, the ready pods serving it.

    `served` holds, by engine role, one set per ready pod that answered its scrape: the adapters
    it serves. With one pool, readyReplicas is how many of its pods serve the adapter. In P/D a
    request for an adapter needs it on both of its legs, a prefill pod and a decode pod: the
    pools serve it as far as the scarcer of the two does, so readyReplicas is the smaller count
    (0 while either pool has none), and `roles` gives each.
    """
    entries = []
    for name in names:
        counts = {role: sum(name in pod for pod in pods) for role, pods in served.items()}
        entry: dict[str, Any] = {"name": name, "readyReplicas": min(counts.values(), default=0)}
        if len(counts) > 1:
            entry["roles"] = counts
        entries.append(entry)
    return entries


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`; {} when they are equal."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            inner = merge_patch(before, value)
            if inner:
                patch[key] = inner
        elif value != before or key not in old:
            patch[key] = value
    return patch
