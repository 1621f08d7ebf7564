"""The KEDA and HPA drivers, and the router in front of a unified pool that may reach zero.

What a user would notice: with `driver: keda` or `hpa` each autoscaled pool gets one
ScaledObject or HPA aimed at its Deployment, with the policy's bounds, windows and rate
limits, and signals on the engines' metrics against the policy's targets; the Deployments'
replicas stay what they were; a unified pool that may reach zero is reached through a
router (which holds requests at zero), and `tidegate plan` lists all of it. Schema checks
of these objects (KEDA's published CRD, Kubernetes 1.30 and 1.37 strict) run with every
other rendered object in test_render.py.
"""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.test_render import (
    KEDA_SCALED_OBJECTS,
    ROUTER_FLAGS,
    config_map,
    deployments,
    disaggregated,
    find,
    main_container,
    model,
    pod_labels,
    render_spec,
    selects,
)
from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.args import load_config_file
from tidegate.operator.plan import write_table
from tidegate.operator.render import Rendered
from tidegate.operator.render_scalers import (
    HPA_KV_METRIC,
    HPA_REQUESTS_METRIC,
    HPA_WAITING_METRIC,
    behavior,
)
from tidegate.operator.spec import AutoscalingPolicy

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


def keda(**policies: Any) -> dict[str, Any]:
    return {"driver": "keda", "prometheus": {"serverAddress": PROMETHEUS}, **policies}


def of_kind(rendered: Rendered, kind: str) -> list[dict[str, Any]]:
    return [obj for obj in rendered.objects if obj["kind"] == kind]


def triggers(scaled_object: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in scaled_object["spec"]["triggers"]}


# --- KEDA -------------------------------------------------------------------------------------


def test_keda_renders_one_scaled_object_per_autoscaled_pool() -> None:
    rendered = render_spec(
        {
            "model": model(),
            "topology": disaggregated(),
            "autoscaling": keda(decode={"minReplicas": 2, "maxReplicas": 9}),
        },
        namespace="team-a",
    )
    (scaled,) = of_kind(rendered, "ScaledObject")  # prefill has no policy: fixed replicas
    assert scaled["metadata"]["name"] == "llm-decode"
    assert scaled["metadata"]["namespace"] == "team-a"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "llm-decode",
    }
    find(rendered, "Deployment", "llm-decode")
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 9)
    assert "cooldownPeriod" not in spec  # only a pool that may reach zero goes idle
    assert not of_kind(rendered, "HorizontalPodAutoscaler")


def test_keda_triggers_query_the_pool_against_the_policy_targets() -> None:
    rendered = render_spec(
        {
            "model": model(),
            "scheduling": {"maxNumSeqs": 64},
            "autoscaling": keda(
                unified={
                    "minReplicas": 1,
                    "maxReplicas": 5,
                    "targets": {"waitingRequestsPerReplica": 3, "kvCacheUsagePercent": 75},
                }
            ),
        },
        namespace="team-a",
    )
    (scaled,) = of_kind(rendered, "ScaledObject")
    found = triggers(scaled)
    assert set(found) == {"requests", "queue", "kvCache"}
    pool = 'namespace="team-a",llmdeployment="llm",role="unified"'
    for trigger in found.values():
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["serverAddress"] == PROMETHEUS
        assert pool in trigger["metadata"]["query"]
    requests = found["requests"]["metadata"]
    # requestsPerReplica absent: a full batch, scheduling.maxNumSeqs.
    assert requests["threshold"] == "64"
    assert f"tidegate:num_requests_running{{{pool}}}" in requests["query"]
    assert f"tidegate:num_requests_waiting{{{pool}}}" in requests["query"]
    # No router in front of this pool (it cannot reach zero): nothing else holds requests.
    assert "router_pending_requests" not in requests["query"]
    queue = found["queue"]["metadata"]
    assert queue["threshold"] == "1"  # the query is the replicas the queue asks for
    assert " - 3 * count(count by (pod)" in queue["query"]
    assert "/ 64))" in queue["query"]
    assert found["kvCache"]["metadata"]["threshold"] == "0.75"
    assert "kv_cache_usage_perc" in found["kvCache"]["metadata"]["query"]
    # Above zero activation is moot: no trigger sets it.
    assert all("activationThreshold" not in t["metadata"] for t in found.values())


def test_keda_pool_that_may_reach_zero_idles_and_wakes_on_demand_alone() -> None:
    rendered = render_spec(
        {
            "model": model(),
            "autoscaling": keda(
                unified={"minReplicas": 0, "maxReplicas": 6, "idleBeforeZeroSeconds": 900}
            ),
        }
    )
    (scaled,) = of_kind(rendered, "ScaledObject")
    spec = scaled["spec"]
    assert spec["minReplicaCount"] == 0
    assert spec["cooldownPeriod"] == 900
    found = triggers(scaled)
    # Requests the router holds for the pool count as demand: they wake it from zero.
    held = (
        'tidegate:router_pending_requests{namespace="ml",llmdeployment="llm",role="router",'
        'pool="unified"}'
    )
    assert held in found["requests"]["metadata"]["query"]
    assert "activationThreshold" not in found["requests"]["metadata"]
    # KV usage (a sum of fractions, one per pod, at most maxReplicas) never keeps it awake.
    assert found["kvCache"]["metadata"]["activationThreshold"] == "6"


def test_keda_and_hpa_behavior_is_the_policy_windows_and_rate_limits() -> None:
    policy = {
        "minReplicas": 1,
        "maxReplicas": 40,
        "scaleUp": {
            "stabilizationWindowSeconds": 30,
            "pods": 2,
            "percent": 50,
            "periodSeconds": 20,
        },
        "scaleDown": {
            "stabilizationWindowSeconds": 600,
            "pods": 3,
            "percent": 0,
            "periodSeconds": 120,
        },
    }
    want = {
        "scaleUp": {
            "stabilizationWindowSeconds": 30,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Pods", "value": 2, "periodSeconds": 20},
                {"type": "Percent", "value": 50, "periodSeconds": 20},
            ],
        },
        # percent 0: pods alone (the HPA refuses a Percent policy of 0).
        "scaleDown": {
            "stabilizationWindowSeconds": 600,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": 3, "periodSeconds": 120}],
        },
    }
    scaled = of_kind(
        render_spec({"model": model(), "autoscaling": keda(unified=policy)}), "ScaledObject"
    )
    assert scaled[0]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == want
    hpa = of_kind(
        render_spec({"model": model(), "autoscaling": {"driver": "hpa", "unified": policy}}),
        "HorizontalPodAutoscaler",
    )
    assert hpa[0]["spec"]["behavior"] == want


@pytest.mark.parametrize("start", [1, 3, 10, 57])
def test_hpa_rate_limits_allow_what_the_policy_says(start: int) -> None:
    """`pods` or `percent` of the pool at the period's start, whichever is more (the HPA's sums)."""
    policy = AutoscalingPolicy.model_validate(
        {
            "maxReplicas": 1000,
            "scaleUp": {"pods": 4, "percent": 100},
            "scaleDown": {"pods": 1, "percent": 10},
        }
    )
    rules = behavior(policy)

    def allowed(direction: str) -> int:
        limits = []
        for rule in rules[direction]["policies"]:
            if rule["type"] == "Pods":
                limits.append(rule["value"])
            elif direction == "scaleUp":  # the HPA: ceil(start * (1 + percent / 100)) - start
                limits.append(math.ceil(start * (1 + rule["value"] / 100)) - start)
            else:  # start - ceil(start * (1 - percent / 100))
                limits.append(start - math.ceil(start * (1 - rule["value"] / 100)))
        return max(limits)

    assert allowed("scaleUp") == max(4, math.ceil(start * 100 / 100))
    assert allowed("scaleDown") == max(1, math.floor(start * 10 / 100))


def test_keda_fixture_refuses_an_unknown_field_and_min_over_max() -> None:
    """The ScaledObject check is strict and runs KEDA's own CEL rule."""
    rendered = render_spec({"model": model(), "autoscaling": keda(unified={"maxReplicas": 3})})
    (scaled,) = of_kind(rendered, "ScaledObject")
    assert KEDA_SCALED_OBJECTS.validate(scaled) == []
    misspelt = copy.deepcopy(scaled)
    misspelt["spec"]["maxReplicas"] = 3
    assert KEDA_SCALED_OBJECTS.validate(misspelt) == ['unknown field "spec.maxReplicas"']
    inverted = copy.deepcopy(scaled)
    inverted["spec"]["minReplicaCount"] = 4
    assert any(
        "minReplicaCount must be less than or equal to maxReplicaCount" in error
        for error in KEDA_SCALED_OBJECTS.validate(inverted)
    )


# --- HPA --------------------------------------------------------------------------------------


def test_hpa_renders_one_per_pool_on_pods_metrics() -> None:
    rendered = render_spec(
        {
            "model": model(),
            "topology": disaggregated(prefill={"replicas": 2}, decode={"replicas": 3}),
            "autoscaling": {
                "driver": "hpa",
                "prefill": {
                    "minReplicas": 1,
                    "maxReplicas": 4,
                    "targets": {"requestsPerReplica": 8},
                },
                "decode": {
                    "minReplicas": 3,
                    "maxReplicas": 12,
                    "targets": {"waitingRequestsPerReplica": 5, "kvCacheUsagePercent": 90},
                },
            },
        }
    )
    hpas = {h["metadata"]["name"]: h for h in of_kind(rendered, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"llm-prefill", "llm-decode"}
    assert not of_kind(rendered, "ScaledObject")
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        assert all(metric["type"] == "Pods" for metric in hpa["spec"]["metrics"])
    prefill, decode = hpas["llm-prefill"]["spec"], hpas["llm-decode"]["spec"]
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (1, 4)
    assert (decode["minReplicas"], decode["maxReplicas"]) == (3, 12)

    def targets(spec: dict[str, Any]) -> dict[str, str]:
        return {
            m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
            for m in spec["metrics"]
        }

    assert targets(prefill) == {
        HPA_REQUESTS_METRIC: "8",
        HPA_WAITING_METRIC: "2",
        HPA_KV_METRIC: "800m",
    }
    # requestsPerReplica absent: scheduling.maxNumSeqs (256 by default).
    assert targets(decode) == {
        HPA_REQUESTS_METRIC: "256",
        HPA_WAITING_METRIC: "5",
        HPA_KV_METRIC: "900m",
    }


@pytest.mark.parametrize(("percent", "quantity"), [(100, "1"), (80, "800m"), (1, "10m")])
def test_hpa_kv_target_is_the_canonical_quantity(percent: int, quantity: str) -> None:
    """The API server stores quantities canonically; another spelling would re-apply forever."""
    targets = {"kvCacheUsagePercent": percent}
    rendered = render_spec(
        {
            "model": model(),
            "autoscaling": {"driver": "hpa", "unified": {"maxReplicas": 2, "targets": targets}},
        }
    )
    (hpa,) = of_kind(rendered, "HorizontalPodAutoscaler")
    (kv,) = [m for m in hpa["spec"]["metrics"] if m["pods"]["metric"]["name"] == HPA_KV_METRIC]
    assert kv["pods"]["target"]["averageValue"] == quantity


def test_hpa_without_a_waiting_target_leaves_the_queue_to_the_requests_metric() -> None:
    rendered = render_spec(
        {
            "model": model(),
            "autoscaling": {
                "driver": "hpa",
                "unified": {"maxReplicas": 3, "targets": {"waitingRequestsPerReplica": 0}},
            },
        }
    )
    (hpa,) = of_kind(rendered, "HorizontalPodAutoscaler")
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == [HPA_REQUESTS_METRIC, HPA_KV_METRIC]


# --- what the drivers leave alone -------------------------------------------------------------


@pytest.mark.parametrize("driver", ["operator", "keda", "hpa"])
def test_drivers_change_no_deployment(driver: str) -> None:
    """Replicas and pods are the driver's business only through the scaler object."""
    autoscaling = keda() if driver == "keda" else {"driver": driver}
    spec = {
        "model": model(),
        "topology": disaggregated(prefill={"replicas": 2}, decode={"replicas": 3}),
    }
    policies = {"prefill": {"minReplicas": 1, "maxReplicas": 4}, "decode": {"maxReplicas": 6}}
    fixed = render_spec(
        {**spec, "autoscaling": {"prefill": policies["prefill"], "decode": policies["decode"]}}
    )
    driven = render_spec({**spec, "autoscaling": {**autoscaling, **policies}})
    assert deployments(driven) == deployments(fixed)
    scalers = {"ScaledObject", "HorizontalPodAutoscaler"}
    assert [o for o in driven.objects if o["kind"] not in scalers] == fixed.objects
    assert bool(of_kind(driven, "ScaledObject")) == (driver == "keda")
    assert bool(of_kind(driven, "HorizontalPodAutoscaler")) == (driver == "hpa")


@pytest.mark.parametrize("driver", ["operator", "keda", "hpa"])
def test_an_autoscaled_pool_starts_within_its_bounds_and_is_left_to_its_driver(
    driver: str,
) -> None:
    """The rendered replicas are the pool's start; `scaled` tells the reconcile to send them
    only when it creates the Deployment, whichever driver sets them afterwards."""
    autoscaling = keda() if driver == "keda" else {"driver": driver}
    spec = {
        "model": model(),
        "topology": disaggregated(prefill={"replicas": 1}, decode={"replicas": 9}),
        "autoscaling": {**autoscaling, "prefill": {"minReplicas": 2, "maxReplicas": 4}},
    }
    rendered = render_spec(spec)
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in deployments(rendered)}
    assert replicas == {"llm-prefill": 2, "llm-decode": 9, "llm-router": 1}
    assert rendered.scaled == {"llm-prefill"}


# --- a unified pool that may reach zero, behind a router --------------------------------------

ZERO = {"unified": {"minReplicas": 0, "maxReplicas": 4}}


def kinds_and_names(rendered: Rendered) -> list[tuple[str, str]]:
    return [(obj["kind"], obj["metadata"]["name"]) for obj in rendered.objects]


@pytest.mark.parametrize("driver", ["operator", "keda"])
def test_unified_pool_that_may_reach_zero_gets_a_router_in_front(driver: str) -> None:
    autoscaling = {**(keda() if driver == "keda" else {}), **ZERO}
    rendered = render_spec({"model": model(), "autoscaling": autoscaling})
    expected = [
        ("ConfigMap", "llm-config"),
        ("Deployment", "llm"),
        ("Deployment", "llm-router"),
        ("Service", "llm"),
        ("Service", "llm-unified"),
        ("PodDisruptionBudget", "llm"),
        ("PodDisruptionBudget", "llm-router"),
        # The router follows the engines' KV-cache events, which only it may read.
        ("NetworkPolicy", "llm-cache-events"),
    ]
    if driver == "keda":
        expected.append(("ScaledObject", "llm"))
    assert kinds_and_names(rendered) == expected
    router, engines = (
        find(rendered, "Deployment", "llm-router"),
        find(rendered, "Deployment", "llm"),
    )
    public = find(rendered, "Service", "llm")
    # Requests that arrive at zero reach the router, which holds them; never the engines.
    assert selects({"matchLabels": public["spec"]["selector"]}, pod_labels(router))
    assert not selects({"matchLabels": public["spec"]["selector"]}, pod_labels(engines))
    assert "clusterIP" not in public["spec"]
    headless = find(rendered, "Service", "llm-unified")
    assert headless["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": headless["spec"]["selector"]}, pod_labels(engines))
    assert not selects({"matchLabels": headless["spec"]["selector"]}, pod_labels(router))
    assert main_container(router)["args"] == ["router", "--config", "/etc/tidegate/router.yaml"]
    assert router["spec"]["replicas"] == 1  # topology.router absent: one


def test_router_in_front_balances_the_unified_pool(tmp_path: Path) -> None:
    rendered = render_spec(
        {
            "model": model(),
            "topology": {"router": {"replicas": 3}},
            "autoscaling": ZERO,
            "service": {"port": 443},
        },
        namespace="team-a",
    )
    path = tmp_path / "router.yaml"
    path.write_text(config_map(rendered)["data"]["router.yaml"], encoding="utf-8")
    values = load_config_file(str(path), [RouterArgs])
    assert set(yaml.safe_load(path.read_text())) <= ROUTER_FLAGS
    # No prefill pool: the router sends each request whole to the unified pods (balancer).
    assert "prefill" not in values
    assert values["decode"] == ["http://llm-unified.team-a.svc:8000"]
    RouterArgs(**values)
    assert find(rendered, "Deployment", "llm-router")["spec"]["replicas"] == 3
    assert find(rendered, "Service", "llm")["spec"]["ports"][0]["port"] == 443
    (policy,) = of_kind(rendered, "NetworkPolicy")
    assert policy["metadata"]["name"] == "llm-cache-events"  # no KV-transfer policy


def test_unified_pool_that_cannot_reach_zero_is_served_directly() -> None:
    plain = render_spec({"model": model()})
    autoscaled = render_spec(
        {"model": model(), "autoscaling": {"unified": {"minReplicas": 1, "maxReplicas": 4}}}
    )
    assert kinds_and_names(autoscaled) == kinds_and_names(plain)
    assert "router.yaml" not in config_map(autoscaled)["data"]


# --- tidegate plan ----------------------------------------------------------------------------


def test_plan_lists_the_scaler_and_the_router() -> None:
    spec = {"model": model(), "autoscaling": {**keda(), **ZERO}}
    rendered = render_spec(spec)
    out = io.StringIO()
    write_table([{"metadata": {"name": "llm", "namespace": "ml"}, "spec": spec}], [rendered], out)
    table = out.getvalue()
    for kind, name in [
        ("ScaledObject", "llm"),
        ("Deployment", "llm-router"),
        ("Service", "llm-unified"),
    ]:
        assert any(line.split()[:2] == [kind, name] for line in table.splitlines()), table
    assert "autoscaled by KEDA, starts at 1" in table
