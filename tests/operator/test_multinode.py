"""A pool whose replicas span nodes, without a cluster: what is rendered (a LeaderWorkerSet of
leader and worker pods, Services on the leaders), what `tidegate plan` says of it, how its
status and changes are read, and what `tidegate up` runs for it (process groups that meet over
TCP as the pods would). The operator end to end is test_multinode_e2e.py; the supervisor's
group restarts, with real processes, test_up_groups_e2e.py."""

from __future__ import annotations

import copy
import io
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.test_render import (
    LEADER_WORKER_SETS,
    assert_valid,
    find,
    model,
    render_spec,
    role_config,
)
from tidegate.engine.config import EngineArgs
from tidegate.operator import up
from tidegate.operator.labels import COMPONENT_LABEL, selector_labels
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.plan import write_table
from tidegate.operator.render import (
    LWS_API_VERSION,
    MASTER_PORT,
    SPEC_HASH,
    WORKER_INDEX_LABEL,
    Rendered,
)
from tidegate.operator.rollout import role_changes, rollout_steps
from tidegate.operator.status import role_state
from tidegate.operator.up import plan_pods, set_master_port, table, units, warn_about_machine

REPO = Path(__file__).resolve().parents[2]
CPU_TWO_NODES = {
    "model": model(dtype="float32"),
    "parallelism": {"pipelineParallelSize": 2, "nodesPerReplica": 2},
    "topology": {"unified": {"replicas": 3}},
}
GPU_405B = {
    "model": model(parameterCount=405e9, numKeyValueHeads=8, numAttentionHeads=128),
    "accelerator": {"perNode": 8, "memoryGiB": 80},
}
LEADER_ARGS = [
    "serve",
    "--config",
    "/etc/tidegate/unified.yaml",
    "--node-rank",
    "0",
    "--master-addr",
    "$(LWS_LEADER_ADDRESS)",
    "--master-port",
    str(MASTER_PORT),
]
WORKER_ARGS = [
    "serve",
    "--config",
    "/etc/tidegate/unified.yaml",
    "--nnodes",
    "$(LWS_GROUP_SIZE)",
    "--node-rank",
    "$(LWS_WORKER_INDEX)",
    "--master-addr",
    "$(LWS_LEADER_ADDRESS)",
    "--master-port",
    str(MASTER_PORT),
]


def group_set(rendered: Rendered, name: str = "llm") -> dict[str, Any]:
    return find(rendered, "LeaderWorkerSet", name)


def templates(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    group = lws["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"], group["workerTemplate"]


def engine(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


# --- what is rendered ---------------------------------------------------------------------


def test_a_replica_over_nodes_is_a_group_of_a_leader_and_workers() -> None:
    rendered = render_spec(CPU_TWO_NODES)
    assert not [obj for obj in rendered.objects if obj["kind"] == "Deployment"]
    lws = group_set(rendered)
    assert lws["apiVersion"] == LWS_API_VERSION
    spec = lws["spec"]
    assert spec["replicas"] == 3
    # Workers start beside their leader: it is ready only once they have joined it.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    # A Service per group: the shared one would be named as the role's own Service.
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = templates(lws)
    assert engine(leader)["args"] == LEADER_ARGS
    assert engine(worker)["args"] == WORKER_ARGS
    assert rendered.grouped == frozenset({"unified"})


def test_only_the_leader_listens_on_http_and_is_probed() -> None:
    leader, worker = templates(group_set(render_spec(CPU_TWO_NODES)))
    ports = {port["name"]: port["containerPort"] for port in engine(leader)["ports"]}
    assert ports == {"http": 8000, "dist": MASTER_PORT, "dist-control": MASTER_PORT + 1}
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(engine(leader))
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(engine(worker))


def test_both_templates_keep_the_pod_security_and_the_models_volume() -> None:
    spec = {**CPU_TWO_NODES, "auth": {"apiKeySecretRef": {"name": "k", "key": "api-key"}}}
    leader, worker = templates(group_set(render_spec(spec)))
    for template in (leader, worker):
        pod = template["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        container = engine(template)
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert {"/dev/shm", "/model", "/tmp", "/etc/tidegate"} <= mounts
        # Every node loads its own stages' weights, from the same path as the leader's.
        assert volumes["model"]["hostPath"]["path"] == "/models/t"
    assert leader["metadata"] == worker["metadata"]
    assert leader["metadata"]["labels"][COMPONENT_LABEL] == "unified"
    assert SPEC_HASH in leader["metadata"]["annotations"]


def test_every_pod_of_a_gpu_group_requests_its_nodes_share() -> None:
    rendered = render_spec(GPU_405B)
    for template in templates(group_set(rendered)):
        resources = engine(template)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "8"
    config = role_config(rendered, "unified")
    assert (config["tensor-parallel-size"], config["pipeline-parallel-size"]) == (8, 2)
    assert config["nnodes"] == 2
    assert config["data-parallel-size-local"] == 1


def test_the_leaders_config_and_flags_are_what_the_engine_takes() -> None:
    rendered = render_spec(GPU_405B)
    text = next(o for o in rendered.objects if o["kind"] == "ConfigMap")["data"]["unified.yaml"]
    lines = text.splitlines()
    for flag, field in (
        ("pipeline-parallel-size", "pipelineParallelSize"),
        ("nnodes", "nodesPerReplica"),
    ):
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{flag}:")]
        reason = rendered.tuning.roles["unified"].choices()[field].reason
        assert lines[at - 1] == f"# {reason}"
    values = {k.replace("-", "_"): v for k, v in yaml.safe_load(text).items()}
    engine_values = {k: v for k, v in values.items() if k in EngineArgs.model_fields}
    # The leader's command line, and a worker's: the same file, its own rank.
    address = {"master_addr": "llm-0.llm-0.ml", "master_port": MASTER_PORT}
    EngineArgs(**engine_values, node_rank=0, **address)
    EngineArgs(**{**engine_values, "nnodes": 2}, node_rank=1, **address)


def test_a_replica_on_one_node_renders_as_before() -> None:
    """No pipeline or node flags in its file, so its pods' spec hash does not move."""
    config = role_config(render_spec({"model": model()}), "unified")
    assert not {"pipeline-parallel-size", "nnodes", "node-rank"} & set(config)
    rendered = render_spec({"model": model(), "parallelism": {"pipelineParallelSize": 2}})
    assert rendered.grouped == frozenset()
    assert role_config(rendered, "unified")["pipeline-parallel-size"] == 2


def test_services_and_the_inference_pool_select_the_leaders_and_the_budget_every_pod() -> None:
    spec = {
        **CPU_TWO_NODES,
        "topology": {"unified": {"replicas": 2}, "router": {"replicas": 1}},
        "gateway": {"inferencePool": True},
    }
    rendered = render_spec(spec)
    leaders = {**selector_labels("llm", "unified"), WORKER_INDEX_LABEL: "0"}
    assert find(rendered, "Service", "llm-unified")["spec"]["selector"] == leaders
    assert find(rendered, "InferencePool", "llm")["spec"]["selector"]["matchLabels"] == leaders
    router = find(rendered, "Service", "llm")["spec"]["selector"]
    assert router == selector_labels("llm", "router")
    # A drain takes one pod at a time, and with it its group: one group down at a time.
    budget = find(rendered, "PodDisruptionBudget", "llm")["spec"]
    assert budget == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": selector_labels("llm", "unified")},
    }


def test_the_events_policy_lets_a_groups_pods_reach_each_other() -> None:
    spec = {
        **CPU_TWO_NODES,
        "topology": {"router": {"replicas": 1}},
        "gateway": {"inferencePool": True},
    }
    policy = find(render_spec(spec), "NetworkPolicy", "llm-cache-events")["spec"]
    peers = {"podSelector": {"matchLabels": selector_labels("llm", "unified")}}
    # The rendezvous, the control channel and the ports torch.distributed picks itself.
    assert {"from": [peers]} in policy["ingress"]
    one_node = find(render_spec({**spec, "parallelism": {}}), "NetworkPolicy", "llm-cache-events")
    assert {"from": [peers]} not in one_node["spec"]["ingress"]


def test_the_group_set_is_checked_strictly_against_lws_crd() -> None:
    lws = copy.deepcopy(group_set(render_spec(GPU_405B)))
    assert LEADER_WORKER_SETS.validate(lws) == []
    lws["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    assert LEADER_WORKER_SETS.validate(lws) == ['unknown field "spec.leaderWorkerTemplate.sizes"']


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_the_multinode_example_renders_what_kubernetes_and_lws_accept(version: str) -> None:
    (example,) = load_llm_deployments(REPO / "examples" / "multinode-tiny.yaml")
    example["metadata"]["uid"] = "uid"
    assert_valid(render_spec(example["spec"]).objects, version)


def test_plan_says_why_two_nodes_and_how_the_group_runs() -> None:
    out = io.StringIO()
    resource = {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llama-405b"},
        "spec": GPU_405B,
    }
    rendered = render_spec(GPU_405B, name="llama-405b")
    write_table([resource], [rendered], out)
    text = out.getvalue()
    assert "LeaderWorkerSet      llama-405b" in text
    assert "Deployment" not in text
    assert "TP 8 x PP 2 = 16 ranks, 8 per node of accelerator.perNode 8" in text
    assert "each replica a group of 2 pods, one per node (LeaderWorkerSet)" in text


# --- status and changes -------------------------------------------------------------------


def lws_live(*, replicas: int, updated: int, ready: int, generation: int = 2) -> dict[str, Any]:
    return {
        "kind": "LeaderWorkerSet",
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "updatedReplicas": updated,
            "readyReplicas": ready,
        },
    }


def test_status_counts_ready_groups() -> None:
    state = role_state("unified", 2, lws_live(replicas=2, updated=2, ready=1), group_size=2)
    assert (state.updated, state.ready, state.done) == (2, 1, False)
    assert state.units(2) == "2 groups of 2 pods"
    rolling = role_state("unified", 2, lws_live(replicas=3, updated=1, ready=3), group_size=2)
    assert (rolling.ready, rolling.old) == (1, 2)
    done = role_state("unified", 2, lws_live(replicas=2, updated=2, ready=2), group_size=2)
    assert done.done


def test_becoming_or_ceasing_to_be_a_group_set_replaces_the_pool() -> None:
    one_node = {**CPU_TWO_NODES, "parallelism": {}}
    (change,) = role_changes(render_spec(one_node), render_spec(CPU_TWO_NODES))
    assert change.kind == "replaced"
    assert "the Deployment becomes a LeaderWorkerSet" in change.describe()
    assert "with no surge between the two kinds" in change.describe()
    steps = rollout_steps("llm", render_spec(CPU_TWO_NODES), render_spec(one_node))
    assert steps == [
        "llm is replaced (the LeaderWorkerSet becomes a Deployment): the old pods stop as the "
        "new ones start, with no surge between the two kinds"
    ]
    image = {**CPU_TWO_NODES, "image": "r.example/engine:2"}
    (rolls,) = role_changes(render_spec(CPU_TWO_NODES), render_spec(image))
    assert (rolls.kind, rolls.pod_parts) == ("rolls", ["image"])


# --- tidegate up ----------------------------------------------------------------------------


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def up_pods(tmp_path: Path, replicas: int = 2) -> list:
    (example,) = load_llm_deployments(REPO / "examples" / "multinode-tiny.yaml")
    example["spec"]["topology"]["unified"]["replicas"] = replicas
    return plan_pods(example, Path("/m"), 9000, tmp_path)


def test_up_runs_each_replica_as_a_group_that_meets_at_127_0_0_1(tmp_path: Path) -> None:
    pods = up_pods(tmp_path)
    names = [pod.name for pod in pods]
    assert names == [
        "tiny-multinode-0",
        "tiny-multinode-0-1",
        "tiny-multinode-1",
        "tiny-multinode-1-1",
        "balancer",
    ]
    groups = units(pods)
    assert [[pod.name for pod in unit] for unit in groups][:2] == [names[:2], names[2:4]]
    ports = set()
    for leader, worker in groups[:2]:
        assert (leader.serves, worker.serves) == (True, False)
        assert flag(leader.command, "--node-rank") == "0"
        assert flag(worker.command, "--node-rank") == "1"
        assert flag(worker.command, "--nnodes") == "2"
        assert flag(leader.command, "--master-addr") == flag(worker.command, "--master-addr")
        assert flag(worker.command, "--master-addr") == "127.0.0.1"
        port = flag(leader.command, "--master-port")
        assert flag(worker.command, "--master-port") == port
        ports.add(port)
        # Only the leader serves: a port of its own, the model, the config file.
        assert flag(leader.command, "--model") == "/m"
        assert Path(flag(leader.command, "--config")).is_file()
        assert "--port" not in worker.command and "--model" not in worker.command
        assert flag(worker.command, "--config") == flag(leader.command, "--config")
    assert len(ports) == 2  # a rendezvous of its own for each group
    balancer = pods[-1]
    assert balancer.port == 9000
    assert balancer.command[balancer.command.index("--decode") + 1 :][:2] == [
        groups[0][0].url,
        groups[1][0].url,
    ]


def test_a_restarted_group_meets_on_a_free_pair_of_ports(tmp_path: Path) -> None:
    leader, worker = units(up_pods(tmp_path, replicas=1))[0]
    port = set_master_port([leader, worker])
    assert flag(leader.command, "--master-port") == flag(worker.command, "--master-port")
    assert flag(worker.command, "--master-port") == str(port)
    for taken in (port, port + 1):  # the rendezvous, and the leader's control channel
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", taken))


def test_up_shows_workers_without_a_url_and_counts_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = up_pods(tmp_path, replicas=1)
    lines = list(table(pods))
    (worker_line,) = [line for line in lines if "tiny-multinode-0-1" in line]
    assert " - " in worker_line and "nodeRank=1" in worker_line
    (leader_line,) = [line for line in lines if line.split()[1] == "tiny-multinode-0"]
    assert "pipelineParallelSize=2" in leader_line and "nodesPerReplica=2" in leader_line
    monkeypatch.setattr(up, "available_cpus", lambda: 4)
    assert warn_about_machine(pods) == []  # one replica: 2 ranks, a stage per process
    many = up_pods(tmp_path, replicas=4)
    assert warn_about_machine(many) == [
        "8 worker processes on 4 cores: they will share the CPUs and run slowly"
    ]
