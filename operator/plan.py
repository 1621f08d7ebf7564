"""`tidegate plan -f FILE`: what the operator would create for a manifest, and why; no cluster.

With `--from OLD` (the manifest as it is now), also what the change rolls: each role's pods
that restart, and the flags or pod parts that make them (operator/rollout.py).
"""

from __future__ import annotations

from typing import Any, TextIO

import yaml

from tidegate.operator.autoscaler import DEFAULT_START_TIME_S, pool_targets, starting_replicas
from tidegate.operator.render import ADAPTERS_KEY, Rendered, RenderOptions, lora_limits, render
from tidegate.operator.rollout import RoleChange
from tidegate.operator.spec import AutoscalingPolicy, LLMDeploymentSpec, ModelSource


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the engine config files) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def plan(resources: list[dict[str, Any]], options: RenderOptions) -> list[Rendered]:
    """Render each resource; SpecError/TuningError propagate with the user's message."""
    return [render(resource, options) for resource in resources]


def write_yaml(resources: list[dict[str, Any]], plans: list[Rendered], out: TextIO) -> None:
    """Every object as a multi-document YAML stream, ready for `kubectl apply -f -`."""
    for resource, rendered in zip(resources, plans, strict=True):
        out.write(f"# {resource['metadata']['name']}: {rendered.endpoint}\n")
        for reason in rendered.tuning.reasons():
            out.write(f"#   {reason}\n")
        for role, row in _scaling_rows(rendered):
            if row[0] == "replicas":
                out.write(f"#   {role}.replicas={row[1]}: {row[2]}\n")
        if rendered.spec.adapters is not None:
            out.write(f"#   {_adapters_heading(rendered.spec)}\n")
        if rendered.kv_keys is not None:
            out.write(f"#   {_kv_keys_note(rendered.kv_keys)}\n")
        for obj in rendered.objects:
            out.write("---\n")
            out.write(yaml.dump(obj, Dumper=_BlockDumper, sort_keys=False, width=100))


def write_table(
    resources: list[dict[str, Any]],
    plans: list[Rendered],
    out: TextIO,
    changes: dict[str, list[RoleChange]] | None = None,
    steps: dict[str, list[str]] | None = None,
) -> None:
    """The objects, and the tuned engine flags with the reason for each; with `changes` (by
    resource name), what the change from the old manifest rolls, and `steps` it goes through."""
    for resource, rendered in zip(resources, plans, strict=True):
        meta = resource["metadata"]
        out.write(f"{meta['name']} ({meta.get('namespace') or 'default'}): {rendered.endpoint}\n\n")
        rows = [(obj["kind"], obj["metadata"]["name"]) for obj in rendered.objects]
        if rendered.kv_keys is not None:
            rows.append(("Secret", f"{rendered.kv_keys['metadata']['name']} (made once)"))
        out.write(_table(("KIND", "NAME"), rows))
        if rendered.kv_keys is not None:
            out.write(f"{_kv_keys_note(rendered.kv_keys)}\n")
        out.write("\n")
        out.write(_table(("ROLE", "FLAG", "VALUE", "REASON"), _tuning_rows(rendered)))
        out.write("\n")
        if rendered.spec.adapters is not None:
            out.write(_adapters_section(rendered))
            out.write("\n")
        rows = [(role, *row) for role, row in _scaling_rows(rendered)]
        out.write(_table(("ROLE", "SCALING", "VALUE", "REASON"), rows))
        out.write("\n")
        if changes is not None:
            out.write(_changes_section(changes.get(meta["name"])))
            out.write("\n")
            for step in (steps or {}).get(meta["name"], []):
                out.write(f"  {step}\n")
            if (steps or {}).get(meta["name"]):
                out.write("\n")


def _kv_keys_note(kv_keys: dict[str, Any]) -> str:
    """What the Secret of the KV key pair is, and who makes it: not in the objects, since a
    pure render has no key."""
    name = kv_keys["metadata"]["name"]
    return (
        f"Secret {name}: the key pair both pools encrypt the KV transfer with; the operator "
        f"creates it once. Applied without the operator, create it first: kubectl create "
        f"secret generic {name} --from-file=public.key --from-file=secret.key"
    )


def _changes_section(changes: list[RoleChange] | None) -> str:
    if changes is None:
        return "change: new in this manifest, nothing runs yet\n"
    rows = [(c.role, c.deployment, c.describe()) for c in changes]
    return _table(("ROLE", "DEPLOYMENT", "WHAT THE CHANGE DOES"), rows)


def _tuning_rows(rendered: Rendered) -> list[tuple[str, ...]]:
    """Each role's tuned flags, then its LoRA limits (the same in every role)."""
    limits = lora_limits(rendered.spec)
    rows = []
    for role, role_tuning in rendered.tuning.roles.items():
        for name, choice in role_tuning.choices().items():
            value = f"{choice.value}" + (" (set)" if choice.user_set else "")
            rows.append((role, name, value, choice.reason))
        for limit in limits:
            value = f"{limit.value}" + (" (set)" if limit.user_set else "")
            rows.append((role, limit.name, value, limit.reason))
    return rows


def _adapters_heading(spec: LLMDeploymentSpec) -> str:
    """How many adapters every engine role serves, and their names."""
    adapters = spec.adapters or []
    if not adapters:
        return "adapters: none yet (LoRA is on, the list is empty)"
    names = ", ".join(adapter.name for adapter in adapters)
    return f"adapters: {len(adapters)}, served by every engine role: {names}"


def _adapters_section(rendered: Rendered) -> str:
    """The adapters heading, and each adapter's source and folder in the pods."""
    heading = _adapters_heading(rendered.spec) + "\n"
    config_map = next(obj for obj in rendered.objects if obj["kind"] == "ConfigMap")
    listed = yaml.safe_load(config_map["data"][ADAPTERS_KEY]) or []
    folders = {entry["name"]: entry["path"] for entry in listed}
    rows = [
        (adapter.name, _source_text(adapter.source), folders[adapter.name])
        for adapter in rendered.spec.adapters or []
    ]
    if not rows:
        return heading
    return heading + "\n" + _table(("ADAPTER", "SOURCE", "FOLDER IN THE PODS"), rows)


def _source_text(source: ModelSource) -> str:
    if source.pvc is not None:
        return f"pvc {source.pvc.claim_name}" + (f":{source.pvc.path}" if source.pvc.path else "")
    if source.host_path is not None:
        return f"hostPath {source.host_path.path}"
    return f"uri {source.uri}"


# Who sets an autoscaled pool's replicas, by spec.autoscaling.driver.
DRIVERS = {"operator": "the operator", "keda": "KEDA", "hpa": "the HPA controller"}


def _scaling_rows(rendered: Rendered) -> list[tuple[str, tuple[str, str, str]]]:
    """Each pool's replicas, and for an autoscaled one its policy, with what each value does."""
    spec = rendered.spec
    policies = spec.autoscaling.policies() if spec.autoscaling else {}
    rows = []
    for role, pool in spec.topology.roles().items():
        policy = policies.get(role)
        if policy is None:
            why = f"fixed: no autoscaling.{role}"
            nodes = rendered.tuning.roles[role].nodes_per_replica
            if nodes > 1:
                why += (
                    f"; each replica a group of {nodes} pods, one per node (LeaderWorkerSet), "
                    "restarted together"
                )
            rows.append((role, ("replicas", str(pool.replicas), why)))
            continue
        rows += [(role, row) for row in _policy_rows(spec, role, policy, pool.replicas)]
    return rows


def _policy_rows(
    spec: LLMDeploymentSpec, role: str, policy: AutoscalingPolicy, replicas: int
) -> list[tuple[str, str, str]]:
    slo = spec.scheduling.slo
    targets = pool_targets(policy, role, spec.scheduling.max_num_seqs, slo.ttft_ms, slo.itl_ms)
    given = policy.targets.requests_per_replica is not None
    bounds = f"{policy.min_replicas}-{policy.max_replicas}"
    start = starting_replicas(policy, replicas)
    zero = (
        f"; to 0 after {policy.idle_before_zero_seconds} s without a request, the router holds "
        "requests and wakes it"
        if policy.min_replicas == 0
        else ""
    )
    up, down = policy.scale_up, policy.scale_down
    latency = (
        f"p90 {targets.latency_name} <= {targets.latency_slo_s * 1000:.0f} ms"
        if targets.latency_slo_s is not None
        else "off"
    )
    driver = spec.autoscaling.driver if spec.autoscaling else "operator"
    return [
        ("replicas", bounds, f"autoscaled by {DRIVERS[driver]}, starts at {start}{zero}"),
        (
            "requestsPerReplica",
            f"{targets.requests_per_replica}" + (" (set)" if given else ""),
            "running + waiting requests one replica carries"
            + ("" if given else "; default: scheduling.maxNumSeqs"),
        ),
        (
            "waitingRequestsPerReplica",
            str(targets.waiting_per_replica),
            "above it, one more replica per requestsPerReplica of the excess",
        ),
        (
            "kvCacheUsagePercent",
            str(policy.targets.kv_cache_usage_percent),
            "grows above, shrinks below (10% tolerance)",
        ),
        ("slo", latency, "grows while missed" if targets.latency_slo_s else "not a target"),
        (
            "scaleUp",
            f"{up.pods} pods or {up.percent}% per {up.period_seconds} s, "
            f"window {up.stabilization_window_seconds} s",
            "grows to the lowest recommendation of the window; after growing, KV and latency "
            f"wait a pod's measured start time ({DEFAULT_START_TIME_S:.0f} s until measured)",
        ),
        (
            "scaleDown",
            f"{down.pods} pods or {down.percent}% per {down.period_seconds} s, "
            f"window {down.stabilization_window_seconds} s",
            "shrinks to the highest recommendation of the window; never while pods are "
            "pending or a rollout runs",
        ),
    ]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    return "\n".join(lines) + "\n"
