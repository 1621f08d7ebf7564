"""What should exist for one LLMDeployment: a pure function from the resource to objects.

No I/O here (but the operator's hostPath allow-list, which looks for links where the operator
can see them: `operator/host_paths.py`): the handlers apply what `render` returns, `tidegate
plan` prints it, and the tests validate it against the upstream Kubernetes schemas.

Unified: ConfigMap, Deployment, Service, PodDisruptionBudget; when its policy lets the pool
reach zero, a router Deployment in front (balancing, and holding requests at zero) behind the
public Service, the engines behind a headless Service `<name>-unified`, and a
PodDisruptionBudget for the router too. Disaggregated: ConfigMap,
prefill and decode Deployments behind headless Services (the router resolves their pods),
a router Deployment behind the public Service, a PodDisruptionBudget per Deployment, and a
NetworkPolicy `<name>-kv` that lets only the decode pods reach the prefill pods' KV ports.
Unless topology.kvEncryption is none, both pools also mount the Secret `<name>-kv-curve`, the
key pair that encrypts the KV transfer; render only describes it (`Rendered.kv_keys`), and the
reconcile creates it once with a fresh pair (operator/kv_keys.py): a pure render has no keys.
Wherever a router runs, the engines publish their KV-cache events and the router, which
mounts the model read-only to tokenize prompts as they do, routes each request to the engine
holding most of its prefix; a NetworkPolicy (`<name>-cache-events` for unified or decode
pods, `<name>-kv` for prefill pods) admits only the router to the events port. With
gateway.inferencePool, also an InferencePool (Gateway API
Inference Extension) of the pods that answer clients, whose endpoint picker is the router
(gRPC on the ClusterIP Service `<name>-epp`); a unified pool then gets a router too.
Every engine pod runs `tidegate serve --config /etc/tidegate/<role>.yaml`, the file being
that role's key of the ConfigMap: engine flags by their CLI names, each tuned one
commented with its reason. With spec.adapters, every role's file turns LoRA on and names
`/etc/tidegate/adapters.yaml`, the ConfigMap's list of adapters, which the engines read again
when it changes; it stays out of the pods' spec hash, so an adapter whose folder the pods
already mount comes and goes without a restart (`adapter_layout` says where each one is).
spec.lora's limits, by contrast, are flags of every role's file: changing one rolls the pods.
A pool whose replicas span several nodes (tuning's nodesPerReplica above 1) is a
LeaderWorkerSet instead of a Deployment: one group of pods per replica, the leader serving
HTTP and the others running only their worker ranks; the pool's Services and InferencePool
select the leaders alone (docs/multinode.md).
With `autoscaling.driver` keda or hpa, each autoscaled pool also gets a KEDA ScaledObject or
an HPA (`operator/render_scalers.py`). An autoscaled pool's
Deployment carries its starting replicas, for its creation only: its driver (the operator's
autoscaler, KEDA or the HPA controller) sets them from then on, and `Rendered.scaled` names
it so that the reconcile leaves them alone.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from tidegate.engine.config import EngineArgs, RouterArgs, ServerArgs, kv_port_layout
from tidegate.operator.autoscaler import starting_replicas
from tidegate.operator.host_paths import HostPathPolicy
from tidegate.operator.labels import child_labels, selector_labels
from tidegate.operator.render_scalers import scaler_objects
from tidegate.operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    AdapterSpec,
    LLMDeploymentSpec,
    SecretKeyRef,
    SpecError,
    parse_spec,
)
from tidegate.operator.tuning import DTYPE_BYTES, MeasuredChunks, RoleTuning, Tuning, tune

DEFAULT_ENGINE_IMAGE = "ghcr.io/tidegate/engine:0.1.0"
ENGINE_PORT = 8000
# Engines publish their KV-cache events (blocks stored and removed) here, for the router;
# vLLM's port for them. The same in every pod, each at its own address: the router is given
# it too, for an engine whose /metrics does not name its port.
KV_EVENTS_PORT = 5557
# The router's endpoint picker for gateway.inferencePool: Envoy's ext_proc gRPC service and
# gRPC health, on the port the Gateway API Inference Extension's own picker uses.
EPP_PORT = 9002
EPP_PORT_NAME = "grpc-epp"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
# A pool whose replicas span nodes: LeaderWorkerSet (kubernetes-sigs/lws), one group per replica.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
# The label LWS's pod webhook puts on every pod of a group: "0" on the leader.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# What LWS's webhook puts in every container of a group: the leader's DNS name, the group's
# pods, and this pod's index in it (0: the leader). Kubernetes expands $(NAME) in args.
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
LWS_GROUP_SIZE = "$(LWS_GROUP_SIZE)"
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"
# The leader's torch.distributed rendezvous, and its control channel to the other nodes on the
# next port: the engine's defaults, the same in every group (each leader has its own address).
MASTER_PORT: int = EngineArgs.model_fields["master_port"].default
CONFIG_DIR = "/etc/tidegate"
# The API key's Secret is mounted here as a file: never in the ConfigMap, an env var or args.
SECRET_DIR = "/var/run/secrets/tidegate"
API_KEY_FILE = f"{SECRET_DIR}/api-key"
# The KV transfer's key pair (the Secret <name>-kv-curve), in prefill and decode pods.
KV_CURVE_DIR = "/var/run/secrets/kv-curve"
MODEL_DIR = "/model"
# spec.model.cache is mounted here, writable: models/<uri digest> holds a fetched model, and
# compile/<image and model digest> the compiled kernels, which only that image and model use.
CACHE_DIR = "/var/cache/tidegate"
SPEC_HASH = f"{GROUP}/spec-hash"
# spec.adapters: the list the engines serve is a key of the ConfigMap of its own, read by every
# role. It is not part of SPEC_HASH: the engine reads the file again when it changes (the
# kubelet swaps a ConfigMap volume's files atomically), so editing the list rolls no pod.
ADAPTERS_KEY = "adapters.yaml"
ADAPTERS_FILE = f"{CONFIG_DIR}/{ADAPTERS_KEY}"
# Adapter folders in a pod: claims whole at pvc/<claim>, node folders at host/<digest of the
# path>, fetched ones at fetched/<digest of the URI> (or in spec.model.cache when given).
ADAPTERS_DIR = "/adapters"
# SIGTERM drains in-flight requests for this long (tidegate serve --shutdown-timeout) ...
SHUTDOWN_TIMEOUT_S = 30
# ... and the kubelet must wait longer than that before it sends SIGKILL.
TERMINATION_GRACE_S = SHUTDOWN_TIMEOUT_S + 15
# The engine images' user: above 10000, so that it is no user of the node.
RUN_AS_UID = 10001
# Requests of an engine container whose spec gives no resources (accelerator pools usually).
DEFAULT_ENGINE_REQUESTS = {"cpu": "2", "memory": "8Gi"}
# A model loads at no less than this rate from a volume (conservative for network disks).
LOAD_BYTES_PER_S = 200e6
# Child names are <name>-prefill and the like: Service names, so DNS-1035 labels.
NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LENGTH = 40


@dataclass(frozen=True)
class RenderOptions:
    """What the operator knows that the resource does not say."""

    default_image: str = DEFAULT_ENGINE_IMAGE
    # The node folders pods may mount (HostPathRefused otherwise). None: no list, for
    # `tidegate plan` and `tidegate up`; `tidegate operator` always has one.
    host_paths: HostPathPolicy | None = None


@dataclass(frozen=True)
class Rendered:
    """The objects to apply, the tuning they carry, and the parsed spec they came from."""

    objects: list[dict[str, Any]]
    tuning: Tuning
    endpoint: str
    spec: LLMDeploymentSpec
    # Names of the Deployments whose spec.replicas an autoscaler sets once they exist.
    scaled: frozenset[str] = frozenset()
    # Roles whose replicas span several nodes: their pools are LeaderWorkerSets.
    grouped: frozenset[str] = frozenset()
    # Whether the engines publish KV-cache events, on KV_EVENTS_PORT, and the router follows
    # them with the model's tokenizer.
    kv_events: bool = False
    # The Secret of the KV transfer's key pair that the pools mount, without its keys: the
    # reconcile creates it once, with a fresh pair (None: the KV transfer is not encrypted).
    kv_keys: dict[str, Any] | None = None


def render(
    resource: dict[str, Any],
    options: RenderOptions | None = None,
    measured: Mapping[str, MeasuredChunks] | None = None,
) -> Rendered:
    """The objects an LLMDeployment should own; SpecError/TuningError when it cannot be served.

    `measured`: chunk thresholds and budgets of closed-loop tuning, by role (`tune`)."""
    options = options or RenderOptions()
    meta = resource.get("metadata", {})
    name = meta.get("name", "")
    if len(name) > MAX_NAME_LENGTH or not NAME_PATTERN.match(name):
        raise SpecError(
            f"metadata.name {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} "
            "characters (lowercase letters, digits, '-'): it names the Services"
        )
    spec = parse_spec(resource.get("spec") or {})
    if options.host_paths is not None:
        options.host_paths.check(spec)
    tuning = tune(spec, measured)
    # A unified pool that may reach zero is reached through a router, which holds requests
    # while no engine is ready; the public Service then selects the router. The router is
    # also the endpoint picker of an InferencePool.
    behind_router = spec.has_router()
    ctx = _Context(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        owner=_owner_reference(meta),
        spec=spec,
        image=spec.image or options.default_image,
        kv_events=behind_router and router_can_read_model(spec),
        grouped=frozenset(r for r, t in tuning.roles.items() if t.nodes_per_replica > 1),
    )
    objects: list[dict[str, Any]] = []
    configs = {role: _engine_config(ctx, t) for role, t in tuning.roles.items()}
    if behind_router:
        configs["router"] = _router_config(ctx)
    objects.append(ctx.config_map(configs, _adapters_config(ctx)))
    policies = spec.autoscaling.policies() if spec.autoscaling else {}
    scaled = set()
    for role, role_tuning in tuning.roles.items():
        replicas = spec.topology.roles()[role].replicas
        if role in policies:
            replicas = starting_replicas(policies[role], replicas)
            scaled.add(deployment_name(ctx.name, role))
        if role in ctx.grouped:
            objects.append(ctx.engine_group(role, role_tuning, replicas, configs[role]))
        else:
            objects.append(ctx.engine_deployment(role, role_tuning, replicas, configs[role]))
    if not behind_router:
        objects.append(ctx.service(ctx.name, "unified", spec.service.port, headless=False))
        objects.append(ctx.pdb("unified"))
    else:
        router_replicas = spec.topology.router.replicas if spec.topology.router else 1
        objects.append(ctx.router_deployment(router_replicas, configs["router"]))
        objects.append(ctx.service(ctx.name, "router", spec.service.port, headless=False))
        for role in tuning.roles:
            objects.append(ctx.service(f"{ctx.name}-{role}", role, ENGINE_PORT, headless=True))
        for role in [*tuning.roles, "router"]:
            objects.append(ctx.pdb(role))
        if spec.topology.mode == "disaggregated":
            objects.append(ctx.kv_network_policy(tuning.roles["prefill"]))
        if ctx.kv_events:
            objects.append(ctx.events_network_policy(clients_role(spec)))
        if spec.gateway.inference_pool:
            objects.append(ctx.epp_service())
    objects += scaler_objects(spec, ctx.name, ctx.namespace, ctx.metadata)
    if spec.gateway.inference_pool:
        # Last: on a cluster without the extension's CRD only this object fails to apply.
        objects.append(ctx.inference_pool())
    return Rendered(
        objects=objects,
        tuning=tuning,
        endpoint=endpoint_of(resource),
        spec=spec,
        scaled=frozenset(scaled),
        grouped=ctx.grouped,
        kv_events=ctx.kv_events,
        kv_keys=ctx.kv_keys_secret() if spec.topology.encrypts_kv() else None,
    )


def router_can_read_model(spec: LLMDeploymentSpec) -> bool:
    """Whether router pods can mount the model folder, whose tokenizer KV-event routing needs.

    A volume (pvc, hostPath) is mounted read-only as in the engine pods, and a uri fetched into
    spec.model.cache is read where the engines' shared fetch put it. A uri without a cache is
    downloaded into each engine pod's own emptyDir: a router pod would download every weight
    of the model to read its tokenizer, so the router routes without KV events instead.
    """
    return spec.model.source.uri is None or spec.model.cache is not None


def clients_role(spec: LLMDeploymentSpec) -> str:
    """The engine pool that answers clients: decode pods when disaggregated, else unified."""
    return "decode" if spec.topology.mode == "disaggregated" else "unified"


def deployment_name(name: str, role: str) -> str:
    """The Deployment (or LeaderWorkerSet) of a role's pool: `<name>` for unified,
    `<name>-<role>` otherwise."""
    return name if role == "unified" else f"{name}-{role}"


POOL_KINDS = (("apps/v1", "Deployment"), (LWS_API_VERSION, "LeaderWorkerSet"))


def is_pool(obj: Mapping[str, Any]) -> bool:
    """Whether an object runs a role's engine (or router) pods: a Deployment or an LWS."""
    return (obj["apiVersion"], obj["kind"]) in POOL_KINDS


def pod_template(pool: Mapping[str, Any]) -> dict[str, Any]:
    """A pool's pod template: a Deployment's, or an LWS's leader template (which carries the
    pool's spec hash, as its worker template does)."""
    if pool["kind"] == "LeaderWorkerSet":
        return pool["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return pool["spec"]["template"]


def endpoint_of(resource: dict[str, Any]) -> str:
    """The in-cluster OpenAI base URL of a resource."""
    meta = resource["metadata"]
    port = ((resource.get("spec") or {}).get("service") or {}).get("port", ENGINE_PORT)
    return f"http://{meta['name']}.{meta.get('namespace') or 'default'}.svc:{port}/v1"


def _owner_reference(meta: dict[str, Any]) -> list[dict[str, Any]]:
    if not meta.get("uid"):  # `tidegate plan` renders a resource no cluster has seen
        return []
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _engine_config(ctx: _Context, tuning: RoleTuning) -> str:
    """The role's `--config` file: every flag the operator sets, tuned ones with their reasons."""
    spec = ctx.spec
    values: dict[str, Any] = {
        "model": ctx.model_path(),
        "served_model_name": [spec.model.name],
        "host": "0.0.0.0",
        "port": ENGINE_PORT,
        "device": "cuda" if spec.accelerator else "cpu",
        "dtype": spec.model.dtype,
        "block_size": spec.scheduling.block_size,
        "max_num_seqs": spec.scheduling.max_num_seqs,
        "enable_prefix_caching": spec.scheduling.enable_prefix_caching,
        "scheduling_policy": spec.scheduling.policy,
        "shutdown_timeout": float(SHUTDOWN_TIMEOUT_S),
        # Also vLLM's `vllm:` names: what the Gateway API Inference Extension's pickers and
        # vLLM dashboards read.
        "metrics_compat": "vllm",
    }
    if spec.model.max_model_len is not None:
        values["max_model_len"] = spec.model.max_model_len
    if spec.model.quantization != "auto":
        # auto is the engine's default: a spec without the field renders (and hashes) as it
        # did before the field existed, so an upgrade of the operator rolls no pod.
        values["quantization"] = spec.model.quantization
    if spec.model.kv_cache_dtype != "auto":
        # Every role alike: the KV transfer moves raw cache blocks, and a decode pod refuses
        # blocks of another dtype than its own. Only when not auto, as quantization above.
        values["kv_cache_dtype"] = spec.model.kv_cache_dtype
    if spec.model.pooling != "auto":
        # Every role alike: the router sends /v1/embeddings to a decode (or unified) pod, and
        # a prefill pod answers one sent to it directly the same. Only when not auto, as above.
        values["pooling"] = spec.model.pooling
    if spec.model.tool_call_parser is not None:
        # Every role alike: the router sends a prefill pod the client's request, tools and
        # tool_choice included, and a server without a parser refuses tool_choice auto.
        values["tool_call_parser"] = spec.model.tool_call_parser
    if spec.model.cache is not None:
        values["compile_cache_dir"] = ctx.compile_cache_dir()
    reasons: dict[str, str] = {}
    if tuning.role != "unified":
        values["kv_role"] = "producer" if tuning.role == "prefill" else "consumer"
        if spec.topology.encrypts_kv():
            values["kv_encryption"] = "curve"
            reasons["kv_encryption"] = (
                "the KV blocks (users' prompts) cross the pod network: encrypted, and only "
                f"pods holding the key pair of Secret {ctx.kv_keys_name} may connect"
            )
            values["kv_curve_key_dir"] = KV_CURVE_DIR
        else:
            values["kv_encryption"] = "none"
            reasons["kv_encryption"] = (
                f"topology.kvEncryption none: KV blocks cross in the clear; only the "
                f"NetworkPolicy {ctx.name}-kv guards them"
            )
    if ctx.kv_events:
        values["kv_events_port"] = KV_EVENTS_PORT
        reasons["kv_events_port"] = (
            "the router follows the blocks each engine holds, and sends a request where its "
            "prefix is cached"
        )
    if spec.gateway.inference_pool and tuning.role == "decode":
        values["prefill_via_header"] = True
        reasons["prefill_via_header"] = (
            "gateway.inferencePool: the endpoint picker names a prefill pod in "
            "x-prefiller-host-port, and this pod has it prefill the prompt"
        )
        # The headless Service's name stands for its ready pods: no other host is sent a
        # prompt, whatever a client that reaches this pod directly puts in the header.
        values["prefill_hosts"] = [f"{ctx.name}-prefill.{ctx.namespace}.svc"]
        reasons["prefill_hosts"] = "only this resource's prefill pods may be named"
    if spec.adapters is not None:
        # Every role alike: in P/D a request's prefill and decode legs both need its adapter.
        values["enable_lora"] = True
        values["lora_modules_file"] = ADAPTERS_FILE
        reasons["lora_modules_file"] = (
            "spec.adapters: the adapters to serve; read again whenever the file changes"
        )
        # Only the limits given: an absent one stays the engine's default, and a spec without
        # spec.lora renders (and hashes) as it did before the field existed.
        for limit in lora_limits(spec):
            if limit.user_set:
                values[limit.field] = limit.value
                reasons[limit.field] = limit.reason
    if spec.speculative_decoding is not None and tuning.role != "prefill":
        # A prefill pod computes one token per request: nothing to guess.
        values["speculative_config"] = spec.speculative_decoding.engine_config()
        reasons["speculative_config"] = (
            "spec.speculativeDecoding: each decode also checks the tokens prompt lookup guesses"
        )
    for field, choice in tuning.engine_choices().items():
        values[field] = choice.value
        reasons[field] = choice.reason
    values.update(_tenancy_values(spec))
    _check_fields(values, EngineArgs, ServerArgs)
    return _config_text(f"tidegate serve --config: {tuning.role} pods", values, reasons)


@dataclass(frozen=True)
class LoRALimit:
    """One of the engines' LoRA limits: its EngineArgs field, value, and why that value."""

    field: str
    name: str  # of spec.lora
    value: int
    reason: str
    user_set: bool


# spec.lora's fields by the engine flag each one sets, with what the flag does.
_LORA_LIMITS = {
    "max_loras": ("maxLoras", "distinct adapters one step mixes; requests of others wait"),
    "max_lora_rank": ("maxLoraRank", "the largest adapter rank served"),
    "max_cpu_loras": ("maxCpuLoras", "adapters kept in host memory, least recently used out"),
}


def lora_limits(spec: LLMDeploymentSpec) -> list[LoRALimit]:
    """The LoRA limits every engine role runs with: spec.lora's, else the engine's defaults."""
    if spec.adapters is None:
        return []
    given = spec.lora.model_dump() if spec.lora is not None else {}
    limits = []
    for field, (name, what) in _LORA_LIMITS.items():
        value = given.get(field)
        if value is not None:
            reason = f"spec.lora.{name}: {what}"
            limits.append(LoRALimit(field, name, value, reason, user_set=True))
            continue
        default = EngineArgs.model_fields[field].default
        reason = f"the engine's default: {what}"
        if default is None:  # max_cpu_loras: max_loras, whichever way that was set
            default = next(limit.value for limit in limits if limit.field == "max_loras")
            reason = f"maxLoras, the engine's default: {what}"
        limits.append(LoRALimit(field, name, default, reason, user_set=False))
    return limits


def _router_config(ctx: _Context) -> str:
    """P/D routing in disaggregated mode; in unified mode a balancer over the unified pool."""
    if ctx.spec.topology.mode == "disaggregated":
        pools = {
            "prefill": [ctx.service_url(f"{ctx.name}-prefill")],
            "decode": [ctx.service_url(f"{ctx.name}-decode")],
        }
    else:
        pools = {"decode": [ctx.service_url(f"{ctx.name}-unified")]}
    values: dict[str, Any] = {
        **pools,
        "host": "0.0.0.0",
        "port": ENGINE_PORT,
        **_tenancy_values(ctx.spec),
    }
    if "max_running_per_tenant" not in values or "max_waiting_per_tenant" not in values:
        values.pop("max_running_per_tenant", None)
        values.pop("max_waiting_per_tenant", None)
    reasons: dict[str, str] = {}
    if ctx.kv_events:
        values["kv_events_port"] = KV_EVENTS_PORT
        reasons["kv_events_port"] = (
            "every engine publishes the blocks it holds there: a request goes where its "
            "prefix is cached"
        )
        values["tokenizer"] = ctx.model_path()
        reasons["tokenizer"] = (
            "the model folder, mounted read-only: prompts are tokenized as the engines do"
        )
    if ctx.spec.gateway.inference_pool:
        values["epp_port"] = EPP_PORT
        reasons["epp_port"] = (
            f"gateway.inferencePool: the endpoint picker a Gateway asks, Service {ctx.name}-epp"
        )
    _check_fields(values, RouterArgs)
    return _config_text("tidegate router --config: router pods", values, reasons)


def _tenancy_values(spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The key file, the tenant header and the per-tenant limits: every engine and the
    router check the same (the router counts a tenant's requests in flight only with both
    limits, as their sum per engine)."""
    values: dict[str, Any] = {}
    if spec.auth is not None and spec.auth.api_key_secret_ref is not None:
        values["api_key_file"] = API_KEY_FILE
    if spec.auth is not None and spec.auth.tenant_header is not None:
        values["cache_salt_header"] = spec.auth.tenant_header.lower()
    for name in ("max_running_per_tenant", "max_waiting_per_tenant"):
        limit = getattr(spec.scheduling, name)
        if limit is not None:
            values[name] = limit
    return values


def _check_fields(names: Iterable[str], *models: type) -> None:
    """Every name (a config's keys) is a flag the engine declares: a renamed field fails here,
    not in a pod."""
    known = {name for model in models for name in model.model_fields}  # type: ignore[attr-defined]
    unknown = sorted(set(names) - known)
    assert not unknown, f"rendered flags the engine does not declare: {unknown}"


def _adapters_config(ctx: _Context) -> str | None:
    """The ConfigMap's adapters.yaml: each adapter's name and its folder in the pods."""
    adapters = ctx.spec.adapters
    if adapters is None:
        return None
    return adapters_file([(adapter.name, ctx.adapter_dir(adapter)) for adapter in adapters])


def adapters_file(entries: list[tuple[str, str]]) -> str:
    """The `--lora-modules-file` text for (name, folder) pairs: a YAML list of {name, path}."""
    listed = [{"name": name, "path": path} for name, path in entries]
    return (
        "# The LoRA adapters every engine serves (spec.adapters). Rendered by the Tidegate\n"
        "# operator; edits are overwritten. The engines read it again when it changes.\n"
        + yaml.safe_dump(listed, sort_keys=False, default_flow_style=False)
    )


def _config_text(title: str, values: dict[str, Any], reasons: dict[str, str]) -> str:
    lines = [f"# {title}. Rendered by the Tidegate operator; edits are overwritten."]
    for field, value in values.items():
        line = yaml.safe_dump({field.replace("_", "-"): value}, default_flow_style=True)
        line = line.strip().removeprefix("{").removesuffix("}")
        if field in reasons:
            lines.append(f"# {reasons[field]}")
        lines.append(line)
    return "\n".join(lines) + "\n"


def kv_ports(tuning: RoleTuning) -> list[dict[str, Any]]:
    """A producer's KV containerPorts: per engine core, its side channel, then one per TP rank."""
    layout = kv_port_layout(
        EngineArgs.model_fields["kv_port"].default,
        int(tuning.data_parallel_size_local.value),
        int(tuning.tensor_parallel_size.value),
    )
    ports = [port for core in layout for port in core.all]
    return [
        {"name": "kv" if k == 0 else f"kv-{k}", "containerPort": port}
        for k, port in enumerate(ports)
    ]


def cached_model_dir(uri: str) -> str:
    """Where spec.model.cache holds the model fetched from `uri`: a folder per URI."""
    return f"{CACHE_DIR}/models/{_digest(uri)}"


def cached_adapter_dir(uri: str) -> str:
    """Where spec.model.cache holds the adapter fetched from `uri`: a folder per URI."""
    return f"{CACHE_DIR}/adapters/{_digest(uri)}"


@dataclass(frozen=True)
class AdapterLayout:
    """What puts every adapter's folder in an engine pod: its volumes, the engine's mounts, and
    the init containers that fetch uri adapters."""

    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]


def _health_check() -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": "http"}}


def template_digest(*parts: Any) -> str:
    """The spec hash of a pod template made of `parts` (pod spec, config, template metadata)."""
    return _digest(*parts)


def _digest(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class _Context:
    name: str
    namespace: str
    owner: list[dict[str, Any]]
    spec: LLMDeploymentSpec
    image: str
    # Engines publish KV-cache events and the router, with the model mounted, follows them.
    kv_events: bool = False
    # Roles whose replicas span nodes (LeaderWorkerSet pools).
    grouped: frozenset[str] = frozenset()

    def serving_labels(self, role: str) -> dict[str, str]:
        """Labels of the pods of a role that answer HTTP: in a LeaderWorkerSet pool, the
        leaders only (the other pods of a group run worker ranks and listen on no http)."""
        labels = selector_labels(self.name, role)
        if role in self.grouped:
            labels[WORKER_INDEX_LABEL] = "0"
        return labels

    def model_path(self) -> str:
        """Where the engine reads the model: the cache's copy of a fetched one, else MODEL_DIR."""
        source = self.spec.model.source
        if self.spec.model.cache is not None and source.uri is not None:
            return cached_model_dir(source.uri)
        return MODEL_DIR

    def adapter_dir(self, adapter: AdapterSpec) -> str:
        """Where an engine pod finds an adapter's folder (adapter_layout mounts it there)."""
        source = adapter.source
        if source.pvc is not None:
            root = f"{ADAPTERS_DIR}/pvc/{source.pvc.claim_name}"
            inside = source.pvc.path.strip("/")
            return f"{root}/{inside}" if inside else root
        if source.host_path is not None:
            return f"{ADAPTERS_DIR}/host/{_digest(source.host_path.path)}"
        assert source.uri is not None
        if self.spec.model.cache is not None:
            return cached_adapter_dir(source.uri)
        return f"{ADAPTERS_DIR}/fetched/{_digest(source.uri)}"

    def compile_cache_dir(self) -> str:
        """The compile cache on spec.model.cache: one per image (torch build) and model."""
        source = self.spec.model.source.model_dump(by_alias=True, exclude_none=True)
        return f"{CACHE_DIR}/compile/{_digest(self.image, source)}"

    @property
    def config_map_name(self) -> str:
        return f"{self.name}-config"

    @property
    def kv_keys_name(self) -> str:
        return f"{self.name}-kv-curve"

    def kv_keys_secret(self) -> dict[str, Any]:
        """The Secret of the KV key pair, without the keys (operator/kv_keys.py adds them)."""
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.metadata(self.kv_keys_name, "kv-keys"),
            "type": "Opaque",
        }

    def service_url(self, service: str) -> str:
        return f"http://{service}.{self.namespace}.svc:{ENGINE_PORT}"

    def metadata(self, name: str, component: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "labels": child_labels(self.name, component),
        }
        if self.owner:
            meta["ownerReferences"] = [dict(ref) for ref in self.owner]
        return meta

    def config_map(self, configs: dict[str, str], adapters: str | None) -> dict[str, Any]:
        data = {f"{role}.yaml": text for role, text in configs.items()}
        if adapters is not None:
            data[ADAPTERS_KEY] = adapters
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.metadata(self.config_map_name, "config"),
            "data": data,
        }

    def service(self, name: str, component: str, port: int, *, headless: bool) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "selector": self.serving_labels(component),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        }
        if headless:
            # One DNS A record per ready pod: the router balances across them itself.
            spec["clusterIP"] = "None"
        else:
            spec["type"] = self.spec.service.type
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata(name, component),
            "spec": spec,
        }

    def pdb(self, component: str) -> dict[str, Any]:
        name = self.name if component == "unified" else f"{self.name}-{component}"
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": self.metadata(name, component),
            "spec": {
                # Drains take one pod of a role at a time, so the endpoint keeps serving.
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector_labels(self.name, component)},
            },
        }

    def kv_network_policy(self, prefill: RoleTuning) -> dict[str, Any]:
        """Prefill pods: http from anywhere, the KV ports only from this resource's decode pods.

        With topology.kvEncryption none a KV port serves raw cache blocks to whoever asks, so
        the policy guards those; with curve (the default) it keeps other pods from trying.
        Router and decode pods listen on http only (consumers dial producers, never the
        reverse) and are not selected: a policy that selects a pod denies what it does not
        list, and their http port has to stay open to the router, the kubelet's probes and
        Prometheus alike, wherever those run.
        """
        kv = [{"protocol": "TCP", "port": p["containerPort"]} for p in kv_ports(prefill)]
        ingress: list[dict[str, Any]] = [
            # The router's legs, the kubelet's probes and metric scrapes.
            {"ports": [{"protocol": "TCP", "port": "http"}]},
            # No namespaceSelector: a podSelector alone means this namespace only.
            {
                "from": [{"podSelector": {"matchLabels": selector_labels(self.name, "decode")}}],
                "ports": kv,
            },
        ]
        if self.kv_events:
            # Which prefixes are cached is the router's business alone.
            router = {"podSelector": {"matchLabels": selector_labels(self.name, "router")}}
            events = [{"protocol": "TCP", "port": KV_EVENTS_PORT}]
            ingress.append({"from": [router], "ports": events})
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": self.metadata(f"{self.name}-kv", "prefill"),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(self.name, "prefill")},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    def events_network_policy(self, role: str) -> dict[str, Any]:
        """Unified or decode pods: http from anywhere, the KV-events port only from the router.

        Those pods listen on nothing else. The events say which prefixes are cached, which
        is the router's business alone; prefill pods get the same rule in `<name>-kv`.
        """
        router = {"podSelector": {"matchLabels": selector_labels(self.name, "router")}}
        ingress: list[dict[str, Any]] = [
            {"ports": [{"protocol": "TCP", "port": "http"}]},
            {"from": [router], "ports": [{"protocol": "TCP", "port": KV_EVENTS_PORT}]},
        ]
        if role in self.grouped:
            # The pods of a group meet at the leader's rendezvous and control ports, then
            # torch.distributed connects every rank to the others on ports it picks itself.
            peers = {"podSelector": {"matchLabels": selector_labels(self.name, role)}}
            ingress.append({"from": [peers]})
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": self.metadata(f"{self.name}-cache-events", role),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(self.name, role)},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    def epp_service(self) -> dict[str, Any]:
        """The router pods' endpoint picker, for the InferencePool to name.

        A Service of its own, always ClusterIP: the public one may be a LoadBalancer, and the
        picker answers only the Gateway's proxy, inside the cluster.
        """
        port = {
            "name": EPP_PORT_NAME,
            "port": EPP_PORT,
            "targetPort": EPP_PORT_NAME,
            "protocol": "TCP",
            # gRPC without TLS: proxies that read appProtocol speak HTTP/2 to it at once.
            "appProtocol": "kubernetes.io/h2c",
        }
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata(f"{self.name}-epp", "router"),
            "spec": {
                "type": "ClusterIP",
                "selector": selector_labels(self.name, "router"),
                "ports": [port],
            },
        }

    def inference_pool(self) -> dict[str, Any]:
        """The InferencePool a Gateway's HTTPRoute names: the pods that answer clients, on
        their http port, and the router as the picker of one of them for each request."""
        role = clients_role(self.spec)
        return {
            "apiVersion": INFERENCE_POOL_API_VERSION,
            "kind": "InferencePool",
            "metadata": self.metadata(self.name, role),
            "spec": {
                "selector": {"matchLabels": self.serving_labels(role)},
                "targetPorts": [{"number": ENGINE_PORT}],
                "endpointPickerRef": {
                    "group": "",
                    "kind": "Service",
                    "name": f"{self.name}-epp",
                    # The Service's port (the picker's container port is the same number).
                    "port": {"number": EPP_PORT},
                    "failureMode": self.spec.gateway.failure_mode,
                },
            },
        }

    def engine_deployment(
        self, role: str, tuning: RoleTuning, replicas: int, config: str
    ) -> dict[str, Any]:
        args = ["serve", "--config", f"{CONFIG_DIR}/{role}.yaml"]
        pod_spec = self.engine_pod(role, tuning, args, serves=True)
        return self.deployment(deployment_name(self.name, role), role, replicas, pod_spec, config)

    def engine_pod(
        self, role: str, tuning: RoleTuning, args: list[str], *, serves: bool
    ) -> dict[str, Any]:
        """An engine pod running `tidegate ARGS`; `serves`: it listens on http, and is probed
        there (an LWS worker pod runs only its worker ranks)."""
        container = self.container(role, args)
        resources = self.engine_resources(tuning)
        if resources:
            container["resources"] = resources
        if not serves:
            del container["ports"]
        else:
            if role == "prefill":
                container["ports"].extend(kv_ports(tuning))
            if self.kv_events:
                port = {"name": "cache-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}
                container["ports"].append(port)
            container.update(self.probes())
        volumes, mounts, init = self.model_volume()
        inits = [init] if init is not None else []
        if self.spec.adapters is not None:
            adapters = self.adapter_layout(volumes)
            volumes += adapters.volumes
            mounts += adapters.mounts
            inits += adapters.init_containers
        if role != "unified" and self.spec.topology.encrypts_kv():
            # The whole Secret (no subPath), read-only, readable by the pod's group only.
            secret = {"secretName": self.kv_keys_name, "defaultMode": 0o440}
            volumes.append({"name": "kv-curve", "secret": secret})
            mounts.append({"name": "kv-curve", "mountPath": KV_CURVE_DIR, "readOnly": True})
        container["volumeMounts"].extend(mounts)
        pod_spec = self.pod_spec(container, volumes)
        if inits:
            pod_spec["initContainers"] = inits
        return pod_spec

    def engine_group(
        self, role: str, tuning: RoleTuning, replicas: int, config: str
    ) -> dict[str, Any]:
        """A pool whose replicas span nodes: a LeaderWorkerSet of `replicas` groups, a pod per
        node. The leader runs `tidegate serve` on the role's config (nnodes is there) as node 0;
        the others run only their worker ranks, with the configuration the leader sends them.
        They read the same file all the same (its flags are ignored there), so that their
        command line is a whole, valid set of engine flags. Both mount what the config names
        (the model, the caches, the adapters): every node loads its own stages' weights."""
        config_file = ["--config", f"{CONFIG_DIR}/{role}.yaml"]
        rendezvous = ["--master-addr", LWS_LEADER_ADDRESS, "--master-port", str(MASTER_PORT)]
        leader_args = ["serve", *config_file, "--node-rank", "0", *rendezvous]
        leader = self.engine_pod(role, tuning, leader_args, serves=True)
        ports = leader["containers"][0]["ports"]
        ports.append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
        ports.append({"name": "dist-control", "containerPort": MASTER_PORT + 1, "protocol": "TCP"})
        nodes = ["--nnodes", LWS_GROUP_SIZE, "--node-rank", LWS_WORKER_INDEX]
        worker = self.engine_pod(
            role, tuning, ["serve", *config_file, *nodes, *rendezvous], serves=False
        )
        _check_fields(["nnodes", "node_rank", "master_addr", "master_port"], EngineArgs)
        template_meta: dict[str, Any] = {"labels": child_labels(self.name, role)}
        template_meta["annotations"] = {SPEC_HASH: _digest(leader, worker, config, template_meta)}
        return {
            "apiVersion": LWS_API_VERSION,
            "kind": "LeaderWorkerSet",
            "metadata": self.metadata(deployment_name(self.name, role), role),
            "spec": {
                "replicas": replicas,
                # Workers start with their leader, not once it is ready: the leader becomes
                # ready only after every worker has joined it.
                "startupPolicy": "LeaderCreated",
                # As the Deployments: a new group serves before an old one goes.
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
                },
                # A headless Service per group, named after its leader pod: the shared one
                # would take the LWS's name, which is the name of this role's own Service.
                "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
                "leaderWorkerTemplate": {
                    "size": tuning.nodes_per_replica,
                    # One pod down takes its group down: the engine's ranks cannot rejoin a
                    # running group, so every pod of it starts again together.
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {"metadata": template_meta, "spec": leader},
                    "workerTemplate": {"metadata": copy.deepcopy(template_meta), "spec": worker},
                },
            },
        }

    def router_deployment(self, replicas: int, config: str) -> dict[str, Any]:
        container = self.container("router", ["router", "--config", f"{CONFIG_DIR}/router.yaml"])
        container["resources"] = {
            "requests": {"cpu": "500m", "memory": "512Mi"},
            "limits": {"memory": "1Gi"},
        }
        container["readinessProbe"] = {**_health_check(), "periodSeconds": 5}
        # /health is 503 while no engine of a role is ready (say, still loading weights);
        # liveness asks only whether the router itself answers.
        container["livenessProbe"] = {
            "httpGet": {"path": "/live", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        }
        if self.spec.gateway.inference_pool:
            port = {"name": EPP_PORT_NAME, "containerPort": EPP_PORT, "protocol": "TCP"}
            container["ports"].append(port)
        volumes: list[dict[str, Any]] = []
        init = None
        if self.kv_events:
            # The tokenizer: the model folder at the engines' path, read-only.
            volumes, mounts, init = self.model_folder(read_only=True)
            container["volumeMounts"].extend(mounts)
        pod_spec = self.pod_spec(container, volumes)
        if init is not None:
            pod_spec["initContainers"] = [init]
        return self.deployment(f"{self.name}-router", "router", replicas, pod_spec, config)

    def deployment(
        self, name: str, role: str, replicas: int, pod_spec: dict[str, Any], config: str
    ) -> dict[str, Any]:
        template_meta: dict[str, Any] = {"labels": child_labels(self.name, role)}
        # The pod template changes when the spec or this role's config does: that rolls the pods.
        template_meta["annotations"] = {SPEC_HASH: _digest(pod_spec, config, template_meta)}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.metadata(name, role),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": selector_labels(self.name, role)},
                "revisionHistoryLimit": 3,
                "progressDeadlineSeconds": self.progress_deadline(),
                # Never below the desired capacity during a rollout: a new pod serves first.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "template": {"metadata": template_meta, "spec": pod_spec},
            },
        }

    def container(self, role: str, args: list[str]) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": "router" if role == "router" else "engine",
            "image": self.image,
            "command": ["tidegate"],
            "args": args,
            "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": [
                {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
        }
        if self.spec.image_pull_policy:
            container["imagePullPolicy"] = self.spec.image_pull_policy
        # The root filesystem is read-only: caches (Triton, torch, tokenizers) go under /tmp.
        container["env"] = [{"name": "HOME", "value": "/tmp"}]
        if self.api_key_ref is not None and role != "fetch-model":
            mount = {"name": "api-key", "mountPath": SECRET_DIR, "readOnly": True}
            container["volumeMounts"].append(mount)
        return container

    @property
    def api_key_ref(self) -> SecretKeyRef | None:
        return self.spec.auth.api_key_secret_ref if self.spec.auth is not None else None

    def pod_spec(self, container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
        if self.api_key_ref is not None:
            # Readable by the pod's group (fsGroup) only. The whole volume is mounted, never a
            # subPath: the kubelet swaps a changed Secret in, and the engines and the router
            # read the file again (a subPath mount would keep the old key until a restart).
            secret = {
                "secretName": self.api_key_ref.name,
                "items": [{"key": self.api_key_ref.key, "path": "api-key"}],
                "defaultMode": 0o440,
            }
            volumes = [*volumes, {"name": "api-key", "secret": secret}]
        pod: dict[str, Any] = {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS_UID,
                "runAsGroup": RUN_AS_UID,
                "fsGroup": RUN_AS_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [
                {"name": "config", "configMap": {"name": self.config_map_name}},
                {"name": "tmp", "emptyDir": {}},
                *volumes,
            ],
        }
        if any(v["name"] == "model-cache" and "persistentVolumeClaim" in v for v in volumes):
            # Else the kubelet may chown every file of the shared claim at each pod's start.
            pod["securityContext"]["fsGroupChangePolicy"] = "OnRootMismatch"
        return pod

    def engine_resources(self, tuning: RoleTuning) -> dict[str, Any]:
        requests: dict[str, str] = {}
        limits: dict[str, str] = {}
        accelerator = self.spec.accelerator
        if accelerator is not None:
            count = str(max(tuning.accelerators_per_pod(), 1))
            requests[accelerator.resource] = count
            limits[accelerator.resource] = count
        resources = self.spec.resources
        if resources is None:
            # No memory limit is guessed: one too small OOM-kills a pod while it loads weights.
            requests.update(DEFAULT_ENGINE_REQUESTS)
        if resources is not None and resources.cpu:
            requests["cpu"] = resources.cpu
        if resources is not None and resources.memory:
            requests["memory"] = resources.memory
            limits["memory"] = resources.memory
        out: dict[str, Any] = {}
        if requests:
            out["requests"] = requests
        if limits:
            out["limits"] = limits
        return out

    def weight_bytes(self) -> float:
        """The checkpoint's size, as the pods fetch and read it."""
        # By dtype even under quantization fp8: a 16-bit checkpoint is quantized only once
        # loaded, so the volume holds and the load reads its full size.
        count = self.spec.model.parameter_count or 0.0
        return count * DTYPE_BYTES[self.spec.model.dtype]

    def load_seconds(self) -> int:
        """How long a pod may take to load its weights before it counts as stuck.

        The fixed 300 s also covers start-up work that does not grow with the weights:
        compiling the model (25-45 s on 2 CPU cores from a cold cache) and, on CUDA,
        capturing the decode graphs.
        """
        return 300 + math.ceil(self.weight_bytes() / LOAD_BYTES_PER_S)

    def progress_deadline(self) -> int:
        return self.load_seconds() + 300

    def probes(self) -> dict[str, Any]:
        period = 10
        return {
            # /health answers only once the weights are loaded: allow for slow loads here,
            # so that liveness can stay strict afterwards.
            "startupProbe": {
                **_health_check(),
                "periodSeconds": period,
                "failureThreshold": math.ceil(self.load_seconds() / period),
            },
            "readinessProbe": {**_health_check(), "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {
                **_health_check(),
                "periodSeconds": 10,
                "timeoutSeconds": 5,
                "failureThreshold": 6,
            },
        }

    def model_volume(
        self,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None]:
        """(volumes, engine mounts, init container) that put the model folder at model_path(),
        with /dev/shm and spec.model.cache (writable, for the compile cache) beside it."""
        volumes: list[dict[str, Any]] = [
            # Workers exchange step inputs through /dev/shm; the container default is 64 MiB.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
        ]
        mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        folder_volumes, folder_mounts, init = self.model_folder(read_only=False)
        return volumes + folder_volumes, mounts + folder_mounts, init

    def model_folder(
        self, *, read_only: bool
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None]:
        """(volumes, mounts, init container) that put the model folder at model_path().

        Engine and router pods alike (the router reads the tokenizer there). spec.model.cache
        is mounted for the engines' compile cache, or, for a fetched model, because the folder
        is in it: `read_only` mounts it so (the fetch keeps a writable mount of its own); the
        model's own volume is always read-only. The router never gets a uri model without a
        cache (`router_can_read_model`).
        """
        source = self.spec.model.source
        volumes: list[dict[str, Any]] = []
        mounts: list[dict[str, Any]] = []
        if self.spec.model.cache is not None and (source.uri is not None or not read_only):
            cache_volume, cache_mount = self.cache_volume()
            volumes.append(cache_volume)
            mounts.append({**cache_mount, "readOnly": True} if read_only else cache_mount)
            if source.uri is not None:
                # Into the cache, once for all the pods that share it: the others wait.
                fetch = ["--shared", source.uri, self.model_path()]
                return volumes, mounts, self.fetch_container(fetch, cache_mount)
        model_mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        mounts.append(model_mount)
        if source.pvc is not None:
            volume = {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
            }
            if source.pvc.path:
                model_mount["subPath"] = source.pvc.path.strip("/")
            return [*volumes, volume], mounts, None
        if source.host_path is not None:
            volume = {
                "name": "model",
                "hostPath": {"path": source.host_path.path, "type": "Directory"},
            }
            return [*volumes, volume], mounts, None
        assert source.uri is not None
        empty_dir: dict[str, Any] = {}
        if self.weight_bytes():
            # The archive and the folder unpacked from it are on the volume together.
            empty_dir["sizeLimit"] = f"{math.ceil(self.weight_bytes() * 2.2 / 2**30)}Gi"
        volume = {"name": "model", "emptyDir": empty_dir}
        init = self.fetch_container(
            [source.uri, MODEL_DIR], {"name": "model", "mountPath": MODEL_DIR}
        )
        return [*volumes, volume], mounts, init

    def adapter_layout(self, volumes: list[dict[str, Any]]) -> AdapterLayout:
        """The volumes, mounts and fetches that put each adapter at adapter_dir().

        Laid out so that the pod template changes only when a volume does, never with the list
        alone (whose order changes nothing either): a claim is mounted whole, once, for every
        adapter on it; the model's claim too, so that adapters kept beside the model need no
        new volume; a claim the pod already mounts (the model's, the cache's) is the same
        volume mounted again. A node folder is a volume of its own: mounting its parent would
        open more of the node's disk than the spec names. A uri adapter needs a fetch, which
        only an init container does (at the pod's start): it changes the template.
        """
        claims = {
            volume["persistentVolumeClaim"]["claimName"]: volume["name"]
            for volume in volumes
            if "persistentVolumeClaim" in volume
        }
        model_source = self.spec.model.source
        wanted = {model_source.pvc.claim_name} if model_source.pvc is not None else set()
        host_paths: set[str] = set()
        uris: set[str] = set()
        for adapter in self.spec.adapters or []:
            source = adapter.source
            if source.pvc is not None:
                wanted.add(source.pvc.claim_name)
            elif source.host_path is not None:
                host_paths.add(source.host_path.path)
            else:
                assert source.uri is not None
                uris.add(source.uri)
        added: list[dict[str, Any]] = []
        mounts: list[dict[str, Any]] = []
        for claim in sorted(wanted):
            name = claims.get(claim)
            if name is None:
                name = f"adapters-pvc-{_digest(claim)}"
                claim_ref = {"claimName": claim, "readOnly": True}
                added.append({"name": name, "persistentVolumeClaim": claim_ref})
            mount_path = f"{ADAPTERS_DIR}/pvc/{claim}"
            mounts.append({"name": name, "mountPath": mount_path, "readOnly": True})
        for path in sorted(host_paths, key=_digest):
            name = f"adapters-host-{_digest(path)}"
            added.append({"name": name, "hostPath": {"path": path, "type": "Directory"}})
            mount_path = f"{ADAPTERS_DIR}/host/{_digest(path)}"
            mounts.append({"name": name, "mountPath": mount_path, "readOnly": True})
        inits = []
        if uris and self.spec.model.cache is None:
            # Each pod's own copy, as a uri model without a cache; the engine only reads it.
            fetched = {"name": "adapters-fetched", "mountPath": f"{ADAPTERS_DIR}/fetched"}
            added.append({"name": "adapters-fetched", "emptyDir": {}})
            mounts.append({**fetched, "readOnly": True})
        for uri in sorted(uris, key=_digest):
            if self.spec.model.cache is not None:
                # Into the shared cache (mounted writable already), once for all the pods.
                args = ["--shared", uri, cached_adapter_dir(uri)]
                target = {"name": "model-cache", "mountPath": CACHE_DIR}
            else:
                args = [uri, f"{ADAPTERS_DIR}/fetched/{_digest(uri)}"]
                target = fetched
            init = self.fetch_container(args, target)
            init["name"] = f"fetch-adapter-{_digest(uri)}"
            inits.append(init)
        return AdapterLayout(added, mounts, inits)

    def cache_volume(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """spec.model.cache as a volume, and its writable mount at CACHE_DIR."""
        cache = self.spec.model.cache
        assert cache is not None
        volume: dict[str, Any] = {"name": "model-cache"}
        if cache.host_path is not None:
            # An existing folder: one the kubelet created would be root's, and the pods'
            # user could not write to it (fsGroup does not reach hostPath volumes).
            volume["hostPath"] = {"path": cache.host_path.path, "type": "Directory"}
        else:
            assert cache.pvc is not None
            volume["persistentVolumeClaim"] = {"claimName": cache.pvc.claim_name}
        return volume, {"name": "model-cache", "mountPath": CACHE_DIR}

    def fetch_container(self, args: list[str], model_mount: dict[str, Any]) -> dict[str, Any]:
        """The init container that runs `tidegate fetch-model ARGS` onto `model_mount`."""
        # The URI is one argument of an exec'd command, never part of a shell line.
        init = self.container("fetch-model", ["fetch-model", *args])
        init["name"] = "fetch-model"
        del init["ports"]
        # It streams the archive to disk in 1 MiB pieces: little CPU, bounded memory.
        init["resources"] = {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        }
        init["volumeMounts"] = [model_mount, {"name": "tmp", "mountPath": "/tmp"}]
        return init
