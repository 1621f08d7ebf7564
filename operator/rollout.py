"""What a change of an LLMDeployment rolls, and why: the renders before and after, compared.

A role's pods restart when its pool's pod template changes, which the renderer sums up
in the template's spec hash (`tidegate.dev/spec-hash`: the pod spec and the role's config
file). `role_changes` says, for each role, whether that hash moves, which engine flags of its
config file change (from what to what), and which parts of the pod spec do; a change of
replicas alone restarts nothing. `tidegate plan -f NEW --from OLD` prints it, with the steps
the Deployment controller then takes (surge-first: a new pod beside the old ones, one at a
time, an old one removed only once the new one is ready). A LeaderWorkerSet pool (replicas
over several nodes) rolls the same way by whole groups; a pool that becomes one (or stops
being one) is replaced: the old pods stop as the new ones start.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from tidegate.operator.canary_judge import policy_of
from tidegate.operator.labels import CANARY_TRACK, COMPONENT_LABEL, TRACK_LABEL
from tidegate.operator.render import SPEC_HASH, Rendered, is_pool, pod_template, template_digest

# The parts of a pod template worth naming when they change, each a path into it.
_POD_PARTS: dict[str, tuple[str, ...]] = {
    "image": ("containers", 0, "image"),
    "command": ("containers", 0, "args"),
    "resources": ("containers", 0, "resources"),
    "ports": ("containers", 0, "ports"),
    "probes": ("containers", 0, "startupProbe"),
    "volume mounts": ("containers", 0, "volumeMounts"),
    "volumes": ("volumes",),
    "init containers": ("initContainers",),
    "node placement": ("nodeSelector",),
    "tolerations": ("tolerations",),
    "security": ("securityContext",),
}


@dataclass(frozen=True)
class FlagChange:
    flag: str
    before: Any
    after: Any


@dataclass(frozen=True)
class RoleChange:
    """One role's pool (Deployment or LeaderWorkerSet) across the change."""

    role: str
    deployment: str
    # "added", "removed", "rolls" (new pod template), "scales" (replicas only), "unchanged",
    # "replaced" (a Deployment becomes a LeaderWorkerSet, or the reverse).
    kind: str
    replicas: tuple[int | None, int | None] = (None, None)
    flags: list[FlagChange] = field(default_factory=list)
    pod_parts: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: what happens to this role's pods, and why."""
        before, after = self.replicas
        if self.kind == "added":
            return f"new: {after} pod(s) start"
        if self.kind == "removed":
            return f"removed: its {before} pod(s) stop"
        if self.kind == "unchanged":
            return "nothing restarts"
        if self.kind == "scales":
            return f"replicas {before} -> {after}; no pod restarts"
        if self.kind == "replaced":
            return (
                f"replaced: {self.pod_parts[0]}; its {before} replica(s) stop as the {after} new "
                "one(s) start, with no surge between the two kinds"
            )
        causes = [f"{c.flag} {_show(c.before)} -> {_show(c.after)}" for c in self.flags]
        causes += self.pod_parts
        scale = f"; replicas {before} -> {after}" if before != after else ""
        why = ", ".join(causes) or "the pod template"
        return (
            f"rolls surge-first: {after} new pod(s), one at a time beside the old ones, each old "
            f"one stopped once a new one is ready ({why}){scale}"
        )


def role_changes(before: Rendered, after: Rendered) -> list[RoleChange]:
    """Every role of either render, in the new render's order (removed roles last)."""
    old, new = _deployments(before), _deployments(after)
    old_configs, new_configs = _configs(before), _configs(after)
    changes = []
    for role, deployment in new.items():
        name = deployment["metadata"]["name"]
        replicas_after = deployment["spec"].get("replicas")
        previous = old.get(role)
        if previous is None:
            changes.append(RoleChange(role, name, "added", (None, replicas_after)))
            continue
        replicas = (previous["spec"].get("replicas"), replicas_after)
        if previous["kind"] != deployment["kind"]:
            what = f"the {previous['kind']} becomes a {deployment['kind']}"
            changes.append(RoleChange(role, name, "replaced", replicas, pod_parts=[what]))
            continue
        if _hash(previous) == _hash(deployment):
            kind = "scales" if replicas[0] != replicas[1] else "unchanged"
            changes.append(RoleChange(role, name, kind, replicas))
            continue
        flags = _flag_changes(old_configs.get(role, {}), new_configs.get(role, {}))
        parts = _pod_parts(previous, deployment)
        changes.append(RoleChange(role, name, "rolls", replicas, flags, parts))
    for role, deployment in old.items():
        if role not in new:
            replicas = (deployment["spec"].get("replicas"), None)
            changes.append(RoleChange(role, deployment["metadata"]["name"], "removed", replicas))
    return changes


def _deployments(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {
        obj["metadata"]["labels"][COMPONENT_LABEL]: obj
        for obj in rendered.objects
        if is_pool(obj) and not is_canary(obj)
    }


def _configs(rendered: Rendered) -> dict[str, dict[str, Any]]:
    """Each role's config file (`<role>.yaml` of the ConfigMap), parsed."""
    config_map = next(obj for obj in rendered.objects if obj["kind"] == "ConfigMap")
    return {
        key.removesuffix(".yaml"): yaml.safe_load(text) or {}
        for key, text in config_map["data"].items()
        if key.endswith(".yaml")
    }


def _hash(pool: Mapping[str, Any]) -> str | None:
    annotations = pod_template(pool)["metadata"].get("annotations") or {}
    return annotations.get(SPEC_HASH)


def _flag_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[FlagChange]:
    return [
        FlagChange(flag, before.get(flag), after.get(flag))
        for flag in sorted(before.keys() | after.keys())
        if before.get(flag) != after.get(flag)
    ]


def _pod_parts(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    old_pod = pod_template(before)["spec"]
    new_pod = pod_template(after)["spec"]
    return [name for name, path in _POD_PARTS.items() if _at(old_pod, path) != _at(new_pod, path)]


def _at(value: Any, path: tuple[str | int, ...]) -> Any:
    for step in path:
        if isinstance(step, int):
            value = value[step] if isinstance(value, list) and len(value) > step else None
        else:
            value = value.get(step) if isinstance(value, Mapping) else None
    return value


def _show(value: Any) -> str:
    return "(unset)" if value is None else str(value)


# --- canaries ------------------------------------------------------------------------------

# The name a canary Deployment adds to its role's Deployment, and the config file it reads.
CANARY_SUFFIX = "-canary"
# metadata.annotations[CANARY_ANNOTATION] = promote | abort decides a canary by hand.
CANARY_ANNOTATION = "tidegate.dev/canary"
CANARY_ACTIONS = ("promote", "abort")
# On a canary's pod template: the change it tries (`canary_revision`). The rollout controller
# counts only the pods of the change it judges, never one of an earlier canary still stopping.
CANARY_REVISION = "tidegate.dev/canary-revision"

Mode = Literal["direct", "canary", "held"]


@dataclass(frozen=True)
class Staged:
    """What a reconcile applies for a change under the canary strategy.

    - direct: the spec as it is (nothing to compare with, nothing that rolls, or the strategy
      is rolling);
    - canary: the changed roles keep their stable pods, and one canary pod each runs the new
      template beside them;
    - held: the change was rolled back; the changed roles keep their stable pods until the
      spec changes again (or the annotation promotes it by hand).
    """

    mode: Mode
    objects: list[dict[str, Any]]
    # The roles whose pods the change rolls, and a digest of their new templates: the same
    # change (whatever else is edited meanwhile) keeps its digest, so a rolled-back change is
    # not tried again until it changes.
    roles: tuple[str, ...] = ()
    revision: str = ""


def canary_revision(new: Rendered, roles: Sequence[str]) -> str:
    """A digest of the changed roles' new templates (their spec hashes)."""
    deployments = _deployments(new)
    parts = [f"{role}={_hash(deployments[role])}" for role in sorted(roles)]
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


def rolled_roles(stable: Rendered, new: Rendered) -> list[str] | None:
    """The roles whose pod template the change moves; None when the roles themselves change
    (a mode change, say), which no canary can try."""
    changes = role_changes(stable, new)
    if any(change.kind in ("added", "removed") for change in changes):
        return None
    return [change.role for change in changes if change.kind == "rolls"]


def stage(
    new: Rendered,
    stable: Rendered | None,
    *,
    rolled_back: str | None,
    traffic_percent: int,
) -> Staged:
    """What to apply for `new` given the last promoted render (None: there is none yet)."""
    if stable is None or not new.spec.canary():
        return Staged("direct", new.objects)
    roles = rolled_roles(stable, new)
    if not roles:
        return Staged("direct", new.objects)
    revision = canary_revision(new, roles)
    held = revision == rolled_back
    old_deployments, new_deployments = _deployments(stable), _deployments(new)
    old_configs = _config_texts(stable)
    canaries = []
    objects = []
    for obj in new.objects:
        role = (obj["metadata"].get("labels") or {}).get(COMPONENT_LABEL)
        if obj["kind"] == "Deployment" and role in roles:
            # The stable pods keep the stable template, at the replicas the spec now asks.
            kept = copy.deepcopy(old_deployments[role])
            kept["spec"]["replicas"] = obj["spec"]["replicas"]
            objects.append(kept)
            if not held:
                canary = canary_deployment(new_deployments[role], traffic_percent, revision)
                canaries.append(canary)
        elif obj["kind"] == "ConfigMap":
            config = copy.deepcopy(obj)
            for role_name in roles:
                key = f"{role_name}.yaml"
                if not held:
                    config["data"][f"{role_name}{CANARY_SUFFIX}.yaml"] = canary_config(
                        obj["data"][key], traffic_percent
                    )
                config["data"][key] = old_configs[key]
            objects.append(config)
        else:
            objects.append(obj)
    # Right after the stable Deployments: a canary pod starts once its config is there.
    at = max(i for i, obj in enumerate(objects) if obj["kind"] == "Deployment") + 1
    objects[at:at] = canaries
    return Staged("held" if held else "canary", objects, tuple(roles), revision)


def canary_config(config: str, traffic_percent: int) -> str:
    """A role's config file as its canary pod reads it: the new flags, and its track."""
    return (
        config
        + f"# A canary: the router sends it {traffic_percent}% of the role's requests.\n"
        + f"track: canary\ntraffic-weight: {traffic_percent / 100:g}\n"
    )


def canary_deployment(
    deployment: Mapping[str, Any], traffic_percent: int, revision: str
) -> dict[str, Any]:
    """The one-pod Deployment of a role's canary, from the role's Deployment in the new render."""
    canary = copy.deepcopy(dict(deployment))
    role = canary["metadata"]["labels"][COMPONENT_LABEL]
    canary["metadata"]["name"] += CANARY_SUFFIX
    canary["metadata"]["labels"][TRACK_LABEL] = CANARY_TRACK
    spec = canary["spec"]
    spec["replicas"] = 1
    spec["selector"]["matchLabels"][TRACK_LABEL] = CANARY_TRACK
    template = spec["template"]
    template["metadata"]["labels"][TRACK_LABEL] = CANARY_TRACK
    container = template["spec"]["containers"][0]
    container["args"] = [
        arg.replace(f"/{role}.yaml", f"/{role}{CANARY_SUFFIX}.yaml") for arg in container["args"]
    ]
    annotations = template["metadata"]["annotations"]
    annotations[SPEC_HASH] = template_digest(template["spec"], traffic_percent, annotations)
    annotations[CANARY_REVISION] = revision
    return canary


def is_canary(obj: Mapping[str, Any]) -> bool:
    """Whether a Deployment (or pod) is a canary's."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(TRACK_LABEL) == CANARY_TRACK


def _config_texts(rendered: Rendered) -> dict[str, str]:
    config_map = next(obj for obj in rendered.objects if obj["kind"] == "ConfigMap")
    return dict(config_map["data"])


def rollout_steps(name: str, before: Rendered, after: Rendered) -> list[str]:
    """The steps a change of resource `name` from `before` to `after` goes through, in order,
    as `tidegate plan --from` shows them."""
    changes = role_changes(before, after)
    rolling = [c for c in changes if c.kind == "rolls"]
    replaced = [
        f"{c.deployment} is replaced ({c.pod_parts[0]}): the old pods stop as the new ones "
        "start, with no surge between the two kinds"
        for c in changes
        if c.kind == "replaced"
    ]
    if not rolling:
        if replaced:
            return replaced
        return ["no pod restarts"] if all(c.kind != "added" for c in changes) else []
    if replaced:
        return [*replaced, "every other changed role rolls at once, surge-first"]
    staged = stage(after, before, rolled_back=None, traffic_percent=1)
    if staged.mode != "canary":
        why = (
            "rollout.strategy is rolling"
            if not after.spec.canary()
            else "the roles themselves change, which no canary can try"
        )
        return [f"every changed role rolls at once, surge-first ({why})"]
    canary = after.spec.rollout.canary
    sizes = [str(size) for size in policy_of(after.spec).look_sizes()]
    policy = sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} and {sizes[-1]}"
    names = ", ".join(f"{c.deployment}{CANARY_SUFFIX}" for c in rolling)
    return [
        f"1. canary: {names} (1 pod each) run(s) the new template beside the unchanged stable "
        f"pods and get {canary.traffic_percent}% of the role's requests from the router",
        f"2. compare with the stable pods at {policy} canary requests: TTFT and ITL may be "
        f"{canary.latency_margin_percent}% slower (a rank test), failures "
        f"{canary.error_margin_percent}% more often; a canary pod that restarts, or one not "
        f"judged good enough within {canary.timeout_seconds} s, is rolled back",
        "3a. promoted: "
        + ", ".join(c.deployment for c in rolling)
        + " roll(s) surge-first to the new template, then the canary is deleted",
        f"3b. rolled back: the canary is deleted, the stable pods stay, and this change "
        f"(revision {staged.revision}) is not tried again until the spec changes it",
        f"by hand: kubectl annotate llmd {name} {CANARY_ANNOTATION}=promote (or abort)",
    ]
