"""The engine pods the operator renders pass checkov's Kubernetes checks, or say why not.

checkov (its own venv, .cache/tools/checkov: `make test` builds it) scans the Deployments
rendered for the examples and for a few specs that reach the other code paths (a GPU pool
whose model an init container fetches, an API key, a disaggregated GPU deployment). checkov
does not read LeaderWorkerSets: a multi-node pool is scanned as the StatefulSets LWS's
controller makes of it (its leaders, and a group's workers). Every
check that fails is in SKIPPED with its reason: either the choice is deliberate, or the user
controls it (shown passing below when the user sets it), or it is "pending render fix", a
change to operator/render.py not yet made. A skip that no longer fires must go.

The examples are rendered into a namespace ("llm"), as `kubectl apply -n llm` would: where
a resource lives is the user's choice, not the renderer's.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import render

REPO = Path(__file__).resolve().parents[2]
CHECKOV = REPO / ".cache" / "tools" / "checkov" / "bin" / "checkov"
# JSON for the test to read; --skip-download: no calls to checkov's cloud (none reachable).
CHECKOV_ARGS = ("--output", "json", "--skip-download")
NAMESPACE = "llm"
DIGEST_IMAGE = "ghcr.io/tidegate/engine@sha256:" + "0123456789abcdef" * 4

SKIPPED = {
    "CKV_K8S_11": (
        "CPU limits: deliberate. A CFS quota throttles the engine-core loop and the API "
        "server in 100 ms periods, which shows up as inter-token latency spikes; the pods "
        "request their CPU (spec.resources.cpu) and are capped on memory instead."
    ),
    "CKV_K8S_15": (
        "imagePullPolicy Always: the user's choice (spec.imagePullPolicy; passes when set). "
        "The default is Kubernetes' own (IfNotPresent for a tag): an engine image is "
        "gigabytes, and a pod should start from the node's copy when the registry is down."
    ),
    "CKV_K8S_43": (
        "image by digest: the user's choice (spec.image, or the operator's --engine-image; "
        "a digest passes). The renderer passes the reference through unchanged."
    ),
    "CKV_K8S_13": (
        "memory limits: deliberate when spec.resources.memory is unset (accelerator pools): "
        "a guessed limit OOM-kills a pod while it loads weights; the pods request memory, "
        "and a user who sets spec.resources.memory gets it as the limit too."
    ),
    "CKV2_K8S_6": (
        "NetworkPolicy: deliberate for router pods, and for unified and decode pods that "
        "publish no KV-cache events. Prefill pods have one (<name>-kv) and pass: their KV "
        "ports, which serve cache blocks to anyone who asks, admit only the same resource's "
        "decode pods; engine pods that publish KV-cache events have one (<name>-cache-events "
        "for unified and decode pods) that admits only the router to that port. The others "
        "listen on http alone, which "
        "clients, the router, the kubelet's probes and Prometheus reach from wherever they "
        "run; the operator cannot know those sources, and a policy that selects a pod denies "
        "every source it does not list."
    ),
    "CKV_K8S_8": (
        "liveness probe: deliberate for the worker pods of a multi-node replica (LWS). They "
        "run worker ranks and listen on no fixed port; a worker that stops fails its leader, "
        "whose probes and exit make LWS recreate the whole group."
    ),
    "CKV_K8S_9": (
        "readiness probe: deliberate for the worker pods of a multi-node replica (LWS). They "
        "serve no traffic (the Services select the leaders), and the leader is ready only "
        "once every worker has joined it."
    ),
}
# Checks that pass once the user sets what they ask for (the `hardened` spec below).
USER_CONTROLLED = (
    "CKV_K8S_15",
    "CKV_K8S_43",
    "CKV_K8S_21",
    "CKV_K8S_10",
    "CKV_K8S_12",
    "CKV_K8S_13",
)


def llm_deployment(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An LLMDeployment as the API server hands it to the operator."""
    return {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}"},
        "spec": spec,
    }


def resources() -> dict[str, dict[str, Any]]:
    """Every resource to scan, by the file name its Deployments go to."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for index, resource in enumerate(load_llm_deployments(path)):
            resource = copy.deepcopy(resource)
            resource["metadata"]["namespace"] = NAMESPACE
            out[f"example-{path.stem}-{index}"] = resource
    gpu = {"resource": "nvidia.com/gpu", "count": 1, "memoryGiB": 80}
    out["fetched-gpu"] = llm_deployment(
        "fetched",
        {
            "model": {
                "name": "llama-3-8b",
                "source": {"uri": "https://models.example/llama-3-8b.tar.gz"},
                "parameterCount": 8.0e9,
            },
            "accelerator": gpu,
            "auth": {"apiKeySecretRef": {"name": "llm-key", "key": "api-key"}},
        },
    )
    # A writable hostPath (spec.model.cache) shared by the node's pods.
    out["cached-gpu"] = llm_deployment(
        "cached",
        {
            "model": {
                "name": "llama-3-8b",
                "source": {"uri": "https://models.example/llama-3-8b.tar.gz"},
                "cache": {"hostPath": {"path": "/var/cache/tidegate"}},
                "parameterCount": 8.0e9,
            },
            "accelerator": gpu,
        },
    )
    out["disaggregated-gpu"] = llm_deployment(
        "split",
        {
            "model": {
                "name": "llama-3-8b",
                "source": {"pvc": {"claimName": "models", "path": "llama-3-8b"}},
                "parameterCount": 8.0e9,
            },
            "accelerator": gpu,
            "topology": {
                "mode": "disaggregated",
                "prefill": {"replicas": 1},
                "decode": {"replicas": 2},
            },
        },
    )
    out["hardened"] = llm_deployment(
        "hardened",
        {
            "model": {
                "name": "tiny-llama",
                "source": {"pvc": {"claimName": "models", "path": "tiny-llama"}},
            },
            "image": DIGEST_IMAGE,
            "imagePullPolicy": "Always",
            "resources": {"cpu": "2", "memory": "4Gi"},
        },
    )
    return out


def scanned_objects(resource: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods' Deployments (an LWS as its StatefulSets), and any NetworkPolicy (checkov
    matches those to the pods)."""
    objects = []
    for obj in render(resource).objects:
        if obj["kind"] == "LeaderWorkerSet":
            objects += lws_statefulsets(obj)
        elif obj["kind"] in ("Deployment", "NetworkPolicy"):
            objects.append(obj)
    return objects


def lws_statefulsets(lws: dict[str, Any]) -> list[dict[str, Any]]:
    """What LWS's controller makes of a LeaderWorkerSet, as checkov reads it: a StatefulSet of
    the leaders (the leader template) and one of group 0's workers (the worker template)."""
    group = lws["spec"]["leaderWorkerTemplate"]
    sets = [
        (lws["metadata"]["name"], lws["spec"]["replicas"], group["leaderTemplate"]),
        (f"{lws['metadata']['name']}-0", group["size"] - 1, group["workerTemplate"]),
    ]
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {**lws["metadata"], "name": name},
            "spec": {
                "replicas": replicas,
                "serviceName": name,
                "selector": {"matchLabels": template["metadata"]["labels"]},
                "template": template,
            },
        }
        for name, replicas, template in sets
    ]


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """checkov's failed and passed checks over every rendered resource, by file stem."""
    if not CHECKOV.exists():
        reason = f"checkov is not installed at {CHECKOV} (`make test` installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("rendered")
    for stem, resource in resources().items():
        (folder / f"{stem}.yaml").write_text(yaml.safe_dump_all(scanned_objects(resource)))
    result = subprocess.run(
        [str(CHECKOV), "--directory", str(folder), "--framework", "kubernetes", *CHECKOV_ARGS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
    )
    # Exit 1 means "some check failed"; anything else is checkov itself failing.
    assert result.returncode in (0, 1), result.stderr[-4000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    checks: dict[str, list[dict[str, Any]]] = {"failed": [], "passed": []}
    for one in reports:
        assert not one["results"]["parsing_errors"], one["results"]["parsing_errors"]
        for kind in checks:
            for check in one["results"][f"{kind}_checks"]:
                checks[kind].append(
                    {
                        "id": check["check_id"],
                        "name": check["check_name"],
                        "resource": check["resource"],
                        "file": Path(check["file_path"]).stem,
                    }
                )
    assert checks["passed"], "checkov ran no check: did it find the rendered files?"
    return checks


def test_rendered_pods_fail_only_checks_skipped_with_a_reason(scan) -> None:
    unexpected = defaultdict(list)
    for check in scan["failed"]:
        if check["id"] not in SKIPPED:
            unexpected[f"{check['id']} ({check['name']})"].append(
                f"{check['file']}: {check['resource']}"
            )
    assert not unexpected, "checkov failures with no reason in SKIPPED:\n" + "\n".join(
        f"{check}\n  " + "\n  ".join(where) for check, where in sorted(unexpected.items())
    )


def test_every_skip_still_fires(scan) -> None:
    fired = {check["id"] for check in scan["failed"]}
    stale = sorted(set(SKIPPED) - fired)
    assert not stale, f"these checks pass now: remove them from SKIPPED: {stale}"


def test_every_skip_has_a_reason() -> None:
    for check_id, reason in SKIPPED.items():
        assert len(reason.split()) >= 8, f"{check_id}: say why it is skipped"


def test_pods_that_serve_kv_blocks_or_events_have_a_network_policy(scan) -> None:
    """The pods that serve KV blocks (prefill) or KV-cache events (any engine behind a router)
    are the ones a NetworkPolicy selects (CKV2_K8S_6); router pods and engines served
    directly listen on http alone."""
    checked = [check for check in scan["passed"] if check["id"] == "CKV2_K8S_6"]
    failed = [check for check in scan["failed"] if check["id"] == "CKV2_K8S_6"]
    by_file: dict[str, set[str]] = defaultdict(set)
    for check in checked:
        by_file[check["file"]].add(check["resource"].split("/component-")[1].split(".")[0])
    assert by_file == {
        "example-disaggregated-tiny-0": {"prefill", "decode"},
        "disaggregated-gpu": {"prefill", "decode"},
        "example-autoscaling-tiny-0": {"unified"},  # minReplicas 0: behind a router
        "example-gateway-tiny-0": {"unified"},
        "example-canary-tiny-0": {"unified"},  # a canary's share: behind a router
    }
    assert not [check for check in failed if "/component-prefill." in check["resource"]]
    behind_a_router = {
        check["file"] for check in failed if "/component-router." in check["resource"]
    }
    assert behind_a_router == set(by_file)


def test_what_the_user_controls_passes_when_the_user_sets_it(scan) -> None:
    """A digest image, imagePullPolicy Always, a namespace and resources: those checks pass."""
    failed = {check["id"] for check in scan["failed"] if check["file"] == "hardened"}
    passed = {check["id"] for check in scan["passed"] if check["file"] == "hardened"}
    for check_id in USER_CONTROLLED:
        assert check_id in passed and check_id not in failed, check_id


def test_the_scan_reaches_every_kind_of_container(scan) -> None:
    """GPU pools, routers, an init container and a Secret reference are all in the scan."""
    scanned = {check["file"] for check in scan["passed"]}
    assert set(resources()) <= scanned
    containers = {
        container["name"]
        for resource in resources().values()
        for obj in scanned_objects(resource)
        if obj["kind"] in ("Deployment", "StatefulSet")
        for key in ("containers", "initContainers")
        for container in obj["spec"]["template"]["spec"].get(key, [])
    }
    assert {"engine", "router", "fetch-model"} <= containers
