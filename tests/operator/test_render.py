"""Rendering turns an LLMDeployment into the objects the operator applies.

What a user would notice: every object is one the API server of Kubernetes 1.30 and 1.37
accepts (strict schemas), the pools and Services a topology promises exist and find each
other, each pod runs `tidegate serve` on a config file the CLI loads, with the tuned flags,
the model mounted, no shell, no root and no API key in plain text, and the pods roll exactly
when something they run changes.
"""

from __future__ import annotations

import copy
import glob
import io
import json
import re
from pathlib import Path
from typing import Any, get_args

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.operator.apiserver_validation import apiserver_refusals
from tests.operator.crd_validation import CRDValidator, load_crd, version_schema
from tidegate.engine.config import EngineArgs, RouterArgs, ServerArgs
from tidegate.engine.entrypoints.args import load_config_file
from tidegate.operator.kube import OWNED_KINDS
from tidegate.operator.kv_keys import key_secret
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.plan import write_table
from tidegate.operator.render import (
    DEFAULT_ENGINE_IMAGE,
    SPEC_HASH,
    Rendered,
    RenderOptions,
    render,
)
from tidegate.operator.spec import API_VERSION, KIND, SpecError
from tidegate.operator.tuning import TuningError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(glob.glob(str(REPO / "examples" / "*.yaml")))
KUBERNETES_VERSIONS = ("1.30", "1.37")
UID = "6f1c2a44-3b7e-4c55-9a1d-0d2f7e9b8c11"
# KEDA's ScaledObject CRD as KEDA publishes it (tests/operator/schemas/README.md says whence).
KEDA_CRD = Path(__file__).resolve().parent / "schemas" / "keda.sh_scaledobjects.yaml"
KEDA_SCALED_OBJECTS = CRDValidator(load_crd(KEDA_CRD), "v1alpha1")
# The Gateway API Inference Extension's InferencePool CRD (tests/fixtures/gie/README.md).
GIE_CRD = REPO / "tests" / "fixtures" / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
INFERENCE_POOLS = CRDValidator(load_crd(GIE_CRD), "v1")
# LeaderWorkerSet's CRD (tests/fixtures/lws/README.md): a pool whose replicas span nodes.
LWS_CRD = REPO / "tests" / "fixtures" / "lws" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LEADER_WORKER_SETS = CRDValidator(load_crd(LWS_CRD), "v1")
SHELLS = {"sh", "/bin/sh", "bash", "/bin/bash", "-c"}
TINY = 1e9  # parameters
LLAMA_70B_MODEL = {
    "name": "llama-3-70b-instruct",
    "source": {"pvc": {"claimName": "models", "path": "llama-3-70b-instruct"}},
    "parameterCount": 70.6e9,
    "numAttentionHeads": 64,
    "numKeyValueHeads": 8,
    "maxModelLen": 8192,
    "dtype": "bfloat16",
}


def resource(spec: dict[str, Any], *, name: str = "llm", namespace: str | None = "ml", uid=UID):
    """An LLMDeployment as the API server hands it to the operator."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    if uid is not None:
        metadata["uid"] = uid
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def model(source: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """A model part of a spec; the tiny model from a node folder unless told otherwise."""
    return {"name": "tiny-llama", "source": source or {"hostPath": {"path": "/models/t"}}, **fields}


def disaggregated(**roles: Any) -> dict[str, Any]:
    return {"mode": "disaggregated", "prefill": {}, "decode": {}, **roles}


def gpus(count: int, memory: float = 80, **fields: Any) -> dict[str, Any]:
    return {"count": count, "memoryGiB": memory, **fields}


def render_spec(spec: dict[str, Any], **meta: Any) -> Rendered:
    return render(resource(spec, **meta))


def find(rendered: Rendered, kind: str, name: str) -> dict[str, Any]:
    matches = [
        obj for obj in rendered.objects if obj["kind"] == kind and obj["metadata"]["name"] == name
    ]
    assert len(matches) == 1, f"expected one {kind} {name}, got {len(matches)}"
    return matches[0]


def deployments(rendered: Rendered) -> list[dict[str, Any]]:
    return [obj for obj in rendered.objects if obj["kind"] == "Deployment"]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(deployment)["containers"]
    return container


def all_containers(rendered: Rendered) -> list[dict[str, Any]]:
    """Every container of every pod template: the Deployments', and a LeaderWorkerSet's."""
    pods = [pod_spec(deployment) for deployment in deployments(rendered)]
    for obj in rendered.objects:
        if obj["kind"] == "LeaderWorkerSet":
            pods += [template["spec"] for template in lws_templates(obj)]
    return [
        container
        for pod in pods
        for key in ("initContainers", "containers")
        for container in pod.get(key, [])
    ]


def spec_hash(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["annotations"][SPEC_HASH]


def config_map(rendered: Rendered) -> dict[str, Any]:
    (cm,) = [obj for obj in rendered.objects if obj["kind"] == "ConfigMap"]
    return cm


def role_config(rendered: Rendered, role: str) -> dict[str, Any]:
    """A role's config file as the flag values it sets, keyed by CLI flag name."""
    return yaml.safe_load(config_map(rendered)["data"][f"{role}.yaml"])


def mount(container: dict[str, Any], path: str) -> dict[str, Any]:
    (found,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    return found


def volume(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == name]
    return found


# --- every object validates against the upstream schemas ------------------------------------

# (version, object as canonical JSON) already accepted: the tables and the generated specs
# share most objects, and each schema check builds its validator afresh.
_accepted: set[tuple[str, str]] = set()


def assert_valid(objects: list[dict[str, Any]], version: str) -> None:
    """Kubernetes `version` accepts each object; a ScaledObject, KEDA's published CRD does, an
    InferencePool, the Gateway API Inference Extension's, and a LeaderWorkerSet, LWS's (whose
    pod templates Kubernetes then checks, in the StatefulSets made of them)."""
    for obj in objects:
        key = (version, json.dumps(obj, sort_keys=True))
        if key in _accepted:
            continue
        if obj["kind"] == "ScaledObject":
            refused = KEDA_SCALED_OBJECTS.validate(obj)
            assert refused == [], f"ScaledObject {obj['metadata']['name']}: {refused}"
        elif obj["kind"] == "InferencePool":
            refused = INFERENCE_POOLS.validate(obj)
            assert refused == [], f"InferencePool {obj['metadata']['name']}: {refused}"
        elif obj["kind"] == "LeaderWorkerSet":
            refused = LEADER_WORKER_SETS.validate(obj)
            assert refused == [], f"LeaderWorkerSet {obj['metadata']['name']}: {refused}"
            for template in lws_templates(obj):
                as_deployment = {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": obj["metadata"],
                    "spec": {
                        "selector": {"matchLabels": template["metadata"]["labels"]},
                        "template": template,
                    },
                }
                assert_valid([as_deployment], version)
        else:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(
                    f"{obj['kind']} {obj['metadata']['name']} is refused by Kubernetes "
                    f"{version}: {error.message} at {error.json_path}"
                )
        assert apiserver_refusals(obj) == []
        _accepted.add(key)


def lws_templates(lws: dict[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's pod templates: its leaders', its workers'."""
    group = lws["spec"]["leaderWorkerTemplate"]
    return [group["leaderTemplate"], group["workerTemplate"]]


HOST_CACHE = {"hostPath": {"path": "/var/cache/tidegate"}}
PVC_CACHE = {"pvc": {"claimName": "model-cache"}}
LORA_CLAIM = {"pvc": {"claimName": "loras", "path": "sql"}}
HOST_LORA = {"hostPath": {"path": "/srv/loras/chat"}}
ADAPTER_SQL = {"name": "sql", "source": LORA_CLAIM}

TABLE = {
    "unified-cpu-hostpath": {"model": model()},
    "pvc-without-path": {"model": model({"pvc": {"claimName": "models"}})},
    "pvc-with-path": {"model": model({"pvc": {"claimName": "models", "path": "/llama/3b/"}})},
    "uri-init-container": {
        "model": model({"uri": "https://models.example/llama.tar.gz"}, parameterCount=3 * TINY)
    },
    "uri-cache-host-path": {
        "model": model({"uri": "https://models.example/llama.tar.gz"}, cache=HOST_CACHE),
    },
    "uri-cache-pvc-disaggregated": {
        "model": model({"uri": "https://models.example/llama.tar.gz"}, cache=PVC_CACHE),
        "topology": disaggregated(),
    },
    "pvc-source-cache": {"model": model({"pvc": {"claimName": "models"}}, cache=HOST_CACHE)},
    "one-gpu": {"model": model(parameterCount=7 * TINY), "accelerator": gpus(1)},
    "eight-gpus-70b": {
        "model": LLAMA_70B_MODEL,
        "accelerator": gpus(8),
        "topology": {"unified": {"replicas": 2}},
    },
    "amd-gpus": {
        "model": model(parameterCount=70 * TINY, numKeyValueHeads=8),
        "accelerator": gpus(8, 192, resource="amd.com/gpu"),
        "parallelism": {"tensorParallelSize": 2},
    },
    "cpu-with-resources": {"model": model(), "resources": {"cpu": "1500m", "memory": "6Gi"}},
    "auth-secret": {
        "model": model(),
        "auth": {"apiKeySecretRef": {"name": "llm-key", "key": "secret-value"}},
    },
    "load-balancer": {"model": model(), "service": {"type": "LoadBalancer", "port": 443}},
    "replicas-0": {"model": model(), "topology": {"unified": {"replicas": 0}}},
    "image-pull-policy": {
        "model": model(),
        "image": "registry.example/tidegate:dev",
        "imagePullPolicy": "Always",
    },
    "max-model-len": {"model": model(maxModelLen=4096, dtype="float16")},
    "disaggregated-cpu": {"model": model(), "topology": disaggregated()},
    "disaggregated-gpu-uri-auth": {
        "model": model({"uri": "file:///seed/llama.tar"}, parameterCount=8 * TINY),
        "accelerator": gpus(4, peakTflops=400),
        "topology": disaggregated(
            prefill={"replicas": 2, "tensorParallelSize": 1},
            decode={"replicas": 3, "tensorParallelSize": 2, "maxNumBatchedTokens": 1024},
            router={"replicas": 2},
        ),
        "auth": {"apiKeySecretRef": {"name": "llm-key", "key": "secret-value"}},
        "service": {"type": "NodePort"},
        "imagePullPolicy": "IfNotPresent",
    },
    "disaggregated-scaled-to-zero": {
        "model": model({"pvc": {"claimName": "models", "path": "tiny"}}),
        "topology": disaggregated(
            prefill={"replicas": 0}, decode={"replicas": 0}, router={"replicas": 0}
        ),
    },
    "unified-to-zero-behind-a-router": {
        "model": model(),
        "topology": {"unified": {"replicas": 0}, "router": {"replicas": 2}},
        "autoscaling": {"unified": {"minReplicas": 0, "maxReplicas": 4}},
    },
    "keda-unified-to-zero": {
        "model": model(),
        "autoscaling": {
            "driver": "keda",
            "prometheus": {"serverAddress": "http://prometheus-operated.monitoring.svc:9090"},
            "unified": {"minReplicas": 0, "maxReplicas": 4, "idleBeforeZeroSeconds": 900},
        },
    },
    "hpa-disaggregated": {
        "model": model(),
        "topology": disaggregated(prefill={"replicas": 2}, decode={"replicas": 2}),
        "autoscaling": {
            "driver": "hpa",
            "prefill": {"minReplicas": 1, "maxReplicas": 6},
            "decode": {
                "minReplicas": 2,
                "maxReplicas": 8,
                "targets": {"waitingRequestsPerReplica": 0},
                "scaleDown": {"percent": 0},
            },
        },
    },
    "adapters-every-source": {
        "model": model({"pvc": {"claimName": "models", "path": "llama"}}),
        "adapters": [
            {"name": "sql", "source": {"pvc": {"claimName": "models", "path": "loras/sql"}}},
            {"name": "chat", "source": {"pvc": {"claimName": "loras"}}},
            {"name": "Support_v2.1", "source": {"hostPath": {"path": "/srv/loras/support"}}},
            {"name": "web", "source": {"uri": "https://loras.example/web.tar.gz"}},
        ],
    },
    "adapters-disaggregated-cache": {
        "model": model({"uri": "https://models.example/llama.tar.gz"}, cache=PVC_CACHE),
        "topology": disaggregated(),
        "adapters": [
            {"name": "web", "source": {"uri": "https://loras.example/web.tar.gz"}},
            {"name": "cached", "source": {"pvc": {"claimName": "model-cache", "path": "l/c"}}},
        ],
    },
    "adapters-none-yet": {"model": model(), "adapters": []},
    "adapters-lora-limits-disaggregated": {
        "model": model(),
        "topology": disaggregated(),
        "adapters": [ADAPTER_SQL],
        "lora": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8},
    },
    "gateway-unified-two-routers": {
        "model": model({"pvc": {"claimName": "models", "path": "llama"}}),
        "topology": {"unified": {"replicas": 3}, "router": {"replicas": 2}},
        "gateway": {"inferencePool": True},
    },
    "gateway-disaggregated-cached-uri-fail-open": {
        "model": model({"uri": "https://models.example/llama.tar.gz"}, cache=PVC_CACHE),
        "topology": disaggregated(decode={"replicas": 2}),
        "gateway": {"inferencePool": True, "failureMode": "FailOpen"},
        "auth": {"apiKeySecretRef": {"name": "llm-key", "key": "secret-value"}},
        "service": {"type": "LoadBalancer"},
    },
    "multinode-cpu": {
        "model": model(dtype="float32"),
        "parallelism": {"pipelineParallelSize": 2, "nodesPerReplica": 2},
        "auth": {"apiKeySecretRef": {"name": "llm-key", "key": "secret-value"}},
    },
    "multinode-gpu-405b-gateway-cached-uri": {
        "model": model(
            {"uri": "https://models.example/llama-405b.tar"},
            cache=PVC_CACHE,
            parameterCount=405 * TINY,
            numKeyValueHeads=8,
        ),
        "accelerator": {"perNode": 8, "memoryGiB": 80},
        "topology": {"unified": {"replicas": 2}, "router": {"replicas": 1}},
        "gateway": {"inferencePool": True},
        "adapters": [ADAPTER_SQL],
    },
    "user-set-chunks": {
        "model": model(parameterCount=7 * TINY),
        "accelerator": gpus(2),
        "scheduling": {
            "longPrefillTokenThreshold": 512,
            "maxNumBatchedTokens": 4096,
            "maxNumSeqs": 64,
            "blockSize": 32,
            "enablePrefixCaching": False,
            "slo": {"ttftMs": 300, "itlMs": 20},
        },
    },
}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: Path(path).stem)
def test_every_example_renders_objects_kubernetes_accepts(path: str, version: str) -> None:
    (example,) = load_llm_deployments(path)
    example["metadata"]["uid"] = UID
    assert_valid(render(example).objects, version)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", TABLE)
def test_every_spec_of_the_table_renders_objects_kubernetes_accepts(case: str, version: str):
    assert_valid(render_spec(TABLE[case]).objects, version)


def test_the_table_renders_every_kind_the_operator_owns() -> None:
    """So the schema checks above see every kind, and reconcile prunes every kind rendered."""
    rendered = {
        (obj["apiVersion"], obj["kind"])
        for spec in TABLE.values()
        for obj in render_spec(spec).objects
    }
    assert rendered == set(OWNED_KINDS)


def test_the_schema_check_refuses_an_unknown_field() -> None:
    """Strict mode is what catches a misspelt field; make sure it is on."""
    deployment = copy.deepcopy(deployments(render_spec(TABLE["unified-cpu-hostpath"]))[0])
    main_container(deployment)["readinessProb"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37", strict=True)


# Generated specs: each part is drawn from values the spec allows and tuning accepts, so any
# refusal is a bug of the renderer or the tuner, not of the strategy.
DNS_LABELS = st.from_regex(r"[a-z]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
# Any text but control characters (Unicode category Cc), which the CRD refuses.
SERVED_NAMES = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=80)


@st.composite
def llm_specs(draw: st.DrawFn) -> dict[str, Any]:
    sources = st.one_of(
        st.builds(
            lambda claim, path: {"pvc": {"claimName": claim, **({"path": path} if path else {})}},
            DNS_LABELS,
            st.sampled_from(["", "m", "/models/m/", "a/b"]),
        ),
        st.just({"hostPath": {"path": "/models/m"}}),
        st.sampled_from(
            ["https://h.example/m.tar", "file:///seed/m.tgz", "http://h/a%20b.tar.gz?x=1&y='2'"]
        ).map(lambda uri: {"uri": uri}),
    )
    model_part = draw(
        st.fixed_dictionaries(
            {"name": SERVED_NAMES, "source": sources},
            optional={
                "parameterCount": st.sampled_from([0.5 * TINY, TINY, 7 * TINY, 30 * TINY]),
                "numAttentionHeads": st.just(32),
                "numKeyValueHeads": st.just(8),
                "maxModelLen": st.sampled_from([2048, 8192, 32768]),
                "dtype": st.sampled_from(["auto", "bfloat16", "float16"]),
                "cache": st.sampled_from([HOST_CACHE, PVC_CACHE]),
                "toolCallParser": st.sampled_from(["hermes", "llama3_json", "mistral"]),
            },
        )
    )
    spec: dict[str, Any] = {"model": model_part}
    if draw(st.booleans()):
        count = draw(st.sampled_from([1, 2, 4, 8]))
        spec["accelerator"] = draw(
            st.fixed_dictionaries(
                {"count": st.just(count), "memoryGiB": st.sampled_from([80, 192])},
                optional={
                    "resource": st.sampled_from(["nvidia.com/gpu", "amd.com/gpu", "x.io/tpu"]),
                    "peakTflops": st.sampled_from([300.0, 1000.0]),
                },
            )
        )
        tp_choices = ["auto", *[n for n in (1, 2, 4, 8) if n <= count]]
        tp = draw(st.sampled_from(tp_choices))
    else:
        tp = draw(st.sampled_from(["auto", 1]))
    spec["parallelism"] = {
        "tensorParallelSize": tp,
        "dataParallelSizeLocal": draw(st.sampled_from(["auto", 1])),
    }
    replicas = st.integers(0, 3)
    spec["topology"] = draw(
        st.one_of(
            st.fixed_dictionaries({}, optional={"unified": st.builds(dict, replicas=replicas)}),
            st.fixed_dictionaries(
                {
                    "mode": st.just("disaggregated"),
                    "prefill": st.builds(dict, replicas=replicas),
                    "decode": st.builds(dict, replicas=replicas),
                },
                optional={"router": st.builds(dict, replicas=replicas)},
            ),
        )
    )
    if draw(st.booleans()):
        spec["autoscaling"] = draw(autoscaling_for(spec["topology"]))
    # An InferencePool where a router may run (its endpoint picker).
    if spec["topology"].get("router", {}).get("replicas", 1) >= 1 and draw(st.booleans()):
        spec["gateway"] = {
            "inferencePool": True,
            "failureMode": draw(st.sampled_from(["FailOpen", "FailClose"])),
        }
    if draw(st.booleans()):
        spec["adapters"] = draw(adapters_besides(model_part["name"]))
    spec.update(
        draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "scheduling": st.fixed_dictionaries(
                        {},
                        optional={
                            "longPrefillTokenThreshold": st.sampled_from(["auto", 256, 1024]),
                            "maxNumBatchedTokens": st.sampled_from(["auto", 2048, 8192]),
                            "maxNumSeqs": st.sampled_from([1, 64, 256]),
                            "blockSize": st.sampled_from([16, 32, 64]),
                            "enablePrefixCaching": st.booleans(),
                            "slo": st.fixed_dictionaries(
                                {"ttftMs": st.integers(1, 5000), "itlMs": st.integers(1, 200)}
                            ),
                        },
                    ),
                    "service": st.fixed_dictionaries(
                        {},
                        optional={
                            "type": st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]),
                            "port": st.integers(1, 65535),
                        },
                    ),
                    "image": st.sampled_from(["r.example/tg:1", "tg@sha256:" + "a" * 64]),
                    "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"]),
                    "resources": st.fixed_dictionaries(
                        {},
                        optional={
                            "cpu": st.sampled_from(["1", "250m", "0.5"]),
                            "memory": st.sampled_from(["512Mi", "8Gi", "1.5G"]),
                        },
                    ),
                    "auth": st.just({"apiKeySecretRef": {"name": "k", "key": "api-key"}}),
                },
            )
        )
    )
    return spec


ADAPTER_SOURCES = st.one_of(
    st.builds(
        lambda claim, path: {"pvc": {"claimName": claim, "path": path}},
        st.sampled_from(["models", "loras", "model-cache"]),
        st.sampled_from(["", "a", "/l/b/"]),
    ),
    st.sampled_from(["/srv/l/a", "/srv/l/b"]).map(lambda path: {"hostPath": {"path": path}}),
    st.sampled_from(["https://h.example/a.tar", "file:///seed/b.tgz"]).map(lambda u: {"uri": u}),
)


def adapters_besides(model_name: str) -> st.SearchStrategy[list[dict[str, Any]]]:
    """spec.adapters: distinct names, none the served model's."""
    names = st.from_regex(r"[a-zA-Z0-9][a-zA-Z0-9._-]{0,20}", fullmatch=True)
    return st.lists(
        st.fixed_dictionaries({"name": names.filter(lambda n: n != model_name)}),
        max_size=4,
        unique_by=lambda adapter: adapter["name"],
    ).flatmap(
        lambda named: st.tuples(*(ADAPTER_SOURCES for _ in named)).map(
            lambda sources: [{**a, "source": s} for a, s in zip(named, sources, strict=True)]
        )
    )


@st.composite
def autoscaling_for(draw: st.DrawFn, topology: dict[str, Any]) -> dict[str, Any]:
    """A driver and a policy per pool; minReplicas 0 where the driver and a router allow it."""
    disaggregated = topology.get("mode") == "disaggregated"
    driver = draw(st.sampled_from(["operator", "keda", "hpa"]))
    router = topology.get("router", {}).get("replicas", 1) >= 1
    lowest = 1 if driver == "hpa" or not router else 0
    autoscaling: dict[str, Any] = {"driver": driver}
    if driver == "keda":
        autoscaling["prometheus"] = {"serverAddress": "http://prometheus.monitoring.svc:9090"}
    for role in ("prefill", "decode") if disaggregated else ("unified",):
        low = draw(st.integers(lowest, 2))
        autoscaling[role] = {
            "minReplicas": low,
            "maxReplicas": draw(st.integers(max(low, 1), 10)),
            "targets": {"waitingRequestsPerReplica": draw(st.integers(0, 4))},
            "scaleDown": {"percent": draw(st.sampled_from([0, 10, 100]))},
        }
    return autoscaling


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=llm_specs(), name=DNS_LABELS, namespace=DNS_LABELS)
def test_generated_specs_render_objects_kubernetes_accepts(spec, name, namespace) -> None:
    rendered = render_spec(spec, name=name, namespace=namespace)
    for version in KUBERNETES_VERSIONS:
        assert_valid(rendered.objects, version)
    for role in rendered.tuning.roles:
        assert role_config(rendered, role)["served-model-name"] == [spec["model"]["name"]]
    if "adapters" in spec:
        assert_every_adapter_is_in_every_engine_pod(rendered)


# --- objects and how they find each other ----------------------------------------------------


def kinds_and_names(rendered: Rendered) -> list[tuple[str, str]]:
    return [(obj["kind"], obj["metadata"]["name"]) for obj in rendered.objects]


def test_unified_renders_a_config_map_deployment_service_and_pdb() -> None:
    rendered = render_spec({"model": model()})
    assert sorted(kinds_and_names(rendered)) == [
        ("ConfigMap", "llm-config"),
        ("Deployment", "llm"),
        ("PodDisruptionBudget", "llm"),
        ("Service", "llm"),
    ]
    service = find(rendered, "Service", "llm")
    deployment = find(rendered, "Deployment", "llm")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    pdb = find(rendered, "PodDisruptionBudget", "llm")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_disaggregated_renders_prefill_decode_and_router_pools() -> None:
    rendered = render_spec({"model": model(), "topology": disaggregated()})
    assert sorted(kinds_and_names(rendered)) == [
        ("ConfigMap", "llm-config"),
        ("Deployment", "llm-decode"),
        ("Deployment", "llm-prefill"),
        ("Deployment", "llm-router"),
        ("NetworkPolicy", "llm-cache-events"),
        ("NetworkPolicy", "llm-kv"),
        ("PodDisruptionBudget", "llm-decode"),
        ("PodDisruptionBudget", "llm-prefill"),
        ("PodDisruptionBudget", "llm-router"),
        ("Service", "llm"),
        ("Service", "llm-decode"),
        ("Service", "llm-prefill"),
    ]
    for role in ("prefill", "decode", "router"):
        selector = find(rendered, "Deployment", f"llm-{role}")["spec"]["selector"]
        assert find(rendered, "PodDisruptionBudget", f"llm-{role}")["spec"]["selector"] == selector


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is rendered"
    return selector["matchLabels"].items() <= labels.items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def admits(
    policy: dict[str, Any],
    to: dict[str, Any],
    port: int,
    source: dict[str, str] | None,
    *,
    same_namespace: bool = True,
) -> bool:
    """Whether `policy` lets a TCP connection in to a pod of Deployment `to` on `port`.

    NetworkPolicy semantics for what the renderer uses: a pod the policy does not select is
    not restricted by it; a selected pod admits what some ingress rule lists, a rule with no
    `from` admitting any source, a podSelector alone only pods of the policy's namespace.
    `source` is the client pod's labels, None for a client that is no pod (a node, outside).
    """
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    if not selects(spec["podSelector"], pod_labels(to)):
        return True
    named = {p["name"]: p["containerPort"] for p in main_container(to)["ports"]}
    for rule in spec["ingress"]:
        ports = [named.get(p["port"], p["port"]) for p in rule["ports"] if p["protocol"] == "TCP"]
        if port not in ports:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "only same-namespace pod peers are rendered"
            if source is not None and same_namespace and selects(peer["podSelector"], source):
                return True
    return False


def test_only_decode_pods_of_the_resource_reach_the_prefill_kv_ports() -> None:
    rendered = render_spec(TABLE["disaggregated-gpu-uri-auth"])
    other = render_spec(TABLE["disaggregated-gpu-uri-auth"], name="other")
    policy = find(rendered, "NetworkPolicy", "llm-kv")
    prefill = find(rendered, "Deployment", "llm-prefill")
    labels = {d["metadata"]["name"]: pod_labels(d) for d in deployments(rendered)}
    other_labels = {d["metadata"]["name"]: pod_labels(d) for d in deployments(other)}
    kv = [p["containerPort"] for p in main_container(prefill)["ports"] if p["name"][:2] == "kv"]
    assert len(kv) > 2  # several engine cores: every core's ports are covered
    for port in kv:
        assert admits(policy, prefill, port, labels["llm-decode"])
        assert not admits(policy, prefill, port, labels["llm-decode"], same_namespace=False)
        for source in (labels["llm-router"], labels["llm-prefill"], other_labels["other-decode"]):
            assert not admits(policy, prefill, port, source)
        assert not admits(policy, prefill, port, None)
    assert not admits(policy, prefill, max(kv) + 1, labels["llm-decode"])
    # http: the router's legs, the kubelet's probes, scrapes from any namespace.
    for source in [*labels.values(), other_labels["other-router"], None]:
        assert admits(policy, prefill, 8000, source)
        assert admits(policy, prefill, 8000, source, same_namespace=False)


def test_the_kv_policy_selects_exactly_the_prefill_pods() -> None:
    rendered = render_spec({"model": model(), "topology": disaggregated()})
    policy = find(rendered, "NetworkPolicy", "llm-kv")
    pools = deployments(rendered) + deployments(
        render_spec({"model": model(), "topology": disaggregated()}, name="other")
    )
    selected = [
        d["metadata"]["name"]
        for d in pools
        if selects(policy["spec"]["podSelector"], pod_labels(d))
    ]
    assert selected == ["llm-prefill"]
    assert (
        policy["spec"]["podSelector"]
        == find(rendered, "Deployment", "llm-prefill")["spec"]["selector"]
    )


def test_unified_renders_no_network_policy() -> None:
    """A unified pod has no KV port: nothing to guard, and its http port stays open."""
    for case in ("unified-cpu-hostpath", "eight-gpus-70b", "auth-secret"):
        assert not [o for o in render_spec(TABLE[case]).objects if o["kind"] == "NetworkPolicy"]


def test_disaggregated_public_service_selects_the_router_pods() -> None:
    rendered = render_spec({"model": model(), "topology": disaggregated()})
    public = find(rendered, "Service", "llm")
    router = find(rendered, "Deployment", "llm-router")
    assert public["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert "clusterIP" not in public["spec"]
    assert main_container(router)["args"] == ["router", "--config", "/etc/tidegate/router.yaml"]


def test_disaggregated_prefill_and_decode_services_are_headless() -> None:
    rendered = render_spec(
        {"model": model(), "topology": disaggregated(), "service": {"type": "LoadBalancer"}}
    )
    for role in ("prefill", "decode"):
        service = find(rendered, "Service", f"llm-{role}")
        pods = find(rendered, "Deployment", f"llm-{role}")["spec"]["selector"]["matchLabels"]
        assert service["spec"]["clusterIP"] == "None"
        assert "type" not in service["spec"]  # only the public Service is a LoadBalancer
        assert service["spec"]["selector"] == pods
    assert find(rendered, "Service", "llm")["spec"]["type"] == "LoadBalancer"


def test_public_service_has_the_spec_port_and_type() -> None:
    rendered = render_spec({"model": model(), "service": {"type": "NodePort", "port": 443}})
    service = find(rendered, "Service", "llm")
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 443, "targetPort": "http", "protocol": "TCP"}
    ]
    container = main_container(find(rendered, "Deployment", "llm"))
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]


def test_replicas_come_from_the_topology() -> None:
    unified = render_spec({"model": model(), "topology": {"unified": {"replicas": 0}}})
    assert find(unified, "Deployment", "llm")["spec"]["replicas"] == 0
    split = render_spec(
        {
            "model": model(),
            "topology": disaggregated(
                prefill={"replicas": 2}, decode={"replicas": 5}, router={"replicas": 3}
            ),
        }
    )
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in deployments(split)}
    assert replicas == {"llm-prefill": 2, "llm-decode": 5, "llm-router": 3}
    default_router = render_spec({"model": model(), "topology": disaggregated()})
    assert find(default_router, "Deployment", "llm-router")["spec"]["replicas"] == 1


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-gpu-uri-auth"])
def test_every_object_is_owned_by_the_resource(case: str) -> None:
    rendered = render_spec(TABLE[case])
    for obj in rendered.objects:
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "tidegate.dev/v1alpha1",
                "kind": "LLMDeployment",
                "name": "llm",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-gpu-uri-auth"])
def test_no_owner_references_without_a_uid(case: str) -> None:
    """`tidegate plan` renders a resource no cluster has seen."""
    rendered = render_spec(TABLE[case], uid=None)
    assert all("ownerReferences" not in obj["metadata"] for obj in rendered.objects)


@pytest.mark.parametrize(
    ("case", "components"),
    [
        ("unified-cpu-hostpath", {"config", "unified"}),
        ("disaggregated-gpu-uri-auth", {"config", "prefill", "decode", "router"}),
    ],
)
def test_every_object_and_pod_carries_the_standard_labels(case: str, components: set) -> None:
    rendered = render_spec(TABLE[case])
    labelled = [obj["metadata"] for obj in rendered.objects]
    labelled += [d["spec"]["template"]["metadata"] for d in deployments(rendered)]
    for meta in labelled:
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "tidegate"
        assert labels["app.kubernetes.io/instance"] == "llm"
        assert labels["app.kubernetes.io/part-of"] == "tidegate"
        assert labels["app.kubernetes.io/managed-by"] == "tidegate-operator"
        assert labels["app.kubernetes.io/component"] in components


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-gpu-uri-auth"])
def test_deployment_selector_is_a_stable_subset_of_the_pod_labels(case: str) -> None:
    """A Deployment's selector is immutable: it must hold no label the operator may change."""
    for deployment in deployments(render_spec(TABLE[case])):
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert set(selector) == {
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
        }


def test_selectors_of_two_resources_do_not_overlap() -> None:
    """Two LLMDeployments in one namespace never select each other's pods."""
    one = deployments(render_spec({"model": model()}, name="one"))[0]
    two = deployments(render_spec({"model": model()}, name="two"))[0]
    one_selector = one["spec"]["selector"]["matchLabels"].items()
    assert not one_selector <= two["spec"]["template"]["metadata"]["labels"].items()


def test_objects_live_in_the_resource_namespace_or_default() -> None:
    placed = render_spec({"model": model(), "topology": disaggregated()}, namespace="team-a")
    assert {obj["metadata"]["namespace"] for obj in placed.objects} == {"team-a"}
    unplaced = render_spec({"model": model()}, namespace=None)
    assert {obj["metadata"]["namespace"] for obj in unplaced.objects} == {"default"}


# --- the config files the pods run -----------------------------------------------------------

SERVE_FLAGS = {
    name.replace("_", "-") for model in (EngineArgs, ServerArgs) for name in model.model_fields
}
ROUTER_FLAGS = {name.replace("_", "-") for name in RouterArgs.model_fields}
CONFIG_CASES = [
    "unified-cpu-hostpath",
    "eight-gpus-70b",
    "disaggregated-gpu-uri-auth",
    "uri-cache-pvc-disaggregated",
    "adapters-every-source",
    "adapters-disaggregated-cache",
    "adapters-lora-limits-disaggregated",
]


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_keys_are_flags_of_tidegate_serve(case: str, tmp_path: Path) -> None:
    rendered = render_spec(TABLE[case])
    for role in rendered.tuning.roles:
        flags = role_config(rendered, role)
        assert set(flags) <= SERVE_FLAGS
        path = tmp_path / f"{role}.yaml"
        path.write_text(config_map(rendered)["data"][f"{role}.yaml"], encoding="utf-8")
        values = load_config_file(str(path), [EngineArgs, ServerArgs])
        # The values, not only the names, are what the engine accepts.
        EngineArgs(**{k: v for k, v in values.items() if k in EngineArgs.model_fields})
        ServerArgs(**{k: v for k, v in values.items() if k in ServerArgs.model_fields})


def test_config_map_holds_one_file_per_pool() -> None:
    unified = render_spec({"model": model()})
    assert set(config_map(unified)["data"]) == {"unified.yaml"}
    split = render_spec({"model": model(), "topology": disaggregated()})
    assert set(config_map(split)["data"]) == {"prefill.yaml", "decode.yaml", "router.yaml"}


@pytest.mark.parametrize("case", [*CONFIG_CASES, "user-set-chunks", "amd-gpus"])
def test_config_holds_the_tuned_values(case: str) -> None:
    rendered = render_spec(TABLE[case])
    for role, tuning in rendered.tuning.roles.items():
        flags = role_config(rendered, role)
        tuned = {name.replace("_", "-"): value for name, value in tuning.engine_args().items()}
        assert {flag: flags[flag] for flag in tuned} == tuned


def test_each_tuned_flag_is_commented_with_its_reason() -> None:
    rendered = render_spec(TABLE["eight-gpus-70b"])
    lines = config_map(rendered)["data"]["unified.yaml"].splitlines()
    tuning = rendered.tuning.roles["unified"]
    for field, choice in {
        "tensor-parallel-size": tuning.tensor_parallel_size,
        "data-parallel-size-local": tuning.data_parallel_size_local,
        "max-num-batched-tokens": tuning.max_num_batched_tokens,
        "long-prefill-token-threshold": tuning.long_prefill_token_threshold,
    }.items():
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{field}:")]
        assert lines[at - 1] == f"# {choice.reason}"


def test_auto_chunks_get_the_itl_slo_as_the_tuners_step_target() -> None:
    spec = TABLE["disaggregated-cpu"] | {"scheduling": {"slo": {"itlMs": 80}}}
    rendered = render_spec(spec)
    lines = config_map(rendered)["data"]["decode.yaml"].splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("long-prefill-step-ms:")]
    assert lines[at] == "long-prefill-step-ms: 80"
    assert lines[at - 1].startswith("# the ITL SLO 80 ms (spec.scheduling.slo.itlMs)")
    assert role_config(rendered, "decode")["long-prefill-token-threshold"] == "auto"
    # Prefill pods carry no decodes: no step target; nor has a pool with a fixed threshold.
    assert "long-prefill-step-ms" not in role_config(rendered, "prefill")
    fixed = render_spec(
        TABLE["unified-cpu-hostpath"] | {"scheduling": {"longPrefillTokenThreshold": 256}}
    )
    assert "long-prefill-step-ms" not in role_config(fixed, "unified")


def test_config_carries_the_model_and_scheduling_of_the_spec() -> None:
    spec = TABLE["user-set-chunks"] | {"model": model(maxModelLen=4096, dtype="bfloat16")}
    flags = role_config(render_spec(spec), "unified")
    assert flags["model"] == "/model"
    assert flags["served-model-name"] == ["tiny-llama"]
    assert flags["port"] == 8000
    assert flags["device"] == "cuda"
    assert flags["dtype"] == "bfloat16"
    assert flags["max-model-len"] == 4096
    assert flags["max-num-seqs"] == 64
    assert flags["block-size"] == 32
    assert flags["enable-prefix-caching"] is False
    assert role_config(render_spec({"model": model()}), "unified")["device"] == "cpu"


def test_max_model_len_is_left_to_the_model_when_not_given() -> None:
    assert "max-model-len" not in role_config(render_spec({"model": model()}), "unified")


@settings(max_examples=25, deadline=None)
@given(name=SERVED_NAMES)
def test_any_served_model_name_survives_the_config_file(name: str) -> None:
    rendered = render_spec({"model": {**model(), "name": name}})
    assert role_config(rendered, "unified")["served-model-name"] == [name]


def test_kv_role_is_producer_on_prefill_consumer_on_decode_none_on_unified() -> None:
    split = render_spec({"model": model(), "topology": disaggregated()})
    assert role_config(split, "prefill")["kv-role"] == "producer"
    assert role_config(split, "decode")["kv-role"] == "consumer"
    unified = role_config(render_spec({"model": model()}), "unified")
    assert unified.get("kv-role", EngineArgs.model_fields["kv_role"].default) == "none"


def test_prefill_pods_expose_the_kv_transport_port() -> None:
    split = render_spec({"model": model(), "topology": disaggregated()})
    kv_port = EngineArgs.model_fields["kv_port"].default
    prefill_ports = main_container(find(split, "Deployment", "llm-prefill"))["ports"]
    config = role_config(split, "prefill")
    tp = config.get("tensor-parallel-size", 1)
    dp = config.get("data-parallel-size-local", 1)
    # Per engine core: the side channel, then one block port per tensor-parallel rank.
    kv = [p["containerPort"] for p in prefill_ports if p["name"].startswith("kv")]
    assert kv == list(range(kv_port, kv_port + dp * (tp + 1)))
    assert {"name": "kv", "containerPort": kv_port} in prefill_ports


KV_CURVE_MOUNT = {"name": "kv-curve", "mountPath": "/var/run/secrets/kv-curve", "readOnly": True}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("encryption", ["curve", None])
def test_both_pools_mount_the_kv_key_pair_and_encrypt_by_default(
    encryption: str | None, version: str
) -> None:
    spec = copy.deepcopy(TABLE["disaggregated-gpu-uri-auth"])
    if encryption:
        spec["topology"]["kvEncryption"] = encryption
    rendered = render_spec(spec)
    assert rendered.kv_keys is not None
    assert rendered.kv_keys["metadata"]["name"] == "llm-kv-curve"
    assert rendered.kv_keys["metadata"]["ownerReferences"][0]["uid"] == UID
    assert_valid([key_secret(rendered.kv_keys)], version)
    for role in ("prefill", "decode"):
        pool = find(rendered, "Deployment", f"llm-{role}")
        assert volume(pool, "kv-curve")["secret"] == {
            "secretName": "llm-kv-curve",
            "defaultMode": 0o440,
        }
        # The whole Secret, read-only, no subPath; the fetch of the model needs no key.
        assert mount(main_container(pool), "/var/run/secrets/kv-curve") == KV_CURVE_MOUNT
        for init in pod_spec(pool).get("initContainers", []):
            assert KV_CURVE_MOUNT not in init["volumeMounts"]
        config = role_config(rendered, role)
        assert config["kv-encryption"] == "curve"
        assert config["kv-curve-key-dir"] == "/var/run/secrets/kv-curve"
    router = find(rendered, "Deployment", "llm-router")
    assert all(v["name"] != "kv-curve" for v in pod_spec(router)["volumes"])
    assert "kv-encryption" not in role_config(rendered, "router")


def test_kv_encryption_none_is_plain_tcp_and_switching_rolls_both_pools() -> None:
    curve = {"model": model(), "topology": disaggregated()}
    plain = {"model": model(), "topology": disaggregated(kvEncryption="none")}
    rendered = render_spec(plain)
    assert rendered.kv_keys is None
    for role in ("prefill", "decode"):
        pool = find(rendered, "Deployment", f"llm-{role}")
        assert all(v["name"] != "kv-curve" for v in pod_spec(pool)["volumes"])
        config = role_config(rendered, role)
        assert config["kv-encryption"] == "none" and "kv-curve-key-dir" not in config
    assert "topology.kvEncryption none" in config_map(rendered)["data"]["prefill.yaml"]
    before, after = hashes(curve), hashes(plain)
    rolled = {name for name in before if before[name] != after[name]}
    assert rolled == {"llm-prefill", "llm-decode"}
    assert render_spec({"model": model()}).kv_keys is None  # unified: no KV crosses pods


def test_router_config_names_the_prefill_and_decode_services(tmp_path: Path) -> None:
    rendered = render_spec({"model": model(), "topology": disaggregated()}, namespace="team-a")
    path = tmp_path / "router.yaml"
    path.write_text(config_map(rendered)["data"]["router.yaml"], encoding="utf-8")
    values = load_config_file(str(path), [RouterArgs])
    assert set(yaml.safe_load(path.read_text())) <= ROUTER_FLAGS
    assert values["prefill"] == ["http://llm-prefill.team-a.svc:8000"]
    assert values["decode"] == ["http://llm-decode.team-a.svc:8000"]
    RouterArgs(**values)
    for role in ("prefill", "decode"):
        service = find(rendered, "Service", f"llm-{role}")
        assert service["spec"]["ports"][0]["port"] == 8000


# --- the pods ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-cpu"])
def test_engine_pods_run_tidegate_serve_on_their_role_config(case: str) -> None:
    rendered = render_spec(TABLE[case])
    cm_name = config_map(rendered)["metadata"]["name"]
    for role in rendered.tuning.roles:
        deployment = find(rendered, "Deployment", "llm" if role == "unified" else f"llm-{role}")
        container = main_container(deployment)
        assert container["command"] == ["tidegate"]
        assert container["args"] == ["serve", "--config", f"/etc/tidegate/{role}.yaml"]
        assert mount(container, "/etc/tidegate")["readOnly"] is True
        config = volume(deployment, mount(container, "/etc/tidegate")["name"])
        assert config["configMap"]["name"] == cm_name


@pytest.mark.parametrize(
    ("spec", "per_pod"),
    [
        ({"model": model(parameterCount=7 * TINY), "accelerator": gpus(1)}, 1),
        (TABLE["eight-gpus-70b"], 8),
        (TABLE["amd-gpus"], 8),
        (
            {
                "model": model(parameterCount=7 * TINY),
                "accelerator": gpus(8),
                "parallelism": {"tensorParallelSize": 2, "dataParallelSizeLocal": 3},
            },
            6,
        ),
    ],
    ids=["one-gpu", "eight-gpus-70b", "amd-tp2", "tp2-dp3-of-8"],
)
def test_accelerators_requested_are_tp_times_dp(spec: dict[str, Any], per_pod: int) -> None:
    rendered = render_spec(spec)
    resource_name = spec["accelerator"].get("resource", "nvidia.com/gpu")
    tuning = rendered.tuning.roles["unified"]
    assert tuning.accelerators_per_pod() == per_pod
    resources = main_container(find(rendered, "Deployment", "llm"))["resources"]
    assert resources["limits"][resource_name] == str(per_pod)
    assert resources["requests"][resource_name] == str(per_pod)


def test_each_pool_requests_its_own_accelerators() -> None:
    rendered = render_spec(TABLE["disaggregated-gpu-uri-auth"])
    limits = {
        role: main_container(find(rendered, "Deployment", f"llm-{role}"))["resources"]["limits"]
        for role in ("prefill", "decode")
    }
    assert limits == {"prefill": {"nvidia.com/gpu": "4"}, "decode": {"nvidia.com/gpu": "4"}}
    router = main_container(find(rendered, "Deployment", "llm-router"))["resources"]
    assert "nvidia.com/gpu" not in router.get("limits", {})


def test_cpu_pods_take_cpu_and_memory_from_the_spec() -> None:
    rendered = render_spec(TABLE["cpu-with-resources"])
    resources = main_container(find(rendered, "Deployment", "llm"))["resources"]
    assert resources == {
        "requests": {"cpu": "1500m", "memory": "6Gi"},
        "limits": {"memory": "6Gi"},
    }
    bare = main_container(find(render_spec({"model": model()}), "Deployment", "llm"))
    # Without spec.resources: default requests, and no guessed memory limit.
    assert bare["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}}


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-gpu-uri-auth"])
def test_dev_shm_is_a_memory_backed_empty_dir(case: str) -> None:
    rendered = render_spec(TABLE[case])
    for role in rendered.tuning.roles:
        deployment = find(rendered, "Deployment", "llm" if role == "unified" else f"llm-{role}")
        shm = volume(deployment, mount(main_container(deployment), "/dev/shm")["name"])
        assert shm["emptyDir"]["medium"] == "Memory"


def model_volume_and_mount(rendered: Rendered) -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = find(rendered, "Deployment", "llm")
    model_mount = mount(main_container(deployment), "/model")
    return volume(deployment, model_mount["name"]), model_mount


def test_pvc_model_is_mounted_read_only_at_its_path() -> None:
    rendered = render_spec(TABLE["pvc-with-path"])
    model_volume, model_mount = model_volume_and_mount(rendered)
    assert model_volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert model_mount["readOnly"] is True
    assert model_mount["subPath"] == "llama/3b"  # relative: the API refuses absolute subPaths


def test_pvc_model_without_path_mounts_the_volume_root() -> None:
    rendered = render_spec(TABLE["pvc-without-path"])
    model_volume, model_mount = model_volume_and_mount(rendered)
    assert model_volume["persistentVolumeClaim"]["claimName"] == "models"
    assert model_mount["readOnly"] is True
    assert "subPath" not in model_mount


def test_host_path_model_is_a_read_only_directory() -> None:
    rendered = render_spec({"model": model({"hostPath": {"path": "/srv/models/llama"}})})
    model_volume, model_mount = model_volume_and_mount(rendered)
    assert model_volume["hostPath"] == {"path": "/srv/models/llama", "type": "Directory"}
    assert model_mount["readOnly"] is True
    assert "initContainers" not in pod_spec(find(rendered, "Deployment", "llm"))


HOSTILE_URI = "https://models.example/a.tar?x=1&y='2';rm%20-rf%20/;`id`#$(id)|&>x"


def test_uri_model_is_fetched_by_an_init_container_without_a_shell() -> None:
    rendered = render_spec({"model": model({"uri": HOSTILE_URI}, parameterCount=TINY)})
    deployment = find(rendered, "Deployment", "llm")
    (init,) = pod_spec(deployment)["initContainers"]
    assert init["command"] == ["tidegate"]
    assert init["args"] == ["fetch-model", HOSTILE_URI, "/model"]
    model_volume, model_mount = model_volume_and_mount(rendered)
    assert "emptyDir" in model_volume
    assert model_mount["readOnly"] is True
    fetch_mount = mount(init, "/model")
    assert fetch_mount["name"] == model_mount["name"]
    assert not fetch_mount.get("readOnly")
    assert env_named(init, "TIDEGATE_API_KEY") is None  # the fetch needs no API key


def test_uri_model_volume_holds_the_archive_and_the_extracted_folder() -> None:
    params = 8 * TINY
    rendered = render_spec({"model": model({"uri": "https://h/m.tar"}, parameterCount=params)})
    model_volume, _ = model_volume_and_mount(rendered)
    limit = model_volume["emptyDir"].get("sizeLimit")
    weights = params * 2
    assert limit is None or int(limit.removesuffix("Gi")) * 2**30 >= 2 * weights


def test_uri_model_volume_is_unbounded_when_the_model_size_is_unknown() -> None:
    rendered = render_spec({"model": model({"uri": "https://h/m.tar"})})
    model_volume, _ = model_volume_and_mount(rendered)
    assert "sizeLimit" not in model_volume["emptyDir"]


# --- spec.model.cache: one fetch and one compile for the pods that share it ------------------

CACHED_URI = "https://models.example/llama.tar.gz"


def cached(cache: dict[str, Any], **spec: Any) -> Rendered:
    return render_spec({"model": model({"uri": CACHED_URI}, cache=cache), **spec})


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        (HOST_CACHE, {"hostPath": {"path": "/var/cache/tidegate", "type": "Directory"}}),
        (PVC_CACHE, {"persistentVolumeClaim": {"claimName": "model-cache"}}),
    ],
    ids=["host-path", "pvc"],
)
def test_a_cached_uri_is_fetched_once_into_the_shared_volume(cache, expected) -> None:
    deployment = find(cached(cache), "Deployment", "llm")
    assert volume(deployment, "model-cache") == {"name": "model-cache", **expected}
    assert "model" not in {v["name"] for v in pod_spec(deployment)["volumes"]}  # no emptyDir
    (init,) = pod_spec(deployment)["initContainers"]
    model_dir = role_config(cached(cache), "unified")["model"]
    assert model_dir.startswith("/var/cache/tidegate/models/")
    assert init["args"] == ["fetch-model", "--shared", CACHED_URI, model_dir]
    assert mount(init, "/var/cache/tidegate") == {
        "name": "model-cache",
        "mountPath": "/var/cache/tidegate",
    }
    engine = main_container(deployment)
    # Writable: the engine writes its compiled kernels there.
    assert not mount(engine, "/var/cache/tidegate").get("readOnly")
    assert "/model" not in {m["mountPath"] for m in engine["volumeMounts"]}
    flags = role_config(cached(cache), "unified")
    assert flags["model"] == model_dir
    assert flags["compile-cache-dir"].startswith("/var/cache/tidegate/compile/")


def test_a_shared_claim_is_not_chowned_again_at_every_start() -> None:
    rendered = cached(PVC_CACHE, topology=disaggregated())
    for name in ("llm-prefill", "llm-decode"):
        context = pod_spec(find(rendered, "Deployment", name))["securityContext"]
        assert context["fsGroupChangePolicy"] == "OnRootMismatch"
    # fsGroup does not reach a hostPath: nothing to say there.
    deployment = find(cached(HOST_CACHE), "Deployment", "llm")
    assert "fsGroupChangePolicy" not in pod_spec(deployment)["securityContext"]


def test_every_pool_shares_one_fetch_and_one_compile_cache() -> None:
    rendered = cached(PVC_CACHE, topology=disaggregated())
    prefill, decode = role_config(rendered, "prefill"), role_config(rendered, "decode")
    assert prefill["model"] == decode["model"]
    assert prefill["compile-cache-dir"] == decode["compile-cache-dir"]
    # A second resource of the same image and model starts warm from the first one's kernels.
    other = role_config(cached(PVC_CACHE, topology=disaggregated()), "prefill")
    assert other["compile-cache-dir"] == prefill["compile-cache-dir"]


def test_another_image_or_model_compiles_into_a_folder_of_its_own() -> None:
    base = role_config(cached(HOST_CACHE), "unified")["compile-cache-dir"]
    new_image = role_config(cached(HOST_CACHE, image="r.example/tg:2"), "unified")
    other_uri = {"model": model({"uri": "https://models.example/b.tar"}, cache=HOST_CACHE)}
    other_model = role_config(render_spec(other_uri), "unified")
    assert len({base, new_image["compile-cache-dir"], other_model["compile-cache-dir"]}) == 3
    assert other_model["model"] != role_config(cached(HOST_CACHE), "unified")["model"]


def test_a_volume_source_with_a_cache_keeps_its_read_only_model_and_caches_kernels() -> None:
    rendered = render_spec(TABLE["pvc-source-cache"])
    deployment = find(rendered, "Deployment", "llm")
    assert "initContainers" not in pod_spec(deployment)
    engine = main_container(deployment)
    assert mount(engine, "/model")["readOnly"] is True
    assert mount(engine, "/var/cache/tidegate")["name"] == "model-cache"
    flags = role_config(rendered, "unified")
    assert flags["model"] == "/model"
    assert flags["compile-cache-dir"].startswith("/var/cache/tidegate/compile/")


def test_without_a_cache_the_engine_keeps_its_own_compile_cache() -> None:
    for case in ("unified-cpu-hostpath", "uri-init-container"):
        assert "compile-cache-dir" not in role_config(render_spec(TABLE[case]), "unified")


@pytest.mark.parametrize("case", TABLE)
def test_no_container_runs_a_shell(case: str) -> None:
    for container in all_containers(render_spec(TABLE[case])):
        words = [*container.get("command", []), *container.get("args", [])]
        assert not SHELLS & set(words), f"{container['name']} runs a shell: {words}"
        assert container["command"] == ["tidegate"]


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-cpu"])
def test_pods_are_probed_on_health(case: str) -> None:
    rendered = render_spec(TABLE[case])
    for deployment in deployments(rendered):
        container = main_container(deployment)
        probes = ["readinessProbe", "livenessProbe"]
        if container["name"] == "engine":
            probes.append("startupProbe")
        for probe in probes:
            # A router's liveness asks only whether it answers: its /health is 503 while an
            # engine pool is still loading, which must not restart it.
            path = (
                "/live" if (container["name"], probe) == ("router", "livenessProbe") else "/health"
            )
            assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe


def startup_window_s(spec: dict[str, Any]) -> int:
    probe = main_container(find(render_spec(spec), "Deployment", "llm"))["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_startup_probe_allows_longer_for_a_bigger_model() -> None:
    unknown = startup_window_s({"model": model()})
    small = startup_window_s({"model": model(parameterCount=TINY)})
    large = startup_window_s(TABLE["eight-gpus-70b"])
    assert unknown >= 300  # a model of unknown size still gets minutes to load
    assert small < large
    # 141 GB of bf16 weights at a few hundred MB/s take minutes, not seconds.
    assert large >= 600


def test_rollout_deadline_outlasts_the_startup_probe() -> None:
    """A rollout is not marked failed while its new pod may still be loading weights."""
    rendered = render_spec(TABLE["eight-gpus-70b"])
    deployment = find(rendered, "Deployment", "llm")
    probe = main_container(deployment)["startupProbe"]
    window = probe["periodSeconds"] * probe["failureThreshold"]
    assert deployment["spec"]["progressDeadlineSeconds"] > window


def test_rollout_never_drops_below_the_desired_capacity() -> None:
    rendered = render_spec(TABLE["disaggregated-cpu"])
    for deployment in deployments(rendered):
        strategy = deployment["spec"]["strategy"]
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize(
    ("case", "count"),
    # disaggregated: engine, engine, router, and the fetch-model of each engine pod
    [("unified-cpu-hostpath", 1), ("disaggregated-gpu-uri-auth", 5)],
)
def test_containers_run_as_non_root_without_privileges(case: str, count: int) -> None:
    rendered = render_spec(TABLE[case])
    for deployment in deployments(rendered):
        pod = pod_spec(deployment)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
    containers = all_containers(rendered)
    assert len(containers) == count
    for container in containers:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["readOnlyRootFilesystem"] is True
        # With a read-only root, /tmp is the one scratch place: it must be a volume.
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])


@pytest.mark.parametrize("case", ["unified-cpu-hostpath", "disaggregated-cpu"])
def test_termination_grace_outlasts_the_shutdown_timeout(case: str) -> None:
    rendered = render_spec(TABLE[case])
    for role in rendered.tuning.roles:
        deployment = find(rendered, "Deployment", "llm" if role == "unified" else f"llm-{role}")
        drain = role_config(rendered, role)["shutdown-timeout"]
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] > drain


@pytest.mark.parametrize("case", ["auth-secret", "disaggregated-gpu-uri-auth"])
def test_api_key_is_a_file_from_its_secret_and_nowhere_else(case: str) -> None:
    rendered = render_spec(TABLE[case])
    mount = {"name": "api-key", "mountPath": "/var/run/secrets/tidegate", "readOnly": True}
    for deployment in (o for o in rendered.objects if o["kind"] == "Deployment"):
        spec = pod_spec(deployment)
        [volume] = [v for v in spec["volumes"] if v["name"] == "api-key"]
        assert volume["secret"] == {
            "secretName": "llm-key",
            "items": [{"key": "secret-value", "path": "api-key"}],
            "defaultMode": 0o440,
        }
    for container in all_containers(rendered):
        if container["name"] == "fetch-model":
            assert mount not in container["volumeMounts"]  # the fetch needs no API key
            continue
        # The folder itself: a subPath mount never sees a rotated Secret.
        assert [m for m in container["volumeMounts"] if m["name"] == "api-key"] == [mount]
        assert env_named(container, "TIDEGATE_API_KEY") is None
        assert not any("api-key" in arg or "api_key" in arg for arg in container["args"])
    for text in config_map(rendered)["data"].values():
        # Each engine and the router read the same file.
        assert yaml.safe_load(text)["api-key-file"] == "/var/run/secrets/tidegate/api-key"
        assert "llm-key" not in text and "secret-value" not in text


def test_no_api_key_without_auth() -> None:
    rendered = render_spec(TABLE["disaggregated-cpu"])
    for container in all_containers(rendered):
        assert env_named(container, "TIDEGATE_API_KEY") is None
        assert all(m["name"] != "api-key" for m in container["volumeMounts"])
    for text in config_map(rendered)["data"].values():
        assert "api-key-file" not in yaml.safe_load(text)
        assert "cache-salt-header" not in yaml.safe_load(text)


def test_the_tenant_header_reaches_every_engine_and_the_router() -> None:
    spec = copy.deepcopy(TABLE["disaggregated-cpu"])
    spec["auth"] = {"tenantHeader": "X-Tenant-Id"}
    rendered = render_spec(spec)
    texts = config_map(rendered)["data"]
    assert set(texts) == {"prefill.yaml", "decode.yaml", "router.yaml"}
    for text in texts.values():
        assert yaml.safe_load(text)["cache-salt-header"] == "x-tenant-id"


def test_the_scheduling_policy_and_tenant_limits_reach_the_engines_and_the_router() -> None:
    spec = copy.deepcopy(TABLE["disaggregated-cpu"])
    spec["auth"] = {"tenantHeader": "X-Tenant-Id"}
    spec["scheduling"] = {"policy": "fair", "maxRunningPerTenant": 6, "maxWaitingPerTenant": 20}
    texts = {k: yaml.safe_load(v) for k, v in config_map(render_spec(spec))["data"].items()}
    for role in ("prefill.yaml", "decode.yaml"):
        assert texts[role]["scheduling-policy"] == "fair"
        assert texts[role]["max-running-per-tenant"] == 6
        assert texts[role]["max-waiting-per-tenant"] == 20
    router = texts["router.yaml"]
    assert (router["max-running-per-tenant"], router["max-waiting-per-tenant"]) == (6, 20)
    assert "scheduling-policy" not in router
    # The router counts in flight only with both limits; an engine takes either alone.
    spec["scheduling"] = {"maxWaitingPerTenant": 20}
    texts = {k: yaml.safe_load(v) for k, v in config_map(render_spec(spec))["data"].items()}
    assert texts["decode.yaml"]["max-waiting-per-tenant"] == 20
    assert texts["decode.yaml"]["scheduling-policy"] == "fcfs"
    assert "max-waiting-per-tenant" not in texts["router.yaml"]


def test_caches_go_to_the_writable_tmp_volume() -> None:
    for container in all_containers(render_spec(TABLE["disaggregated-cpu"])):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert env_named(container, "HOME") == {"name": "HOME", "value": "/tmp"}
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def env_named(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in container.get("env", []) if e["name"] == name), None)


def test_image_and_pull_policy_come_from_the_spec() -> None:
    rendered = render_spec(TABLE["disaggregated-gpu-uri-auth"] | {"image": "r.example/tg:2"})
    for container in all_containers(rendered):
        assert container["image"] == "r.example/tg:2"
        assert container["imagePullPolicy"] == "IfNotPresent"


def test_image_defaults_to_the_operators_and_pull_policy_to_the_clusters() -> None:
    default = all_containers(render_spec({"model": model()}))
    assert [c["image"] for c in default] == [DEFAULT_ENGINE_IMAGE]
    assert "imagePullPolicy" not in default[0]
    mirrored = render(resource({"model": model()}), RenderOptions(default_image="mirror/tg:1"))
    assert [c["image"] for c in all_containers(mirrored)] == ["mirror/tg:1"]


# --- when pods roll ---------------------------------------------------------------------------


def hashes(spec: dict[str, Any]) -> dict[str, str]:
    return {d["metadata"]["name"]: spec_hash(d) for d in deployments(render_spec(spec))}


SIZED = {"model": model(parameterCount=7 * TINY), "accelerator": gpus(1)}
SPLIT = {"model": model(), "topology": disaggregated()}


def test_changing_the_image_rolls_every_pool() -> None:
    before, after = hashes(SPLIT), hashes(SPLIT | {"image": "r.example/tg:2"})
    assert before.keys() == after.keys()
    assert all(before[name] != after[name] for name in before)


def test_changing_the_slo_rolls_the_pods_when_the_model_size_is_known() -> None:
    slower = SIZED | {"scheduling": {"slo": {"itlMs": 100}}}
    assert render_spec(SIZED).tuning != render_spec(slower).tuning
    assert hashes(SIZED) != hashes(slower)


def test_changing_max_num_seqs_rolls_the_pods() -> None:
    assert hashes(SIZED) != hashes(SIZED | {"scheduling": {"maxNumSeqs": 32}})


def test_changing_only_replicas_rolls_nothing() -> None:
    assert hashes({"model": model()}) == hashes(
        {"model": model(), "topology": {"unified": {"replicas": 7}}}
    )
    scaled = SPLIT | {
        "topology": disaggregated(
            prefill={"replicas": 4}, decode={"replicas": 0}, router={"replicas": 2}
        )
    }
    assert hashes(SPLIT) == hashes(scaled)


def test_changing_one_pool_rolls_only_that_pool() -> None:
    split = SIZED | {"topology": disaggregated()}
    tuned = SIZED | {"topology": disaggregated(decode={"maxNumBatchedTokens": 1024})}
    before, after = hashes(split), hashes(tuned)
    assert before["llm-decode"] != after["llm-decode"]
    assert before["llm-prefill"] == after["llm-prefill"]
    assert before["llm-router"] == after["llm-router"]


@pytest.mark.parametrize("case", list(TABLE))
def test_rendering_is_deterministic_and_leaves_the_resource_alone(case: str) -> None:
    original = resource(TABLE[case])
    kept = copy.deepcopy(original)
    first, second = render(original), render(copy.deepcopy(original))
    assert json.dumps(first.objects) == json.dumps(second.objects)
    assert first.endpoint == second.endpoint
    assert original == kept


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": {"name": "m", "source": {}}}, "spec.model.source"),
        (
            {"model": model({"uri": "https://h/m.tar", "hostPath": {"path": "/m"}})},
            "spec.model.source",
        ),
        ({"model": model({"uri": "s3://bucket/m.tar"})}, "spec.model.source.uri"),
        (
            {"model": model(), "topology": {"unified": {"replicas": -1}}},
            "spec.topology.unified.replicas",
        ),
        ({"model": model(), "topology": {"mode": "disaggregated"}}, "spec.topology"),
        ({"model": model(), "modle": {}}, "spec.modle"),
        ({"model": model(), "service": {"port": 0}}, "spec.service.port"),
        ({"model": model(), "resources": {"memory": "4 GB"}}, "spec.resources.memory"),
        (
            {"model": model(), "adapters": [ADAPTER_SQL, {**ADAPTER_SQL, "source": HOST_LORA}]},
            "spec.adapters: adapter names must be unique; given more than once: sql",
        ),
        (
            {"model": model(), "adapters": [{**ADAPTER_SQL, "name": "-sql"}]},
            "spec.adapters.0.name: must be 1 to 63 letters, digits, '.', '_' or '-'",
        ),
        (
            {"model": model(), "adapters": [{**ADAPTER_SQL, "name": "tiny-llama"}]},
            "spec: an adapter's name must differ from model.name",
        ),
        (
            {"model": model(), "adapters": [{"name": "sql", "source": {"s3": "bucket/sql"}}]},
            'unknown field "spec.adapters.0.source.s3"',
        ),
        (
            {"model": model(), "lora": {"maxLoras": 2}},
            "spec: lora is only allowed together with adapters",
        ),
        (
            {"model": model(), "adapters": [], "lora": {"maxLoras": 4, "maxCpuLoras": 2}},
            "spec.lora: maxCpuLoras must be at least maxLoras",
        ),
    ],
    ids=[
        "no-source",
        "two-sources",
        "bad-uri",
        "negative-replicas",
        "no-pools",
        "typo",
        "port-0",
        "memory",
        "adapter-twice",
        "adapter-name",
        "adapter-is-the-model",
        "adapter-source",
        "lora-without-adapters",
        "cpu-loras-below-loras",
    ],
)
def test_an_invalid_spec_is_refused_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=re.escape(field)):
        render_spec(spec)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            {"model": model(), "parallelism": {"tensorParallelSize": 16}},
            "spec.parallelism.tensorParallelSize",
        ),
        (
            {
                "model": model(parameterCount=TINY),
                "accelerator": gpus(2),
                "parallelism": {"tensorParallelSize": 4},
            },
            "accelerator.count",
        ),
        (
            {"model": model(parameterCount=400 * TINY), "accelerator": gpus(2)},
            "accelerator.memoryGiB",
        ),
        (
            {
                "model": model(parameterCount=TINY),
                "accelerator": gpus(4),
                "topology": disaggregated(
                    prefill={"tensorParallelSize": 4}, decode={"tensorParallelSize": 2}
                ),
            },
            "spec.topology.prefill/decode.tensorParallelSize",
        ),
    ],
    ids=["tp-on-cpu", "tp-above-count", "weights-do-not-fit", "prefill-wider-than-decode"],
)
def test_a_refused_tuning_is_refused_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(TuningError, match=re.escape(field)):
        render_spec(spec)


@pytest.mark.parametrize("name", ["llama.3", "a" * 60], ids=["dotted", "too-long"])
def test_a_name_no_service_can_take_is_refused(name: str) -> None:
    with pytest.raises(SpecError, match=re.escape("metadata.name")):
        render_spec({"model": model(), "topology": disaggregated()}, name=name)


# --- the endpoint -----------------------------------------------------------------------------


@pytest.mark.parametrize("topology", [{}, disaggregated()], ids=["unified", "disaggregated"])
def test_endpoint_is_the_public_service_url(topology: dict[str, Any]) -> None:
    rendered = render_spec({"model": model(), "topology": topology}, name="chat", namespace="ml")
    assert rendered.endpoint == "http://chat.ml.svc:8000/v1"
    service = find(rendered, "Service", "chat")
    assert service["spec"]["ports"][0]["port"] == 8000


def test_endpoint_follows_the_service_port_and_default_namespace() -> None:
    rendered = render_spec({"model": model(), "service": {"port": 443}}, namespace=None)
    assert rendered.endpoint == "http://llm.default.svc:443/v1"


# --- LoRA adapters ----------------------------------------------------------------------------

PVC_MODEL = model({"pvc": {"claimName": "models", "path": "llama"}})


def adapters_listed(rendered: Rendered) -> list[dict[str, Any]]:
    """The ConfigMap's adapters.yaml, as the engine reads it: a list of {name, path}."""
    return yaml.safe_load(config_map(rendered)["data"]["adapters.yaml"])


def assert_every_adapter_is_in_every_engine_pod(rendered: Rendered) -> None:
    """Each listed folder lies on a volume the engine mounts, and a fetched one is fetched
    there first, in every engine pool."""
    listed = adapters_listed(rendered)
    assert [a["name"] for a in listed] == [a.name for a in rendered.spec.adapters or []]
    for deployment in deployments(rendered):
        if main_container(deployment)["name"] != "engine":
            continue
        mounts = main_container(deployment)["volumeMounts"]
        fetched = {
            container["args"][-1]
            for container in pod_spec(deployment).get("initContainers", [])
            if container["name"].startswith("fetch-adapter-")
        }
        volumes = {v["name"] for v in pod_spec(deployment)["volumes"]}
        for adapter in listed:
            path = adapter["path"]
            (on,) = [
                m for m in mounts if path == m["mountPath"] or path.startswith(f"{m['mountPath']}/")
            ]
            assert on["name"] in volumes and "subPath" not in on
            source = next(
                a.source for a in rendered.spec.adapters or [] if a.name == adapter["name"]
            )
            assert (source.uri is not None) == (path in fetched), adapter


def test_adapters_turn_lora_on_in_every_engine_role_and_the_router_keeps_its_file() -> None:
    for topology, roles in (({}, ["unified"]), (disaggregated(), ["prefill", "decode"])):
        rendered = render_spec({"model": model(), "topology": topology, "adapters": [ADAPTER_SQL]})
        for role in roles:
            flags = role_config(rendered, role)
            assert flags["enable-lora"] is True
            assert flags["lora-modules-file"] == "/etc/tidegate/adapters.yaml"
        if topology:
            assert not {"enable-lora", "lora-modules-file"} & set(role_config(rendered, "router"))
        assert adapters_listed(rendered) == [{"name": "sql", "path": "/adapters/pvc/loras/sql"}]


def test_without_spec_adapters_lora_stays_off() -> None:
    rendered = render_spec({"model": model()})
    assert "enable-lora" not in role_config(rendered, "unified")
    assert set(config_map(rendered)["data"]) == {"unified.yaml"}
    mount_paths = [m["mountPath"] for m in main_container(deployments(rendered)[0])["volumeMounts"]]
    assert not [path for path in mount_paths if path.startswith("/adapters")]


def test_an_empty_list_turns_lora_on_with_no_adapter() -> None:
    rendered = render_spec({"model": model(), "adapters": []})
    assert role_config(rendered, "unified")["enable-lora"] is True
    assert adapters_listed(rendered) == []


@pytest.mark.parametrize("case", ["adapters-every-source", "adapters-disaggregated-cache"])
def test_each_adapter_is_listed_at_its_folder_in_the_pod(case: str) -> None:
    assert_every_adapter_is_in_every_engine_pod(render_spec(TABLE[case]))


def test_prefill_and_decode_serve_the_same_adapters_from_the_same_folders() -> None:
    rendered = render_spec(TABLE["adapters-every-source"] | {"topology": disaggregated()})
    prefill, decode = (
        find(rendered, "Deployment", f"llm-{role}") for role in ("prefill", "decode")
    )
    for key in ("volumes", "initContainers"):
        assert pod_spec(prefill)[key] == pod_spec(decode)[key]
    adapter_mounts = [
        [m for m in main_container(d)["volumeMounts"] if m["mountPath"].startswith("/adapters")]
        for d in (prefill, decode)
    ]
    assert adapter_mounts[0] == adapter_mounts[1] and adapter_mounts[0]
    assert (
        role_config(rendered, "prefill")["lora-modules-file"]
        == (role_config(rendered, "decode")["lora-modules-file"])
    )


def test_a_claim_is_mounted_whole_once_read_only_whatever_its_adapters() -> None:
    rendered = render_spec(TABLE["adapters-every-source"])
    (deployment,) = deployments(rendered)
    container = main_container(deployment)
    # The model's claim: one volume, mounted at /model (its folder) and whole for adapters.
    claims = [v for v in pod_spec(deployment)["volumes"] if "persistentVolumeClaim" in v]
    assert sorted(v["persistentVolumeClaim"]["claimName"] for v in claims) == ["loras", "models"]
    assert all(v["persistentVolumeClaim"]["readOnly"] for v in claims)
    whole = mount(container, "/adapters/pvc/models")
    assert whole == {
        "name": mount(container, "/model")["name"],
        "mountPath": "/adapters/pvc/models",
        "readOnly": True,
    }
    assert mount(container, "/adapters/pvc/loras")["readOnly"] is True
    assert [a["path"] for a in adapters_listed(rendered)][:2] == [
        "/adapters/pvc/models/loras/sql",
        "/adapters/pvc/loras",
    ]


def test_a_claim_the_cache_already_is_mounted_again_not_claimed_twice() -> None:
    rendered = render_spec(TABLE["adapters-disaggregated-cache"])
    for deployment in deployments(rendered):
        if main_container(deployment)["name"] != "engine":
            continue
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod_spec(deployment)["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == ["model-cache"]
        again = mount(main_container(deployment), "/adapters/pvc/model-cache")
        assert again == {
            "name": "model-cache",
            "mountPath": "/adapters/pvc/model-cache",
            "readOnly": True,
        }


def test_a_uri_adapter_is_fetched_by_an_init_container_into_the_pod() -> None:
    rendered = render_spec(TABLE["adapters-every-source"])
    (deployment,) = deployments(rendered)
    (fetch,) = pod_spec(deployment)["initContainers"]
    (web,) = [a for a in adapters_listed(rendered) if a["name"] == "web"]
    assert fetch["name"].startswith("fetch-adapter-")
    assert fetch["args"] == ["fetch-model", "https://loras.example/web.tar.gz", web["path"]]
    assert mount(fetch, "/adapters/fetched")["name"] == "adapters-fetched"
    assert volume(deployment, "adapters-fetched") == {"name": "adapters-fetched", "emptyDir": {}}
    assert mount(main_container(deployment), "/adapters/fetched")["readOnly"] is True


def test_a_uri_adapter_goes_to_the_shared_cache_once_for_every_pod() -> None:
    rendered = render_spec(TABLE["adapters-disaggregated-cache"])
    (web,) = [a for a in adapters_listed(rendered) if a["name"] == "web"]
    assert web["path"].startswith("/var/cache/tidegate/adapters/")
    for role in ("prefill", "decode"):
        inits = pod_spec(find(rendered, "Deployment", f"llm-{role}"))["initContainers"]
        assert inits[0]["name"] == "fetch-model"  # the model first
        (fetch,) = [c for c in inits if c["name"].startswith("fetch-adapter-")]
        assert fetch["args"] == [
            "fetch-model",
            "--shared",
            "https://loras.example/web.tar.gz",
            web["path"],
        ]
        assert mount(fetch, "/var/cache/tidegate")["name"] == "model-cache"


def test_a_node_folder_is_a_read_only_directory_of_its_own() -> None:
    rendered = render_spec({"model": model(), "adapters": [{"name": "chat", "source": HOST_LORA}]})
    (deployment,) = deployments(rendered)
    (chat,) = adapters_listed(rendered)
    on = mount(main_container(deployment), chat["path"])
    assert on["readOnly"] is True
    assert volume(deployment, on["name"])["hostPath"] == {
        "path": "/srv/loras/chat",
        "type": "Directory",
    }


LORA_ON = {"model": PVC_MODEL, "adapters": []}


@pytest.mark.parametrize(
    "adapters",
    [
        [{"name": "sql", "source": {"pvc": {"claimName": "models", "path": "loras/sql"}}}],
        [
            {"name": "sql", "source": {"pvc": {"claimName": "models", "path": "loras/sql"}}},
            {"name": "root", "source": {"pvc": {"claimName": "models"}}},
        ],
    ],
    ids=["one-beside-the-model", "two-beside-the-model"],
)
def test_adapters_on_the_models_claim_come_and_go_without_rolling_a_pod(adapters) -> None:
    for topology in ({}, disaggregated()):
        before = LORA_ON | {"topology": topology}
        assert hashes(before) == hashes(before | {"adapters": adapters})


def test_adding_removing_or_reordering_adapters_of_a_mounted_volume_rolls_no_pod() -> None:
    chat = {"name": "chat", "source": HOST_LORA}
    sql2 = {"name": "sql2", "source": {"pvc": {"claimName": "loras", "path": "sql-v2"}}}
    web = {"name": "web", "source": {"uri": "https://loras.example/web.tar.gz"}}
    base = {"model": model(), "adapters": [ADAPTER_SQL, chat, web]}
    assert hashes(base) == hashes(base | {"adapters": [web, chat, ADAPTER_SQL]})
    assert hashes(base) == hashes(base | {"adapters": [ADAPTER_SQL, chat, web, sql2]})
    assert hashes(base) == hashes(base | {"adapters": [sql2, chat, web]})
    # Two adapters of one node folder or one archive: the same volume, the same fetch.
    assert hashes(base) == hashes(base | {"adapters": [*base["adapters"], {**chat, "name": "c2"}]})
    assert hashes(base) == hashes(base | {"adapters": [*base["adapters"], {**web, "name": "w2"}]})


@pytest.mark.parametrize(
    "added",
    [
        {"pvc": {"claimName": "more-loras", "path": "x"}},
        {"hostPath": {"path": "/srv/loras/other"}},
        {"uri": "https://loras.example/other.tar.gz"},
    ],
    ids=["new-claim", "new-node-folder", "new-uri"],
)
def test_an_adapter_that_needs_a_new_volume_or_fetch_rolls_the_pods(added) -> None:
    split = LORA_ON | {"topology": disaggregated()}
    before = hashes(split)
    after = hashes(split | {"adapters": [{"name": "new", "source": added}]})
    assert before["llm-prefill"] != after["llm-prefill"]
    assert before["llm-decode"] != after["llm-decode"]
    assert before["llm-router"] == after["llm-router"]


def test_turning_lora_on_or_off_rolls_the_pods() -> None:
    assert hashes({"model": PVC_MODEL}) != hashes(LORA_ON)


# --- LoRA limits (spec.lora) ------------------------------------------------------------------

LIMITS = TABLE["adapters-lora-limits-disaggregated"]
LIMIT_FLAGS = {"max-loras": 4, "max-lora-rank": 64, "max-cpu-loras": 8}


@pytest.mark.parametrize("topology", [{}, disaggregated()], ids=["unified", "disaggregated"])
def test_lora_limits_reach_every_engine_role_alike_and_the_engine_takes_them(
    topology: dict[str, Any], tmp_path: Path
) -> None:
    rendered = render_spec(LIMITS | {"topology": topology})
    for role in rendered.tuning.roles:
        flags = role_config(rendered, role)
        assert {flag: flags[flag] for flag in LIMIT_FLAGS} == LIMIT_FLAGS
        path = tmp_path / f"{role}.yaml"
        path.write_text(config_map(rendered)["data"][f"{role}.yaml"], encoding="utf-8")
        values = load_config_file(str(path), [EngineArgs, ServerArgs])
        engine = EngineArgs(**{k: v for k, v in values.items() if k in EngineArgs.model_fields})
        assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (4, 64, 8)
    if topology:
        assert not set(LIMIT_FLAGS) & set(role_config(rendered, "router"))


def test_each_lora_limit_is_commented_with_where_it_comes_from() -> None:
    rendered = render_spec(LIMITS)
    for role in ("prefill", "decode"):
        lines = config_map(rendered)["data"][f"{role}.yaml"].splitlines()
        for flag, field in (
            ("max-loras", "maxLoras"),
            ("max-lora-rank", "maxLoraRank"),
            ("max-cpu-loras", "maxCpuLoras"),
        ):
            (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{flag}:")]
            assert lines[at - 1].startswith(f"# spec.lora.{field}: ")


def test_a_limit_not_given_is_left_to_the_engine() -> None:
    flags = role_config(render_spec(LORA_ON | {"lora": {"maxLoraRank": 32}}), "unified")
    assert flags["max-lora-rank"] == 32
    assert "max-loras" not in flags and "max-cpu-loras" not in flags
    # And a spec without spec.lora renders as before the field existed: no pod rolls.
    assert not set(LIMIT_FLAGS) & set(role_config(render_spec(LORA_ON), "unified"))
    assert hashes(LORA_ON) == hashes(LORA_ON | {"lora": {}})


def test_changing_a_lora_limit_rolls_the_engine_pods_not_the_router() -> None:
    before = hashes(LIMITS)
    after = hashes(LIMITS | {"lora": {**LIMITS["lora"], "maxLoras": 2}})
    assert before["llm-prefill"] != after["llm-prefill"]
    assert before["llm-decode"] != after["llm-decode"]
    assert before["llm-router"] == after["llm-router"]


def plan_table(spec: dict[str, Any]) -> str:
    out = io.StringIO()
    write_table([resource(spec)], [render_spec(spec)], out)
    return out.getvalue()


def plan_row(table: str, *first: str) -> list[str]:
    """The one row of a plan table that starts with the words `first`, split into words."""
    (row,) = [
        line.split() for line in table.splitlines() if line.split()[: len(first)] == list(first)
    ]
    return row


def test_plan_names_the_adapters_and_each_roles_lora_limits() -> None:
    chat = {"name": "chat", "source": HOST_LORA}
    table = plan_table(LIMITS | {"adapters": [ADAPTER_SQL, chat], "lora": {"maxLoras": 2}})
    assert "adapters: 2, served by every engine role: sql, chat" in table
    assert plan_row(table, "sql") == ["sql", "pvc", "loras:sql", "/adapters/pvc/loras/sql"]
    assert plan_row(table, "chat")[:3] == ["chat", "hostPath", "/srv/loras/chat"]
    for role in ("prefill", "decode"):
        limit = plan_row(table, role, "maxLoras")
        assert limit[2:4] == ["2", "(set)"] and limit[4] == "spec.lora.maxLoras:"
        # Those not given: the engine's defaults, said so.
        rank = plan_row(table, role, "maxLoraRank")
        assert rank[2] == "16" and " ".join(rank[3:]).startswith("the engine's default")
        assert plan_row(table, role, "maxCpuLoras")[2] == "2"


def test_plan_without_adapters_says_nothing_of_lora() -> None:
    table = plan_table({"model": model()})
    assert "adapters" not in table and "maxLoras" not in table
    assert "adapters: none yet" in plan_table(LORA_ON)


# --- tool calls (spec.model.toolCallParser) ---------------------------------------------------

CRD_MODEL = version_schema(load_crd(), "v1alpha1")["properties"]["spec"]["properties"]["model"]
TOOL_CALL_PARSERS = CRD_MODEL["properties"]["toolCallParser"]["enum"]
# Each way engine pods are laid out, with the roles whose pods run `tidegate serve`.
ENGINE_LAYOUTS = {
    "unified": ({"model": model()}, {"unified"}),
    "unified-behind-a-router": (TABLE["unified-to-zero-behind-a-router"], {"unified"}),
    "disaggregated": (SPLIT, {"prefill", "decode"}),
}


def test_the_crd_offers_exactly_the_engines_tool_call_parsers() -> None:
    (engine,) = [
        get_args(choices)
        for choices in get_args(ServerArgs.model_fields["tool_call_parser"].annotation)
        if choices is not type(None)
    ]
    assert sorted(TOOL_CALL_PARSERS) == sorted(engine)


def role_args(texts: dict[str, str], role: str, args_class, tmp_path: Path):
    """A role's rendered config file, read as the engine reads it, into `args_class`."""
    path = tmp_path / f"{role}.yaml"
    path.write_text(texts[f"{role}.yaml"], encoding="utf-8")
    values = load_config_file(str(path), [EngineArgs, ServerArgs])
    return args_class(**{k: v for k, v in values.items() if k in args_class.model_fields})


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_the_tool_call_parser_reaches_every_engine_role_and_the_engine_takes_it(
    layout: str, tmp_path: Path
) -> None:
    spec, engine_roles = ENGINE_LAYOUTS[layout]
    for parser in TOOL_CALL_PARSERS:
        rendered = render_spec(spec | {"model": {**spec["model"], "toolCallParser": parser}})
        assert set(rendered.tuning.roles) == engine_roles
        texts = config_map(rendered)["data"]
        for role in engine_roles:
            server = role_args(texts, role, ServerArgs, tmp_path)
            assert server.tool_call_parser == parser
        # The router reads no output for calls; its config has no such flag.
        if "router.yaml" in texts:
            assert "tool-call-parser" not in yaml.safe_load(texts["router.yaml"])


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_without_a_tool_call_parser_no_role_gets_one(layout: str) -> None:
    spec, _ = ENGINE_LAYOUTS[layout]
    for text in config_map(render_spec(spec))["data"].values():
        assert "tool-call-parser" not in yaml.safe_load(text)


def test_setting_or_changing_the_tool_call_parser_rolls_the_engine_pods_not_the_router() -> None:
    none = hashes(SPLIT)
    hermes = hashes(SPLIT | {"model": model(toolCallParser="hermes")})
    mistral = hashes(SPLIT | {"model": model(toolCallParser="mistral")})
    for engine in ("llm-prefill", "llm-decode"):
        assert len({none[engine], hermes[engine], mistral[engine]}) == 3
    assert none["llm-router"] == hermes["llm-router"] == mistral["llm-router"]


# --- weight quantization (spec.model.quantization) ---------------------------------------------

QUANTIZATIONS = CRD_MODEL["properties"]["quantization"]["enum"]


def test_the_crd_offers_exactly_the_engines_quantizations() -> None:
    engine = get_args(EngineArgs.model_fields["quantization"].annotation)
    assert sorted(QUANTIZATIONS) == sorted(engine)


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_a_quantization_reaches_every_engine_role_and_the_engine_takes_it(
    layout: str, tmp_path: Path
) -> None:
    spec, engine_roles = ENGINE_LAYOUTS[layout]
    for quantization in ("fp8", "none"):
        rendered = render_spec(spec | {"model": {**spec["model"], "quantization": quantization}})
        texts = config_map(rendered)["data"]
        for role in engine_roles:
            assert role_args(texts, role, EngineArgs, tmp_path).quantization == quantization
        # The router holds no weights.
        if "router.yaml" in texts:
            assert "quantization" not in yaml.safe_load(texts["router.yaml"])


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_quantization_auto_or_absent_renders_no_flag(layout: str) -> None:
    spec, _ = ENGINE_LAYOUTS[layout]
    auto = spec | {"model": {**spec["model"], "quantization": "auto"}}
    for text in config_map(render_spec(spec))["data"].values():
        assert "quantization" not in yaml.safe_load(text)
    # auto is the engine's default: resources that predate the field keep their pods.
    assert config_map(render_spec(auto)) == config_map(render_spec(spec))


def test_changing_the_quantization_rolls_the_engine_pods_not_the_router() -> None:
    auto = hashes(SPLIT)
    fp8 = hashes(SPLIT | {"model": model(quantization="fp8")})
    none = hashes(SPLIT | {"model": model(quantization="none")})
    for engine in ("llm-prefill", "llm-decode"):
        assert len({auto[engine], fp8[engine], none[engine]}) == 3
    assert auto["llm-router"] == fp8["llm-router"] == none["llm-router"]


def test_fp8_weights_take_fewer_gpus_in_the_rendered_config() -> None:
    # 70.6e9 parameters on 80 GiB GPUs: 141 GB in bfloat16 need TP 4, 70.6 GB in fp8 TP 2.
    bf16 = render_spec({"model": LLAMA_70B_MODEL, "accelerator": gpus(8)})
    fp8 = render_spec({"model": {**LLAMA_70B_MODEL, "quantization": "fp8"}, "accelerator": gpus(8)})
    assert role_config(bf16, "unified")["tensor-parallel-size"] == 4
    assert role_config(fp8, "unified")["tensor-parallel-size"] == 2
    assert role_config(fp8, "unified")["quantization"] == "fp8"


def test_fp8_leaves_the_fetch_volume_and_load_deadline_sized_by_the_checkpoint() -> None:
    # A 16-bit checkpoint is quantized only once loaded: the archive and the read are full size.
    spec = TABLE["uri-init-container"]
    fp8 = spec | {"model": {**spec["model"], "quantization": "fp8"}}
    before, after = deployments(render_spec(spec)), deployments(render_spec(fp8))
    assert [volume(d, "model") for d in after] == [volume(d, "model") for d in before]
    assert [d["spec"]["progressDeadlineSeconds"] for d in after] == [
        d["spec"]["progressDeadlineSeconds"] for d in before
    ]


# --- KV cache dtype (spec.model.kvCacheDtype) ------------------------------------------------

KV_CACHE_DTYPES = CRD_MODEL["properties"]["kvCacheDtype"]["enum"]


def test_the_crd_offers_exactly_the_engines_kv_cache_dtypes() -> None:
    engine = get_args(EngineArgs.model_fields["kv_cache_dtype"].annotation)
    assert sorted(KV_CACHE_DTYPES) == sorted(engine)


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_an_fp8_kv_cache_reaches_every_engine_role_and_the_engine_takes_it(
    layout: str, tmp_path: Path
) -> None:
    spec, engine_roles = ENGINE_LAYOUTS[layout]
    rendered = render_spec(spec | {"model": {**spec["model"], "kvCacheDtype": "fp8"}})
    texts = config_map(rendered)["data"]
    # Prefill and decode alike: a decode pod refuses KV blocks of another dtype than its own.
    for role in engine_roles:
        assert role_args(texts, role, EngineArgs, tmp_path).kv_cache_dtype == "fp8"
    # The router holds no KV cache.
    if "router.yaml" in texts:
        assert "kv-cache-dtype" not in yaml.safe_load(texts["router.yaml"])


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_kv_cache_dtype_auto_or_absent_renders_no_flag(layout: str) -> None:
    spec, _ = ENGINE_LAYOUTS[layout]
    auto = spec | {"model": {**spec["model"], "kvCacheDtype": "auto"}}
    for text in config_map(render_spec(spec))["data"].values():
        assert "kv-cache-dtype" not in yaml.safe_load(text)
    # auto is the engine's default: resources that predate the field keep their pods.
    assert config_map(render_spec(auto)) == config_map(render_spec(spec))


def test_changing_the_kv_cache_dtype_rolls_the_engine_pods_not_the_router() -> None:
    auto = hashes(SPLIT)
    fp8 = hashes(SPLIT | {"model": model(kvCacheDtype="fp8")})
    for engine in ("llm-prefill", "llm-decode"):
        assert auto[engine] != fp8[engine]
    assert auto["llm-router"] == fp8["llm-router"]


# --- embeddings' pooling (spec.model.pooling) --------------------------------------------------

POOLINGS = CRD_MODEL["properties"]["pooling"]["enum"]


def test_the_crd_offers_exactly_the_engines_poolings() -> None:
    engine = get_args(ServerArgs.model_fields["pooling"].annotation)
    assert sorted(POOLINGS) == sorted(engine)


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_a_pooling_reaches_every_engine_role_and_the_server_takes_it(
    layout: str, tmp_path: Path
) -> None:
    spec, engine_roles = ENGINE_LAYOUTS[layout]
    rendered = render_spec(spec | {"model": {**spec["model"], "pooling": "mean"}})
    texts = config_map(rendered)["data"]
    for role in engine_roles:
        assert role_args(texts, role, ServerArgs, tmp_path).pooling == "mean"
    if "router.yaml" in texts:
        assert "pooling" not in yaml.safe_load(texts["router.yaml"])
    # auto is the server's default: resources that predate the field keep their pods.
    auto = spec | {"model": {**spec["model"], "pooling": "auto"}}
    assert config_map(render_spec(auto)) == config_map(render_spec(spec))
    for text in config_map(render_spec(spec))["data"].values():
        assert "pooling" not in yaml.safe_load(text)


# --- speculative decoding (spec.speculativeDecoding) ------------------------------------------

SPECULATIVE = {"numSpeculativeTokens": 5, "promptLookupMax": 3, "disableByBatchSize": 32}


@pytest.mark.parametrize("topology", [{}, disaggregated()], ids=["unified", "disaggregated"])
def test_speculation_reaches_the_engines_that_decode_and_the_engine_takes_it(
    topology: dict[str, Any], tmp_path: Path
) -> None:
    spec = {"model": model(), "topology": topology, "speculativeDecoding": SPECULATIVE}
    rendered = render_spec(spec)
    decoding = {"decode", "unified"} & set(rendered.tuning.roles)
    assert decoding
    for role in rendered.tuning.roles:
        text = config_map(rendered)["data"][f"{role}.yaml"]
        if role not in decoding:
            assert "speculative-config" not in role_config(rendered, role)  # one token each
            continue
        lines = text.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.startswith("speculative-config:")]
        assert lines[at - 1].startswith("# spec.speculativeDecoding: ")
        path = tmp_path / f"{role}.yaml"
        path.write_text(text, encoding="utf-8")
        values = load_config_file(str(path), [EngineArgs, ServerArgs])
        engine = EngineArgs(**{k: v for k, v in values.items() if k in EngineArgs.model_fields})
        assert engine.speculative_config is not None
        assert engine.speculative_config.model_dump() == {
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 3,
            "disable_by_batch_size": 32,
        }


def test_turning_speculation_on_rolls_the_decoding_pods_only() -> None:
    split = {"model": model(), "topology": disaggregated()}
    before = hashes(split)
    after = hashes(split | {"speculativeDecoding": {"numSpeculativeTokens": 4}})
    assert before["llm-decode"] != after["llm-decode"]
    assert before["llm-prefill"] == after["llm-prefill"]
    assert before["llm-router"] == after["llm-router"]
