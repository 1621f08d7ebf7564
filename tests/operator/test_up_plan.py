"""What `tidegate up` would run for a manifest: the rendered pods, with local stand-ins only."""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tidegate.engine.kv_transfer.zmq_curve import load_curve_keys
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.up import (
    UpError,
    container_exit_code,
    plan_pods,
    resolve_model_dir,
    stopped_when_up_dies,
    warn_about_machine,
)

REPO = Path(__file__).resolve().parents[2]


def example(name: str) -> dict:
    return load_llm_deployments(str(REPO / "examples" / name))[0]


def flag(command: list[str], name: str) -> list[str]:
    """The values after --name, up to the next flag."""
    index = command.index(name) + 1
    values = []
    while index < len(command) and not command[index].startswith("--"):
        values.append(command[index])
        index += 1
    return values


def test_disaggregated_pods_get_local_ports_configs_and_each_others_urls(tmp_path: Path) -> None:
    pods = plan_pods(example("disaggregated-tiny.yaml"), Path("/m"), 9000, tmp_path)
    assert [p.role for p in pods] == ["prefill", "decode", "router"]
    prefill, decode, router = pods
    assert router.port == 9000 and len({p.port for p in pods}) == 3
    for pod in (prefill, decode):
        config = Path(flag(pod.command, "--config")[0])
        assert config.parent == tmp_path / "config" and config.is_file()
        assert "kv-role" in config.read_text()  # the operator's file, as rendered
        assert flag(pod.command, "--model") == ["/m"]
        assert flag(pod.command, "--kv-port") == ["0"]
        assert flag(pod.command, "--host") == ["127.0.0.1"]
    assert flag(router.command, "--prefill") == [prefill.url]
    assert flag(router.command, "--decode") == [decode.url]
    assert prefill.flags["longPrefillTokenThreshold"] == "auto"


@pytest.mark.parametrize("on_this_machine", [True, False])
def test_the_model_cache_is_a_local_folder_the_replicas_share(tmp_path, on_this_machine):
    node_cache = tmp_path / "node-cache"
    if on_this_machine:
        node_cache.mkdir()
    resource = copy.deepcopy(example("disaggregated-tiny.yaml"))
    resource["spec"]["model"]["cache"] = {"hostPath": {"path": str(node_cache)}}
    pods = plan_pods(resource, Path("/m"), 9000, tmp_path / "up")
    local = node_cache if on_this_machine else tmp_path / "up" / "model-cache"
    compile_dirs = {
        yaml.safe_load(Path(flag(pod.command, "--config")[0]).read_text())["compile-cache-dir"]
        for pod in pods
        if pod.role != "router"
    }
    (compile_dir,) = compile_dirs  # prefill and decode share their kernels
    assert Path(compile_dir).parent == local / "compile"


def test_several_unified_replicas_get_a_balancing_router(tmp_path: Path) -> None:
    resource = copy.deepcopy(example("unified-tiny.yaml"))
    resource["spec"]["topology"]["unified"]["replicas"] = 3
    pods = plan_pods(resource, Path("/m"), 9000, tmp_path)
    engines, [balancer] = pods[:3], pods[3:]
    assert [p.role for p in engines] == ["unified"] * 3 and 9000 not in {p.port for p in engines}
    assert balancer.port == 9000
    assert flag(balancer.command, "--decode") == [p.url for p in engines]
    assert "--prefill" not in balancer.command


def test_the_api_key_secret_is_a_private_local_file_from_the_environment(
    tmp_path: Path, monkeypatch
) -> None:
    resource = copy.deepcopy(example("disaggregated-tiny.yaml"))
    resource["spec"]["auth"] = {"apiKeySecretRef": {"name": "llm-key", "key": "api-key"}}
    monkeypatch.delenv("TIDEGATE_API_KEY", raising=False)
    with pytest.raises(UpError, match=r"Secret llm-key.*set TIDEGATE_API_KEY"):
        plan_pods(resource, Path("/m"), 9000, tmp_path)
    monkeypatch.setenv("TIDEGATE_API_KEY", "sk-local")
    pods = plan_pods(resource, Path("/m"), 9000, tmp_path)
    key_file = tmp_path / "secrets" / "api-key"
    assert key_file.read_text() == "sk-local"
    assert key_file.stat().st_mode & 0o777 == 0o600
    for pod in pods:
        config = Path(flag(pod.command, "--config")[0]).read_text()
        assert f"api-key-file: {key_file}" in config
        assert "sk-local" not in config and "sk-local" not in " ".join(pod.command)


def test_the_kv_key_pair_is_made_here_once_and_private(tmp_path: Path) -> None:
    """The Secret a cluster would mount: both pools read one pair of this machine's."""
    pods = plan_pods(example("disaggregated-tiny.yaml"), Path("/m"), 9000, tmp_path / "up")
    key_dir = tmp_path / "up" / "secrets" / "kv-curve"
    keys = load_curve_keys(str(key_dir))
    assert key_dir.stat().st_mode & 0o777 == 0o700
    assert key_dir.parent.stat().st_mode & 0o777 == 0o700
    for pod in pods[:2]:
        config = yaml.safe_load(Path(flag(pod.command, "--config")[0]).read_text())
        assert config["kv-encryption"] == "curve"
        assert config["kv-curve-key-dir"] == str(key_dir)
    plan_pods(example("disaggregated-tiny.yaml"), Path("/m"), 9000, tmp_path / "up")
    assert load_curve_keys(str(key_dir)) == keys  # a restarted up keeps the pair
    plain = copy.deepcopy(example("disaggregated-tiny.yaml"))
    plain["spec"]["topology"]["kvEncryption"] = "none"
    plan_pods(plain, Path("/m"), 9000, tmp_path / "plain")
    assert not (tmp_path / "plain" / "secrets").exists()


def test_one_unified_replica_serves_the_public_port_itself(tmp_path: Path) -> None:
    [pod] = plan_pods(example("unified-tiny.yaml"), Path("/m"), 9000, tmp_path)
    assert pod.port == 9000


def test_accelerator_pods_run_on_cpu_here_with_warnings(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TIDEGATE_API_KEY", "sk-local")  # the example has an API key Secret
    monkeypatch.setattr("tidegate.operator.up._cuda_available", lambda: False)
    monkeypatch.setattr("tidegate.operator.up.available_cpus", lambda: 2)
    pods = plan_pods(example("llama-70b-8gpu.yaml"), Path("/m"), 9000, tmp_path)
    assert all(flag(p.command, "--device") == ["cpu"] for p in pods if p.role != "router")
    warnings = warn_about_machine(pods)
    assert any("worker processes on 2 cores" in w for w in warnings)
    assert any("no CUDA" in w for w in warnings)


def test_the_model_folder_must_hold_a_model(tmp_path: Path) -> None:
    resource = example("unified-tiny.yaml")
    with pytest.raises(UpError, match=f"model folder {tmp_path} not found"):
        resolve_model_dir(resource, tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(resource, tmp_path) == tmp_path


def test_an_exit_reads_as_kubernetes_shows_a_containers() -> None:
    assert container_exit_code(0) == "0"
    assert container_exit_code(1) == "1"
    assert container_exit_code(-signal.SIGKILL) == "137 (SIGKILL)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pod_is_stopped_when_what_started_it_is_gone() -> None:
    started: list[subprocess.Popen] = []

    def start() -> None:
        started.append(subprocess.Popen(stopped_when_up_dies(["sleep", "30"])))
        deadline = time.monotonic() + 10
        while psutil.Process(started[0].pid).cmdline()[:1] != ["sleep"]:  # set up, exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)  # polling with a deadline

    # The signal is tied to the thread that started the process: its end stands for up's.
    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    assert started[0].wait(timeout=10) == -signal.SIGTERM
