"""Make the cluster match one LLMDeployment: apply what `render` says, drop what it no longer
says, and report status. Level-based and idempotent: it reads the resource and its children
each time, keeps no state of its own, and writes only what differs.

An autoscaled pool's replicas belong to its driver: the reconcile sends `spec.replicas` only
when it creates the Deployment (the starting replicas), and applies the rest of it without
them, so that the autoscaler (field manager `tidegate-autoscaler`), KEDA or the HPA
controller and the reconcile never undo each other.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidegate.operator.kube import (
    AUTOSCALER_FIELD_MANAGER,
    FIELD_MANAGER,
    OPTIONAL_KINDS,
    OWNED_KINDS,
    Kube,
    KubeError,
)
from tidegate.operator.labels import COMPONENT_LABEL, owned_labels, selector_labels
from tidegate.operator.render import SPEC_HASH, RenderOptions, render
from tidegate.operator.spec import API_VERSION, KIND, SpecError
from tidegate.operator.status import (
    Revision,
    RoleState,
    compute_status,
    merge_patch,
    role_revisions,
    role_state,
)
from tidegate.operator.tuning import TuningError

# Status keys kopf, the autoscaler and the adapter report keep for themselves; the reconcile
# neither compares nor overwrites them.
KOPF_STATUS_KEY = "kopf"
AUTOSCALING_STATUS_KEY = "autoscaling"
ADAPTERS_STATUS_KEY = "adapters"
OTHERS_STATUS_KEYS = {KOPF_STATUS_KEY, AUTOSCALING_STATUS_KEY, ADAPTERS_STATUS_KEY}
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
    reason = "TuningRefused" if isinstance(error, TuningError) else "InvalidSpec"
    return reason, str(error)


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    try:
        rendered = render(dict(resource), options)
    except SpecError as error:  # TuningError too
        outcome.error = refusal(error)
    if outcome.error is not None:
        # Keep what runs: a bad edit must not take a working endpoint down.
        logger.warning(f"not applying {name}: {outcome.error[1]}")
        roles = await _live_roles(kube, namespace, name)
        deployments = await kube.list("apps/v1", "Deployment", namespace, owned_labels(name))
        endpoint = (resource.get("status") or {}).get("endpoint", "")
    else:
        effective = rendered.tuning.to_status()
        endpoint = rendered.endpoint
        try:
            live = await _apply_all(kube, rendered.objects, rendered.scaled, outcome, logger)
            await _delete_stale(kube, namespace, name, meta.get("uid"), rendered.objects, outcome)
        except KubeError as error:
            outcome.error = (APPLY_FAILED, error.message)
            live = {}
        else:
            if outcome.not_installed:
                outcome.error = (CRD_NOT_INSTALLED, "; ".join(outcome.not_installed))
        roles = [
            role_state(
                obj["metadata"]["labels"][COMPONENT_LABEL],
                _desired(obj, live.get(_key(obj)), rendered.scaled),
                live.get(_key(obj)),
            )
            for obj in rendered.objects
            if obj["kind"] == "Deployment"
        ]
        deployments = [obj for obj in rendered.objects if obj["kind"] == "Deployment"]
    try:
        revisions = await _revisions(kube, namespace, name, deployments)
    except KubeError as error:
        # Only the revisions' list is missing: the rest of the status still holds.
        logger.warning(f"cannot list the ReplicaSets of {name}: {error.message}")
        revisions = None
    previous = {
        k: v for k, v in (resource.get("status") or {}).items() if k not in OTHERS_STATUS_KEYS
    }
    status = compute_status(
        generation=meta.get("generation"),
        roles=roles,
        effective=effective,
        endpoint=endpoint,
        error=outcome.error,
        previous=previous,
        now=_now(),
        revisions=revisions or (),
    )
    if revisions is None and "revisions" in previous:
        status["revisions"] = previous["revisions"]
    patch = merge_patch(previous, status)
    if patch:
        await kube.patch_status(API_VERSION, KIND, namespace, name, patch)
        outcome.status_written = True
    return outcome


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


async def _apply_all(
    kube: Kube,
    objects: list[dict[str, Any]],
    scaled: frozenset[str],
    outcome: Outcome,
    logger: logging.Logger | logging.LoggerAdapter,
) -> dict[str, dict[str, Any]]:
    """Create what is missing, apply what differs; returns the live objects by kind/name."""
    live_objects: dict[str, dict[str, Any]] = {}
    for obj in objects:
        meta = obj["metadata"]
        live = await kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
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
            else:
                live_objects[_key(obj)] = live or obj
                continue
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
    kube: Kube, namespace: str, name: str, deployments: list[dict[str, Any]]
) -> list[Revision]:
    """Every role's revisions: each Deployment's current template (its spec hash), and the
    older ones whose pods still run, from the role's ReplicaSets (which carry the pod
    template's labels: one list finds every role's)."""
    replica_sets = await kube.list("apps/v1", "ReplicaSet", namespace, owned_labels(name))
    revisions: list[Revision] = []
    for deployment in deployments:
        role = deployment["metadata"]["labels"][COMPONENT_LABEL]
        template = deployment["spec"]["template"]["metadata"]
        current = (template.get("annotations") or {}).get(SPEC_HASH)
        selector = selector_labels(name, role)
        of_role = [
            rs
            for rs in replica_sets
            if selector.items() <= ((rs.get("metadata") or {}).get("labels") or {}).items()
        ]
        revisions += role_revisions(role, current, of_role, SPEC_HASH)
    return revisions


async def _live_roles(kube: Kube, namespace: str, name: str) -> list[RoleState]:
    labels = owned_labels(name)
    deployments = await kube.list("apps/v1", "Deployment", namespace, labels)
    return [
        role_state(
            d["metadata"]["labels"][COMPONENT_LABEL],
            (d.get("spec") or {}).get("replicas", 1),
            d,
        )
        for d in deployments
    ]
