"""`tidegate up`: run an LLMDeployment on this machine, as the operator would in a cluster.

The operator's own renderer says what to run (no second code path): every replica of every
rendered Deployment becomes a local process running its container's command and args, with
these local substitutions only:
- the ConfigMap's files are written to a folder and `--config` points there (the adapters
  file with this machine's folders, kept in step with the manifest while up runs:
  `operator/up_adapters.py`);
- each process listens on 127.0.0.1 and a free port; KV transfer ports are picked free too,
  and so is the router's endpoint picker port (gateway.inferencePool);
- decode pods behind an InferencePool may name prefill pods at 127.0.0.1
  (`--prefill-hosts`), where in a cluster only the prefill Service's pods are allowed;
- each engine publishes its KV-cache events on a free port (`--kv-events-port 0`, which its
  /metrics names for the router), where in a cluster each pod has its own address and all
  use one port; the router reads the tokenizer from the local model folder;
- the model source becomes a local folder (`--model-dir`, or the hostPath when it exists);
- the KV transfer's key pair (the Secret `<name>-kv-curve` in a cluster) is made on this
  machine, once per work folder, readable by this user only;
- a Service becomes the URLs of the replicas behind it (the router's --prefill/--decode);
- accelerator requests are ignored on a machine without CUDA (`--device cpu`, with a warning).
A LeaderWorkerSet pool (replicas over several nodes) runs each replica as a group of
processes, a pod of the group each, that meet over TCP as the pods would: the leader runs
`tidegate serve ... --node-rank 0 --master-addr 127.0.0.1 --master-port P` and the others the
worker command with their node rank, P a free port of the group's (P + 1 too: the leader's
control channel), for LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX. Only the
leader serves HTTP.
The public endpoint (`--port`) is the router, or the engine of a one-replica unified pool, or
a router balancing whole requests over several unified replicas. A process that exits is
restarted like the kubelet does, after a backoff that doubles; a group is restarted as a
unit, as LWS's RecreateGroupOnPodRestart does: when one of its processes exits, the others
are stopped, and after the backoff all start again (on fresh ports). SIGTERM or Ctrl-C stops
them all, each with its whole process session, so nothing is left behind. Should up itself be
killed, the kernel sends each pod SIGTERM (on Linux), so nothing is left behind then either.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tidegate.common.cpus import available_cpus
from tidegate.common.local_server import LocalServer, free_port, tidegate_command
from tidegate.engine.config import API_KEY_ENV
from tidegate.operator.autoscaler import starting_replicas
from tidegate.operator.kv_keys import write_key_dir
from tidegate.operator.labels import COMPONENT_LABEL
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import (
    ADAPTERS_KEY,
    API_KEY_FILE,
    CACHE_DIR,
    CONFIG_DIR,
    KV_CURVE_DIR,
    LWS_GROUP_SIZE,
    LWS_LEADER_ADDRESS,
    LWS_WORKER_INDEX,
    SECRET_DIR,
    Rendered,
    RenderOptions,
    is_pool,
    pod_template,
    render,
)
from tidegate.operator.rollout import CANARY_SUFFIX
from tidegate.operator.spec import LLMDeploymentSpec, SpecError
from tidegate.operator.up_adapters import (
    AdapterError,
    AdapterWatcher,
    LocalAdapters,
    manifest_state,
    read_adapters_file,
    write_adapters_file,
)

logger = logging.getLogger("tidegate.up")

# kubelet's restart backoff, scaled down for one machine: 1 s doubling to 30 s; a process
# that stayed up this long starts again from 1 s.
BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 1.0, 30.0, 60.0
# Roles started first (their URLs are the router's arguments); the router last.
START_ORDER = ("unified", "prefill", "decode", "router")
# How long the rest of a group may take to stop once one of its processes has exited.
GROUP_STOP_S = 10.0


@dataclass
class LocalPod:
    """One replica of a rendered Deployment, run as a local process."""

    role: str
    name: str
    command: list[str]
    port: int
    log_path: Path
    server: LocalServer | None = None
    log: TextIO | None = None
    restarts: int = 0
    backoff_s: float = BACKOFF_S
    restart_at: float | None = None
    started_at: float = 0.0
    flags: dict[str, Any] = field(default_factory=dict)
    # Whether the pod should run: the replicas of an autoscaled pool are made for its
    # maxReplicas, each with its port, and the autoscaler turns them on and off.
    active: bool = True
    # Set while a pod turned off drains (SIGTERM, then its in-flight requests finish).
    draining: threading.Thread | None = None
    # "canary": the one pod of a role that runs a change first (operator/up_rollout.py).
    track: str = "stable"
    # A LeaderWorkerSet pool's replica: the group's name, and this pod's index in it (0: the
    # leader, the only one that serves HTTP). None: a Deployment's pod.
    group: str | None = None
    node_rank: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def serves(self) -> bool:
        """Whether the pod answers HTTP (all but a group's worker pods)."""
        return self.node_rank == 0

    def start(self) -> None:
        if self.server is not None:
            self.server.stop(timeout=5.0)  # what the last run left in its session goes too
        if self.log is not None:
            self.log.close()
        self.log = self.log_path.open("a")  # one log across restarts, as `kubectl logs -p`
        self.server = LocalServer(stopped_when_up_dies(self.command), self.port, log=self.log)
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def pid(self) -> int | None:
        return self.server.process.pid if self.server else None

    def exited(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return None if self.server is None else self.server.process.poll()

    @property
    def idle(self) -> bool:
        """Turned off, drained and stopped: the pod may be started again."""
        return not self.active and self.server is None and self.draining is None

    def drain(self, timeout_s: float) -> None:
        """SIGTERM the pod and let it finish its requests, on a thread of its own."""
        server = self.server
        assert server is not None

        def stop() -> None:
            server.stop(timeout=timeout_s)
            if self.log is not None:
                self.log.close()
                self.log = None
            self.server, self.draining = None, None

        self.draining = threading.Thread(target=stop, name=f"drain-{self.name}", daemon=True)
        self.draining.start()


# Run before a pod's command, in its process: prctl(PR_SET_PDEATHSIG, SIGTERM), which the
# exec keeps. The kernel sends the signal when the *thread* that started the process ends:
# the supervisor starts every pod from one thread that lives as long as up does.
_STOPPED_WHEN_UP_DIES = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):  # up died before the prctl
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def stopped_when_up_dies(command: list[str]) -> list[str]:
    """`command`, run so that it gets SIGTERM should this process die (Linux; else as is)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-c", _STOPPED_WHEN_UP_DIES, str(os.getpid()), *command]


def container_exit_code(code: int) -> str:
    """A process's exit status as Kubernetes shows a container's: 128 + N after signal N."""
    if code >= 0:
        return str(code)
    return f"{128 - code} ({signal.Signals(-code).name})"


class UpError(Exception):
    """What cannot run on this machine, said so that the user can fix it."""


def plan_pods(
    resource: dict[str, Any],
    model_dir: Path,
    port: int,
    workdir: Path,
    claim_dirs: Mapping[str, Path] | None = None,
) -> list[LocalPod]:
    """The local processes of one LLMDeployment, in start order; the public one on `port`."""
    return plan(resource, model_dir, port, workdir, claim_dirs)[0]


def plan(
    resource: dict[str, Any],
    model_dir: Path,
    port: int,
    workdir: Path,
    claim_dirs: Mapping[str, Path] | None = None,
) -> tuple[list[LocalPod], LLMDeploymentSpec]:
    """plan_pods(), and the spec they were rendered from.

    An autoscaled pool gets a pod for each of its maxReplicas, those beyond the replicas it
    starts with turned off: the router knows them all, the autoscaler turns them on. With
    spec.adapters, the adapters file lists this machine's folders (`local_adapters`): a pvc
    adapter's claim is a folder of `claim_dirs`.
    """
    # No hostPath allow-list: up runs as the user, whose own folders the pods read.
    rendered = render(resource, RenderOptions())
    policies = rendered.spec.autoscaling.policies() if rendered.spec.autoscaling else {}
    config_map = next(o for o in rendered.objects if o["kind"] == "ConfigMap")
    local = LocalConfig(
        local_config_dir(workdir),
        _local_secrets(rendered, workdir),
        _local_cache(rendered.spec, workdir),
    )
    local.config_dir.mkdir(parents=True, exist_ok=True)
    config_dir = local.config_dir
    for key, text in config_map["data"].items():
        if key == ADAPTERS_KEY:
            continue  # the pods' mounts: written below with this machine's folders
        local.write(key, text)
    if rendered.spec.adapters is not None:
        local = local_adapters(rendered.spec, workdir, claim_dirs)
        try:
            entries = local.entries(rendered.spec)
        except AdapterError as error:
            raise UpError(str(error)) from None
        write_adapters_file(config_dir / ADAPTERS_KEY, entries)
    deployments = sorted(
        (o for o in rendered.objects if is_pool(o)),
        key=lambda o: START_ORDER.index(o["metadata"]["labels"][COMPONENT_LABEL]),
    )
    pods: list[LocalPod] = []
    for deployment in deployments:
        role = deployment["metadata"]["labels"][COMPONENT_LABEL]
        if deployment["kind"] == "LeaderWorkerSet":
            pods += _group_pods(deployment, config_dir, workdir)
            continue
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        if role in policies:
            pool = rendered.spec.topology.roles()[role]
            count = policies[role].max_replicas
            start = starting_replicas(policies[role], pool.replicas)
        else:
            count = start = deployment["spec"]["replicas"]
        args = [a.replace(CONFIG_DIR, str(config_dir)) for a in container["args"]]
        for index in range(count):
            name = f"{deployment['metadata']['name']}-{index}"
            command = [*tidegate_command(), *args]
            pod = LocalPod(role, name, command, 0, workdir / f"{name}.log", active=index < start)
            pods.append(pod)
        if rendered.spec.canary() and role != "router":
            # Off until a change of the manifest runs on it; the router knows it from the start.
            name = f"{deployment['metadata']['name']}{CANARY_SUFFIX}"
            canary_args = [a.replace(f"/{role}.yaml", f"/{role}{CANARY_SUFFIX}.yaml") for a in args]
            command = [*tidegate_command(), *canary_args]
            log = workdir / f"{name}.log"
            pods.append(LocalPod(role, name, command, 0, log, active=False, track="canary"))
    _assign_ports_and_flags(pods, model_dir, port, rendered, autoscaled=set(policies))
    return pods, rendered.spec


def _group_pods(lws: dict[str, Any], config_dir: Path, workdir: Path) -> list[LocalPod]:
    """A LeaderWorkerSet's groups as processes: per replica its leader, then its workers, named
    as LWS names the pods (`<lws>-<group>`, `<lws>-<group>-<index>`). What LWS's webhook puts
    in the containers becomes this machine's: the leader at 127.0.0.1, the group's size, each
    pod's index; `set_master_port` gives each group its own rendezvous port."""
    role = lws["metadata"]["labels"][COMPONENT_LABEL]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    leader_args = pod_template(lws)["spec"]["containers"][0]["args"]
    worker_args = template["workerTemplate"]["spec"]["containers"][0]["args"]
    pods = []
    for index in range(lws["spec"]["replicas"]):
        group = f"{lws['metadata']['name']}-{index}"
        members = []
        for rank in range(size):
            values = {LWS_LEADER_ADDRESS: "127.0.0.1", LWS_GROUP_SIZE: str(size)}
            values[LWS_WORKER_INDEX] = str(rank)
            args = [
                values.get(arg, arg.replace(CONFIG_DIR, str(config_dir)))
                for arg in (worker_args if rank else leader_args)
            ]
            name = group if rank == 0 else f"{group}-{rank}"
            command = [*tidegate_command(), *args]
            log = workdir / f"{name}.log"
            members.append(LocalPod(role, name, command, 0, log, group=group, node_rank=rank))
        set_master_port(members)
        pods += members
    return pods


def set_master_port(members: list[LocalPod]) -> int:
    """Give a group a fresh rendezvous port, free and reserved with the next one (the
    leader's control channel), in every member's `--master-port`; the port. Not the one it
    had: a restarted group's old sockets may linger."""
    at = members[0].command.index("--master-port") + 1
    port = free_port(consecutive=2)
    while str(port) == members[0].command[at]:
        port = free_port(consecutive=2)
    for pod in members:
        at = pod.command.index("--master-port") + 1
        pod.command[at] = str(port)
    return port


@dataclass(frozen=True)
class LocalConfig:
    """The folders standing for a pod's mounts: the ConfigMap's, the Secrets', the cache's."""

    config_dir: Path
    secret_dir: Path
    cache_dir: Path

    def write(self, key: str, text: str) -> Path:
        """A file of the ConfigMap, with its paths made this machine's."""
        text = text.replace(SECRET_DIR, str(self.secret_dir)).replace(
            CACHE_DIR, str(self.cache_dir)
        )
        text = text.replace(KV_CURVE_DIR, str(local_kv_keys_dir(self.secret_dir)))
        path = self.config_dir / key
        # A new file renamed over the old: a process that starts meanwhile reads a whole one.
        partial = path.with_name(f".{key}.partial")
        partial.write_text(text.replace(CONFIG_DIR, str(self.config_dir)))
        partial.replace(path)
        return path


def local_config_dir(workdir: Path) -> Path:
    """The folder standing for the ConfigMap's mount: every pod's config, the adapters file."""
    return workdir / "config"


def local_adapters(
    spec: LLMDeploymentSpec, workdir: Path, claim_dirs: Mapping[str, Path] | None = None
) -> LocalAdapters:
    """Where this machine has the spec's adapters: `claim_dirs` stand for claims, and fetched
    ones go to the local model cache."""
    return LocalAdapters(_local_cache(spec, workdir), dict(claim_dirs or {}))


def _local_cache(spec: LLMDeploymentSpec, workdir: Path) -> Path:
    """The folder standing for spec.model.cache: its hostPath where this machine has it (this
    machine is the node), else one under workdir that the local replicas share."""
    cache = spec.model.cache
    if cache is not None and cache.host_path is not None and Path(cache.host_path.path).is_dir():
        return Path(cache.host_path.path)
    return workdir / "model-cache"


def local_kv_keys_dir(secret_dir: Path) -> Path:
    """The folder standing for the KV key pair's Secret, inside the one for the API key's."""
    return secret_dir / "kv-curve"


def _local_secrets(
    rendered: Rendered, workdir: Path, environ: Mapping[str, str] = os.environ
) -> Path:
    """The folder standing for the mounted Secrets: the API key from TIDEGATE_API_KEY, if
    asked, and a KV key pair made here, if the pools encrypt their KV transfer."""
    secret_dir = workdir / "secrets"
    auth = rendered.spec.auth
    api_key_ref = auth.api_key_secret_ref if auth is not None else None
    if api_key_ref is not None:
        key = environ.get(API_KEY_ENV)
        if not key:
            raise UpError(
                f"the endpoint takes its API key from Secret {api_key_ref.name}, which only "
                f"a cluster has; set {API_KEY_ENV} to the key to use here"
            )
        secret_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = secret_dir / Path(API_KEY_FILE).name
        path.touch(mode=0o600)
        path.write_text(key)
    if rendered.kv_keys is not None:
        secret_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_key_dir(local_kv_keys_dir(secret_dir))
    return secret_dir


def _assign_ports_and_flags(
    pods: list[LocalPod], model_dir: Path, port: int, rendered: Rendered, autoscaled: set[str]
) -> None:
    for pod in pods:
        if not pod.serves:
            # The leader hands its configuration to the group's other pods.
            pod.flags = {"nodeRank": pod.node_rank}
    engines = [p for p in pods if p.role != "router" and p.serves]
    # A lone engine serves on the public port, unless autoscaled: at zero, or while a
    # replica starts, the router in front holds the requests.
    alone = len(engines) == 1 and not autoscaled
    public = [p for p in pods if p.role == "router"] or (engines if alone else [])
    for pod in pods:
        if not pod.serves:
            continue
        pod.port = port if pod in public else free_port()
        pod.command += ["--host", "127.0.0.1", "--port", str(pod.port)]
    for pod in engines:
        pod.command += ["--model", str(model_dir)]
        if pod.role in ("prefill", "decode"):
            pod.command += ["--kv-host", "127.0.0.1", "--kv-port", "0"]
        if pod.role == "decode" and rendered.spec.gateway.inference_pool:
            # The prefill pods are processes here: the picker names them at 127.0.0.1.
            pod.command += ["--prefill-hosts", "127.0.0.1"]
        if rendered.kv_events:
            pod.command += ["--kv-events-port", "0"]
        tuning = rendered.tuning.roles[pod.role]
        # torch is imported (seconds) only when some pool asks for accelerators.
        if tuning.accelerated and not _cuda_available():
            pod.command += ["--device", "cpu"]
        pod.flags = {name: choice.value for name, choice in tuning.choices().items()}
    for pod in pods:
        if pod.role == "router" and rendered.spec.gateway.inference_pool:
            # The endpoint picker, for a local Envoy to try: a free port, shown in the table.
            epp_port = free_port()
            pod.command += ["--epp-port", str(epp_port)]
            pod.flags = {"eppPort": epp_port}
        if pod.role == "router" and rendered.kv_events:
            pod.command += ["--tokenizer", str(model_dir)]
        if pod.role == "router":
            # A unified pool's router balances it as the decode side.
            for role, behind in (("prefill", {"prefill"}), ("decode", {"decode", "unified"})):
                urls = [p.url for p in engines if p.role in behind]
                if urls:
                    pod.command += [f"--{role}", *urls]
    if not public:
        # Several unified replicas: a router in front balances whole requests over them.
        command = [*tidegate_command(), "router", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--decode", *(p.url for p in engines)]
        log = engines[0].log_path.with_name("balancer.log")
        pods.append(LocalPod("router", "balancer", command, port, log))
    if autoscaled or rendered.spec.canary():
        # The router's health checks find a started or drained replica within a second.
        for pod in pods:
            if pod.role == "router":
                pod.command += ["--health-interval", "1"]


@functools.cache
def _cuda_available() -> bool:
    """Whether the engine's interpreter sees a CUDA device.

    Asked in a child process: the operator's own process never imports torch (an import
    contract holds it to that), and the engine pods run in that interpreter anyway.
    """
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def resolve_model_dir(resource: dict[str, Any], given: Path | None) -> Path:
    """The local folder standing for the model source; UpError naming what is missing."""
    source = resource.get("spec", {}).get("model", {}).get("source", {})
    if given is not None:
        path = given
    elif "hostPath" in source:
        path = Path(source["hostPath"]["path"])
    else:
        kind = next(iter(source), "source")
        raise UpError(f"the model comes from a {kind}; give its local folder with --model-dir")
    if not (path / "config.json").is_file():
        raise UpError(f"model folder {path} not found (no config.json there); use --model-dir")
    return path


def warn_about_machine(pods: list[LocalPod]) -> list[str]:
    """What will run, but slowly or not as in the cluster, on this machine."""
    cores = available_cpus()
    warnings = []
    ranks = sum(
        int(p.flags.get("tensorParallelSize", 1))
        * int(p.flags.get("pipelineParallelSize", 1))
        * int(p.flags.get("dataParallelSizeLocal", 1))
        for p in pods
        if p.role != "router" and p.serves
    )
    if ranks > cores:
        warnings.append(
            f"{ranks} worker processes on {cores} cores: they will share the CPUs and run slowly"
        )
    if "--device" in {arg for p in pods for arg in p.command}:
        warnings.append("the resource asks for accelerators and this machine has no CUDA: CPU")
    return warnings


def units(pods: list[LocalPod]) -> list[list[LocalPod]]:
    """The pods as what starts and restarts together: a group's pods (leader first), or one."""
    out: list[list[LocalPod]] = []
    for pod in pods:
        if pod.group is not None and out and out[-1][0].group == pod.group:
            out[-1].append(pod)
        else:
            out.append([pod])
    return out


class Supervisor:
    """Starts the pods in order, restarts those that exit (a group's as a unit), stops them
    all on request."""

    def __init__(
        self, pods: list[LocalPod], startup_timeout_s: float = 300.0, drain_timeout_s: float = 60.0
    ) -> None:
        self.pods = pods
        self.startup_timeout_s = startup_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.error: str | None = None
        # Held while a process is launched: once stop() has it, nothing new starts.
        self._launching = threading.Lock()
        self._stopped = threading.Event()

    def run(self) -> None:
        """start(), set `ready`, watch(); on a thread of its own, which outlives the pods.

        Every pod is started on this thread (their parent-death signal is tied to it), and
        the thread ends only after stop() has stopped them in order.
        """
        try:
            self.start()
            self.ready.set()
            if self.error is None:
                self.watch()
        finally:
            self._stopped.wait()

    def start(self) -> None:
        """Start every pod and wait until each is ready (engines before the router); a
        group's pods all at once, then its leader is waited for (it is ready once they have
        joined it).

        A pod that exits or does not become ready sets `error`. Pods turned off (the
        replicas an autoscaled pool does not start with) are left for watch() to start.
        """
        for unit in units(self.pods):
            if not unit[0].active:
                continue
            with self._launching:
                if self.stopping.is_set():
                    return
                for pod in unit:
                    pod.start()
            leader = unit[0]
            assert leader.server is not None
            try:
                self._wait_healthy(unit)
            except RuntimeError as error:
                self.error = f"{leader.name} did not become ready: {error}"
                return

    def _wait_healthy(self, unit: list[LocalPod]) -> None:
        """Until the unit's leader answers /health; RuntimeError if any of its pods exits."""
        leader = unit[0]
        assert leader.server is not None
        if len(unit) == 1:
            leader.server.wait_healthy(self.startup_timeout_s)
            return
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            for pod in unit:
                code = pod.exited()
                if code is not None:
                    raise RuntimeError(
                        f"{pod.name} exited with code {container_exit_code(code)} (its log: "
                        f"{pod.log_path})"
                    )
            with contextlib.suppress(RuntimeError):  # not yet: look at the workers again
                leader.server.wait_healthy(1.0)
                return
        raise RuntimeError(f"not healthy within {self.startup_timeout_s:.0f} s")

    def watch(self, poll_s: float = 0.2) -> None:
        """Until stopped: restart exited pods with a doubling backoff, as the kubelet does;
        start the pods the autoscaler turned on, drain those it turned off."""
        while not self.stopping.wait(poll_s):
            now = time.monotonic()
            for unit in units(self.pods):
                if unit[0].group is not None:
                    with self._launching:
                        if self.stopping.is_set():
                            return
                        self._watch_group(unit, now)
                    continue
                pod = unit[0]
                # A draining pod's exit is the drain ending, not a crash, even when the pod
                # was turned on again meanwhile (the next canary on the canary pod): it
                # starts once the drain is over.
                if not pod.active or pod.server is None or pod.draining is not None:
                    self._follow_autoscaler(pod)
                    continue
                code = pod.exited()
                if code is None:
                    if now - pod.started_at > STABLE_S:
                        pod.backoff_s = BACKOFF_S
                    continue
                with self._launching:  # once stop() has had it, no exit is a crash
                    if self.stopping.is_set():
                        return
                    self._restart_after_backoff(pod, code, now)

    def _watch_group(self, group: list[LocalPod], now: float) -> None:
        """A group as LWS's RecreateGroupOnPodRestart runs it: once any of its pods exits, stop
        the others (the leader fails its requests, the workers exit without it), and after
        the backoff start them all again, on a fresh rendezvous port."""
        leader = group[0]
        exited = [(pod, code) for pod in group if (code := pod.exited()) is not None]
        if not exited and leader.restart_at is None:
            if now - leader.started_at > STABLE_S:
                leader.backoff_s = BACKOFF_S
            return
        if leader.restart_at is None:
            for pod, code in exited:
                logger.warning(
                    "%s (pid %s) exited with code %s", pod.name, pod.pid, container_exit_code(code)
                )
            for pod in group:
                if pod.server is not None and pod.exited() is None:
                    pod.server.stop(timeout=GROUP_STOP_S)
            leader.restart_at = now + leader.backoff_s
            logger.warning(
                "group %s stopped; restarting its %d pods in %.0f s",
                leader.group,
                len(group),
                leader.backoff_s,
            )
            leader.backoff_s = min(leader.backoff_s * 2, MAX_BACKOFF_S)
        elif now >= leader.restart_at:
            set_master_port(group)
            for pod in group:
                pod.restarts += 1
                pod.start()
                logger.info("%s restarted (pid %s)", pod.name, pod.pid)

    def _follow_autoscaler(self, pod: LocalPod) -> None:
        """Start a pod turned on (not before the last run has drained); drain one turned off."""
        with self._launching:
            if self.stopping.is_set():
                return
            if pod.active and pod.server is None and pod.draining is None:
                pod.start()
                pod.backoff_s = BACKOFF_S
                logger.info("%s started (pid %s)", pod.name, pod.pid)
            elif not pod.active and pod.server is not None and pod.draining is None:
                logger.info("%s draining (pid %s)", pod.name, pod.pid)
                pod.drain(self.drain_timeout_s)

    def _restart_after_backoff(self, pod: LocalPod, code: int, now: float) -> None:
        """At its exit, say so and when it restarts; once the backoff has passed, restart."""
        if pod.restart_at is None:
            pod.restart_at = now + pod.backoff_s
            logger.warning(
                "%s (pid %s) exited with code %s; restarting in %.0f s",
                pod.name,
                pod.pid,
                container_exit_code(code),
                pod.backoff_s,
            )
            pod.backoff_s = min(pod.backoff_s * 2, MAX_BACKOFF_S)
        elif now >= pod.restart_at:
            pod.restarts += 1
            pod.start()
            logger.info("%s restarted (pid %s)", pod.name, pod.pid)

    def stop(self) -> None:
        """Stop the router first, then the engines, a group's leader before its workers (it
        drains its requests while they still run); each with its whole session."""
        with self._launching:
            self.stopping.set()
        for pod in [pod for unit in reversed(units(self.pods)) for pod in unit]:
            if pod.draining is not None:
                pod.draining.join()
            if pod.server is not None:
                pod.server.stop(timeout=30.0)
            if pod.log is not None:
                pod.log.close()
        self._stopped.set()


def _start_autoscaler(
    spec: LLMDeploymentSpec, pods: list[LocalPod], port: int, stopping: threading.Event
) -> None:
    """The autoscaler of the spec's autoscaled pools, on a thread, until `stopping`."""
    from tidegate.operator.up_scaler import LocalAutoscaler, autoscaled_pools

    pools = autoscaled_pools(spec, pods)
    if not pools:
        return
    for pool in pools:
        logger.info(
            "autoscaler: %s runs %d of %d-%d replicas",
            pool.role,
            len(pool.active),
            pool.policy.min_replicas,
            pool.policy.max_replicas,
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per scrape
    scaler = LocalAutoscaler(pools, router_url=f"http://127.0.0.1:{port}")
    threading.Thread(target=scaler.run, args=(stopping,), name="up-autoscaler", daemon=True).start()


def _start_rollout(
    file: Path,
    resource: dict[str, Any],
    pods: list[LocalPod],
    spec: LLMDeploymentSpec,
    workdir: Path,
    stopping: threading.Event,
) -> None:
    """The canary of each change of the manifest's engine pods, on a thread, until `stopping`."""
    from tidegate.operator.up_rollout import LocalRollout

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per scrape
    config = LocalConfig(
        local_config_dir(workdir), workdir / "secrets", _local_cache(spec, workdir)
    )
    rollout = LocalRollout(file, resource, pods, config)
    threading.Thread(target=rollout.run, args=(stopping,), name="up-rollout", daemon=True).start()


def table(pods: list[LocalPod]) -> Iterator[str]:
    """The lines `tidegate up` prints: role, name, pid, URL, tuned flags."""
    yield f"{'ROLE':8} {'NAME':28} {'PID':>7}  {'URL':24} FLAGS"
    for pod in pods:
        flags = " ".join(f"{k}={v}" for k, v in pod.flags.items())
        url = pod.url if pod.serves else "-"
        yield f"{pod.role:8} {pod.name:28} {pod.pid or '-':>7}  {url:24} {flags}"


def adapter_watcher(
    file: Path,
    resource: dict[str, Any],
    spec: LLMDeploymentSpec,
    workdir: Path,
    claim_dirs: Mapping[str, Path] | None = None,
    started_from: tuple[int, str] | None = None,
) -> AdapterWatcher:
    """What follows spec.adapters in `file` into the adapters file plan() wrote in `workdir`;
    `started_from`: manifest_state(file) from before `resource` was read (None: now)."""
    local = local_adapters(spec, workdir, claim_dirs)
    adapters_path = local_config_dir(workdir) / ADAPTERS_KEY
    written = read_adapters_file(adapters_path)
    return AdapterWatcher(file, resource, local, adapters_path, written, started_from)


def _manifest_state_or_none(file: Path) -> tuple[int, str] | None:
    try:
        return manifest_state(file)
    except OSError:
        return None  # load_llm_deployments says what is wrong with the file


def run_up(
    file: str, model_dir: Path | None, port: int, claim_dirs: Mapping[str, Path] | None = None
) -> int:
    """The `tidegate up` command: 0 after SIGTERM/Ctrl-C, 1 when it cannot run the file."""
    try:
        # Before the read: a save while the engines start is then seen as one (adapter_watcher).
        started_from = _manifest_state_or_none(Path(file))
        resources = load_llm_deployments(file)
        if len(resources) != 1:
            raise UpError(f"{file} holds {len(resources)} LLMDeployments; up runs exactly one")
        resource = resources[0]
        model = resolve_model_dir(resource, model_dir)
        workdir = Path(tempfile.mkdtemp(prefix="tidegate-up-"))
        pods, spec = plan(resource, model, port, workdir, claim_dirs)
    except (SpecError, UpError) as error:
        print(f"tidegate up: {error}", flush=True)
        return 1
    for warning in warn_about_machine(pods):
        logger.warning("%s", warning)
    supervisor = Supervisor(pods)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.stopping.set())
    name = resource["metadata"]["name"]
    try:
        # The main thread only waits, so that it hears a stop signal at once.
        threading.Thread(target=supervisor.run, name="up-supervisor", daemon=True).start()
        while not supervisor.ready.is_set() and not supervisor.stopping.wait(0.1):
            pass
        if supervisor.stopping.is_set():
            return 0
        if supervisor.error is not None:
            print(f"tidegate up: {supervisor.error}\n(logs in {workdir})", flush=True)
            return 1
        print("\n".join(table(pods)), flush=True)
        print(f"{name}: serving on http://127.0.0.1:{port}/v1 (logs in {workdir})", flush=True)
        _start_autoscaler(spec, pods, port, supervisor.stopping)
        watcher = adapter_watcher(Path(file), resource, spec, workdir, claim_dirs, started_from)
        watcher.others_followed = spec.canary()
        threading.Thread(
            target=watcher.run, args=(supervisor.stopping,), name="up-adapters", daemon=True
        ).start()
        if spec.canary():
            _start_rollout(Path(file), resource, pods, spec, workdir, supervisor.stopping)
        while not supervisor.stopping.wait(1.0):
            pass
        return 0
    finally:
        supervisor.stop()
