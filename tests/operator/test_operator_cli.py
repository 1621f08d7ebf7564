"""`tidegate plan` and `tidegate operator`, run as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from tests.operator.cluster import EmulatedCluster, wait_for
from tidegate.common.local_server import free_port

CLI = [sys.executable, "-m", "tidegate.cli"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tidegate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def test_plan_prints_objects_and_tuning_with_reasons(tmp_path: Path) -> None:
    # The 70B example with an autoscaling policy (the examples carry none until the
    # operator acts on one).
    resource = yaml.safe_load((EXAMPLES / "llama-70b-8gpu.yaml").read_text())
    resource["spec"]["autoscaling"] = {"unified": {"minReplicas": 1, "maxReplicas": 4}}
    manifest = tmp_path / "llama-70b-autoscaled.yaml"
    manifest.write_text(yaml.safe_dump(resource))
    result = tidegate("plan", "-f", str(manifest))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "http://llama-3-70b.default.svc:8000/v1" in out
    for kind in ("ConfigMap", "Deployment", "Service", "PodDisruptionBudget"):
        assert kind in out
    tp_line = next(line for line in out.splitlines() if "tensorParallelSize" in line)
    assert tp_line.split()[:3] == ["unified", "tensorParallelSize", "4"]
    assert "does not fit" in tp_line  # the reason is on the line
    # The pool's autoscaling policy, with what each value does.
    replicas_line = next(line for line in out.splitlines() if line.startswith("unified  replicas"))
    assert replicas_line.split()[:3] == ["unified", "replicas", "1-4"]
    assert "autoscaled by the operator, starts at 2" in replicas_line
    assert "default: scheduling.maxNumSeqs" in out and "p90 TTFT <= 800 ms" in out


def test_plan_yaml_is_what_kubectl_would_apply(tmp_path: Path) -> None:
    result = tidegate(
        "plan", "-f", str(EXAMPLES / "disaggregated-tiny.yaml"), "-o", "yaml", "-n", "ml"
    )
    assert result.returncode == 0, result.stderr
    objects = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    assert "Deployment/tiny-disagg-router" in kinds
    assert "NetworkPolicy/tiny-disagg-kv" in kinds
    assert {o["metadata"]["namespace"] for o in objects} == {"ml"}
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    # The config files stay readable blocks, with each tuned flag's reason as a comment.
    assert "|" in result.stdout.split("prefill.yaml:")[1].splitlines()[0]
    assert "# no accelerator" in config["data"]["prefill.yaml"]


def test_plan_refuses_a_bad_manifest_with_the_field_named(tmp_path: Path) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        "apiVersion: tidegate.dev/v1alpha1\nkind: LLMDeployment\nmetadata: {name: bad}\n"
        "spec:\n  model: {name: m, source: {hostPath: {path: /m}}, parameterCount: 70.6e9}\n"
        "  accelerator: {count: 2, memoryGiB: 80}\n  parallelism: {tensorParallelSize: 8}\n"
    )
    result = tidegate("plan", "-f", str(manifest))
    assert result.returncode == 1
    assert "tensorParallelSize" in result.stderr and "Traceback" not in result.stderr
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    result = tidegate("plan", "-f", str(manifest))
    assert result.returncode == 1
    assert "holds no LLMDeployment" in result.stderr


def test_operator_command_serves_liveness_reconciles_and_stops_on_sigterm(tmp_path: Path) -> None:
    with EmulatedCluster(tmp_path) as cluster:
        cluster.create_namespace("ml")
        port, metrics_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        process = subprocess.Popen(
            [
                *CLI,
                "operator",
                "--namespace",
                "ml",
                "--liveness",
                f"http://127.0.0.1:{port}/healthz",
                "--engine-image",
                "example/engine:9",
                "--metrics-port",
                str(metrics_port),
                "--autoscale-period",
                "5",
                # The example's model is a node folder: allowed here, as an admin would.
                "--allowed-host-path",
                "/models",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:

            def alive() -> bool:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200

            wait_for(lambda: _quietly(alive), timeout=60, what="the liveness endpoint")

            def gauges() -> bytes:
                url = f"http://127.0.0.1:{metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=2) as response:
                    return response.read()

            # The autoscaler's gauges, on the port given.
            text = wait_for(lambda: _quietly(gauges), timeout=30, what="the metrics endpoint")
            assert b"# TYPE tidegate:autoscaler_desired_replicas gauge" in text
            (resource,) = [
                d for d in yaml.safe_load_all((EXAMPLES / "unified-tiny.yaml").read_text()) if d
            ]
            resource["metadata"].update(namespace="ml", uid="uid-cli")
            del resource["spec"]["image"]
            cluster.create(resource)
            deployment = wait_for(
                lambda: cluster.get("apps/v1", "Deployment", resource["metadata"]["name"], "ml"),
                timeout=30,
                what="the Deployment",
            )
            image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
            assert image == "example/engine:9"  # --engine-image fills an unset spec.image
            # Resources in other namespaces are not this operator's.
            other = dict(
                resource, metadata={"name": "elsewhere", "namespace": "default", "uid": "uid-other"}
            )
            cluster.create(other)
            time.sleep(1.5)
            assert cluster.get("apps/v1", "Deployment", "elsewhere", "default") is None
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output[-3000:]


def _quietly(check):  # type: ignore[no-untyped-def]
    try:
        return check()
    except OSError:
        return False
