"""The LLMDeployment CRD: a schema the apiserver accepts, that says what spec.py says.

Two layers check a spec: kube-apiserver with crds/llmdeployment.yaml (emulated by
crd_validation.py) when a user applies it, and `parse_spec` when `tidegate plan` reads a file
or the operator reads a resource. They must accept and refuse the same specs, with the same
messages for the cross-field rules.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.operator.crd_validation import (
    CRDValidator,
    apply_defaults,
    load_crd,
    load_yaml,
    resource,
    structural_problems,
    version_schema,
)
from tidegate.operator.autoscaler import PoolSignals, ScalerState, decide, pool_targets
from tidegate.operator.cluster_scaler import status_entry
from tidegate.operator.spec import (
    ADAPTER_IS_NOT_MODEL,
    ADAPTER_NAME_MESSAGE,
    ADAPTER_NAMES_UNIQUE,
    API_VERSION,
    AUTOSCALING_ROLES_ONLY,
    AUTOSCALING_UNIFIED_ONLY,
    COUNT_WHOLE_NODES,
    CPU_LORAS_AT_LEAST_LORAS,
    GROUP,
    HPA_CANNOT_REACH_ZERO,
    INFERENCE_POOL_NEEDS_ROUTER,
    KEDA_NEEDS_PROMETHEUS,
    KIND,
    KV_ENCRYPTION_DISAGGREGATED_ONLY,
    LOOKUP_MIN_AT_MOST_MAX,
    LORA_NEEDS_ADAPTERS,
    PLURAL,
    UNIFIED_ROUTER_NEEDS_ZERO,
    VERSION,
    ZERO_NEEDS_ROUTER,
    AutoscalingPolicy,
    LLMDeploymentSpec,
    SpecError,
    parse_spec,
)
from tidegate.operator.status import adapter_status

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
PARALLEL_SIZE_MESSAGE = "must be 'auto' or an integer from 1 to 64"
STEP_TOKENS_MESSAGE = "must be 'auto' or an integer from 1 to 1048576"
ONE_SOURCE = "exactly one of pvc, hostPath or uri must be set"
ONE_CACHE = "exactly one of hostPath or pvc must be set"
_NOT_CHECKED = (
    '<nil>: Invalid value: "null": some validation rules were not checked because the object '
    "was invalid; correct the existing errors to complete validation"
)

CRD = load_crd()
SCHEMA = version_schema(CRD, VERSION)
VALIDATOR = CRDValidator(CRD, VERSION)


# -- the CRD itself ----------------------------------------------------------------------------


def test_crd_is_structural() -> None:
    assert structural_problems(CRD) == []


def test_crd_names_scope_and_version() -> None:
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["kind"] == "CustomResourceDefinition"
    assert CRD["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    spec = CRD["spec"]
    assert spec["group"] == GROUP
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": KIND,
        "listKind": f"{KIND}List",
        "plural": PLURAL,
        "singular": "llmdeployment",
        "shortNames": ["llmd"],
        "categories": ["tidegate"],
    }
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    [version] = CRD["spec"]["versions"]
    columns = [(c["name"], c["type"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [
        ("Mode", "string", ".spec.topology.mode"),
        ("Ready", "string", ".status.ready"),
        ("Phase", "string", ".status.phase"),
        ("Endpoint", "string", ".status.endpoint"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]


def test_every_field_is_described() -> None:
    # A list's items and a map's values are described by the list or the map.
    undescribed = [
        path
        for root in ("spec", "status")
        for path, node in _walk(SCHEMA["properties"][root], root)
        if not node.get("description") and not path.endswith((".items", ".additionalProperties"))
    ]
    assert undescribed == []


def test_status_the_operator_writes_is_valid() -> None:
    # What operator/status.py's compute_status returns, with kopf's bookkeeping beside it: a
    # status the schema refused would make every status patch fail.
    status = {
        "phase": "Progressing",
        "observedGeneration": 3,
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "RollingOut",
                "message": "decode: 1 of 2 pods run the current spec",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
                "observedGeneration": 3,
            }
        ],
        "effective": {
            "roles": {
                "decode": {
                    "tensorParallelSize": 4,
                    "dataParallelSizeLocal": 2,
                    "longPrefillTokenThreshold": 256,
                    "maxNumBatchedTokens": "auto",
                }
            },
            "reasons": ["decode.tensorParallelSize=4: 141 GB fits 4 x 80 GiB"],
        },
        "endpoint": "http://llama.default.svc:8000/v1",
        "ready": "3/4",
        "replicas": {"decode": {"desired": 2, "ready": 1, "updated": 1}},
        "kopf": {"progress": {"reconcile": {"retries": 1}}},
    }
    obj = resource(_spec({}), "llama")
    assert VALIDATOR.validate_status({**obj, "status": status}) == []
    status["phase"] = "Sleeping"
    assert VALIDATOR.validate_status({**obj, "status": status}) == [
        'status.phase: Unsupported value: "Sleeping": supported values: '
        '"Pending", "Progressing", "Ready", "Degraded"',
        _NOT_CHECKED,
    ]


def test_status_the_autoscaler_writes_is_valid() -> None:
    # What operator/cluster_scaler.py's status_entry returns, under status.autoscaling: a
    # field the schema did not list would be pruned, and a restarted operator would find none.
    policy = AutoscalingPolicy.model_validate({"minReplicas": 1, "maxReplicas": 8})
    targets = pool_targets(policy, "decode", 16, 1000, 100)
    signals = PoolSignals(ready=2, running=40, start_time_s=80.0)
    decision = decide(policy, targets, signals, ScalerState(), 1_800_000_000.5)
    entry = status_entry(decision, policy, 80.0, 1_800_000_000.5)
    assert set(entry) >= {"desired", "current", "reason", "lastScaleTime", "recommendations"}
    status = {"autoscaling": {"decode": entry}}
    obj = resource(_spec({}), "llama")
    assert VALIDATOR.validate_status({**obj, "status": status}) == []
    assert _pruned(SCHEMA["properties"]["status"], status) == []


def test_status_the_adapter_report_writes_is_valid() -> None:
    # What operator/status.py's adapter_status returns, under status.adapters.
    status = {
        "adapters": [
            *adapter_status(["sql"], {"unified": [frozenset({"sql"})]}),
            *adapter_status(["chat"], {"prefill": [], "decode": [frozenset({"chat"})]}),
        ]
    }
    assert status["adapters"][1]["roles"] == {"prefill": 0, "decode": 1}
    obj = resource(_spec({}), "llama")
    assert VALIDATOR.validate_status({**obj, "status": status}) == []
    assert _pruned(SCHEMA["properties"]["status"], status) == []


def _pruned(schema: dict[str, Any], value: Any, path: str = "status") -> list[str]:
    """Paths in `value` that the structural schema does not list (the API server drops them)."""
    if isinstance(value, dict):
        known = schema.get("properties")
        if known is None:
            extra = schema.get("additionalProperties")
            if not isinstance(extra, dict):
                return []
            return [p for k, v in value.items() for p in _pruned(extra, v, f"{path}.{k}")]
        return [
            p
            for k, v in value.items()
            for p in (_pruned(known[k], v, f"{path}.{k}") if k in known else [f"{path}.{k}"])
        ]
    if isinstance(value, list):
        return [p for v in value for p in _pruned(schema.get("items", {}), v, f"{path}[]")]
    return []


# -- examples ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_both_layers(path: Path) -> None:
    obj = load_yaml(path.read_text())
    assert obj["apiVersion"] == API_VERSION
    assert obj["kind"] == KIND
    assert VALIDATOR.validate(obj) == []
    typed = parse_spec(obj["spec"])
    # The apiserver stores the spec with its defaults; the operator must read the same thing.
    assert parse_spec(VALIDATOR.defaulted(obj)["spec"]) == typed


def test_examples_cover_both_modes_and_an_accelerator() -> None:
    specs = [parse_spec(load_yaml(path.read_text())["spec"]) for path in EXAMPLES]
    assert {spec.topology.mode for spec in specs} == {"unified", "disaggregated"}
    assert any(spec.accelerator is not None for spec in specs)
    assert any(spec.accelerator is None for spec in specs)


# -- invalid specs: both layers refuse them, with the same words -------------------------------

BASE: dict[str, Any] = {
    "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny-llama"}}},
}
DISAGGREGATED = {"mode": "disaggregated", "prefill": {}, "decode": {}}


def _spec(patch: dict[str, Any]) -> dict[str, Any]:
    """BASE with a JSON merge patch (RFC 7386) applied: None removes a field."""
    return _merge(copy.deepcopy(BASE), patch)


def _merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    target = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge(target.get(key), value)
    return target


def _row(id: str, patch: dict[str, Any], crd: str, model: str | None, name: str = "example") -> Any:
    return pytest.param(patch, crd, model, name, id=id)


SQL = {"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "sql"}}}

INVALID = [
    _row(
        "adapter-names-twice",
        {"adapters": [SQL, {**SQL, "source": {"uri": "https://l/sql.tar"}}]},
        f'spec.adapters: Invalid value: "array": {ADAPTER_NAMES_UNIQUE}',
        f"spec.adapters: {ADAPTER_NAMES_UNIQUE}; given more than once: sql",
    ),
    _row(
        "adapter-is-the-model",
        {"adapters": [{**SQL, "name": "tiny-llama"}]},
        f'spec: Invalid value: "object": {ADAPTER_IS_NOT_MODEL}',
        f"spec: {ADAPTER_IS_NOT_MODEL}",
    ),
    _row(
        "adapter-name-a-path",
        {"adapters": [{**SQL, "name": "loras/sql"}]},
        f'spec.adapters[0].name: Invalid value: "string": {ADAPTER_NAME_MESSAGE}',
        f"spec.adapters.0.name: {ADAPTER_NAME_MESSAGE}",
    ),
    _row(
        "adapter-without-source",
        {"adapters": [{"name": "sql"}]},
        "spec.adapters[0].source: Required value",
        "spec.adapters.0.source: Field required",
    ),
    _row(
        "adapter-of-two-sources",
        {"adapters": [{**SQL, "source": {"uri": "https://l/s.tar", "hostPath": {"path": "/s"}}}]},
        f'spec.adapters[0].source: Invalid value: "object": {ONE_SOURCE}',
        f"spec.adapters.0.source: {ONE_SOURCE}",
    ),
    _row(
        "too-many-adapters",
        {"adapters": [{**SQL, "name": f"a{i}"} for i in range(65)]},
        "spec.adapters: Too many: 65: must have at most 64 items",
        "spec.adapters: List should have at most 64 items",
    ),
    _row(
        "lora-without-adapters",
        {"lora": {"maxLoras": 2}},
        f'spec: Invalid value: "object": {LORA_NEEDS_ADAPTERS}',
        f"spec: {LORA_NEEDS_ADAPTERS}",
    ),
    _row(
        "cpu-loras-below-loras",
        {"adapters": [SQL], "lora": {"maxLoras": 4, "maxCpuLoras": 2}},
        f'spec.lora: Invalid value: "object": {CPU_LORAS_AT_LEAST_LORAS}',
        f"spec.lora: {CPU_LORAS_AT_LEAST_LORAS}",
    ),
    _row(
        "speculative-lookup-min-above-max",
        {"speculativeDecoding": {"numSpeculativeTokens": 4, "promptLookupMin": 5}},
        f'spec.speculativeDecoding: Invalid value: "object": {LOOKUP_MIN_AT_MOST_MAX}',
        f"spec.speculativeDecoding: {LOOKUP_MIN_AT_MOST_MAX}",
    ),
    _row(
        "speculative-without-token-count",
        {"speculativeDecoding": {"promptLookupMax": 4}},
        "spec.speculativeDecoding.numSpeculativeTokens: Required value",
        "spec.speculativeDecoding.numSpeculativeTokens: Field required",
    ),
    _row(
        "speculative-draft-model-method",
        {"speculativeDecoding": {"numSpeculativeTokens": 4, "method": "eagle"}},
        'spec.speculativeDecoding.method: Unsupported value: "eagle": supported values: "ngram"',
        "spec.speculativeDecoding.method: Input should be 'ngram'",
    ),
    _row(
        "speculative-17-tokens",
        {"speculativeDecoding": {"numSpeculativeTokens": 17}},
        "spec.speculativeDecoding.numSpeculativeTokens: Invalid value: 17: "
        "spec.speculativeDecoding.numSpeculativeTokens in body should be less than or equal "
        "to 16",
        "spec.speculativeDecoding.numSpeculativeTokens: Input should be less than or equal to 16",
    ),
    _row(
        "lora-rank-above-512",
        {"adapters": [SQL], "lora": {"maxLoraRank": 1024}},
        "spec.lora.maxLoraRank: Invalid value: 1024: spec.lora.maxLoraRank in body should be "
        "less than or equal to 512",
        "spec.lora.maxLoraRank: Input should be less than or equal to 512",
    ),
    _row(
        "max-loras-0",
        {"adapters": [SQL], "lora": {"maxLoras": 0}},
        "spec.lora.maxLoras: Invalid value: 0: spec.lora.maxLoras in body should be greater "
        "than or equal to 1",
        "spec.lora.maxLoras: Input should be greater than or equal to 1",
    ),
    _row(
        "lora-unknown-limit",
        {"adapters": [SQL], "lora": {"maxLoraSlots": 2}},
        'unknown field "spec.lora.maxLoraSlots"',
        'unknown field "spec.lora.maxLoraSlots"',
    ),
    _row(
        "no-model-source",
        {"model": {"source": {"hostPath": None}}},
        f'spec.model.source: Invalid value: "object": {ONE_SOURCE}',
        f"spec.model.source: {ONE_SOURCE}",
    ),
    _row(
        "two-model-sources",
        {"model": {"source": {"pvc": {"claimName": "models"}}}},
        f'spec.model.source: Invalid value: "object": {ONE_SOURCE}',
        f"spec.model.source: {ONE_SOURCE}",
    ),
    _row(
        "disaggregated-without-decode",
        {"topology": {"mode": "disaggregated", "prefill": {"replicas": 1}}},
        'spec.topology: Invalid value: "object": prefill and decode are required when mode is '
        "disaggregated",
        "spec.topology: prefill and decode are required when mode is disaggregated",
    ),
    _row(
        "unified-with-prefill",
        {"topology": {"mode": "unified", "prefill": {"replicas": 1}}},
        'spec.topology: Invalid value: "object": prefill and decode are only allowed when mode '
        "is disaggregated",
        "spec.topology: prefill and decode are only allowed when mode is disaggregated",
    ),
    _row(
        "unified-router-without-zero",
        {
            "topology": {"router": {"replicas": 1}},
            "autoscaling": {"unified": {"minReplicas": 1, "maxReplicas": 2}},
        },
        f'spec: Invalid value: "object": {UNIFIED_ROUTER_NEEDS_ZERO}',
        f"spec: {UNIFIED_ROUTER_NEEDS_ZERO}",
    ),
    _row(
        "inference-pool-without-a-router",
        {"topology": {"router": {"replicas": 0}}, "gateway": {"inferencePool": True}},
        f'spec: Invalid value: "object": {INFERENCE_POOL_NEEDS_ROUTER}',
        f"spec: {INFERENCE_POOL_NEEDS_ROUTER}",
    ),
    _row(
        "disaggregated-inference-pool-without-a-router",
        {
            "topology": {**DISAGGREGATED, "router": {"replicas": 0}},
            "gateway": {"inferencePool": True},
        },
        f'spec: Invalid value: "object": {INFERENCE_POOL_NEEDS_ROUTER}',
        f"spec: {INFERENCE_POOL_NEEDS_ROUTER}",
    ),
    _row(
        "unified-router-without-an-inference-pool",
        {"topology": {"router": {"replicas": 2}}, "gateway": {"inferencePool": False}},
        f'spec: Invalid value: "object": {UNIFIED_ROUTER_NEEDS_ZERO}',
        f"spec: {UNIFIED_ROUTER_NEEDS_ZERO}",
    ),
    _row(
        "gateway-failure-mode-unknown",
        {"gateway": {"inferencePool": True, "failureMode": "FailSilently"}},
        'spec.gateway.failureMode: Unsupported value: "FailSilently": supported values: '
        '"FailOpen", "FailClose"',
        "spec.gateway.failureMode: Input should be 'FailOpen' or 'FailClose'",
    ),
    _row(
        "unified-to-zero-without-a-router",
        {
            "topology": {"router": {"replicas": 0}},
            "autoscaling": {"unified": {"minReplicas": 0, "maxReplicas": 2}},
        },
        f'spec: Invalid value: "object": {ZERO_NEEDS_ROUTER}',
        f"spec: {ZERO_NEEDS_ROUTER}",
    ),
    _row(
        "kv-encryption-in-unified-mode",
        {"topology": {"mode": "unified", "kvEncryption": "curve"}},
        f'spec.topology: Invalid value: "object": {KV_ENCRYPTION_DISAGGREGATED_ONLY}',
        f"spec.topology: {KV_ENCRYPTION_DISAGGREGATED_ONLY}",
    ),
    _row(
        "kv-encryption-unknown",
        {"topology": {**DISAGGREGATED, "kvEncryption": "tls"}},
        'spec.topology.kvEncryption: Unsupported value: "tls": supported values: "curve", "none"',
        "spec.topology.kvEncryption: Input should be 'curve' or 'none'",
    ),
    _row(
        "disaggregated-with-unified",
        {"topology": {**DISAGGREGATED, "unified": {}}},
        'spec.topology: Invalid value: "object": unified is only allowed when mode is unified',
        "spec.topology: unified is only allowed when mode is unified",
    ),
    _row(
        "mode-both",
        {"topology": {"mode": "both"}},
        'spec.topology.mode: Unsupported value: "both": supported values: "unified", '
        '"disaggregated"',
        "spec.topology.mode: Input should be 'unified' or 'disaggregated'",
    ),
    _row(
        "replicas-negative",
        {"topology": {"unified": {"replicas": -1}}},
        "spec.topology.unified.replicas: Invalid value: -1: spec.topology.unified.replicas in "
        "body should be greater than or equal to 0",
        "spec.topology.unified.replicas: Input should be greater than or equal to 0",
    ),
    _row(
        "replicas-a-string",
        {"topology": {"unified": {"replicas": "two"}}},
        'spec.topology.unified.replicas: Invalid value: "string": spec.topology.unified.replicas '
        'in body must be of type integer: "string"',
        "spec.topology.unified.replicas: Input should be a valid integer",
    ),
    _row(
        "tensor-parallel-0",
        {"parallelism": {"tensorParallelSize": 0}},
        f'spec.parallelism.tensorParallelSize: Invalid value: "": {PARALLEL_SIZE_MESSAGE}',
        f"spec.parallelism.tensorParallelSize: {PARALLEL_SIZE_MESSAGE}",
    ),
    _row(
        "count-not-whole-nodes",
        {"accelerator": {"count": 12, "perNode": 8, "memoryGiB": 80}},
        f'spec.accelerator: Invalid value: "object": {COUNT_WHOLE_NODES}',
        f"spec.accelerator: {COUNT_WHOLE_NODES}",
    ),
    _row(
        "per-node-0",
        {"accelerator": {"perNode": 0, "memoryGiB": 80}},
        "spec.accelerator.perNode: Invalid value: 0: spec.accelerator.perNode in body should be "
        "greater than or equal to 1",
        "spec.accelerator.perNode: Input should be greater than or equal to 1",
    ),
    _row(
        "pipeline-parallel-0",
        {"parallelism": {"pipelineParallelSize": 0}},
        f'spec.parallelism.pipelineParallelSize: Invalid value: "": {PARALLEL_SIZE_MESSAGE}',
        f"spec.parallelism.pipelineParallelSize: {PARALLEL_SIZE_MESSAGE}",
    ),
    _row(
        "nodes-per-replica-65",
        {"parallelism": {"nodesPerReplica": 65}},
        f'spec.parallelism.nodesPerReplica: Invalid value: "": {PARALLEL_SIZE_MESSAGE}',
        f"spec.parallelism.nodesPerReplica: {PARALLEL_SIZE_MESSAGE}",
    ),
    _row(
        "tensor-parallel-many",
        {"parallelism": {"tensorParallelSize": "many"}},
        f'spec.parallelism.tensorParallelSize: Invalid value: "": {PARALLEL_SIZE_MESSAGE}',
        f"spec.parallelism.tensorParallelSize: {PARALLEL_SIZE_MESSAGE}",
    ),
    _row(
        "decode-threshold-0",
        {"topology": {**DISAGGREGATED, "decode": {"longPrefillTokenThreshold": 0}}},
        f'spec.topology.decode.longPrefillTokenThreshold: Invalid value: "": {STEP_TOKENS_MESSAGE}',
        f"spec.topology.decode.longPrefillTokenThreshold: {STEP_TOKENS_MESSAGE}",
    ),
    _row(
        "token-budget-a-fraction",
        {"scheduling": {"maxNumBatchedTokens": 2.5}},
        'spec.scheduling.maxNumBatchedTokens: Invalid value: "number": '
        'spec.scheduling.maxNumBatchedTokens in body must be of type integer,string: "number"',
        f"spec.scheduling.maxNumBatchedTokens: {STEP_TOKENS_MESSAGE}",
    ),
    _row("unknown-field", {"foo": 1}, 'unknown field "spec.foo"', 'unknown field "spec.foo"'),
    _row(
        "snake-case-field",
        {"model": {"source": {"hostPath": None, "host_path": {"path": "/m"}}}},
        'unknown field "spec.model.source.host_path"',
        'unknown field "spec.model.source.host_path"',
    ),
    _row(
        "bad-dtype",
        {"model": {"dtype": "fp8"}},
        'spec.model.dtype: Unsupported value: "fp8": supported values: "auto", "bfloat16", '
        '"float16", "float32"',
        "spec.model.dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32'",
    ),
    _row(
        "bad-quantization",
        {"model": {"quantization": "int4"}},
        'spec.model.quantization: Unsupported value: "int4": supported values: "auto", "fp8", '
        '"none"',
        "spec.model.quantization: Input should be 'auto', 'fp8' or 'none'",
    ),
    _row(
        "bad-kv-cache-dtype",
        {"model": {"kvCacheDtype": "int8"}},
        'spec.model.kvCacheDtype: Unsupported value: "int8": supported values: "auto", "fp8"',
        "spec.model.kvCacheDtype: Input should be 'auto' or 'fp8'",
    ),
    _row(
        "bad-pooling",
        {"model": {"pooling": "cls"}},
        'spec.model.pooling: Unsupported value: "cls": supported values: "auto", "last", "mean"',
        "spec.model.pooling: Input should be 'auto', 'last' or 'mean'",
    ),
    _row(
        "tool-call-parser-not-the-engines",
        {"model": {"toolCallParser": "qwen"}},
        'spec.model.toolCallParser: Unsupported value: "qwen": supported values: "hermes", '
        '"llama3_json", "mistral"',
        "spec.model.toolCallParser: Input should be 'hermes', 'llama3_json' or 'mistral'",
    ),
    _row(
        "block-size-24",
        {"scheduling": {"blockSize": 24}},
        'spec.scheduling.blockSize: Unsupported value: 24: supported values: "16", "32", "64"',
        "spec.scheduling.blockSize: Input should be 16, 32 or 64",
    ),
    _row(
        "service-port-70000",
        {"service": {"port": 70000}},
        "spec.service.port: Invalid value: 70000: spec.service.port in body should be less than "
        "or equal to 65535",
        "spec.service.port: Input should be less than or equal to 65535",
    ),
    _row(
        "slo-itl-0",
        {"scheduling": {"slo": {"itlMs": 0}}},
        "spec.scheduling.slo.itlMs: Invalid value: 0: spec.scheduling.slo.itlMs in body should "
        "be greater than or equal to 1",
        "spec.scheduling.slo.itlMs: Input should be greater than or equal to 1",
    ),
    _row(
        "max-num-seqs-0",
        {"scheduling": {"maxNumSeqs": 0}},
        "spec.scheduling.maxNumSeqs: Invalid value: 0: spec.scheduling.maxNumSeqs in body should "
        "be greater than or equal to 1",
        "spec.scheduling.maxNumSeqs: Input should be greater than or equal to 1",
    ),
    _row(
        "uri-ftp",
        {"model": {"source": {"hostPath": None, "uri": "ftp://models/m.tar"}}},
        'spec.model.source.uri: Invalid value: "string": must be an http://, https:// or '
        "file:// URL",
        "spec.model.source.uri: must be an http://, https:// or file:// URL",
    ),
    _row(
        "host-path-relative",
        {"model": {"source": {"hostPath": {"path": "models/tiny"}}}},
        'spec.model.source.hostPath.path: Invalid value: "models/tiny": '
        "spec.model.source.hostPath.path in body should match '^/'",
        "spec.model.source.hostPath.path: String should match pattern '^/'",
    ),
    _row(
        "cache-host-path-and-pvc",
        {"model": {"cache": {"hostPath": {"path": "/var/cache/t"}, "pvc": {"claimName": "c"}}}},
        f'spec.model.cache: Invalid value: "object": {ONE_CACHE}',
        f"spec.model.cache: {ONE_CACHE}",
    ),
    _row(
        "cache-of-no-kind",
        {"model": {"cache": {}}},
        f'spec.model.cache: Invalid value: "object": {ONE_CACHE}',
        f"spec.model.cache: {ONE_CACHE}",
    ),
    # The pods write there: never the node's whole disk.
    _row(
        "cache-host-path-root",
        {"model": {"cache": {"hostPath": {"path": "//"}}}},
        'spec.model.cache.hostPath.path: Invalid value: "//": '
        "spec.model.cache.hostPath.path in body should match '^/[^/]'",
        "spec.model.cache.hostPath.path: String should match pattern '^/[^/]'",
    ),
    _row(
        "cache-host-path-dot-dot",
        {"model": {"cache": {"hostPath": {"path": "/var/cache/../../etc"}}}},
        'spec.model.cache.hostPath.path: Invalid value: "string": path must not contain',
        "spec.model.cache.hostPath.path: path must not contain '..'",
    ),
    _row(
        "cache-claim-name-uppercase",
        {"model": {"cache": {"pvc": {"claimName": "Cache"}}}},
        'spec.model.cache.pvc.claimName: Invalid value: "string": must be a DNS-1123 subdomain',
        "spec.model.cache.pvc.claimName: must be a DNS-1123 subdomain",
    ),
    _row(
        "empty-claim-name",
        {"model": {"source": {"hostPath": None, "pvc": {"claimName": ""}}}},
        'spec.model.source.pvc.claimName: Invalid value: "": spec.model.source.pvc.claimName in '
        "body should be at least 1 chars long",
        "spec.model.source.pvc.claimName: String should have at least 1 character",
    ),
    _row(
        "max-model-len-8",
        {"model": {"maxModelLen": 8}},
        "spec.model.maxModelLen: Invalid value: 8: spec.model.maxModelLen in body should be "
        "greater than or equal to 16",
        "spec.model.maxModelLen: Input should be greater than or equal to 16",
    ),
    _row(
        "model-name-too-long",
        {"model": {"name": "m" * 254}},
        "spec.model.name: Too long: may not be longer than 253",
        "spec.model.name: String should have at most 253 characters",
    ),
    _row(
        "no-model",
        {"model": None},
        "spec.model: Required value",
        "spec.model: Field required",
    ),
    _row(
        "accelerator-without-memory",
        {"accelerator": {"resource": "nvidia.com/gpu", "count": 8}},
        "spec.accelerator.memoryGiB: Required value",
        "spec.accelerator.memoryGiB: Field required",
    ),
    _row(
        "accelerator-memory-0",
        {"accelerator": {"memoryGiB": 0}},
        "spec.accelerator.memoryGiB: Invalid value: 0: spec.accelerator.memoryGiB in body should "
        "be greater than 0",
        "spec.accelerator.memoryGiB: Input should be greater than 0",
    ),
    _row(
        "cpu-in-words",
        {"resources": {"cpu": "two"}},
        'spec.resources.cpu: Invalid value: "two": spec.resources.cpu in body should match',
        "spec.resources.cpu: String should match pattern",
    ),
    _row(
        "prefix-caching-maybe",
        {"scheduling": {"enablePrefixCaching": "maybe"}},
        "spec.scheduling.enablePrefixCaching in body must be of type boolean",
        "spec.scheduling.enablePrefixCaching: Input should be a valid boolean",
    ),
    _row(
        "pull-policy-sometimes",
        {"imagePullPolicy": "Sometimes"},
        'spec.imagePullPolicy: Unsupported value: "Sometimes": supported values: "Always", '
        '"IfNotPresent", "Never"',
        "spec.imagePullPolicy: Input should be 'Always', 'IfNotPresent' or 'Never'",
    ),
    _row(
        "secret-ref-without-key",
        {"auth": {"apiKeySecretRef": {"name": "api-keys"}}},
        "spec.auth.apiKeySecretRef.key: Required value",
        "spec.auth.apiKeySecretRef.key: Field required",
    ),
    _row(
        "autoscaling-min-over-max",
        {"autoscaling": {"unified": {"minReplicas": 5, "maxReplicas": 2}}},
        'spec.autoscaling.unified: Invalid value: "object": minReplicas must be at most '
        "maxReplicas",
        "spec.autoscaling.unified: minReplicas must be at most maxReplicas",
    ),
    _row(
        "autoscaling-without-max",
        {"autoscaling": {"unified": {"minReplicas": 1}}},
        "spec.autoscaling.unified.maxReplicas: Required value",
        "spec.autoscaling.unified.maxReplicas: Field required",
    ),
    _row(
        "autoscaling-prefill-when-unified",
        {"autoscaling": {"prefill": {"maxReplicas": 2}}},
        f'spec: Invalid value: "object": {AUTOSCALING_ROLES_ONLY}',
        f"spec: {AUTOSCALING_ROLES_ONLY}",
    ),
    _row(
        "autoscaling-unified-when-disaggregated",
        {"topology": DISAGGREGATED, "autoscaling": {"unified": {"maxReplicas": 2}}},
        f'spec: Invalid value: "object": {AUTOSCALING_UNIFIED_ONLY}',
        f"spec: {AUTOSCALING_UNIFIED_ONLY}",
    ),
    _row(
        "scale-to-zero-without-a-router",
        {
            "topology": {**DISAGGREGATED, "router": {"replicas": 0}},
            "autoscaling": {"decode": {"minReplicas": 0, "maxReplicas": 4}},
        },
        f'spec: Invalid value: "object": {ZERO_NEEDS_ROUTER}',
        f"spec: {ZERO_NEEDS_ROUTER}",
    ),
    _row(
        "keda-without-prometheus",
        {"autoscaling": {"driver": "keda", "unified": {"maxReplicas": 2}}},
        f'spec.autoscaling: Invalid value: "object": {KEDA_NEEDS_PROMETHEUS}',
        f"spec.autoscaling: {KEDA_NEEDS_PROMETHEUS}",
    ),
    _row(
        "keda-prometheus-not-a-url",
        {
            "autoscaling": {
                "driver": "keda",
                "prometheus": {"serverAddress": "prometheus:9090"},
                "unified": {"maxReplicas": 2},
            }
        },
        'spec.autoscaling.prometheus.serverAddress: Invalid value: "string": must be an '
        "http:// or https:// URL",
        "spec.autoscaling.prometheus.serverAddress: must be an http:// or https:// URL",
    ),
    _row(
        "hpa-unified-to-zero",
        {"autoscaling": {"driver": "hpa", "unified": {"minReplicas": 0, "maxReplicas": 4}}},
        f'spec.autoscaling: Invalid value: "object": {HPA_CANNOT_REACH_ZERO}',
        f"spec.autoscaling: {HPA_CANNOT_REACH_ZERO}",
    ),
    _row(
        "hpa-decode-to-zero",
        {
            "topology": DISAGGREGATED,
            "autoscaling": {
                "driver": "hpa",
                "prefill": {"maxReplicas": 2},
                "decode": {"minReplicas": 0, "maxReplicas": 4},
            },
        },
        f'spec.autoscaling: Invalid value: "object": {HPA_CANNOT_REACH_ZERO}',
        f"spec.autoscaling: {HPA_CANNOT_REACH_ZERO}",
    ),
    _row(
        "kv-usage-over-100-percent",
        {"autoscaling": {"unified": {"maxReplicas": 2, "targets": {"kvCacheUsagePercent": 150}}}},
        "spec.autoscaling.unified.targets.kvCacheUsagePercent: Invalid value: 150: "
        "spec.autoscaling.unified.targets.kvCacheUsagePercent in body should be less than or "
        "equal to 100",
        "spec.autoscaling.unified.targets.kvCacheUsagePercent: Input should be less than or "
        "equal to 100",
    ),
    _row(
        "scale-down-period-0",
        {"autoscaling": {"unified": {"maxReplicas": 2, "scaleDown": {"periodSeconds": 0}}}},
        "spec.autoscaling.unified.scaleDown.periodSeconds in body should be greater than or "
        "equal to 1",
        "spec.autoscaling.unified.scaleDown.periodSeconds: Input should be greater than or "
        "equal to 1",
    ),
    # parse_spec sees only the spec: the name is the apiserver's alone to check.
    _row(
        "name-over-40-characters",
        {},
        '<nil>: Invalid value: "object": metadata.name must be at most 40 characters: child '
        "objects add suffixes",
        None,
        name="a" * 41,
    ),
    _row(
        "name-with-a-dot",
        {},
        "metadata.name must be a DNS-1035 label",
        None,
        name="llama.3",
    ),
    _row(
        "pvc-path-escaping-the-volume",
        {"model": {"source": {"hostPath": None, "pvc": {"claimName": "m", "path": "a/../../x"}}}},
        "spec.model.source.pvc.path: Invalid value: \"string\": path must not contain '..'",
        "spec.model.source.pvc.path: path must not contain '..'",
    ),
    _row(
        "string-for-an-integer",
        {"scheduling": {"maxNumSeqs": "64"}},
        'spec.scheduling.maxNumSeqs: Invalid value: "string": spec.scheduling.maxNumSeqs in '
        "body must be of type integer",
        "spec.scheduling.maxNumSeqs: Input should be a valid integer",
    ),
]


@pytest.mark.parametrize(("patch", "crd_message", "model_message", "name"), INVALID)
def test_invalid_spec_is_refused_by_both_layers(
    patch: dict[str, Any], crd_message: str, model_message: str | None, name: str
) -> None:
    spec = _spec(patch)
    errors = VALIDATOR.validate_spec(spec, name=name)
    assert any(crd_message in error for error in errors), errors
    if model_message is None:
        parse_spec(spec)  # accepted: only the apiserver sees the resource's name
        return
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert model_message in str(refused.value)


def test_name_of_40_characters_is_accepted() -> None:
    assert VALIDATOR.validate_spec(BASE, name="a" * 40) == []


def test_rules_wait_until_the_object_has_its_shape() -> None:
    # As the apiserver: with a type error, CEL rules are not run and a note says so.
    spec = _spec({"model": {"source": {"hostPath": None}}, "service": {"port": "http"}})
    errors = VALIDATOR.validate_spec(spec)
    assert errors[-1] == _NOT_CHECKED
    assert not any("exactly one of" in error for error in errors)


# -- the typed model and the CRD schema, side by side ------------------------------------------

_ABSENT = object()
_BOUNDS = ("minimum", "maximum", "minLength", "maxLength", "pattern", "minItems", "maxItems")


def test_spec_model_matches_crd_schema() -> None:
    model = LLMDeploymentSpec.model_json_schema(by_alias=True)
    problems = _compare(model, SCHEMA["properties"]["spec"], "spec", model.get("$defs", {}))
    assert problems == [], "\n".join(problems)


def _compare(model: dict, crd: dict, path: str, defs: dict) -> list[str]:
    """Where the model's JSON schema and the CRD's schema disagree, each problem with its path."""
    model = _resolve(model, defs)
    problems = []
    if _is_int_or_auto(model):
        if not crd.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: the model takes an integer or 'auto'; the CRD does not")
        maximum = model["anyOf"][0]["maximum"]
        message = f"must be 'auto' or an integer from 1 to {maximum}"
        rule = f"type(self) == string ? self == 'auto' : self >= 1 && self <= {maximum}"
        if {"rule": rule, "message": message} not in crd.get("x-kubernetes-validations", []):
            problems.append(f"{path}: no CEL rule {rule!r} says {message!r}")
        return problems
    if model.get("type") != crd.get("type"):
        problems.append(
            f"{path}: type {model.get('type')} in the model, {crd.get('type')} in the CRD"
        )
    if model.get("enum") != crd.get("enum"):
        problems.append(
            f"{path}: enum {model.get('enum')} in the model, {crd.get('enum')} in the CRD"
        )
    if _bounds(model, model=True) != _bounds(crd, model=False):
        problems.append(
            f"{path}: bounds {_bounds(model, model=True)} in the model, "
            f"{_bounds(crd, model=False)} in the CRD"
        )
    described = (model.get("description") or "").rstrip(".")
    if described and described not in (crd.get("description") or ""):
        problems.append(f"{path}: the CRD's description does not say {described!r}")
    if model.get("type") == "array":
        return problems + _compare(model["items"], crd.get("items", {}), f"{path}[]", defs)
    if model.get("type") != "object":
        return problems
    model_props, crd_props = model.get("properties", {}), crd.get("properties", {})
    for name in sorted(set(model_props) ^ set(crd_props)):
        where = "the model" if name in model_props else "the CRD"
        problems.append(f"{path}.{name}: only in {where}")
    if sorted(model.get("required", [])) != sorted(crd.get("required", [])):
        problems.append(
            f"{path}: required {sorted(model.get('required', []))} in the model, "
            f"{sorted(crd.get('required', []))} in the CRD"
        )
    for name in sorted(model_props.keys() & crd_props.keys()):
        model_default = _model_default(model_props[name])
        crd_default = _crd_default(crd_props[name])
        if model_default != crd_default:
            problems.append(
                f"{path}.{name}: default {_show(model_default)} in the model, "
                f"{_show(crd_default)} in the CRD (with its nested defaults)"
            )
        problems += _compare(model_props[name], crd_props[name], f"{path}.{name}", defs)
    return problems


def _resolve(node: dict, defs: dict) -> dict:
    """A model node with its $ref followed and an optional's null branch dropped."""
    outer = {key: value for key, value in node.items() if key not in ("$ref", "anyOf")}
    if "$ref" in node:
        return {**_resolve(defs[node["$ref"].split("/")[-1]], defs), **outer}
    options = [option for option in node.get("anyOf", []) if option != {"type": "null"}]
    if len(options) == 1:
        return {**_resolve(options[0], defs), **outer}
    return node


def _is_int_or_auto(node: dict) -> bool:
    options = node.get("anyOf", [])
    return len(options) == 2 and options[0].get("minimum") == 1 and options[1] == {"enum": ["auto"]}


def _bounds(node: dict, *, model: bool) -> dict[str, Any]:
    bounds = {key: node[key] for key in _BOUNDS if key in node}
    # JSON Schema's exclusiveMinimum is the bound; OpenAPI 3.0's is a flag on minimum.
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if model and exclusive in node:
            bounds[inclusive], bounds[exclusive] = node[exclusive], True
        elif not model and node.get(exclusive):
            bounds[exclusive] = True
    return bounds


def _model_default(node: dict) -> Any:
    default = node.get("default", _ABSENT)
    return _ABSENT if default is None else _drop_nulls(default)


def _crd_default(node: dict) -> Any:
    default = node.get("default", _ABSENT)
    return default if default is _ABSENT else apply_defaults(default, node)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _drop_nulls(item) for key, item in value.items() if item is not None}
    return value


def _show(value: Any) -> str:
    return "none" if value is _ABSENT else repr(value)


def _walk(node: dict, path: str) -> list[tuple[str, dict]]:
    nodes = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        nodes += _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            nodes += _walk(node[key], f"{path}.{key}")
    return nodes


# -- property-based: valid building blocks, and one bad value ----------------------------------

_names = st.text(min_size=1, max_size=60).filter(str.isprintable)
_dns_subdomains = st.from_regex(
    r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]{1,8}){0,2}", fullmatch=True
)
_secret_keys = st.from_regex(r"[-_a-zA-Z0-9][-._a-zA-Z0-9]{0,30}", fullmatch=True)
_parallel_sizes = st.one_of(st.just("auto"), st.integers(1, 64))
_step_tokens = st.one_of(st.just("auto"), st.integers(1, 1 << 20))
_sources = st.one_of(
    st.builds(
        lambda claim, path: {"pvc": {"claimName": claim, "path": path}},
        _dns_subdomains,
        st.sampled_from(["", "llama-3-8b", "org/model"]),
    ),
    st.builds(lambda path: {"hostPath": {"path": path}}, st.sampled_from(["/", "/models/m"])),
    st.builds(
        lambda uri: {"uri": uri},
        st.sampled_from(["https://models.example/m.tar.gz", "http://m/m.tar", "file:///m.tar"]),
    ),
)


def _some(**fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=fields)


_models = st.fixed_dictionaries(
    {"name": _names, "source": _sources},
    optional={
        "parameterCount": st.floats(1e6, 1e12),
        "numAttentionHeads": st.integers(1, 128),
        "numKeyValueHeads": st.integers(1, 128),
        "maxModelLen": st.integers(16, 1_000_000),
        "dtype": st.sampled_from(["auto", "bfloat16", "float16", "float32"]),
        "quantization": st.sampled_from(["auto", "fp8", "none"]),
        "kvCacheDtype": st.sampled_from(["auto", "fp8"]),
        "pooling": st.sampled_from(["auto", "last", "mean"]),
        "toolCallParser": st.sampled_from(["hermes", "llama3_json", "mistral"]),
    },
)
_roles = _some(
    replicas=st.integers(0, 1000),
    tensorParallelSize=_parallel_sizes,
    longPrefillTokenThreshold=_step_tokens,
    maxNumBatchedTokens=_step_tokens,
)
_topologies = st.one_of(
    _some(mode=st.just("unified"), unified=_roles),
    st.fixed_dictionaries(
        {"mode": st.just("disaggregated"), "prefill": _roles, "decode": _roles},
        optional={"router": _some(replicas=st.integers(0, 1000))},
    ),
)


def _with_counts(accelerator: dict[str, Any]) -> st.SearchStrategy[dict]:
    """`accelerator` with a count, a perNode, both or neither: a count above perNode is a
    multiple of it (whole nodes)."""
    per_node = st.integers(1, 64)
    return st.one_of(
        st.just(accelerator),
        st.integers(1, 64).map(lambda count: {**accelerator, "count": count}),
        per_node.map(lambda size: {**accelerator, "perNode": size}),
        per_node.flatmap(
            lambda size: _counts_beside(size).map(
                lambda count: {**accelerator, "perNode": size, "count": count}
            )
        ),
    )


def _counts_beside(per_node: int) -> st.SearchStrategy[int]:
    """A count within one node, or of whole nodes (at most 64)."""
    nodes = st.integers(1, 64 // per_node).map(lambda n: n * per_node)
    return st.one_of(st.integers(1, per_node), nodes)


_base_specs = st.fixed_dictionaries(
    {"model": _models},
    optional={
        "image": st.sampled_from(["ghcr.io/tidegate/engine:0.1.0", "engine"]),
        "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"]),
        "topology": _topologies,
        "accelerator": st.fixed_dictionaries(
            {"memoryGiB": st.one_of(st.integers(1, 4096), st.floats(0.5, 4096))},
            optional={
                "resource": st.sampled_from(["nvidia.com/gpu", "amd.com/gpu"]),
                "peakTflops": st.floats(1, 5000),
            },
        ).flatmap(_with_counts),
        "resources": _some(
            cpu=st.sampled_from(["1", "500m", "2.5"]),
            memory=st.sampled_from(["4Gi", "512Mi", "1.5G", "1000"]),
        ),
        "parallelism": _some(
            tensorParallelSize=_parallel_sizes,
            pipelineParallelSize=_parallel_sizes,
            nodesPerReplica=_parallel_sizes,
            dataParallelSizeLocal=_parallel_sizes,
        ),
        "scheduling": _some(
            longPrefillTokenThreshold=_step_tokens,
            maxNumBatchedTokens=_step_tokens,
            maxNumSeqs=st.integers(1, 65536),
            enablePrefixCaching=st.booleans(),
            blockSize=st.sampled_from([16, 32, 64]),
            slo=_some(ttftMs=st.integers(1, 10_000), itlMs=st.integers(1, 1000)),
        ),
        "service": _some(
            port=st.integers(1, 65535),
            type=st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]),
        ),
        "auth": _some(
            apiKeySecretRef=st.fixed_dictionaries({"name": _dns_subdomains, "key": _secret_keys})
        ),
    },
)


def _policies(zero: bool) -> st.SearchStrategy[dict]:
    """An autoscaling policy; minReplicas 0 only where `zero` (a router can hold requests)."""
    return st.integers(0 if zero else 1, 20).flatmap(
        lambda low: st.fixed_dictionaries(
            {"minReplicas": st.just(low), "maxReplicas": st.integers(max(low, 1), 1000)},
            optional={
                "targets": _some(
                    requestsPerReplica=st.integers(1, 65536),
                    waitingRequestsPerReplica=st.integers(0, 100),
                    kvCacheUsagePercent=st.integers(1, 100),
                    slo=st.booleans(),
                ),
                "scaleUp": _some(
                    stabilizationWindowSeconds=st.integers(0, 3600),
                    pods=st.integers(1, 1000),
                    percent=st.integers(0, 1000),
                    periodSeconds=st.integers(1, 1800),
                ),
                "scaleDown": _some(
                    stabilizationWindowSeconds=st.integers(0, 3600),
                    pods=st.integers(1, 1000),
                    percent=st.integers(0, 100),
                    periodSeconds=st.integers(1, 1800),
                ),
                "idleBeforeZeroSeconds": st.integers(0, 86400),
            },
        )
    )


_PROMETHEUS = {"serverAddress": "http://prometheus-operated.monitoring.svc:9090"}


def _with_autoscaling(spec: dict[str, Any]) -> st.SearchStrategy[dict]:
    """`spec`, or `spec` with policies for the pools its topology runs, and a driver."""
    topology = spec.get("topology", {})
    return st.one_of(
        st.just(spec),
        st.sampled_from([None, "operator", "keda", "hpa"]).flatmap(
            lambda driver: _driven(topology, driver).map(
                lambda given: {**spec, "autoscaling": given}
            )
        ),
    )


def _driven(topology: dict[str, Any], driver: str | None) -> st.SearchStrategy[dict]:
    """Policies a driver can act on: no zero for hpa (nor without a router), KEDA's Prometheus."""
    zero = driver != "hpa"
    if topology.get("mode") == "disaggregated":
        zero = zero and topology.get("router", {}).get("replicas", 1) >= 1
        policies = _some(prefill=_policies(zero), decode=_policies(zero))
    else:
        policies = _some(unified=_policies(zero))
    if driver is None:
        return policies
    extra = {"driver": driver, **({"prometheus": _PROMETHEUS} if driver == "keda" else {})}
    return policies.map(lambda given: {**given, **extra})


# spec.lora's limits: maxCpuLoras drawn from maxLoras up, so that the pair holds the rule.
_lora_limits = st.integers(1, 64).flatmap(
    lambda loras: _some(
        maxLoras=st.just(loras),
        maxLoraRank=st.integers(1, 512),
        maxCpuLoras=st.integers(loras, 64),
    )
)


def _with_lora(drawn: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """A spec with adapters, and spec.lora when any limit was drawn."""
    spec, limits = drawn
    return {**spec, "lora": limits} if limits else spec


def _with_adapters(spec: dict[str, Any]) -> st.SearchStrategy[dict]:
    """`spec`, or `spec` with adapters of distinct names, none the served model's, and
    perhaps spec.lora's limits."""
    names = st.from_regex(r"[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}", fullmatch=True).filter(
        lambda name: name != spec["model"]["name"]
    )
    adapters = st.lists(
        st.fixed_dictionaries({"name": names, "source": _sources}),
        max_size=5,
        unique_by=lambda adapter: adapter["name"],
    )
    with_adapters = adapters.map(lambda given: {**spec, "adapters": given})
    return st.one_of(st.just(spec), st.tuples(with_adapters, _lora_limits).map(_with_lora))


def _with_gateway(spec: dict[str, Any]) -> st.SearchStrategy[dict]:
    """`spec`, or `spec` with spec.gateway: an InferencePool only where a router may run, and
    in unified mode perhaps a topology.router of its own (its endpoint picker)."""
    topology = spec.get("topology", {})
    router = topology.get("router", {}).get("replicas", 1) >= 1
    gateway = _some(
        inferencePool=st.just(True) if router else st.just(False),
        failureMode=st.sampled_from(["FailOpen", "FailClose"]),
    )
    with_gateway = gateway.map(lambda given: {**spec, "gateway": given})
    if topology.get("mode") == "disaggregated" or "router" in topology:
        return st.one_of(st.just(spec), with_gateway)
    picker = st.integers(1, 3).map(
        lambda replicas: {
            **spec,
            "topology": {**topology, "router": {"replicas": replicas}},
            "gateway": {"inferencePool": True},
        }
    )
    return st.one_of(st.just(spec), with_gateway, picker)


# spec.speculativeDecoding: promptLookupMin drawn up to promptLookupMax (given, or its 4).
_speculation = st.integers(1, 64).flatmap(
    lambda longest: st.fixed_dictionaries(
        {"numSpeculativeTokens": st.integers(1, 16)},
        optional={
            "method": st.just("ngram"),
            "promptLookupMax": st.just(longest),
            "promptLookupMin": st.integers(1, longest),
            "disableByBatchSize": st.integers(1, 65536),
        },
    ).filter(lambda given: given.get("promptLookupMin", 3) <= given.get("promptLookupMax", 4))
)


def _with_speculation(spec: dict[str, Any]) -> st.SearchStrategy[dict]:
    return st.one_of(
        st.just(spec), _speculation.map(lambda given: {**spec, "speculativeDecoding": given})
    )


_specs = (
    _base_specs.flatmap(_with_autoscaling)
    .flatmap(_with_adapters)
    .flatmap(_with_gateway)
    .flatmap(_with_speculation)
)

# Any JSON scalar but an integral float (kubectl sends 2.0 as 2) and null (the apiserver drops
# it; pydantic refuses it where a field has a non-null default).
_scalars = st.one_of(
    st.integers(-5, 100_000),
    st.floats(-1e6, 1e6).filter(lambda x: not x.is_integer()),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from(["auto", "unified", "disaggregated", "/m", "https://m", "16", "1.5"]),
)
_FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(_specs)
def test_valid_specs_are_accepted_by_both_layers(spec: dict[str, Any]) -> None:
    assert VALIDATOR.validate_spec(spec) == []
    typed = parse_spec(spec)
    assert parse_spec(VALIDATOR.defaulted(resource(spec))["spec"]) == typed


@_FAST
@given(_specs, st.data())
def test_one_bad_value_is_judged_alike_by_both_layers(spec: dict[str, Any], data: Any) -> None:
    leaves = _leaves(spec, ())
    path = data.draw(st.sampled_from(leaves), label="path")
    value = data.draw(_scalars, label="value")
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value

    crd_errors = VALIDATOR.validate_spec(spec)
    try:
        parse_spec(spec)
        model_error = None
    except SpecError as error:
        model_error = str(error)
    if not crd_errors and model_error is None:
        return
    if crd_errors and model_error is None and _accepted_only_by_conversion(spec):
        return  # pydantic's lax mode turns "2" into 2 and 1 into true; the apiserver does not
    assert crd_errors and model_error, (crd_errors, model_error)


def _leaves(value: Any, path: tuple) -> list[tuple]:
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in _leaves(item, (*path, key))]
    return [path]


def _accepted_only_by_conversion(spec: dict[str, Any]) -> bool:
    try:
        LLMDeploymentSpec.model_validate(spec, strict=True, by_alias=True, by_name=False)
    except ValidationError:
        return True
    return False
