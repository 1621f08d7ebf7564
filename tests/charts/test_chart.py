"""The Helm chart (charts/tidegate), rendered and linted by Helm's own library (helm-python-sdk).

What a user would notice: the chart installs with its defaults and with every option its
values.yaml documents, each object it renders is one the API server of Kubernetes 1.30 and
1.37 accepts (strict schemas), a misspelt or mistyped value is refused by name, the operator
pod starts `tidegate operator` with flags the CLI accepts and no privilege, its RBAC grants
exactly what the operator's code touches, the monitors find the engine pods the operator
creates, checkov finds nothing it was not told why, and the Argo CD and Flux health checks of
docs/argocd-flux.md read the statuses the operator writes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import helm_python as helm
import jsonschema
import kopf
import kubernetes_validate
import pytest
import yaml

from tidegate.cli import build_parser
from tidegate.operator import handlers as operator_handlers
from tidegate.operator.cluster_scaler import ClusterAutoscaler
from tidegate.operator.kube import KINDS, OWNED_KINDS, Kube
from tidegate.operator.labels import MANAGED_BY, MANAGED_BY_LABEL, PART_OF_LABEL, selector_labels
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import DEFAULT_ENGINE_IMAGE, render
from tidegate.operator.spec import API_VERSION, KIND
from tidegate.operator.status import RoleState, compute_status

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tidegate"
DOC = REPO / "docs" / "argocd-flux.md"
CHECKOV = REPO / ".cache" / "tools" / "checkov" / "bin" / "checkov"
KUBERNETES_VERSIONS = ("1.30", "1.37")
RELEASE, NAMESPACE = "tidegate", "tidegate-system"
DIGEST = "sha256:" + "0123456789abcdef" * 4
MONITOR = {"enabled": True, "interval": "15s", "scrapeTimeout": "5s", "labels": {"release": "kps"}}
PROBE = {"periodSeconds": 3, "timeoutSeconds": 1, "failureThreshold": 5}

# Each documented option, set to something other than its default at least once
# (test_every_value_is_exercised holds this list to values.yaml).
SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "named-namespaces": {"watchNamespaces": ["ml-serving", "ml-staging"]},
    "replicas": {"replicas": 2},
    "replicas-named-namespaces": {"replicas": 3, "watchNamespaces": ["ml-serving", "ml-staging"]},
    "image": {
        "image": {
            "repository": "registry.example.com/tidegate/operator",
            "tag": "0.1.0-rc.1",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "registry"}],
    },
    "image-digest": {"image": {"digest": DIGEST}},
    "engine-image": {"engineImage": "registry.example.com/tidegate/engine:0.1.0"},
    "host-paths": {
        "hostPaths": {"readOnly": ["/models", "/srv/loras"], "cache": ["/var/cache/tidegate"]}
    },
    "name-override": {"nameOverride": "llm-operator"},
    "fullname-override": {"fullnameOverride": "llm-ops"},
    "health-and-probes": {
        "health": {"port": 9090},
        "operatorMetrics": {"port": 9102},
        "probes": {"startup": PROBE, "liveness": PROBE, "readiness": PROBE},
    },
    "resources-and-identity": {
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "securityContext": {"runAsUser": 10001, "runAsGroup": 10001},
    },
    "service-account-annotations": {
        "serviceAccount": {
            "name": "tidegate-operator",
            "annotations": {"iam.example.com/role": "tidegate"},
        }
    },
    "existing-service-account": {"serviceAccount": {"create": False, "name": "platform-ops"}},
    "no-rbac": {"rbac": {"create": False}},
    "placement": {
        "podAnnotations": {"example.com/team": "ml-platform"},
        "podLabels": {"example.com/cost-center": "ml"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "node-role", "operator": "In", "values": ["ops"]}
                            ]
                        }
                    ]
                }
            }
        },
        "priorityClassName": "platform-critical",
    },
    "service-monitor": {"metrics": {"serviceMonitor": MONITOR}},
    "pod-monitor-named-namespaces": {
        "watchNamespaces": ["ml-serving"],
        "metrics": {"podMonitor": MONITOR},
    },
    "network-policy": {
        "networkPolicy": {
            "enabled": True,
            "apiServer": {"cidrs": ["10.0.0.1/32", "fd00::1/128"], "ports": [6443]},
            "metricsFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        }
    },
    # Every hardening option at once: what checkov is also run on.
    "hardened": {
        "image": {"digest": DIGEST, "pullPolicy": "Always"},
        "watchNamespaces": ["ml-serving"],
        "networkPolicy": {"enabled": True},
        "metrics": {"podMonitor": MONITOR},
    },
}


# -- rendering ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render_chart(chart: helm.Chart, values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print them."""
    return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects_of(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every object of the rendered templates (NOTES.txt is not one)."""
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# Kubernetes' schemas do not hold the Prometheus Operator's kinds. These are the fields of its
# monitoring.coreos.com/v1 API that the chart sets, closed, so a misspelt field still fails.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABELINGS = {
    "type": "array",
    "items": closed(
        {"sourceLabels": {"type": "array", "items": {"type": "string"}}, "targetLabel": {}},
        ("targetLabel",),
    ),
}
_ENDPOINTS = {
    "type": "array",
    "minItems": 1,
    "items": closed(
        {
            "port": {"type": "string"},
            "path": {"type": "string"},
            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
            "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
            "relabelings": _RELABELINGS,
        },
        ("port",),
    ),
}


def _monitor_schema(endpoints_field: str) -> dict[str, Any]:
    return closed(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"type": "string"},
            "metadata": closed(
                {
                    "name": {"type": "string"},
                    "namespace": {"type": "string"},
                    "labels": _STRING_MAP,
                },
                ("name", "namespace"),
            ),
            "spec": closed(
                {
                    "namespaceSelector": closed(
                        {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        }
                    ),
                    "selector": closed({"matchLabels": _STRING_MAP}, ("matchLabels",)),
                    endpoints_field: _ENDPOINTS,
                },
                ("selector", endpoints_field),
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


MONITOR_SCHEMAS = {
    "ServiceMonitor": _monitor_schema("endpoints"),
    "PodMonitor": _monitor_schema("podMetricsEndpoints"),
}


# kopf's peering kinds, by the schemas of the chart's own CRDs for them.
PEERING_SCHEMAS = {
    crd["spec"]["names"]["kind"]: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for crd in yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text())
}


def assert_valid(obj: dict[str, Any]) -> None:
    """The object is one the API server accepts (a Prometheus Operator one: its API's fields;
    a kopf peering object: its CRD's)."""
    name = f"{obj['kind']} {obj['metadata']['name']}"
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        jsonschema.validate(obj, MONITOR_SCHEMAS[obj["kind"]])
        return
    if obj["apiVersion"] == "kopf.dev/v1":
        jsonschema.validate(obj, PEERING_SCHEMAS[obj["kind"]])
        return
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name} is refused by Kubernetes {version}: {error.message}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_renders_objects_kubernetes_accepts(chart: helm.Chart, scenario: str) -> None:
    objects = objects_of(render_chart(chart, SCENARIOS[scenario]))
    assert by_kind(objects, "Deployment"), "no operator Deployment"
    for obj in objects:
        assert_valid(obj)
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            # Namespaced objects name their namespace: `helm template | kubectl apply` works.
            assert obj["metadata"]["namespace"], obj["metadata"]["name"]


def test_the_crd_validates_and_is_the_repository_crd(chart: helm.Chart) -> None:
    source = REPO / "crds" / "llmdeployment.yaml"
    assert (CHART / "crds" / "llmdeployment.yaml").read_bytes() == source.read_bytes()
    crds = {crd["name"]: crd["data"] for crd in chart.crds}
    assert crds["crds/llmdeployment.yaml"] == source.read_text()
    assert_valid(yaml.safe_load(crds["crds/llmdeployment.yaml"]))
    # ... and kopf's peering CRDs, for replicas above 1.
    assert set(crds) == {"crds/llmdeployment.yaml", "crds/kopf-peering.yaml"}
    for crd in yaml.safe_load_all(crds["crds/kopf-peering.yaml"]):
        assert_valid(crd)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lints_without_errors(scenario: str) -> None:
    for version in KUBERNETES_VERSIONS:
        report = helm.lint(
            CHART, SCENARIOS[scenario], namespace=NAMESPACE, kube_version=f"v{version}.0"
        )
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # warning, error
        assert not problems and not report["errors"], (version, report)


def test_app_version_is_the_package_version(chart: helm.Chart) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart.metadata["appVersion"] == project["version"]
    container = operator_container(objects_of(render_chart(chart, {})))
    assert container["image"] == f"ghcr.io/tidegate/operator:{project['version']}"
    # engineImage "" leaves the operator's default, which is the same release's engine.
    assert DEFAULT_ENGINE_IMAGE.endswith(f":{project['version']}")


def test_image_digest_pins_the_image(chart: helm.Chart) -> None:
    container = operator_container(objects_of(render_chart(chart, SCENARIOS["image-digest"])))
    assert container["image"] == f"ghcr.io/tidegate/operator@{DIGEST}"


# -- the operator pod ----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_operator_runs_tidegate_operator_with_flags_the_cli_accepts(
    chart: helm.Chart, scenario: str
) -> None:
    values = chart.merge_values(SCENARIOS[scenario])
    container = operator_container(objects_of(render_chart(chart, SCENARIOS[scenario])))
    assert container["command"] == ["tidegate"]
    parsed = build_parser().parse_args(container["args"])
    assert parsed.command == "operator"
    assert (parsed.namespace or []) == values["watchNamespaces"]
    assert parsed.engine_image == (values["engineImage"] or DEFAULT_ENGINE_IMAGE)
    # The chart's lists are the operator's; empty by default, which allows no hostPath.
    assert parsed.allowed_host_path == values["hostPaths"]["readOnly"]
    assert parsed.allowed_cache_host_path == values["hostPaths"]["cache"]
    # The probes call the endpoint the operator serves, and the metrics port is its /metrics.
    port = int(re.fullmatch(r"http://0\.0\.0\.0:(\d+)/healthz", parsed.liveness).group(1))
    assert parsed.metrics_port == values["operatorMetrics"]["port"]
    assert container["ports"] == [
        {"name": "health", "containerPort": port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": parsed.metrics_port, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_operator_pod_has_no_privilege(chart: helm.Chart) -> None:
    (deployment,) = by_kind(objects_of(render_chart(chart, {})), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert set(container["resources"]) == {"requests", "limits"}
    # Standalone kopf has no peering: never two operators at once, not even in a rollout.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


# -- RBAC: exactly what the operator's code touches ---------------------------------------

Rule = tuple[str, str, str]  # (API group, resource, verb)


class RecordingKube(Kube):
    """The operator's API client over an in-memory API server that records every request."""

    def __init__(self, *_: Any) -> None:
        super().__init__(kopf.ConnectionInfo(server="https://kubernetes.test"))
        self.objects: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        self.requests.append((method, path))
        if method == "GET" and path in self.objects:
            return copy.deepcopy(self.objects[path])
        if method == "GET":
            items = [obj for key, obj in self.objects.items() if key.rpartition("/")[0] == path]
            return {"items": copy.deepcopy(items)} if _rest_path(path)[1] is None else None
        if method == "POST":
            self.objects[f"{path}/{body['metadata']['name']}"] = copy.deepcopy(body)
        elif method == "PATCH" and not path.endswith("/status"):
            self.objects[path] = copy.deepcopy(body)
        elif method == "DELETE":
            self.objects.pop(path, None)
        return copy.deepcopy(body) if isinstance(body, dict) else {}


def _rest_path(path: str) -> tuple[str, str | None, str]:
    """(API group, object name or None, resource[/subresource]) of a namespaced REST path."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    assert rest[0] == "namespaces", path
    plural, *tail = rest[2:]
    return group, (tail[0] if tail else None), "/".join([plural, *tail[1:]])


def _rule_of(method: str, path: str) -> Rule:
    group, name, resource = _rest_path(path)
    verb = {"GET": "get" if name else "list", "POST": "create", "PUT": "update", "PATCH": "patch"}
    verb["DELETE"] = "delete" if name else "deletecollection"
    return group, resource, verb[method]


# kopf has no public API listing a registry's handlers: these private attributes are kopf 1.x's.
def _handler(handlers: list[Any], name: str) -> Any:
    """The function of a registered handler (kopf registers one per cause, all the same fn)."""
    return next(h.fn for h in handlers if h.fn.__name__ == name)


def handlers_requests(monkeypatch: pytest.MonkeyPatch) -> set[Rule]:
    """Run the operator's own handlers (login, reconcile, delete) and collect what they call.

    The story: an LLMDeployment is created (children created, status patched), switched from
    unified to disaggregated with an HPA per pool and an InferencePool (the unified Deployment
    and PDB deleted as stale), someone edits every child (each applied back), it becomes a
    unified pool over two nodes (a LeaderWorkerSet, edited and applied back) and disaggregated
    again (the LeaderWorkerSet deleted as stale), the driver becomes KEDA (the HPAs
    deleted, ScaledObjects created) and every child is edited again, then the operator's own
    autoscaler drives the pools (their pods and the router's listed and scraped, the pools
    grown, then priced and shrunk, Events posted, status patched), then the resource is
    deleted (children listed, deleted).
    """
    kube = RecordingKube()
    monkeypatch.setattr(operator_handlers, "Kube", lambda info, **_: kube)
    monkeypatch.setattr(
        kopf, "login_with_service_account", lambda **_: kopf.ConnectionInfo(server="https://k")
    )
    registry = operator_handlers.build_registry()
    changing = registry._changing.get_all_handlers()
    login = _handler(registry._activities.get_all_handlers(), "login")
    reconcile_resource = _handler(changing, "reconcile_resource")
    delete_children = _handler(changing, "delete_children")
    (example,) = load_llm_deployments(REPO / "examples" / "unified-tiny.yaml")
    example["metadata"].update(namespace="ml-serving", uid="uid-1", generation=1)
    path = f"/apis/{API_VERSION}/namespaces/ml-serving/llmdeployments/{example['metadata']['name']}"
    logger = logging.getLogger("tests.charts")

    async def story() -> None:
        await login(logger=logger)
        kube.objects[path] = copy.deepcopy(example)
        await reconcile_resource(body=example, logger=logger)
        spec = kube.objects[path]["spec"]
        spec["topology"] = {
            "mode": "disaggregated",
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
        }
        policies = {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2}}
        spec["autoscaling"] = {"driver": "hpa", **policies}
        spec["gateway"] = {"inferencePool": True}
        await reconcile_resource(body=example, logger=logger)

        async def edit_every_child() -> None:
            for key, child in kube.objects.items():
                if key != path:
                    child["metadata"]["labels"][PART_OF_LABEL] = "edited"
            await reconcile_resource(body=example, logger=logger)

        await edit_every_child()
        # A unified pool over two nodes: its LeaderWorkerSet made and edited, then stale.
        multinode = {"pipelineParallelSize": 2, "nodesPerReplica": 2}
        saved = {key: spec.pop(key) for key in ("topology", "autoscaling", "gateway")}
        spec["parallelism"] = multinode
        await reconcile_resource(body=example, logger=logger)
        await edit_every_child()
        del spec["parallelism"]
        spec.update(saved)
        await reconcile_resource(body=example, logger=logger)
        prometheus = {"serverAddress": "http://prometheus.monitoring.svc:9090"}
        spec["autoscaling"] = {"driver": "keda", "prometheus": prometheus, **policies}
        await reconcile_resource(body=example, logger=logger)
        await edit_every_child()
        await autoscale(spec, example["metadata"]["name"])
        await delete_children(body=kube.objects.pop(path), logger=logger)

    async def autoscale(spec: dict[str, Any], name: str) -> None:
        quick = {"maxReplicas": 2, "scaleDown": {"stabilizationWindowSeconds": 0}}
        spec["autoscaling"] = {"prefill": quick, "decode": quick}
        await reconcile_resource(body=example, logger=logger)
        for role in ("prefill", "decode", "router"):
            for index in (0, 1):
                pod = _ready_pod(f"{name}-{role}-{index}", selector_labels(name, role))
                kube.objects[f"/api/v1/namespaces/ml-serving/pods/{pod['metadata']['name']}"] = pod
        load = {"running": 1000}  # over 256 (maxNumSeqs) per replica

        async def fetch(url: str) -> str:
            return f"tidegate:num_requests_running {load['running']}\n"

        now = [1000.0]
        autoscaler = ClusterAutoscaler(kube, fetch=fetch, clock=lambda: now[0])
        await autoscaler.step(kube.objects[path])  # 1 -> 2 in each pool
        load["running"], now[0] = 0, 2000.0
        await autoscaler.step(kube.objects[path])  # priced, then 2 -> 1
        await autoscaler.close()

    asyncio.run(story())
    rules = {_rule_of(method, p) for method, p in kube.requests}
    for plural in {KINDS[kind] for kind in OWNED_KINDS}:
        verbs = {verb for _, resource, verb in rules if resource == plural}
        assert verbs == {"get", "list", "create", "patch", "delete"}, f"{plural}: {verbs}"
    return rules


def _ready_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml-serving", "labels": labels},
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]
        },
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def kopf_needs(namespaced: bool, peering: bool = False) -> set[Rule]:
    """What kopf itself reads and writes for the handlers registered (none of it our calls),
    and for its peering when several operators run."""
    rules: set[Rule] = set()
    registry = operator_handlers.build_registry()
    changing = registry._changing.get_all_handlers()
    for handler in [*changing, *registry._watching.get_all_handlers()]:
        selector = handler.selector
        api = f"{selector.group}/{selector.version}" if selector.group else selector.version
        name = selector.any_name
        (plural,) = {p for (a, kind), p in KINDS.items() if a == api and name in (kind, p)}
        # Every served resource is listed, then watched (kopf/_cogs/clients/watching.py).
        rules |= {(selector.group, plural, "list"), (selector.group, plural, "watch")}
        if handler in changing:
            # Progress and diff-base live in status.kopf, patched through /status; a finalizer
            # left on the object (settings.persistence.finalizer) kopf removes with a patch of
            # the object itself, or the object could never be deleted.
            rules |= {
                (selector.group, plural, "patch"),
                (selector.group, f"{plural}/status", "patch"),
            }
    # kopf watches CRDs to notice its resources come and go (kopf/_core/reactor/observation.py).
    rules |= {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
    # kopf posts warnings and errors about an object as core v1 Events (posting.py, EVENTS).
    rules.add(("", "events", "create"))
    if namespaced:
        # Serving named namespaces, kopf watches Namespaces to follow them (observation.py).
        rules |= {("", "namespaces", "list"), ("", "namespaces", "watch")}
    if peering:
        # It lists and watches the peering object, and patches its keep-alive into it
        # (kopf/_core/engines/peering.py): a KopfPeering per served namespace, or the
        # ClusterKopfPeering.
        plural = "kopfpeerings" if namespaced else "clusterkopfpeerings"
        rules |= {("kopf.dev", plural, verb) for verb in ("list", "watch", "patch")}
    return rules


def granted(rules: list[dict[str, Any]]) -> set[Rule]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.fixture(scope="module")
def handlers_rules() -> Iterator[set[Rule]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield handlers_requests(monkeypatch)


CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(
    chart: helm.Chart, handlers_rules: set[Rule]
) -> None:
    objects = objects_of(render_chart(chart, {}))
    (role,) = by_kind(objects, "ClusterRole")
    assert not by_kind(objects, "Role")
    assert granted(role["rules"]) == handlers_rules | kopf_needs(namespaced=False)
    assert_bound(objects, "ClusterRoleBinding", role)


def test_named_namespaces_get_roles_and_only_discovery_cluster_wide(
    chart: helm.Chart, handlers_rules: set[Rule]
) -> None:
    namespaces = SCENARIOS["named-namespaces"]["watchNamespaces"]
    objects = objects_of(render_chart(chart, SCENARIOS["named-namespaces"]))
    needed = handlers_rules | kopf_needs(namespaced=True)
    (cluster_role,) = by_kind(objects, "ClusterRole")
    roles = by_kind(objects, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == sorted(namespaces)
    assert granted(cluster_role["rules"]) == {r for r in needed if r[1] in CLUSTER_SCOPED}
    for role in roles:
        assert granted(role["rules"]) == {r for r in needed if r[1] not in CLUSTER_SCOPED}
        assert_bound(objects, "RoleBinding", role)
    assert_bound(objects, "ClusterRoleBinding", cluster_role)


@pytest.mark.parametrize("scenario", ["replicas", "replicas-named-namespaces"])
def test_replicas_elect_one_operator_through_kopf_peering(
    chart: helm.Chart, handlers_rules: set[Rule], scenario: str
) -> None:
    values = SCENARIOS[scenario]
    namespaces = values.get("watchNamespaces", [])
    objects = objects_of(render_chart(chart, values))
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == values["replicas"]
    # A new pod stands by, so the pods may roll; kopf names each in the peering by POD_ID.
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    container = operator_container(objects)
    assert build_parser().parse_args(container["args"]).peering == RELEASE
    (pod_id,) = [env for env in container["env"] if env["name"] == "POD_ID"]
    assert pod_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The peering object the flag names: cluster-wide, or one in each served namespace.
    peerings = [o for o in objects if o["apiVersion"] == "kopf.dev/v1"]
    if namespaces:
        assert {p["kind"] for p in peerings} == {"KopfPeering"}
        assert sorted(p["metadata"]["namespace"] for p in peerings) == sorted(namespaces)
    else:
        assert [p["kind"] for p in peerings] == ["ClusterKopfPeering"]
    assert {p["metadata"]["name"] for p in peerings} == {RELEASE}
    # RBAC: what the operator needs, and kopf's peering besides.
    needed = handlers_rules | kopf_needs(namespaced=bool(namespaces), peering=True)
    granted_all = set().union(
        *(granted(o["rules"]) for o in objects if o["kind"] in ("ClusterRole", "Role"))
    )
    assert granted_all == needed
    for role in by_kind(objects, "Role"):
        assert granted(role["rules"]) == {r for r in needed if r[1] not in CLUSTER_SCOPED}


def assert_bound(objects: list[dict[str, Any]], kind: str, role: dict[str, Any]) -> None:
    """A binding of `kind` gives `role` to the operator's ServiceAccount, and only to it."""
    (account,) = by_kind(objects, "ServiceAccount")
    (deployment,) = by_kind(objects, "Deployment")
    assert (
        deployment["spec"]["template"]["spec"]["serviceAccountName"]
        == (account["metadata"]["name"])
    )
    namespace = role["metadata"].get("namespace")
    (binding,) = [
        b
        for b in by_kind(objects, kind)
        if b["roleRef"]["name"] == role["metadata"]["name"]
        and b["metadata"].get("namespace") == namespace
    ]
    assert binding["roleRef"]["kind"] == role["kind"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_without_rbac_or_service_account_nothing_is_granted(chart: helm.Chart) -> None:
    objects = objects_of(render_chart(chart, SCENARIOS["no-rbac"]))
    assert not [o for o in objects if o["apiVersion"].startswith("rbac.")]
    objects = objects_of(render_chart(chart, SCENARIOS["existing-service-account"]))
    assert not by_kind(objects, "ServiceAccount")
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == "platform-ops"


# -- values.yaml and values.schema.json ---------------------------------------------------


def leaf_paths(values: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if isinstance(values, dict) and values:
        return {p for key, value in values.items() for p in leaf_paths(value, (*prefix, key))}
    return {prefix}


def test_every_value_is_exercised() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    exercised = set().union(*(leaf_paths(values) for values in SCENARIOS.values()))
    missing = {p for p in leaf_paths(defaults) if not any(p[: len(e)] == e for e in exercised)}
    assert not missing, f"options no scenario sets: {sorted(missing)}"


def test_every_value_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line):
            assert lines[number - 1].strip().startswith("#"), f"values.yaml:{number + 1} {line}"


def test_values_and_schema_describe_the_same_keys(chart: helm.Chart) -> None:
    schema = chart.schema
    assert schema is not None

    def walk(node: dict[str, Any], values: Any, where: str) -> None:
        if node.get("type") != "object" or "properties" not in node:
            return
        assert node.get("additionalProperties") is False, f"{where or '.'} accepts any key"
        keys = set(node["properties"]) - ({"global"} if not where else set())
        # An empty map by default (affinity: {}) documents its keys in its comment.
        if values:
            assert keys == set(values), (
                f"{where or '.'}: schema {sorted(keys)}, values {sorted(values)}"
            )
        for key, child in node["properties"].items():
            if key in values:
                walk(child, values[key], f"{where}.{key}")

    walk(schema, yaml.safe_load((CHART / "values.yaml").read_text()), "")
    chart.validate_schema({})


BAD_VALUES = {
    "misspelt top-level key": ({"watchNamespace": ["ml"]}, "watchNamespace"),
    "misspelt nested key": ({"image": {"tga": "1"}}, "tga"),
    "misspelt monitor key": ({"metrics": {"podMonitor": {"enable": True}}}, "enable"),
    "tag is a number": ({"image": {"tag": 1.0}}, "/image/tag"),
    "namespaces is a string": ({"watchNamespaces": "ml"}, "/watchNamespaces"),
    "namespace is no DNS label": ({"watchNamespaces": ["ML_serving"]}, "/watchNamespaces/0"),
    "enabled is a string": ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
    "port out of range": ({"health": {"port": 70000}}, "/health/port"),
    "root user": ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    "unknown pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "bad interval": (
        {"metrics": {"serviceMonitor": {"interval": "half a minute"}}},
        "/metrics/serviceMonitor/interval",
    ),
    "bad digest": ({"image": {"digest": "latest"}}, "/image/digest"),
    "relative host path": ({"hostPaths": {"readOnly": ["models"]}}, "/hostPaths/readOnly/0"),
    "root as a cache": ({"hostPaths": {"cache": ["/"]}}, "/hostPaths/cache/0"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_schema_refuses_typos_and_wrong_types(chart: helm.Chart, case: str) -> None:
    values, named = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as refused:
        render_chart(chart, values)
    assert named in str(refused.value)


# -- monitors, network policy, notes -------------------------------------------------------


def engine_objects() -> list[dict[str, Any]]:
    """What the operator creates for every example LLMDeployment."""
    objects = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for resource in load_llm_deployments(path):
            resource["metadata"].update(namespace="ml-serving", uid="uid-1")
            objects.extend(render(resource).objects)
    return objects


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_service_monitor_scrapes_each_engine_pod_once(chart: helm.Chart) -> None:
    objects = objects_of(render_chart(chart, SCENARIOS["service-monitor"]))
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector[MANAGED_BY_LABEL] == MANAGED_BY
    engines = engine_objects()
    services = [
        s for s in by_kind(engines, "Service") if matches(selector, s["metadata"]["labels"])
    ]
    assert services == by_kind(engines, "Service")
    port = monitor["spec"]["endpoints"][0]["port"]
    for deployment in by_kind(engines, "Deployment"):
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        behind = [s for s in services if matches(s["spec"]["selector"], pod_labels)]
        # Prometheus scrapes a pod through each Service of its that has the endpoint's port;
        # another (the router's endpoint picker, gRPC) yields no target.
        scraped = [s for s in behind if port in [p["name"] for p in s["spec"]["ports"]]]
        assert len(scraped) == 1, deployment["metadata"]["name"]


def test_pod_monitor_scrapes_the_engines_not_the_operator(chart: helm.Chart) -> None:
    objects = objects_of(render_chart(chart, SCENARIOS["pod-monitor-named-namespaces"]))
    (monitor,) = by_kind(objects, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml-serving"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    for deployment in by_kind(engine_objects(), "Deployment"):
        template = deployment["spec"]["template"]
        assert matches(selector, template["metadata"]["labels"])
        assert port in [p["name"] for p in template["spec"]["containers"][0]["ports"]]
    (operator,) = by_kind(objects, "Deployment")
    assert not matches(selector, operator["spec"]["template"]["metadata"]["labels"])


def test_network_policy_lets_the_operator_reach_only_dns_the_api_server_and_engines(
    chart: helm.Chart,
) -> None:
    objects = objects_of(render_chart(chart, SCENARIOS["network-policy"]))
    (policy,) = by_kind(objects, "NetworkPolicy")
    (operator,) = by_kind(objects, "Deployment")
    assert matches(
        policy["spec"]["podSelector"]["matchLabels"],
        operator["spec"]["template"]["metadata"]["labels"],
    )
    dns, api, engines = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert api["ports"] == [{"protocol": "TCP", "port": 6443}]
    assert [peer["ipBlock"]["cidr"] for peer in api["to"]] == ["10.0.0.1/32", "fd00::1/128"]
    # The autoscaler scrapes the port every engine and router container names http.
    ports = {
        p["containerPort"]
        for d in by_kind(engine_objects(), "Deployment")
        for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]
        if p["name"] == "http"
    }
    assert engines["ports"] == [{"protocol": "TCP", "port": port} for port in ports]
    # Only the peers named may scrape the operator's /metrics, on that port alone.
    (scrape,) = policy["spec"]["ingress"]
    assert scrape["from"] == SCENARIOS["network-policy"]["networkPolicy"]["metricsFrom"]
    assert scrape["ports"] == [{"protocol": "TCP", "port": 8081}]
    (hardened,) = by_kind(objects_of(render_chart(chart, SCENARIOS["hardened"])), "NetworkPolicy")
    assert hardened["spec"]["ingress"] == []


def test_notes_apply_the_repository_example_and_call_its_service(chart: helm.Chart) -> None:
    notes = render_chart(chart, {})["tidegate/templates/NOTES.txt"]
    manifest = re.search(r"<<'YAML'\n(.*?)\n\s*YAML\n", notes, re.S)
    assert manifest is not None
    applied = yaml.safe_load(manifest.group(1))
    (example,) = load_llm_deployments(REPO / "examples" / "unified-tiny.yaml")
    assert applied == example
    applied["metadata"].update(namespace="default", uid="uid-1")
    (service,) = by_kind(render(applied).objects, "Service")
    port = service["spec"]["ports"][0]["port"]
    assert f"port-forward svc/{service['metadata']['name']} {port}:{port}" in notes
    assert f'"model": "{example["spec"]["model"]["name"]}"' in notes


# -- Argo CD and Flux health checks (docs/argocd-flux.md) ----------------------------------


def statuses() -> dict[str, dict[str, Any]]:
    """Statuses the operator writes, by the health a GitOps tool should see."""

    def role(**state: Any) -> RoleState:
        fields = {"role": "unified", "desired": 2, "updated": 2, "ready": 2, "old": 0}
        return RoleState(**{**fields, "observed": True, "stuck": None, **state})

    def status(roles: list[RoleState], error: tuple[str, str] | None = None) -> dict[str, Any]:
        return compute_status(
            generation=3,
            roles=roles,
            effective=None,
            endpoint="http://tiny.ml.svc:8000/v1",
            error=error,
            previous={},
            now="2025-01-01T00:00:00Z",
        )

    return {
        "Healthy": status([role()]),
        "Healthy (scaled to zero)": status([role(desired=0, updated=0, ready=0)]),
        "Progressing": status([role(ready=1)]),
        "Progressing (old pods)": status([role(old=1)]),
        "Degraded": status([role()], error=("TuningRefused", "8 GiB of weights on 4 GiB")),
        "Degraded (stuck)": status([role(ready=1, stuck="ProgressDeadlineExceeded")]),
    }


def llmdeployment(status: dict[str, Any] | None, generation: int = 3) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "tiny", "namespace": "ml", "generation": generation},
        "spec": {},
    }
    if status is not None:
        obj["status"] = status
    return obj


def doc_block(language: str, contains: str) -> dict[str, Any]:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if contains in b]
    return yaml.safe_load(block)


def test_argocd_health_check_maps_conditions() -> None:
    lupa = pytest.importorskip("lupa", reason="lupa runs the Lua health check")
    config_map = doc_block("yaml", "argocd-cm")
    script = config_map["data"][
        f"resource.customizations.health.{API_VERSION.split('/')[0]}_{KIND}"
    ]
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def health(obj: dict[str, Any]) -> str:
        lua.globals().obj = lua.table_from(json.loads(json.dumps(obj)), recursive=True)
        result = lua.execute(script)
        assert result["message"], obj
        return result["status"]

    for expected, status in statuses().items():
        assert health(llmdeployment(status)) == expected.split(" ")[0], expected
    assert health(llmdeployment(None)) == "Progressing"
    assert health(llmdeployment(statuses()["Healthy"], generation=4)) == "Progressing"


def test_flux_health_expressions_map_conditions() -> None:
    kustomization = doc_block("yaml", "healthCheckExprs")
    (check,) = kustomization["spec"]["healthCheckExprs"]
    assert (check["apiVersion"], check["kind"]) == (API_VERSION, KIND)
    env = celpy.Environment()
    programs = {name: env.program(env.compile(check[name])) for name in ("failed", "current")}

    def health(obj: dict[str, Any]) -> str:
        activation = {key: celpy.json_to_cel(value) for key, value in obj.items()}
        for name, verdict in (("failed", "Degraded"), ("current", "Healthy")):
            try:
                result = programs[name].evaluate(activation)
            except celpy.CELEvalError:
                return "Progressing"  # a field not there yet: Flux keeps waiting
            if isinstance(result, celpy.CELEvalError):
                return "Progressing"
            if result:
                return verdict
        return "Progressing"

    for expected, status in statuses().items():
        if "scaled to zero" in expected:
            assert health(llmdeployment(status)) == "Progressing"  # documented
            continue
        assert health(llmdeployment(status)) == expected.split(" ")[0], expected
    assert health(llmdeployment(None)) == "Progressing"
    assert health(llmdeployment(statuses()["Healthy"], generation=4)) == "Progressing"


# -- checkov -------------------------------------------------------------------------------

# Every check checkov fails on a render, and why that is right for this chart. The test runs
# checkov with no skip and requires the failures to be exactly these: a check that starts
# passing, or a new failure, fails the test.
CHECKOV_SKIPS = {
    "CKV_K8S_38": (
        "Service account token mounted: the operator's one job is calling the Kubernetes API "
        "with it (kopf logs in with the pod's service account)."
    ),
    "CKV_K8S_43": (
        "Image by tag, not digest: the default tag is the chart's appVersion, a release tag; "
        "the digest of an image is known only once it is built. image.digest pins it."
    ),
    "CKV_K8S_15": (
        "pullPolicy IfNotPresent: the tag is an immutable release tag, and Always would make "
        "every operator restart depend on the registry. image.pullPolicy sets Always."
    ),
    "CKV2_K8S_6": (
        "No NetworkPolicy by default: the API server's address and port differ per cluster, "
        "so a default policy would cut most operators off. networkPolicy.enabled adds one."
    ),
}
CHECKOV_EXPECTED = {
    "defaults": set(CHECKOV_SKIPS),
    "hardened": {"CKV_K8S_38"},
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", CHECKOV_EXPECTED)
def test_checkov_finds_only_the_documented_exceptions(
    chart: helm.Chart, scenario: str, tmp_path: Path
) -> None:
    if not CHECKOV.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHECKOV} is missing: `make {CHECKOV.relative_to(REPO)}` installs it")
        pytest.skip(f"checkov is not installed at {CHECKOV} (make installs it)")
    for path, text in render_chart(chart, SCENARIOS[scenario]).items():
        if path.endswith(".yaml") and text.strip():
            (tmp_path / Path(path).name).write_text(text)
    shutil.copy(CHART / "crds" / "llmdeployment.yaml", tmp_path / "crd-llmdeployment.yaml")
    command = [str(CHECKOV), "-d", str(tmp_path), "--framework", "kubernetes"]
    command += ["--quiet", "--compact", "-o", "json", "--skip-download"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    (result,) = report if isinstance(report, list) else [report]
    assert result["summary"]["resource_count"] >= 5 and result["summary"]["parsing_errors"] == 0
    failed = {check["check_id"] for check in result["results"]["failed_checks"]}
    assert failed == CHECKOV_EXPECTED[scenario], {
        check["check_id"]: f"{check['check_name']} ({check['resource']})"
        for check in result["results"]["failed_checks"]
        if check["check_id"] not in CHECKOV_EXPECTED[scenario]
    }
