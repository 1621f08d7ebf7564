"""Make the cluster match one LLMDeployment: apply what `render` says, drop what it no longer
says, and report status. Level-based and idempotent: it reads the resource and its children
each time, keeps no state of its own, and writes only what differs.

An autoscaled pool's replicas belong to its driver: the reconcile sends `spec.replicas` only
when it creates the Deployment (the starting replicas), and applies the rest of it without
them, so that the autoscaler (field manager `tidegate-autoscaler`), KEDA or the HPA
controller and the reconcile never undo each other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidegate.operator.closed_loop import TUNING_STATUS_KEY, tuning_inputs
from tidegate.operator.events import rfc3339
from tidegate.operator.host_paths import REASON as HOST_PATH_REFUSED
from tidegate.operator.host_paths import HostPathRefused
from tidegate.operator.kube import (
    AUTOSCALER_FIELD_MANAGER,
    FIELD_MANAGER,
    OPTIONAL_KINDS,
    OWNED_KINDS,
    Kube,
    KubeError,
)
from tidegate.operator.kv_keys import key_secret
from tidegate.operator.labels import COMPONENT_LABEL, owned_labels, selector_labels
from tidegate.operator.render import (
    POOL_KINDS,
    SPEC_HASH,
    Rendered,
    RenderOptions,
    is_pool,
    pod_template,
    render,
)
from tidegate.operator.rollout import Staged, is_canary, stage
from tidegate.operator.spec import API_VERSION, KIND, SpecError
from tidegate.operator.status import (
    Revision,
    RoleState,
    compute_status,
    merge_patch,
    role_revisions,
    role_state,
)
from tidegate.operator.tuning import MeasuredChunks, TuningError

# Status keys kopf, the autoscaler and the adapter report keep for themselves; the reconcile
# neither compares nor overwrites them.
KOPF_STATUS_KEY = "kopf"
AUTOSCALING_STATUS_KEY = "autoscaling"
ADAPTERS_STATUS_KEY = "adapters"
# The rollout controller's report of a running canary (operator/rollout_controller.py).
CANARY_ANALYSIS_STATUS_KEY = "canaryAnalysis"
OTHERS_STATUS_KEYS = {
    KOPF_STATUS_KEY,
    AUTOSCALING_STATUS_KEY,
    ADAPTERS_STATUS_KEY,
    CANARY_ANALYSIS_STATUS_KEY,
    TUNING_STATUS_KEY,  # closed-loop tuning's (operator/closed_loop.py), which the reconcile reads
}
# status.rollout: the last promoted spec and where a change under the canary strategy stands.
# The reconcile writes it; the rollout controller writes its verdicts into it (a promoted
# spec, a rolled-back revision), which the reconcile then carries forward.
ROLLOUT_STATUS_KEY = "rollout"
# Degraded reasons of a pass that could not apply everything: the handlers retry them.
APPLY_FAILED = "ApplyFailed"
# The spec asks for an object whose CRD the cluster lacks: the rest is applied all the same.
CRD_NOT_INSTALLED = "CRDNotInstalled"


@dataclass
class Outcome:
    """What one reconcile did: the writes it made and the error it reported, if any."""

    created: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    # Objects not created because the cluster does not serve their kind (OPTIONAL_KINDS).
    not_installed: list[str] = field(default_factory=list)
    status_written: bool = False
    error: tuple[str, str] | None = None

    @property
    def writes(self) -> int:
        return len(self.created) + len(self.applied) + len(self.deleted) + self.status_written


def is_subset(want: Any, have: Any) -> bool:
    """Whether every field we set is already so; fields others added (defaults) do not count."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            is_subset(value, have.get(key)) for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(is_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return want == have


def refusal(error: SpecError) -> tuple[str, str]:
    """The Degraded condition's (reason, message) for a spec the operator will not serve."""
    if isinstance(error, TuningError):
        return "TuningRefused", str(error)
    if isinstance(error, HostPathRefused):
        return HOST_PATH_REFUSED, str(error)
    return "InvalidSpec", str(error)


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


async def reconcile(
    kube: Kube,
    resource: Mapping[str, Any],
    options: RenderOptions,
    logger: logging.Logger | logging.LoggerAdapter,
) -> Outcome:
    """One pass of make-it-so for `resource` (a whole LLMDeployment object)."""
    meta = resource["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or "default"
    outcome = Outcome()
    effective: dict[str, Any] | None = None
    roles: list[RoleState]
    previous = {
        k: v for k, v in (resource.get("status") or {}).items() if k not in OTHERS_STATUS_KEYS
    }
    rollout_before = previous.get(ROLLOUT_STATUS_KEY) or {}
    staged: Staged | None = None
    live: dict[str, dict[str, Any]] = {}
    rollout: dict[str, Any] | None = None
    applied, proposed = tuning_inputs(resource)
    try:
        rendered = render(dict(resource), options, {**applied, **proposed})
        staged = stage(
            rendered,
            _stable_render(resource, rendered, rollout_before, options, logger, applied, proposed),
            rolled_back=(rollout_before.get("rolledBack") or {}).get("revision"),
            traffic_percent=rendered.spec.rollout.canary.traffic_percent,
        )
    except SpecError as error:  # TuningError too
        outcome.error = refusal(error)
    if outcome.error is not None:
        # Keep what runs: a bad edit must not take a working endpoint down.
        logger.warning(f"not applying {name}: {outcome.error[1]}")
        deployments = await _live_pools(kube, namespace, name)
        roles = [
            role_state(
                d["metadata"]["labels"][COMPONENT_LABEL],
                (d.get("spec") or {}).get("replicas", 1),
                d,
                group_size(d),
            )
            for d in deployments
        ]
        endpoint = (resource.get("status") or {}).get("endpoint", "")
    else:
        assert staged is not None
        effective = rendered.tuning.to_status()
        endpoint = rendered.endpoint
        objects = staged.objects
        try:
            live = await _apply_all(
                kube, objects, rendered.scaled, outcome, logger, rendered.kv_keys
            )
            await _delete_stale(kube, namespace, name, meta.get("uid"), objects, outcome)
        except KubeError as error:
            outcome.error = (APPLY_FAILED, error.message)
            live = {}
        else:
            if outcome.not_installed:
                outcome.error = (CRD_NOT_INSTALLED, "; ".join(outcome.not_installed))
        deployments = [o for o in objects if is_pool(o) and not is_canary(o)]
        roles = [
            role_state(
                obj["metadata"]["labels"][COMPONENT_LABEL],
                _desired(obj, live.get(_key(obj)), rendered.scaled),
                live.get(_key(obj)),
                group_size(obj),
            )
            for obj in deployments
        ]
    try:
        revisions = await _revisions(kube, namespace, name, deployments, roles)
    except KubeError as error:
        # Only the revisions' list is missing: the rest of the status still holds.
        logger.warning(f"cannot list the ReplicaSets of {name}: {error.message}")
        revisions = None
    change = None
    now = rfc3339(time.time())
    if staged is not None and outcome.error is None:
        rollout, change = rollout_status(resource, staged, rollout_before, live, now=now)
    status = compute_status(
        generation=meta.get("generation"),
        roles=roles,
        effective=effective,
        endpoint=endpoint,
        error=outcome.error,
        previous=previous,
        now=now,
        revisions=revisions or (),
        change=change,
    )
    if staged is None or outcome.error is not None:
        rollout = rollout_before or None  # nothing was applied: what ran still runs
    if rollout:
        status[ROLLOUT_STATUS_KEY] = rollout
    if revisions is None and "revisions" in previous:
        status["revisions"] = previous["revisions"]
    patch = merge_patch(previous, status)
    if patch:
        await kube.patch_status(API_VERSION, KIND, namespace, name, patch)
        outcome.status_written = True
    return outcome


def _stable_render(
    resource: Mapping[str, Any],
    rendered: Rendered,
    rollout: Mapping[str, Any],
    options: RenderOptions,
    logger: logging.Logger | logging.LoggerAdapter,
    applied: Mapping[str, MeasuredChunks],
    proposed: Mapping[str, MeasuredChunks],
) -> Rendered | None:
    """The render of the last promoted spec (with the promoted closed-loop values), when a
    change (of the spec, or a closed-loop proposal) is to go through a canary."""
    stable_spec = rollout.get("stableSpec")
    if not rendered.spec.canary() or stable_spec is None:
        return None
    if stable_spec == resource.get("spec") and not proposed:
        return None
    try:
        return render({**resource, "spec": stable_spec}, options, applied)
    except SpecError as error:
        # Written by an operator that read specs differently: nothing to compare with.
        logger.warning(f"the stable spec no longer renders ({error}); applying the spec as is")
        return None


# The rollout controller's verdicts in status.rollout, which the reconcile carries forward.
_VERDICTS = ("rolledBack", "lastPromoted")


def rollout_status(
    resource: Mapping[str, Any],
    staged: Staged,
    before: Mapping[str, Any],
    live: Mapping[str, Mapping[str, Any]],
    *,
    now: str,
) -> tuple[dict[str, Any] | None, tuple[str, str, bool] | None]:
    """status.rollout after applying `staged`, and the condition a pending change sets
    (reason, message, whether it degrades the resource), or None when the spec is applied."""
    spec = resource.get("spec") or {}
    generation = resource["metadata"].get("generation")
    if staged.mode == "direct":
        if (spec.get("rollout") or {}).get("strategy") != "canary":
            return None, None  # rolling: nothing to keep
        rollout: dict[str, Any] = {"phase": "Stable", "stableSpec": spec}
        if before.get("stableSpec") == spec and "stableGeneration" in before:
            rollout["stableGeneration"] = before["stableGeneration"]
        elif generation is not None:
            rollout["stableGeneration"] = generation
        rollout.update({k: before[k] for k in _VERDICTS if before.get(k)})
        return rollout, None
    kept = ("stableSpec", "stableGeneration", *_VERDICTS)
    rollout = {k: v for k, v in before.items() if k in kept and v}
    roles = ", ".join(staged.roles)
    if staged.mode == "held":
        rollout["phase"] = "RolledBack"
        reason = (before.get("rolledBack") or {}).get("reason", "")
        return rollout, (
            "CanaryRolledBack",
            f"the change of {roles} (revision {staged.revision}) was rolled back: {reason}; "
            f"the stable pods serve, and the spec is applied once it changes again or the "
            f"annotation tidegate.dev/canary: promote is set",
            True,
        )
    started = before.get("canary") or {}
    canary: dict[str, Any] = {
        "revision": staged.revision,
        "roles": list(staged.roles),
        "generation": generation,
        "startedAt": started.get("startedAt", now)
        if started.get("revision") == staged.revision
        else now,
        "ready": sum(
            ((live.get(f"Deployment/{obj['metadata']['name']}") or {}).get("status") or {}).get(
                "readyReplicas", 0
            )
            for obj in staged.objects
            if obj["kind"] == "Deployment" and is_canary(obj)
        ),
    }
    rollout["phase"] = "Canary"
    rollout["canary"] = canary
    return rollout, (
        "CanaryRunning",
        f"the change of {roles} (revision {staged.revision}) runs on a canary pod beside the "
        "stable ones; status.canaryAnalysis says how it compares",
        False,
    )


def group_size(pool: Mapping[str, Any]) -> int:
    """Pods of one replica of a pool: an LWS's group size, 1 for a Deployment."""
    if pool["kind"] != "LeaderWorkerSet":
        return 1
    return (pool.get("spec") or {}).get("leaderWorkerTemplate", {}).get("size", 1)


def _desired(obj: Mapping[str, Any], live: Mapping[str, Any] | None, scaled: frozenset[str]) -> int:
    """The replicas a rendered Deployment is to run: its driver's, once it has set them."""
    rendered = obj["spec"]["replicas"]
    if live is None or obj["metadata"]["name"] not in scaled:
        return rendered
    return (live.get("spec") or {}).get("replicas", rendered)


def without_replicas(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A Deployment as the reconcile applies it once it exists when an autoscaler owns its
    replicas: the same, less `spec.replicas`."""
    spec = {key: value for key, value in obj["spec"].items() if key != "replicas"}
    return {**obj, "spec": spec}


def owns_replicas(live: Mapping[str, Any], manager: str, operation: str) -> bool:
    """Whether the API server records `manager` as owning spec.replicas through `operation`."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == operation:
            fields = entry.get("fieldsV1") or {}
            if "f:replicas" in (fields.get("f:spec") or {}):
                return True
    return False


def replicas_body(obj: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    """The smallest server-side apply body that sets a Deployment's replicas."""
    meta = obj["metadata"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }


# Where a kind's pod selector is: the operator's alone, key by key.
_SELECTORS: dict[str, tuple[str, ...]] = {
    "Service": ("spec", "selector"),
    "InferencePool": ("spec", "selector", "matchLabels"),
}


def dropped_selector_keys(obj: Mapping[str, Any], live: Mapping[str, Any] | None) -> Any:
    """The JSON merge patch that removes the selector keys a live Service or InferencePool has
    and `obj` no longer sets (the leaders' worker-index once a pool fits one node again), or
    None. An apply that leaves a key out removes it only where an apply of ours set it, not
    where our create did; and its subset check would not even send it."""
    path = _SELECTORS.get(obj["kind"])
    if live is None or path is None:
        return None
    want: Any = obj
    have: Any = live
    for step in path:
        want = (want or {}).get(step)
        have = (have or {}).get(step)
    extra = sorted(set(have or {}) - set(want or {}))
    if not extra:
        return None
    patch: Any = dict.fromkeys(extra)
    for step in reversed(path):
        patch = {step: patch}
    return patch


def wants_kv_keys(obj: Mapping[str, Any], live: Mapping[str, Any] | None, secret: str) -> bool:
    """Whether the Secret `secret` (the KV key pair) must be made sure of before `obj` is
    applied: `obj` is a pool whose pods mount it, and it is new, its pod template changes, or
    some of its pods are unavailable (as when someone deleted the Secret). The operator may not
    read Secrets, so it creates it then, and one that exists (409) is kept as it is."""
    if not is_pool(obj):
        return False
    volumes = pod_template(obj)["spec"].get("volumes", [])
    if not any((v.get("secret") or {}).get("secretName") == secret for v in volumes):
        return False
    if live is None:
        return True
    unavailable = (live.get("status") or {}).get("unavailableReplicas")
    return bool(unavailable) or not is_subset(pod_template(obj), pod_template(live))


async def _create_kv_keys(
    kube: Kube,
    described: Mapping[str, Any],
    outcome: Outcome,
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    """Create the KV key pair's Secret with a fresh pair, unless it exists: never rewritten, as
    the running pods hold the pair they read at start."""
    try:
        await kube.create(key_secret(described))
    except KubeError as error:
        if error.status != 409:
            raise
        return
    outcome.created.append(_key(described))
    logger.info(f"created {_key(described)} with a fresh KV key pair")


async def _apply_all(
    kube: Kube,
    objects: list[dict[str, Any]],
    scaled: frozenset[str],
    outcome: Outcome,
    logger: logging.Logger | logging.LoggerAdapter,
    kv_keys: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Create what is missing, apply what differs; returns the live objects by kind/name.

    `kv_keys`: the Secret of the KV key pair (`Rendered.kv_keys`), created when a pool that
    mounts it needs it (`wants_kv_keys`), before that pool is applied."""
    live_objects: dict[str, dict[str, Any]] = {}
    for obj in objects:
        meta = obj["metadata"]
        live = await kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if kv_keys is not None and wants_kv_keys(obj, live, kv_keys["metadata"]["name"]):
            await _create_kv_keys(kube, kv_keys, outcome, logger)
            kv_keys = None  # once a pass
        if live is None:
            try:
                live = await kube.create(obj)
                outcome.created.append(_key(obj))
                logger.info(f"created {_key(obj)}")
            except KubeError as error:
                kind = (obj["apiVersion"], obj["kind"])
                if error.status == 404 and kind in OPTIONAL_KINDS:
                    # The API server does not serve the kind: the rest still applies.
                    outcome.not_installed.append(
                        f"the {obj['kind']} CRD ({obj['apiVersion']}) is not installed; "
                        f"install {OPTIONAL_KINDS[kind]}"
                    )
                    logger.warning(f"not creating {_key(obj)}: {outcome.not_installed[-1]}")
                    continue
                if error.status != 409:  # 409: another pass created it in between
                    raise
                live = await kube.get(
                    obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]
                )
                if live is None:  # ... and it is gone again (or was going): the retry creates it
                    raise
            else:
                live_objects[_key(obj)] = live or obj
                continue
        dropped = dropped_selector_keys(obj, live)
        if live is not None and dropped is not None:
            live = await kube.merge_patch(
                obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], dropped
            )
            outcome.applied.append(_key(obj))
            logger.info(f"updated {_key(obj)}: dropped selector keys")
        handoff = False
        if live is not None and obj["kind"] == "Deployment" and meta["name"] in scaled:
            obj = without_replicas(obj)
            handoff = owns_replicas(live, FIELD_MANAGER, "Apply")
            if handoff:
                # The pool was fixed until now: our earlier applies own its replicas, and an
                # apply without them would have the API server drop the field (back to 1).
                # Hand them to the autoscaler's field manager at their live value, then give
                # them up with an apply that leaves them out.
                live_replicas = (live.get("spec") or {}).get("replicas", 1)
                await kube.apply(replicas_body(obj, live_replicas), AUTOSCALER_FIELD_MANAGER)
        if live is not None and (handoff or not is_subset(obj, live)):
            live = await kube.apply(obj)
            outcome.applied.append(_key(obj))
            logger.info(f"updated {_key(obj)}")
        live_objects[_key(obj)] = live or obj
    return live_objects


async def _delete_stale(
    kube: Kube,
    namespace: str,
    name: str,
    uid: str | None,
    objects: list[dict[str, Any]],
    outcome: Outcome,
) -> None:
    """Delete our children that the spec no longer asks for (e.g. after a mode change)."""
    wanted = {_key(obj) for obj in objects}
    labels = owned_labels(name)
    for api_version, kind in OWNED_KINDS:
        for item in await kube.list(api_version, kind, namespace, labels):
            if _key({"kind": kind, **item}) in wanted or not _owned_by(item, uid):
                continue
            await kube.delete(api_version, kind, namespace, item["metadata"]["name"])
            outcome.deleted.append(f"{kind}/{item['metadata']['name']}")


def _owned_by(item: Mapping[str, Any], uid: str | None) -> bool:
    refs = item.get("metadata", {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


async def _revisions(
    kube: Kube,
    namespace: str,
    name: str,
    deployments: list[dict[str, Any]],
    roles: list[RoleState],
) -> list[Revision]:
    """Every role's revisions: each Deployment's current template (its spec hash), and the
    older ones whose pods still run, from the role's ReplicaSets (which carry the pod
    template's labels: one list finds every role's). A LeaderWorkerSet keeps its revisions in
    ControllerRevisions, which the operator does not read: its role lists the current one,
    with the groups its status counts."""
    replica_sets = await kube.list("apps/v1", "ReplicaSet", namespace, owned_labels(name))
    states = {state.role: state for state in roles}
    revisions: list[Revision] = []
    for deployment in deployments:
        role = deployment["metadata"]["labels"][COMPONENT_LABEL]
        template = pod_template(deployment)["metadata"]
        current = (template.get("annotations") or {}).get(SPEC_HASH)
        if deployment["kind"] == "LeaderWorkerSet":
            if current is not None and role in states:
                state = states[role]
                revisions.append(Revision(role, current, state.updated, state.ready, True))
            continue
        selector = selector_labels(name, role)
        of_role = [
            rs
            for rs in replica_sets
            if selector.items() <= ((rs.get("metadata") or {}).get("labels") or {}).items()
        ]
        revisions += role_revisions(role, current, of_role, SPEC_HASH)
    return revisions


async def _live_pools(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """The pools that run now: Deployments and LeaderWorkerSets, with their kinds."""
    pools = []
    for api_version, kind in POOL_KINDS:
        for item in await kube.list(api_version, kind, namespace, owned_labels(name)):
            pools.append({**item, "apiVersion": api_version, "kind": kind})
    return pools
