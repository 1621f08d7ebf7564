"""The autoscalers other than the operator's own: a KEDA ScaledObject or an HPA per pool.

With `spec.autoscaling.driver: keda` or `hpa`, each pool that has a policy gets one object
that targets its Deployment; the HPA controller (directly, or through the HPA that KEDA
makes) then sets the Deployment's replicas. Each carries the policy's bounds and, as its
behavior, the policy's stabilization windows and rate limits, which are the HPA's own rules
(`operator/autoscaler.py` follows them too). The signals differ in how they reach the HPA:

- KEDA queries Prometheus, so a trigger may compute what `decide` computes: demand (running,
  waiting and router-held requests) over `requestsPerReplica`; the replicas the queue above
  `waitingRequestsPerReplica` asks for; the summed KV-cache usage over its target. A pool
  with minReplicas 0 goes to zero after `idleBeforeZeroSeconds` without demand (KEDA's
  cooldownPeriod) and wakes on the first request, held by the router meanwhile.
- An HPA reads Pods metrics, one value per pod, from a metrics adapter (prometheus-adapter
  with the rules in docs/autoscaling-drivers.md): running plus waiting requests against
  `requestsPerReplica`, waiting requests against `waitingRequestsPerReplica` (the HPA's
  averaging: mean waiting per pod), KV-cache usage against its target.

Series are picked by the labels the chart's PodMonitor and ServiceMonitor put on them:
`namespace`, and `llmdeployment` and `role` from the pods' labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidegate.operator.autoscaler import PoolTargets, pool_targets
from tidegate.operator.spec import (
    AutoscalingPolicy,
    LLMDeploymentSpec,
    ScaleDownRules,
    ScaleUpRules,
)

# How often KEDA asks Prometheus: the HPA controller's own sync period, so a pool at zero
# wakes within it.
KEDA_POLLING_INTERVAL_S = 15
# The metric names an HPA asks the custom metrics API for (the adapter's rules name them).
HPA_REQUESTS_METRIC = "tidegate_requests"
HPA_WAITING_METRIC = "tidegate_num_requests_waiting"
HPA_KV_METRIC = "tidegate_kv_cache_usage_perc"

Metadata = Callable[[str, str], dict[str, Any]]


def scaler_objects(
    spec: LLMDeploymentSpec, name: str, namespace: str, metadata: Metadata
) -> list[dict[str, Any]]:
    """One ScaledObject (keda) or HorizontalPodAutoscaler (hpa) per autoscaled pool."""
    autoscaling = spec.autoscaling
    if autoscaling is None or autoscaling.driver == "operator":
        return []
    objects = []
    for role, policy in autoscaling.policies().items():
        slo = spec.scheduling.slo
        targets = pool_targets(policy, role, spec.scheduling.max_num_seqs, slo.ttft_ms, slo.itl_ms)
        pool = _Pool(name, namespace, role, policy, targets, router=spec.has_router())
        meta = metadata(pool.deployment, role)
        if autoscaling.driver == "keda":
            assert autoscaling.prometheus is not None  # the spec's rule
            objects.append(pool.scaled_object(meta, autoscaling.prometheus.server_address))
        else:
            objects.append(pool.horizontal_pod_autoscaler(meta))
    return objects


def behavior(policy: AutoscalingPolicy) -> dict[str, Any]:
    """The HPA's behavior for a policy: its windows, and pods or percent per period (the more)."""
    return {"scaleUp": _rules(policy.scale_up), "scaleDown": _rules(policy.scale_down)}


def _rules(rules: ScaleUpRules | ScaleDownRules) -> dict[str, Any]:
    policies = [{"type": "Pods", "value": rules.pods, "periodSeconds": rules.period_seconds}]
    # percent 0 means pods alone; the HPA refuses a Percent policy of value 0.
    if rules.percent:
        policies.append(
            {"type": "Percent", "value": rules.percent, "periodSeconds": rules.period_seconds}
        )
    return {
        "stabilizationWindowSeconds": rules.stabilization_window_seconds,
        "selectPolicy": "Max",
        "policies": policies,
    }


class _Pool:
    """One autoscaled pool: its Deployment, policy, resolved targets, and its series."""

    def __init__(
        self,
        name: str,
        namespace: str,
        role: str,
        policy: AutoscalingPolicy,
        targets: PoolTargets,
        router: bool,
    ) -> None:
        self.name, self.namespace, self.role = name, namespace, role
        self.policy, self.targets, self.router = policy, targets, router
        self.deployment = name if role == "unified" else f"{name}-{role}"

    def scale_target(self) -> dict[str, str]:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "name": self.deployment}

    def series(self, metric: str, role: str | None = None, **labels: str) -> str:
        """`metric` of this resource's pods of `role` (this pool's when None)."""
        matchers = {
            "namespace": self.namespace,
            "llmdeployment": self.name,
            "role": role or self.role,
            **labels,
        }
        inside = ",".join(f'{key}="{value}"' for key, value in matchers.items())
        return f"tidegate:{metric}{{{inside}}}"

    # -- KEDA -----------------------------------------------------------------------------

    def scaled_object(self, meta: dict[str, Any], server_address: str) -> dict[str, Any]:
        policy = self.policy
        spec: dict[str, Any] = {
            "scaleTargetRef": self.scale_target(),
            "minReplicaCount": policy.min_replicas,
            "maxReplicaCount": policy.max_replicas,
            "pollingInterval": KEDA_POLLING_INTERVAL_S,
        }
        if policy.min_replicas == 0:
            # KEDA takes the pool to zero once no trigger is active for this long.
            spec["cooldownPeriod"] = policy.idle_before_zero_seconds
        spec["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": behavior(policy)}}
        spec["triggers"] = [
            _prometheus_trigger(name, server_address, query, threshold, activation)
            for name, query, threshold, activation in self.keda_signals()
        ]
        return {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": meta,
            "spec": spec,
        }

    def keda_signals(self) -> list[tuple[str, str, str, str | None]]:
        """(trigger name, PromQL, threshold, activation threshold) of each signal.

        With AverageValue targets the HPA asks for ceil(value / threshold) replicas. A
        trigger is active (keeps the pool from zero, wakes it) while its value exceeds its
        activation threshold, 0 unless given.
        """
        targets = self.targets
        running = f"(sum({self.series('num_requests_running')}) or vector(0))"
        waiting = f"(sum({self.series('num_requests_waiting')}) or vector(0))"
        demand = f"{running} + {waiting}"
        if self.router:
            held = self.series("router_pending_requests", "router", pool=self.role)
            demand += f" + (sum({held}) or vector(0))"
        # Pods whose engines report, as `decide` counts ready replicas.
        pods = f"count(count by (pod) ({self.series('num_requests_waiting')}))"
        excess = f"({waiting} - {targets.waiting_per_replica} * {pods})"
        # As `decide`: the queue votes only while it is over target, for the ready pods plus
        # one per requestsPerReplica of the excess (the value is that count; threshold 1).
        queue = f"({pods} + ceil({excess} / {targets.requests_per_replica})) and ({excess} > 0)"
        kv = f"sum(avg by (pod) ({self.series('kv_cache_usage_perc')}))"
        # Only demand may keep a pool from zero: cached blocks of an idle pool must not. A sum
        # of fractions over at most maxReplicas pods never exceeds maxReplicas.
        kv_activation = str(self.policy.max_replicas) if self.policy.min_replicas == 0 else None
        return [
            ("requests", demand, str(targets.requests_per_replica), None),
            ("queue", queue, "1", None),
            ("kvCache", kv, f"{targets.kv_cache_usage:g}", kv_activation),
        ]

    # -- HPA ------------------------------------------------------------------------------

    def horizontal_pod_autoscaler(self, meta: dict[str, Any]) -> dict[str, Any]:
        targets = self.targets
        kv_milli = round(targets.kv_cache_usage * 1000)
        metrics = [_pods_metric(HPA_REQUESTS_METRIC, str(targets.requests_per_replica))]
        # An average target must be above 0; at 0 the requests metric, which counts the
        # waiting requests too, is the queue's signal.
        if targets.waiting_per_replica:
            metrics.append(_pods_metric(HPA_WAITING_METRIC, str(targets.waiting_per_replica)))
        # As the API server writes the quantity back ("1000m" becomes "1"), so that the
        # reconcile finds the live HPA equal to the rendered one.
        kv = str(kv_milli // 1000) if kv_milli % 1000 == 0 else f"{kv_milli}m"
        metrics.append(_pods_metric(HPA_KV_METRIC, kv))
        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": meta,
            "spec": {
                "scaleTargetRef": self.scale_target(),
                "minReplicas": self.policy.min_replicas,
                "maxReplicas": self.policy.max_replicas,
                "metrics": metrics,
                "behavior": behavior(self.policy),
            },
        }


def _prometheus_trigger(
    name: str, server_address: str, query: str, threshold: str, activation: str | None
) -> dict[str, Any]:
    metadata = {"serverAddress": server_address, "query": query, "threshold": threshold}
    if activation is not None:
        metadata["activationThreshold"] = activation
    return {"type": "prometheus", "name": name, "metricType": "AverageValue", "metadata": metadata}


def _pods_metric(name: str, average: str) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": average},
        },
    }
