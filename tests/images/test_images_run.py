"""The images built and run, as a cluster would run them (tests/images/test_images.py reads
the Dockerfiles; this builds them).

`make images-local` builds engine-cpu and operator on a Debian base it makes itself (no
registry). The engine then serves the tiny model the way the operator's pods run it: the model
mounted read-only, a read-only root filesystem with /tmp writable, uid 10001, no capabilities,
and /dev/shm as large as the operator renders it; it answers a chat request and /metrics, and
SIGTERM drains a stream in flight and ends it with exit 0. The operator image, which must hold
no torch, reconciles an example against the kmock emulator over the host's network. Each
image's size, its build time and its start-to-healthy time go to .cache/images/images.json, or
where TIDEGATE_IMAGES_RESULT says (benchmarks/results/images.json holds the figures the
README's install section quotes).

Needs podman (or docker) able to build and run; elsewhere the tests skip and say why. Where
`make test` can install podman (CI here: root, apt-get), a missing or broken podman fails them
instead, so that CI never passes by skipping them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.operator.cluster import EmulatedCluster, wait_for
from tidegate.common.local_server import free_port
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import render

# Builds and start-up timings: the quiet run of make test, after everything else.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.alone]

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
EXAMPLE = REPO / "examples" / "unified-tiny.yaml"
# Where the sizes and times go: under .cache by default, so that a test run leaves the
# checkout as it was; TIDEGATE_IMAGES_RESULT=benchmarks/results/images.json records the
# figures the README quotes.
RESULTS = Path(os.environ.get("TIDEGATE_IMAGES_RESULT", REPO / ".cache" / "images" / "images.json"))
CONTAINERS_CONF = REPO / "images" / "containers.conf"
# Every container: podman runs an image's HEALTHCHECK on systemd timers, which a host without
# systemd (CI here) lacks; the tests poll the same endpoints themselves.
RUN_OPTIONS = ("run", "--no-healthcheck")
IMAGES = {name: f"ghcr.io/tidegate/{name}:{VERSION}" for name in ("engine-cpu", "operator")}
# A cold build (base, torch, apt) takes minutes on 2 cores; a warm one, seconds.
BUILD_TIMEOUT = 1800
# The engine compiles its CPU kernels and warms up inductor before /health answers (about a
# minute on 2 cores).
ENGINE_START_TIMEOUT = 300


def container_engine() -> tuple[str | None, str]:
    """podman or docker, whichever can run a container here, or None and why neither can."""
    reasons = []
    for engine in ("podman", "docker"):
        if shutil.which(engine) is None:
            reasons.append(f"no {engine}")
            continue
        result = subprocess.run(
            [engine, "info"], capture_output=True, text=True, env=engine_env(), timeout=60
        )
        if result.returncode == 0:
            return engine, ""
        reasons.append(f"{engine} info failed: {result.stderr.strip()[-300:]}")
    return None, "; ".join(reasons)


def engine_env() -> dict[str, str]:
    """podman's settings for this kind of host (runc, cgroupfs), unless the caller set its own:
    make exports the same file."""
    return {"CONTAINERS_CONF": str(CONTAINERS_CONF), **os.environ}


def required_here() -> bool:
    """CI here: make test installs podman (tools/container_tools.sh), so a skip would hide a
    failure."""
    return os.environ.get("CI") == "true" and os.geteuid() == 0 and bool(shutil.which("apt-get"))


@dataclass
class Runtime:
    """The container engine the tests drive, and the numbers they record for
    benchmarks/results/images.json."""

    engine: str
    results: dict

    def run(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [self.engine, *args], capture_output=True, text=True, env=engine_env(), timeout=timeout
        )
        if check:
            assert result.returncode == 0, f"{self.engine} {args[0]}: {result.stderr[-3000:]}"
        return result

    def once(
        self, image: str, *args: str, entrypoint: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        """A one-off command in a fresh container of `image`, removed after; no network."""
        options = ["--entrypoint", entrypoint] if entrypoint else []
        return self.run(
            *RUN_OPTIONS, "--rm", "--network", "none", *options, image, *args, check=check
        )

    def size_mb(self, image: str) -> float:
        size = self.run("image", "inspect", "--format", "{{.Size}}", image).stdout
        return round(int(size) / 1e6, 1)

    def labels(self, image: str) -> dict[str, str]:
        return json.loads(
            self.run("image", "inspect", "--format", "{{json .Labels}}", image).stdout
        )

    def remove(self, name: str) -> None:
        self.run("rm", "--force", name, check=False)


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    """The images built with `make images-local`, and the timings recorded once all ran."""
    engine, why = container_engine()
    if engine is None:
        if required_here():
            pytest.fail(f"make test installs podman here, yet no container engine works: {why}")
        pytest.skip(f"no container engine can run images here: {why}")
    started = time.monotonic()
    build = subprocess.run(
        ["make", "images-local", f"IMAGE_ENGINE={engine}", f"PYTHON={sys.executable}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=engine_env(),
        timeout=BUILD_TIMEOUT,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    results = {
        "engine": engine,
        "build_s": round(time.monotonic() - started, 1),
        "images": {name: {"image": image} for name, image in IMAGES.items()},
    }
    runtime = Runtime(engine, results)
    yield runtime
    for name, image in IMAGES.items():
        results["images"][name]["size_mb"] = runtime.size_mb(image)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"image sizes and times: {RESULTS}")


def readable_copy(source: Path, parent: Path) -> Path:
    """A copy anyone may read: the containers run as users other than this one, and pytest's
    temporary folders are private to it."""
    target = parent / source.name
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy(source, target)
    for path in [parent, *parent.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tidegate-image-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def rendered_engine_pod() -> dict:
    """The pod spec the operator renders for the CPU example."""
    resource = load_llm_deployments(EXAMPLE)[0]
    deployment = next(o for o in render(resource).objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def shm_size(pod: dict) -> str:
    """/dev/shm's size limit in the rendered pod, as podman's --shm-size takes it (1Gi -> 1g)."""
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    limit = volume["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi"), limit
    return limit.removesuffix("Gi") + "g"


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_engine_image_serves_as_the_operator_runs_it(
    runtime: Runtime, tiny_llama_dir: Path, shared_dir: Path
) -> None:
    pod = rendered_engine_pod()
    security = pod["securityContext"]
    user = f"{security['runAsUser']}:{security['runAsGroup']}"
    assert user == "10001:10001"
    model = readable_copy(tiny_llama_dir, shared_dir)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = f"tidegate-test-engine-{os.getpid()}"
    started = time.monotonic()
    runtime.run(
        *RUN_OPTIONS, "--detach", "--name", name, "--network", "host",
        "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
        "--user", user, "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--shm-size", shm_size(pod),
        "--volume", f"{model}:/model:ro",
        IMAGES["engine-cpu"],
        "serve", "--model", "/model", "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    try:
        wait_for(
            lambda: answers(f"{base}/health") or not running(runtime, name),
            timeout=ENGINE_START_TIMEOUT,
            what="the engine's /health",
        )
        assert running(runtime, name), logs(runtime, name)
        runtime.results["images"]["engine-cpu"]["start_to_healthy_s"] = round(
            time.monotonic() - started, 1
        )
        with httpx.Client(base_url=base, timeout=60) as client:
            reply = client.post(
                "/v1/chat/completions",
                json={
                    "model": "/model",
                    "messages": [{"role": "user", "content": "Hello"}],
                    "max_tokens": 8,
                    "ignore_eos": True,
                },
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
            metrics = client.get("/metrics")
            assert metrics.status_code == 200
            assert "# TYPE tidegate:" in metrics.text
            # SIGTERM while a stream is in flight: the stream ends whole, then the process.
            stream_tokens = drained_stream(
                client, lambda: runtime.run("kill", "--signal", "TERM", name)
            )
            assert stream_tokens == 256
        exit_code = runtime.run("wait", name, timeout=60).stdout.strip()
        assert exit_code == "0", logs(runtime, name)
    finally:
        runtime.remove(name)


def drained_stream(client: httpx.Client, stop: Callable[[], object]) -> int:
    """The tokens a streamed completion delivered, when `stop` is called after its first one."""
    tokens = 0
    request = {
        "model": "/model",
        "prompt": "Once",
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        stopper: threading.Thread | None = None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if stopper is None:
                stopper = threading.Thread(target=stop)
                stopper.start()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        assert stopper is not None
        stopper.join(30)
    return tokens


def running(runtime: Runtime, name: str) -> bool:
    state = runtime.run("inspect", "--format", "{{.State.Running}}", name, check=False)
    return state.stdout.strip() == "true"


def logs(runtime: Runtime, name: str) -> str:
    result = runtime.run("logs", name, check=False)
    return (result.stdout + result.stderr)[-3000:]


def test_operator_image_reconciles_an_example(
    runtime: Runtime, tmp_path: Path, shared_dir: Path
) -> None:
    with EmulatedCluster(tmp_path) as cluster:
        cluster.create_namespace("ml")
        config = readable_copy(cluster.kubeconfig, shared_dir)
        port, metrics_port = free_port(), free_port()
        name = f"tidegate-test-operator-{os.getpid()}"
        started = time.monotonic()
        runtime.run(
            *RUN_OPTIONS, "--detach", "--name", name, "--network", "host",
            "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
            "--user", "65532:65532", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--volume", f"{config}:/etc/tidegate/kubeconfig:ro",
            "--env", "KUBECONFIG=/etc/tidegate/kubeconfig",
            IMAGES["operator"],
            "operator", "--namespace", "ml",
            "--liveness", f"http://127.0.0.1:{port}/healthz",
            "--metrics-port", str(metrics_port),
            # The example's model is a node folder: allowed here, as an admin would.
            "--allowed-host-path", "/models",
        )  # fmt: skip
        try:
            wait_for(
                lambda: answers(f"http://127.0.0.1:{port}/healthz") or not running(runtime, name),
                timeout=120,
                what="the operator's liveness endpoint",
            )
            assert running(runtime, name), logs(runtime, name)
            runtime.results["images"]["operator"]["start_to_healthy_s"] = round(
                time.monotonic() - started, 1
            )
            (resource,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
            resource["metadata"].update(namespace="ml", uid="uid-image-test")
            cluster.create(resource)
            deployment = wait_for(
                lambda: cluster.get("apps/v1", "Deployment", resource["metadata"]["name"], "ml"),
                timeout=60,
                what="the Deployment",
            )
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            # The example names the engine-cpu image of this very version.
            assert container["image"] == IMAGES["engine-cpu"]
            runtime.run("kill", "--signal", "TERM", name)
            assert runtime.run("wait", name, timeout=60).stdout.strip() == "0", logs(runtime, name)
        finally:
            runtime.remove(name)


def test_operator_image_has_no_torch_and_runs_its_commands(runtime: Runtime) -> None:
    image = IMAGES["operator"]
    torch = runtime.once(image, "-c", "import torch", entrypoint="python", check=False)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr, torch.stderr
    assert "--liveness" in runtime.once(image, "operator", "--help").stdout


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_images_carry_the_version_and_revision_and_no_build_configuration(
    runtime: Runtime, name: str
) -> None:
    image = IMAGES[name]
    assert runtime.once(image, "--version").stdout.strip() == f"tidegate {VERSION}"
    labels = runtime.labels(image)
    assert labels["org.opencontainers.image.version"] == VERSION
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert labels["org.opencontainers.image.revision"] == head.stdout.strip()
    # The host's pip configuration served the build only: no file, no setting, no trace in
    # the history of the layers shipped.
    config = runtime.once(image, "-m", "pip", "config", "list", entrypoint="python")
    assert config.stdout.strip() == ""
    history = runtime.run("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert "pipconf" not in history and "/opt/wheels" not in history
    sbom = json.loads((REPO / "dist" / "images" / f"{name}-{VERSION}.sbom.json").read_text())
    installed = {d["metadata"]["name"].lower() for d in sbom["python"]["installed"]}
    assert "tidegate" in installed and ("torch" in installed) == (name == "engine-cpu")
    assert sbom["debian"] and sbom["revision"] == labels["org.opencontainers.image.revision"]
