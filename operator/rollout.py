"""What a change of an LLMDeployment rolls, and why: the renders before and after, compared.

A role's pods restart when its Deployment's pod template changes, which the renderer sums up
in the template's spec hash (`tidegate.dev/spec-hash`: the pod spec and the role's config
file). `role_changes` says, for each role, whether that hash moves, which engine flags of its
config file change (from what to what), and which parts of the pod spec do; a change of
replicas alone restarts nothing. `tidegate plan -f NEW --from OLD` prints it, with the steps
the Deployment controller then takes (surge-first: a new pod beside the old ones, one at a
time, an old one removed only once the new one is ready).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from tidegate.operator.labels import COMPONENT_LABEL
from tidegate.operator.render import SPEC_HASH, Rendered

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
    """One role's Deployment across the change."""

    role: str
    deployment: str
    # "added", "removed", "rolls" (new pod template), "scales" (replicas only), "unchanged".
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
        if obj["kind"] == "Deployment"
    }


def _configs(rendered: Rendered) -> dict[str, dict[str, Any]]:
    """Each role's config file (`<role>.yaml` of the ConfigMap), parsed."""
    config_map = next(obj for obj in rendered.objects if obj["kind"] == "ConfigMap")
    return {
        key.removesuffix(".yaml"): yaml.safe_load(text) or {}
        for key, text in config_map["data"].items()
        if key.endswith(".yaml")
    }


def _hash(deployment: Mapping[str, Any]) -> str | None:
    annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
    return annotations.get(SPEC_HASH)


def _flag_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[FlagChange]:
    return [
        FlagChange(flag, before.get(flag), after.get(flag))
        for flag in sorted(before.keys() | after.keys())
        if before.get(flag) != after.get(flag)
    ]


def _pod_parts(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    old_pod = before["spec"]["template"]["spec"]
    new_pod = after["spec"]["template"]["spec"]
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
