"""spec.gateway and KV-event routing, as rendered: what a Gateway and the pods find.

With gateway.inferencePool an InferencePool (the Gateway API Inference Extension's CRD, in
tests/fixtures/gie/) selects the pods that answer clients and names the router's endpoint
picker; the router runs in unified mode too. Wherever a router runs, every engine publishes
its KV-cache events and the router, with the model folder mounted where the engines read it,
follows them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.test_render import (
    INFERENCE_POOLS,
    TABLE,
    admits,
    config_map,
    deployments,
    disaggregated,
    find,
    main_container,
    model,
    pod_labels,
    pod_spec,
    render_spec,
    resource,
    role_config,
    selects,
)
from tidegate.engine.config import EngineArgs, RouterArgs, ServerArgs
from tidegate.engine.entrypoints.args import load_config_file
from tidegate.operator.plan import write_table
from tidegate.operator.render import EPP_PORT, KV_EVENTS_PORT, Rendered, render
from tidegate.operator.up import plan_pods

UNIFIED_POOL = {"model": model(), "gateway": {"inferencePool": True}}
SPLIT_POOL = {
    "model": model(),
    "topology": disaggregated(),
    "gateway": {"inferencePool": True, "failureMode": "FailOpen"},
}
HOST_CACHE = {"hostPath": {"path": "/var/cache/tidegate"}}
PVC_CACHE = {"pvc": {"claimName": "model-cache"}}
URI = "https://models.example/llama.tar.gz"


def router_config(rendered: Rendered, tmp_path: Path) -> RouterArgs:
    """The router's file as `tidegate router --config` reads it: names and values checked."""
    path = tmp_path / "router.yaml"
    path.write_text(config_map(rendered)["data"]["router.yaml"], encoding="utf-8")
    return RouterArgs(**load_config_file(str(path), [RouterArgs]))


def engine_config(rendered: Rendered, role: str, tmp_path: Path) -> tuple[EngineArgs, ServerArgs]:
    """A role's file as `tidegate serve --config` reads it."""
    path = tmp_path / f"{role}.yaml"
    path.write_text(config_map(rendered)["data"][f"{role}.yaml"], encoding="utf-8")
    values = load_config_file(str(path), [EngineArgs, ServerArgs])
    return (
        EngineArgs(**{k: v for k, v in values.items() if k in EngineArgs.model_fields}),
        ServerArgs(**{k: v for k, v in values.items() if k in ServerArgs.model_fields}),
    )


# --- the InferencePool ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "role", "failure_mode"),
    [(UNIFIED_POOL, "unified", "FailClose"), (SPLIT_POOL, "decode", "FailOpen")],
    ids=["unified", "disaggregated"],
)
def test_the_pool_selects_the_pods_answering_clients_and_names_the_routers_picker(
    spec: dict[str, Any], role: str, failure_mode: str
) -> None:
    rendered = render_spec(spec)
    pool = find(rendered, "InferencePool", "llm")
    assert INFERENCE_POOLS.validate(pool) == []
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "LLMDeployment"
    # The pods: exactly those of the pool that answers clients, on their http port.
    selected = [
        d["metadata"]["name"]
        for d in deployments(rendered) + deployments(render_spec(spec, name="other"))
        if selects(pool["spec"]["selector"], pod_labels(d))
    ]
    assert selected == ["llm" if role == "unified" else "llm-decode"]
    engine = main_container(find(rendered, "Deployment", selected[0]))
    (http,) = [p for p in engine["ports"] if p["name"] == "http"]
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    # The picker: a Service port that reaches the router pods' gRPC port.
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["failureMode"] == failure_mode
    assert (picker["group"], picker["kind"], picker["name"]) == ("", "Service", "llm-epp")
    service = find(rendered, "Service", "llm-epp")
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    router = find(rendered, "Deployment", "llm-router")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(router))
    named = {p["name"]: p["containerPort"] for p in main_container(router)["ports"]}
    assert named[port["targetPort"]] == EPP_PORT
    assert port["appProtocol"] == "kubernetes.io/h2c"


def test_the_picker_stays_inside_the_cluster_whatever_the_public_service() -> None:
    rendered = render_spec(UNIFIED_POOL | {"service": {"type": "LoadBalancer", "port": 443}})
    assert find(rendered, "Service", "llm")["spec"]["type"] == "LoadBalancer"
    epp = find(rendered, "Service", "llm-epp")
    assert epp["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in find(rendered, "Service", "llm")["spec"]["ports"]] == [443]


def test_the_pool_fails_closed_unless_told_otherwise() -> None:
    pool = find(render_spec(UNIFIED_POOL), "InferencePool", "llm")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


def test_a_unified_pool_gets_a_router_of_as_many_replicas_as_asked() -> None:
    rendered = render_spec(TABLE["gateway-unified-two-routers"])
    assert find(rendered, "Deployment", "llm-router")["spec"]["replicas"] == 2
    assert find(rendered, "Deployment", "llm")["spec"]["replicas"] == 3
    # As for a pool that may reach zero: clients of the Service go through the router too.
    public = find(rendered, "Service", "llm")
    assert selects(
        {"matchLabels": public["spec"]["selector"]},
        pod_labels(find(rendered, "Deployment", "llm-router")),
    )
    assert find(rendered, "Service", "llm-unified")["spec"]["clusterIP"] == "None"
    assert find(rendered, "PodDisruptionBudget", "llm-router")
    # Without a router of its own, one replica.
    assert find(render_spec(UNIFIED_POOL), "Deployment", "llm-router")["spec"]["replicas"] == 1


def test_without_the_pool_nothing_of_the_gateway_is_rendered(tmp_path: Path) -> None:
    for spec in ({"model": model()}, {"model": model(), "topology": disaggregated()}):
        rendered = render_spec(spec)
        kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
        assert ("InferencePool", "llm") not in kinds and ("Service", "llm-epp") not in kinds
    rendered = render_spec({"model": model(), "topology": disaggregated()})
    assert router_config(rendered, tmp_path).epp_port is None
    router_ports = [
        p["name"] for p in main_container(find(rendered, "Deployment", "llm-router"))["ports"]
    ]
    assert router_ports == ["http"]
    for role in ("prefill", "decode"):
        assert engine_config(rendered, role, tmp_path)[1].prefill_via_header is False
    # A unified pool without the gateway or a policy to zero keeps no router.
    assert not [
        d for d in deployments(render_spec({"model": model()})) if "router" in d["metadata"]["name"]
    ]


def test_plan_lists_the_pool_and_the_pickers_service() -> None:
    out = io.StringIO()
    rendered = render_spec(UNIFIED_POOL)
    write_table([resource(UNIFIED_POOL)], [rendered], out)
    rows = [line.split() for line in out.getvalue().splitlines()]
    assert ["InferencePool", "llm"] in rows
    assert ["Service", "llm-epp"] in rows


# --- the config files -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "roles"),
    [(UNIFIED_POOL, ["unified"]), (SPLIT_POOL, ["prefill", "decode"])],
    ids=["unified", "disaggregated"],
)
def test_engines_publish_kv_events_speak_vllm_metrics_and_decode_prefills_via_header(
    spec: dict[str, Any], roles: list[str], tmp_path: Path
) -> None:
    rendered = render_spec(spec)
    for role in roles:
        engine, server = engine_config(rendered, role, tmp_path)
        assert engine.kv_events_port == KV_EVENTS_PORT
        # The extension's pickers read vLLM's metric names.
        assert server.metrics_compat == "vllm"
        assert server.prefill_via_header is (role == "decode")
        # Only this resource's prefill pods (its headless Service's) may be named.
        wanted = ["llm-prefill.ml.svc"] if role == "decode" else []
        assert server.prefill_hosts == wanted


def test_the_router_serves_the_picker_and_follows_the_kv_events(tmp_path: Path) -> None:
    for spec in (UNIFIED_POOL, SPLIT_POOL):
        rendered = render_spec(spec)
        router = router_config(rendered, tmp_path)
        assert router.epp_port == EPP_PORT
        assert router.kv_events_port == KV_EVENTS_PORT
        # The tokenizer is the model folder as the engines see it.
        engine_role = "unified" if "unified" in rendered.tuning.roles else "decode"
        assert router.tokenizer == role_config(rendered, engine_role)["model"]


@pytest.mark.parametrize(
    "spec",
    [
        {"model": model(), "topology": disaggregated()},
        {
            "model": model(),
            "topology": {"router": {"replicas": 1}},
            "autoscaling": {"unified": {"minReplicas": 0, "maxReplicas": 2}},
        },
    ],
    ids=["disaggregated", "unified-to-zero"],
)
def test_any_router_routes_by_kv_events_gateway_or_not(
    spec: dict[str, Any], tmp_path: Path
) -> None:
    rendered = render_spec(spec)
    router = router_config(rendered, tmp_path)
    assert (router.kv_events_port, router.tokenizer) == (KV_EVENTS_PORT, "/model")
    assert router.epp_port is None
    for role in rendered.tuning.roles:
        assert engine_config(rendered, role, tmp_path)[0].kv_events_port == KV_EVENTS_PORT


def test_without_a_router_the_engines_publish_nothing(tmp_path: Path) -> None:
    rendered = render_spec({"model": model()})
    assert engine_config(rendered, "unified", tmp_path)[0].kv_events_port is None
    ports = main_container(find(rendered, "Deployment", "llm"))["ports"]
    assert [p["name"] for p in ports] == ["http"]


# --- the pods ---------------------------------------------------------------------------------


def model_mounts(container: dict[str, Any]) -> list[dict[str, Any]]:
    """The container's mounts of the model folder or the cache it is in."""
    return [m for m in container["volumeMounts"] if m["name"] in ("model", "model-cache")]


def volumes_named(deployment: dict[str, Any], names: set[str]) -> list[dict[str, Any]]:
    return [v for v in pod_spec(deployment)["volumes"] if v["name"] in names]


@pytest.mark.parametrize(
    "source",
    [
        model(),
        model({"pvc": {"claimName": "models", "path": "/llama/3b/"}}),
        model({"pvc": {"claimName": "models"}}, cache=HOST_CACHE),
        model({"uri": URI}, cache=HOST_CACHE),
        model({"uri": URI}, cache=PVC_CACHE),
    ],
    ids=["host-path", "pvc-path", "pvc-and-cache", "uri-host-cache", "uri-pvc-cache"],
)
def test_the_router_mounts_the_model_read_only_where_the_engines_read_it(
    source: dict[str, Any], tmp_path: Path
) -> None:
    rendered = render_spec(
        {"model": source, "topology": disaggregated(), "gateway": {"inferencePool": True}}
    )
    router = find(rendered, "Deployment", "llm-router")
    engine = find(rendered, "Deployment", "llm-decode")
    tokenizer = router_config(rendered, tmp_path).tokenizer
    assert tokenizer == role_config(rendered, "decode")["model"]
    mounts = model_mounts(main_container(router))
    assert mounts and all(m.get("readOnly") for m in mounts)
    # The folder is under one of them, by the same volume as in the engine pods.
    (holding,) = [m for m in mounts if tokenizer.startswith(m["mountPath"])]
    names = {m["name"] for m in mounts}
    assert volumes_named(router, names) == volumes_named(engine, names)
    engine_mount = next(
        m for m in model_mounts(main_container(engine)) if m["name"] == holding["name"]
    )
    assert holding.get("subPath") == engine_mount.get("subPath")
    assert holding["mountPath"] == engine_mount["mountPath"]
    # A fetched model: the router joins the engines' shared fetch (one download in all),
    # with a writable mount of its own for it.
    engine_fetch = [
        c for c in pod_spec(engine).get("initContainers", []) if c["name"] == "fetch-model"
    ]
    router_inits = pod_spec(router).get("initContainers", [])
    if "uri" in source["source"]:
        (fetch,) = router_inits
        (engine_fetch_container,) = engine_fetch
        assert fetch["args"] == engine_fetch_container["args"]
        assert "--shared" in fetch["args"]
        assert fetch["volumeMounts"] == engine_fetch_container["volumeMounts"]
    else:
        assert router_inits == []
    # A shared claim is not chowned again at every start, router pods included.
    policy = pod_spec(router)["securityContext"].get("fsGroupChangePolicy")
    assert policy == ("OnRootMismatch" if "pvc" in source.get("cache", {}) else None)


def test_a_uri_model_without_a_cache_keeps_kv_routing_off(tmp_path: Path) -> None:
    """Each engine pod fetches its own copy: a router pod would download every weight."""
    rendered = render_spec(
        {
            "model": model({"uri": URI}),
            "topology": disaggregated(),
            "gateway": {"inferencePool": True},
        }
    )
    router = find(rendered, "Deployment", "llm-router")
    assert model_mounts(main_container(router)) == []
    assert "initContainers" not in pod_spec(router)
    config = router_config(rendered, tmp_path)
    assert (config.kv_events_port, config.tokenizer) == (None, None)
    assert config.epp_port == EPP_PORT  # the picker serves all the same
    for role in ("prefill", "decode"):
        assert engine_config(rendered, role, tmp_path)[0].kv_events_port is None
    policy = find(rendered, "NetworkPolicy", "llm-kv")
    assert len(policy["spec"]["ingress"]) == 2  # http, and KV transfer from decode pods


def test_engine_pods_declare_the_events_port_and_only_the_router_reads_a_prefill_pods() -> None:
    rendered = render_spec(SPLIT_POOL)
    other = render_spec(SPLIT_POOL, name="other")
    labels = {d["metadata"]["name"]: pod_labels(d) for d in deployments(rendered)}
    for name in ("llm-prefill", "llm-decode"):
        ports = main_container(find(rendered, "Deployment", name))["ports"]
        assert {"name": "cache-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"} in ports
    policy = find(rendered, "NetworkPolicy", "llm-kv")
    prefill = find(rendered, "Deployment", "llm-prefill")
    assert admits(policy, prefill, KV_EVENTS_PORT, labels["llm-router"])
    other_router = pod_labels(find(other, "Deployment", "other-router"))
    for source in (labels["llm-decode"], labels["llm-prefill"], other_router, None):
        assert not admits(policy, prefill, KV_EVENTS_PORT, source)
    assert not admits(policy, prefill, KV_EVENTS_PORT, labels["llm-router"], same_namespace=False)


@pytest.mark.parametrize("spec,role", [(UNIFIED_POOL, "unified"), (SPLIT_POOL, "decode")])
def test_only_the_router_reads_the_events_of_the_pods_answering_clients(
    spec: dict[str, Any], role: str
) -> None:
    rendered = render_spec(spec)
    other = render_spec(spec, name="other")
    name = "llm" if role == "unified" else f"llm-{role}"
    engine = find(rendered, "Deployment", name)
    policy = find(rendered, "NetworkPolicy", "llm-cache-events")
    router = pod_labels(find(rendered, "Deployment", "llm-router"))
    assert admits(policy, engine, KV_EVENTS_PORT, router)
    assert not admits(policy, engine, KV_EVENTS_PORT, router, same_namespace=False)
    other_router = pod_labels(find(other, "Deployment", "other-router"))
    for source in (pod_labels(engine), other_router, None):
        assert not admits(policy, engine, KV_EVENTS_PORT, source)
    # http stays open to clients, probes and scrapers wherever they run.
    for source in (router, other_router, None):
        assert admits(policy, engine, 8000, source, same_namespace=False)
    # The policy selects only this resource's pods of that role.
    assert admits(policy, find(rendered, "Deployment", "llm-router"), KV_EVENTS_PORT, None)
    if role == "decode":
        prefill = find(rendered, "Deployment", "llm-prefill")
        assert admits(policy, prefill, KV_EVENTS_PORT, None)  # that is `llm-kv`'s business


def test_no_events_no_events_policy() -> None:
    plain = {"model": model(), "topology": {"mode": "unified", "unified": {"replicas": 2}}}
    assert not [o for o in render_spec(plain).objects if o["kind"] == "NetworkPolicy"]
    uri_no_cache = {"model": model(source={"uri": URI}), "gateway": {"inferencePool": True}}
    rendered = render_spec(uri_no_cache)
    assert not [o for o in rendered.objects if o["kind"] == "NetworkPolicy"]


def hashes(spec: dict[str, Any]) -> dict[str, str]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"][
            "tidegate.dev/spec-hash"
        ]
        for d in deployments(render_spec(spec))
    }


def test_turning_the_pool_on_rolls_the_router_and_decode_pods_not_prefill() -> None:
    before = hashes({"model": model(), "topology": disaggregated()})
    after = hashes(SPLIT_POOL)
    assert before["llm-prefill"] == after["llm-prefill"]
    assert before["llm-decode"] != after["llm-decode"]  # prefill_via_header
    assert before["llm-router"] != after["llm-router"]  # the picker's port


def test_failure_mode_rolls_no_pod() -> None:
    fail_close = SPLIT_POOL | {"gateway": {"inferencePool": True, "failureMode": "FailClose"}}
    assert hashes(fail_close) == hashes(SPLIT_POOL)


# --- tidegate up ------------------------------------------------------------------------------


def test_up_runs_the_picker_and_each_engines_events_on_free_ports(tmp_path: Path) -> None:
    """Local pods share one address: each engine publishes on a port of its own, which its
    /metrics names, and the router reads the local model's tokenizer."""
    example = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples" / "gateway-tiny.yaml").read_text()
    )
    pods = plan_pods(example, Path("/m"), 9000, tmp_path)
    routers = [p for p in pods if p.role == "router"]
    assert len(routers) == 2
    for router in routers:
        (epp,) = [router.command[i + 1] for i, a in enumerate(router.command) if a == "--epp-port"]
        assert router.flags == {"eppPort": int(epp)}
        assert router.command[router.command.index("--tokenizer") + 1] == "/m"
    engines = [p for p in pods if p.role == "unified"]
    assert len(engines) == 2
    for engine in engines:
        assert engine.command[engine.command.index("--kv-events-port") + 1] == "0"
    # The command line overrides the files' pod values (the port all pods share, /model).
    assert yaml.safe_load((tmp_path / "config" / "unified.yaml").read_text())["kv-events-port"]
    assert yaml.safe_load((tmp_path / "config" / "router.yaml").read_text())["tokenizer"]


def test_up_lets_decode_pods_name_the_local_prefill_processes(tmp_path: Path) -> None:
    pods = plan_pods(resource(SPLIT_POOL), Path("/m"), 9000, tmp_path)
    (decode,) = [p for p in pods if p.role == "decode"]
    assert decode.command[decode.command.index("--prefill-hosts") + 1] == "127.0.0.1"
    assert all("--prefill-hosts" not in p.command for p in pods if p.role != "decode")


def test_the_example_renders_a_pool_of_two_unified_pods_and_two_pickers() -> None:
    example = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples" / "gateway-tiny.yaml").read_text()
    )
    example["metadata"]["uid"] = "uid-gw"
    rendered = render(example)
    pool = find(rendered, "InferencePool", "tiny-gateway")
    assert INFERENCE_POOLS.validate(pool) == []
    assert find(rendered, "Deployment", "tiny-gateway")["spec"]["replicas"] == 2
    assert find(rendered, "Deployment", "tiny-gateway-router")["spec"]["replicas"] == 2
