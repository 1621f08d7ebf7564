"""The LLMDeployment resource as typed values; crds/llmdeployment.yaml is the source of truth.

Field names are the CRD's camelCase names (aliases); Python code reads the snake_case
attributes. A test walks the CRD's openAPIV3Schema and this model side by side, so the two
cannot drift. The rules that the CRD checks with CEL (across fields, and on the free-form
strings that reach a pod) are checked here again, so that `tidegate plan` and the operator
give the same message a `kubectl apply` would: the operator reads resources the API server
never checked too (created before the CRD tightened, or by a cluster that skips validation).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

GROUP = "tidegate.dev"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
API_VERSION = f"{GROUP}/{VERSION}"


# The most accelerators one replica may have (accelerator.count, over all its nodes) or one
# node may have (accelerator.perNode), and so the widest TP, PP or DP.
MAX_PARALLEL_SIZE = 64
# A step's token budget and chunk: beyond this a step's activations need more memory than
# any accelerator has, and its buffers would be allocated at start-up all the same.
MAX_STEP_TOKENS = 1 << 20


def _int_or_auto(maximum: int) -> Any:
    """An x-kubernetes-int-or-string field: 'auto' or an integer from 1 to `maximum`.

    The CRD checks it with a CEL rule; one validator gives one message (the CRD's) instead of
    one per branch of a union.
    """
    message = f"must be 'auto' or an integer from 1 to {maximum}"

    def check(value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
            raise ValueError(f"{message}, not {_shown(value)}")
        return value

    return Annotated[
        int | Literal["auto"],
        PlainValidator(check),
        WithJsonSchema(
            {"anyOf": [{"type": "integer", "minimum": 1, "maximum": maximum}, {"enum": ["auto"]}]}
        ),
    ]


ParallelSize = _int_or_auto(MAX_PARALLEL_SIZE)
StepTokens = _int_or_auto(MAX_STEP_TOKENS)


def _shown(value: Any, limit: int = 40) -> str:
    """A user's value for a message, cut short: messages end up in status and events."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _rule(holds: Any, message: str) -> AfterValidator:
    """A CEL rule of the CRD on one field: refused here with the rule's message."""

    def check(value: Any) -> Any:
        if not holds(value):
            raise ValueError(message)
        return value

    return AfterValidator(check)


def _matches(pattern: str, message: str) -> AfterValidator:
    """The CRD's rule `self.matches('^pattern$')` (RE2 syntax, which Python reads alike)."""
    compiled = re.compile(pattern)
    return _rule(lambda value: compiled.fullmatch(value) is not None, message)


# Free-form strings that end up in a pod: each allows what Kubernetes and the engine take.
DNSSubdomain = Annotated[
    str,
    Field(min_length=1, max_length=253),
    _matches(
        r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*",
        "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting and "
        "ending with a letter or digit",
    ),
]
_no_dots = _rule(lambda path: ".." not in path, "path must not contain '..'")


def _quantity(pattern: str) -> Any:
    """A CPU or memory quantity above 0: as a limit, Kubernetes reads 0 as no limit at all."""
    return Annotated[
        str,
        Field(pattern=pattern, max_length=32),
        _rule(lambda value: not re.fullmatch(r"[0.]*[a-zA-Z]*", value), "must be more than 0"),
    ]


class SpecModel(BaseModel):
    """Base of every spec part: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class PVCSource(SpecModel):
    """A model folder on a PersistentVolumeClaim, mounted read-only."""

    claim_name: DNSSubdomain
    path: Annotated[str, Field(max_length=4096), _no_dots] = Field(
        "", description="Folder inside the volume; empty means its root."
    )


class HostPathSource(SpecModel):
    """A model folder on every node's disk (single-node clusters, pre-seeded nodes)."""

    path: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^/"), _no_dots]


class ModelSource(SpecModel):
    """Where the weights come from: exactly one of pvc, hostPath, uri."""

    pvc: PVCSource | None = None
    host_path: HostPathSource | None = None
    uri: (
        Annotated[
            str,
            Field(max_length=4096),
            _matches(
                r"(https?|file)://[!-~]+",
                "must be an http://, https:// or file:// URL of printable ASCII characters, "
                "without spaces (percent-encode others)",
            ),
        ]
        | None
    ) = Field(
        None,
        description="A .tar or .tar.gz of the model folder, fetched by an init container.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [name for name in ("pvc", "host_path", "uri") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of pvc, hostPath or uri must be set")
        return self


class CacheHostPath(SpecModel):
    """A folder on each node's disk that the node's pods share: one fetch per node."""

    path: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^/[^/]"), _no_dots] = Field(
        description="Absolute path of an existing folder below the root"
    )


class CachePVC(SpecModel):
    """A ReadWriteMany PersistentVolumeClaim that pods on every node share: one fetch in all."""

    claim_name: DNSSubdomain


class ModelCache(SpecModel):
    """A writable volume for the fetched model and compiled kernels: exactly one of hostPath, pvc."""

    host_path: CacheHostPath | None = None
    pvc: CachePVC | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelCache:
        if (self.host_path is None) == (self.pvc is None):
            raise ValueError("exactly one of hostPath or pvc must be set")
        return self


class ModelSpec(SpecModel):
    """The model to serve and what the tuner may know about it."""

    name: Annotated[
        str,
        Field(min_length=1, max_length=253),
        _rule(
            lambda name: not re.search(r"[\x00-\x1f\x7f-\x9f]", name),
            "must not contain control characters (such as newlines or tabs)",
        ),
    ] = Field(description="Served model name.")
    source: ModelSource
    cache: ModelCache | None = None
    parameter_count: float | None = Field(None, ge=1, le=1e14, description="Weights, for tuning.")
    num_attention_heads: int | None = Field(None, ge=1, le=65536)
    num_key_value_heads: int | None = Field(None, ge=1, le=65536)
    max_model_len: int | None = Field(None, ge=16, le=1 << 24)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # The engine's `quantization` choices (EngineArgs); a test keeps the two the same.
    quantization: Literal["auto", "fp8", "none"] = "auto"
    # The engine's `kv_cache_dtype` choices (EngineArgs); a test keeps the two the same.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # The engine's `pooling` choices (ServerArgs); a test keeps the two the same.
    pooling: Literal["auto", "last", "mean"] = "auto"
    # The engine's `tool_call_parser` choices (ServerArgs); a test keeps the two the same.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        None, description="The model family's format of tool calls"
    )


# spec.adapters: bounded, so that the CRD's rule that names be unique (each name against every
# other) has a bounded cost, which the API server requires of a CRD's rules.
MAX_ADAPTERS = 64
# An adapter's name is what a request's `model` field carries to pick it, a label value of the
# engine's `tidegate:lora_adapter_ready{adapter}` and a key of the adapters file: a label
# value's characters and length, so that it fits a label too, and never a leading '-' that a
# command line would read as a flag nor a '/' that would read as a path.
ADAPTER_NAME_MESSAGE = (
    "must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit"
)
ADAPTER_NAMES_UNIQUE = "adapter names must be unique"
ADAPTER_IS_NOT_MODEL = (
    "an adapter's name must differ from model.name: a request picks the model or an adapter "
    "by that name"
)


class AdapterSpec(SpecModel):
    """A LoRA adapter of the model, which every engine serves under its own name."""

    name: Annotated[
        str,
        Field(min_length=1, max_length=63),
        _matches(r"[a-zA-Z0-9][a-zA-Z0-9._-]*", ADAPTER_NAME_MESSAGE),
    ] = Field(description="Name requests ask for in their model field.")
    source: ModelSource = Field(
        description="Where the adapter's folder comes from: exactly one of pvc, hostPath, uri."
    )


# spec.lora: the engine's LoRA limits. A step's slots and the host-memory cache hold adapters of
# spec.adapters only (the operator turns no runtime loading on), so neither needs to exceed it.
MAX_LORA_RANK = 512
CPU_LORAS_AT_LEAST_LORAS = (
    "maxCpuLoras must be at least maxLoras: every adapter of a step is also held in host memory"
)
LORA_NEEDS_ADAPTERS = (
    "lora is only allowed together with adapters: its limits are on serving spec.adapters, and "
    "without adapters LoRA is off"
)


class LoRASpec(SpecModel):
    """The engines' limits on serving spec.adapters; absent ones keep the engine's defaults."""

    max_loras: int | None = Field(
        None,
        ge=1,
        le=MAX_ADAPTERS,
        description="Distinct adapters one engine step may mix (engine max_loras).",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        le=MAX_LORA_RANK,
        description="The largest adapter rank the engines accept (engine max_lora_rank).",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        le=MAX_ADAPTERS,
        description="Adapters each engine worker keeps in host memory (engine max_cpu_loras).",
    )

    @model_validator(mode="after")
    def _cpu_holds_a_step(self) -> LoRASpec:
        low, high = self.max_loras, self.max_cpu_loras
        if low is not None and high is not None and high < low:
            raise ValueError(CPU_LORAS_AT_LEAST_LORAS)
        return self


def _unique_names(adapters: list[AdapterSpec]) -> list[AdapterSpec]:
    names = [adapter.name for adapter in adapters]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{ADAPTER_NAMES_UNIQUE}; given more than once: {', '.join(twice)}")
    return adapters


LOOKUP_MIN_AT_MOST_MAX = (
    "promptLookupMin must not exceed promptLookupMax: the suffixes looked up run from the "
    "longest down to the shortest"
)


class SpeculativeDecodingSpec(SpecModel):
    """Speculative decoding by prompt lookup (engine speculative_config), on the engines that
    decode: unified, or decode in disaggregated mode."""

    method: Literal["ngram"] = Field(
        "ngram",
        description="How tokens are guessed; ngram (prompt lookup) is the only one.",
        json_schema_extra={"enum": ["ngram"]},
    )
    num_speculative_tokens: int = Field(
        ge=1, le=16, description="Most tokens guessed for a request per step."
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="Longest suffix of a request's tokens looked up."
    )
    prompt_lookup_min: int = Field(
        3, ge=1, le=64, description="Shortest suffix of a request's tokens looked up."
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Guess nothing in a step when at least this many requests run.",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeDecodingSpec:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(LOOKUP_MIN_AT_MOST_MAX)
        return self

    def engine_config(self) -> dict[str, Any]:
        """The engine's speculative_config: vLLM's field names."""
        return self.model_dump(exclude_none=True)


class RoleSpec(SpecModel):
    """One engine pool; the optional fields override spec.parallelism and spec.scheduling."""

    replicas: int = Field(1, ge=0, le=1000)
    tensor_parallel_size: ParallelSize | None = None
    long_prefill_token_threshold: StepTokens | None = None
    max_num_batched_tokens: StepTokens | None = None


class RouterSpec(SpecModel):
    """The pods that send each request to a prefill pod and then a decode pod."""

    # In unified mode: the balancer in front of a pool that may reach zero (it holds requests),
    # or the endpoint picker of gateway.inferencePool.

    replicas: int = Field(1, ge=0, le=1000)


KV_ENCRYPTION_DISAGGREGATED_ONLY = (
    "kvEncryption is only allowed when mode is disaggregated: unified pods move no KV between pods"
)


class TopologySpec(SpecModel):
    """One unified pool, or prefill and decode pools behind a router."""

    mode: Literal["unified", "disaggregated"] = "unified"
    unified: RoleSpec | None = None
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    router: RouterSpec | None = None
    # Absent means curve: the blocks are users' prompts, so the safe choice is the default.
    kv_encryption: Literal["curve", "none"] | None = Field(
        None,
        description="How KV blocks cross from prefill to decode pods: curve (the default when "
        "absent) or none",
    )

    @model_validator(mode="after")
    def _roles_match_mode(self) -> TopologySpec:
        if self.mode == "disaggregated":
            if self.prefill is None or self.decode is None:
                raise ValueError("prefill and decode are required when mode is disaggregated")
            if self.unified is not None:
                raise ValueError("unified is only allowed when mode is unified")
        elif self.prefill is not None or self.decode is not None:
            raise ValueError("prefill and decode are only allowed when mode is disaggregated")
        elif self.kv_encryption is not None:
            raise ValueError(KV_ENCRYPTION_DISAGGREGATED_ONLY)
        return self

    def encrypts_kv(self) -> bool:
        """Whether KV blocks cross between the pools encrypted (ZMQ CURVE)."""
        return self.mode == "disaggregated" and self.kv_encryption != "none"

    def roles(self) -> dict[str, RoleSpec]:
        """The engine pools this topology runs, by role name."""
        if self.mode == "disaggregated":
            assert self.prefill is not None and self.decode is not None
            return {"prefill": self.prefill, "decode": self.decode}
        return {"unified": self.unified or RoleSpec()}


# The CRD's rule on spec.accelerator: a replica over several nodes takes whole nodes.
COUNT_WHOLE_NODES = (
    "count above perNode must be a multiple of perNode: a replica over several nodes takes "
    "all the accelerators of each"
)


class AcceleratorSpec(SpecModel):
    """The accelerators of one replica, and of one node; absent means the engine runs on CPU."""

    resource: Annotated[
        str,
        Field(min_length=1, max_length=128),
        _rule(
            lambda name: (
                re.fullmatch(
                    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
                    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?",
                    name,
                )
                and "kubernetes.io/" not in name
            ),
            "must be an extended resource name such as nvidia.com/gpu: a domain outside "
            "kubernetes.io, '/', and a name of at most 63 letters, digits, '-', '_' or '.'",
        ),
    ] = "nvidia.com/gpu"
    count: int | None = Field(
        None,
        ge=1,
        le=MAX_PARALLEL_SIZE,
        description="Accelerators of one replica, over all its pods",
    )
    per_node: int | None = Field(
        None,
        ge=1,
        le=MAX_PARALLEL_SIZE,
        description="Accelerators of one node, the most one pod may request",
    )
    memory_gi_b: float = Field(gt=0, le=4096, alias="memoryGiB")
    peak_tflops: float | None = Field(
        None, gt=0, le=100_000, description="Dense bf16 TFLOP/s of one accelerator, for tuning."
    )

    @model_validator(mode="after")
    def _whole_nodes(self) -> AcceleratorSpec:
        count, per_node = self.count, self.per_node
        if count is not None and per_node is not None and count > per_node and count % per_node:
            raise ValueError(COUNT_WHOLE_NODES)
        return self

    def node_size(self) -> int:
        """Accelerators of one node: perNode, else count (a replica is one pod), else 1."""
        return self.per_node or self.count or 1


class ResourcesSpec(SpecModel):
    """CPU and memory of each engine container (requests; memory is also the limit)."""

    cpu: _quantity(r"^[0-9]+(\.[0-9]+)?m?$") | None = None
    memory: _quantity(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$") | None = None


class ParallelismSpec(SpecModel):
    """How the accelerators of a replica hold one model copy, and how many copies a pod runs."""

    tensor_parallel_size: ParallelSize = "auto"
    pipeline_parallel_size: ParallelSize = "auto"
    nodes_per_replica: ParallelSize = "auto"
    data_parallel_size_local: ParallelSize = "auto"


class SLOSpec(SpecModel):
    """The latency targets that `auto` tunes for."""

    ttft_ms: int = Field(800, ge=1, le=600_000)
    itl_ms: int = Field(50, ge=1, le=60_000)


class SchedulingSpec(SpecModel):
    """The engine's step budget and cache switches."""

    long_prefill_token_threshold: StepTokens = "auto"
    max_num_batched_tokens: StepTokens = "auto"
    max_num_seqs: int = Field(256, ge=1, le=65536)
    enable_prefix_caching: bool = True
    block_size: Literal[16, 32, 64] = 16
    slo: SLOSpec = SLOSpec()
    policy: Literal["fcfs", "fair", "priority"] = "fcfs"
    max_running_per_tenant: int | None = Field(None, ge=1, le=65536)
    max_waiting_per_tenant: int | None = Field(None, ge=1, le=1_000_000)


class ServiceSpec(SpecModel):
    """The in-cluster OpenAI-compatible endpoint."""

    port: int = Field(8000, ge=1, le=65535)
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class GatewaySpec(SpecModel):
    """Serving through a Gateway of the Gateway API Inference Extension."""

    inference_pool: bool = Field(
        False,
        description="Render an InferencePool (inference.networking.k8s.io/v1) named after "
        "this resource",
    )
    # The extension's own default: a picker that does not answer stops the request rather
    # than letting the Gateway send it to any pod (which may be loaded, or lack its prefix).
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="What the Gateway does while the endpoint picker does not answer"
    )


class CanarySpec(SpecModel):
    """How a canary is run and judged."""

    traffic_percent: int = Field(
        10, ge=1, le=50, description="Share of the role's requests the router sends the canary."
    )
    latency_margin_percent: int = Field(
        20,
        ge=1,
        le=100,
        description="How much slower (TTFT, ITL) than the stable pods the canary may be",
    )
    error_margin_percent: int = Field(
        1,
        ge=1,
        le=50,
        description="How many more failed requests, in percent of its requests, the canary may have.",
    )
    min_requests: int = Field(
        100, ge=10, le=100_000, description="Requests each side finishes before the first look."
    )
    looks: int = Field(4, ge=1, le=10, description="Looks at minRequests, 2x, 4x... requests")
    timeout_seconds: int = Field(
        3600,
        ge=60,
        le=7 * 86400,
        description="A canary not judged good enough by then is rolled back.",
    )


class RolloutSpec(SpecModel):
    """How a change of a role's pods (image, engine flags, tuning) reaches them."""

    strategy: Literal["rolling", "canary"] = Field(
        "rolling",
        description="rolling: every changed role rolls at once, surge-first. canary: one pod "
        "of the change first, behind the router",
    )
    canary: CanarySpec = CanarySpec()


class TuningSpec(SpecModel):
    """Where the chunk threshold and the step budget come from."""

    mode: Literal["static", "closed-loop"] = Field(
        "static",
        description="static: the cost model, once (status.effective.reasons). closed-loop: "
        "the operator refits the cost model per role from the engines' step times",
    )
    window_seconds: int = Field(
        300, ge=10, le=86400, description="Step times gathered before each proposal."
    )


class SecretKeyRef(SpecModel):
    """A key of a Secret in the resource's namespace."""

    name: DNSSubdomain
    key: Annotated[
        str,
        Field(min_length=1, max_length=253),
        _rule(
            lambda key: (
                re.fullmatch(r"[-._a-zA-Z0-9]+", key) and key != "." and not key.startswith("..")
            ),
            "must be a key of a Secret: letters, digits, '-', '_' and '.', neither '.' nor "
            "starting with '..'",
        ),
    ]


class AuthSpec(SpecModel):
    """Who may call the endpoint, and whose cached prefixes a request may reuse."""

    api_key_secret_ref: SecretKeyRef | None = None
    tenant_header: (
        Annotated[
            str,
            Field(min_length=1, max_length=64),
            _matches(
                r"[A-Za-z0-9][-A-Za-z0-9]*",
                "must be an HTTP header name: letters, digits and '-', starting with a letter "
                "or digit",
            ),
        ]
        | None
    ) = None


# Growing follows the HPA's defaults (double, or add 4 pods, every 15 s, with no window).
# Shrinking is gentler than the HPA's: an LLM pod that goes takes minutes of weight loading
# to come back, so a pool sheds one pod (or 10%) a minute, after five minutes of lower demand.
class ScaleUpRules(SpecModel):
    """How fast a pool may grow: a stabilization window and a rate limit."""

    stabilization_window_seconds: int = Field(
        0, ge=0, le=3600, description="Grow only to the lowest recommendation of this window."
    )
    pods: int = Field(4, ge=1, le=1000, description="Pods one period may add, or percent.")
    percent: int = Field(100, ge=0, le=1000, description="Percent one period may add, or pods.")
    period_seconds: int = Field(15, ge=1, le=1800)
    predictive: bool = Field(False, description="Grow ahead of a demand that rises")


class ScaleDownRules(SpecModel):
    """How fast a pool may shrink: a stabilization window and a rate limit."""

    stabilization_window_seconds: int = Field(
        300, ge=0, le=3600, description="Shrink only to the highest recommendation of this window."
    )
    pods: int = Field(1, ge=1, le=1000, description="Pods one period may remove, or percent.")
    percent: int = Field(10, ge=0, le=100, description="Percent one period may remove, or pods.")
    period_seconds: int = Field(60, ge=1, le=1800)


class AutoscalingTargets(SpecModel):
    """What one replica should carry; the pool takes the most replicas any signal asks for."""

    requests_per_replica: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Running plus waiting requests per replica; absent: scheduling.maxNumSeqs.",
    )
    waiting_requests_per_replica: int = Field(
        2, ge=0, le=65536, description="Waiting requests per replica above which the pool grows."
    )
    kv_cache_usage_percent: int = Field(80, ge=1, le=100)
    slo: bool = Field(
        True,
        description="Grow while the p90 TTFT (prefill, unified) or ITL (decode) misses its SLO.",
    )


class AutoscalingPolicy(SpecModel):
    """Bounds, targets and pace of one autoscaled pool."""

    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(ge=1, le=1000)
    targets: AutoscalingTargets = AutoscalingTargets()
    scale_up: ScaleUpRules = ScaleUpRules()
    scale_down: ScaleDownRules = ScaleDownRules()
    idle_before_zero_seconds: int = Field(600, ge=0, le=86400)

    @model_validator(mode="after")
    def _min_below_max(self) -> AutoscalingPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be at most maxReplicas")
        return self


class PrometheusSpec(SpecModel):
    """The Prometheus that KEDA's triggers query for the engines' and the router's metrics."""

    server_address: Annotated[
        str,
        Field(min_length=1, max_length=2048),
        _matches(
            r"https?://[!-~]+",
            "must be an http:// or https:// URL of printable ASCII characters, without spaces",
        ),
    ] = Field(description="Prometheus's base URL, as KEDA reaches it")


# The CRD's rules on spec.autoscaling: what each driver can do.
KEDA_NEEDS_PROMETHEUS = (
    "driver keda needs prometheus.serverAddress: the Prometheus its triggers query"
)
HPA_CANNOT_REACH_ZERO = (
    "driver hpa cannot scale a pool to zero (a HorizontalPodAutoscaler needs the alpha "
    "HPAScaleToZero feature gate for that): set minReplicas to at least 1, or use driver "
    "operator or keda"
)


class AutoscalingSpec(SpecModel):
    """Autoscaled pools by role; a pool without a policy keeps its topology replicas."""

    driver: Literal["operator", "keda", "hpa"] = Field(
        "operator", description="Who acts on the policies"
    )
    prometheus: PrometheusSpec | None = None
    unified: AutoscalingPolicy | None = None
    prefill: AutoscalingPolicy | None = None
    decode: AutoscalingPolicy | None = None

    @model_validator(mode="after")
    def _driver_can_serve(self) -> AutoscalingSpec:
        if self.driver == "keda" and self.prometheus is None:
            raise ValueError(KEDA_NEEDS_PROMETHEUS)
        if self.driver == "hpa" and any(p.min_replicas == 0 for p in self.policies().values()):
            raise ValueError(HPA_CANNOT_REACH_ZERO)
        return self

    def policies(self) -> dict[str, AutoscalingPolicy]:
        """The policies given, by role name."""
        given = {"unified": self.unified, "prefill": self.prefill, "decode": self.decode}
        return {role: policy for role, policy in given.items() if policy is not None}


# The CRD's rules on spec as a whole: they read autoscaling and topology together.
AUTOSCALING_UNIFIED_ONLY = "autoscaling.unified is only allowed when mode is unified"
AUTOSCALING_ROLES_ONLY = (
    "autoscaling.prefill and autoscaling.decode are only allowed when mode is disaggregated"
)
ZERO_NEEDS_ROUTER = (
    "minReplicas 0 needs a router to hold requests: topology.router.replicas must be at least 1"
)
UNIFIED_ROUTER_NEEDS_ZERO = (
    "topology.router in unified mode is for a pool that may reach zero, for the endpoint "
    "picker of an InferencePool or for a canary's share of requests: it needs "
    "autoscaling.unified.minReplicas 0, gateway.inferencePool true or rollout.strategy canary"
)
CLOSED_LOOP_NEEDS_CANARY = (
    "tuning.mode closed-loop needs rollout.strategy canary: every proposal is tried on a "
    "canary pod before it reaches the others"
)
CANARY_NEEDS_ROUTER = (
    "rollout.strategy canary needs the router, which gives the canary its share of requests: "
    "topology.router.replicas must be at least 1"
)
INFERENCE_POOL_NEEDS_ROUTER = (
    "gateway.inferencePool needs the router, its endpoint picker: topology.router.replicas "
    "must be at least 1"
)


class LLMDeploymentSpec(SpecModel):
    """spec of an LLMDeployment."""

    model: ModelSpec
    adapters: (
        Annotated[list[AdapterSpec], Field(max_length=MAX_ADAPTERS), AfterValidator(_unique_names)]
        | None
    ) = Field(
        None,
        description="LoRA adapters every engine serves beside the model; absent: LoRA is off.",
    )
    lora: LoRASpec | None = None
    speculative_decoding: SpeculativeDecodingSpec | None = Field(
        None, description="Speculative decoding by prompt lookup (engine speculative_config)"
    )
    image: (
        Annotated[
            str,
            Field(min_length=1, max_length=512),
            _matches(
                r"[a-zA-Z0-9][a-zA-Z0-9._/:@-]*",
                "must be an image reference: letters, digits, '.', '_', '-', '/', ':' and '@', "
                "starting with a letter or digit",
            ),
        ]
        | None
    ) = Field(None, description="Engine image; the operator's default when absent.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    topology: TopologySpec = TopologySpec()
    accelerator: AcceleratorSpec | None = None
    resources: ResourcesSpec | None = None
    parallelism: ParallelismSpec = ParallelismSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    service: ServiceSpec = ServiceSpec()
    gateway: GatewaySpec = GatewaySpec()
    auth: AuthSpec | None = None
    autoscaling: AutoscalingSpec | None = None
    rollout: RolloutSpec = RolloutSpec()
    tuning: TuningSpec = TuningSpec()

    @model_validator(mode="after")
    def _closed_loop_needs_canary(self) -> LLMDeploymentSpec:
        if self.tuning.mode == "closed-loop" and self.rollout.strategy != "canary":
            raise ValueError(CLOSED_LOOP_NEEDS_CANARY)
        router = self.topology.router
        if self.rollout.strategy == "canary" and router is not None and router.replicas == 0:
            raise ValueError(CANARY_NEEDS_ROUTER)
        return self

    @model_validator(mode="after")
    def _autoscaling_fits_topology(self) -> LLMDeploymentSpec:
        unified_router = self.topology.mode == "unified" and self.topology.router is not None
        behind = self.unified_may_reach_zero() or self.gateway.inference_pool or self.canary()
        if unified_router and not behind:
            raise ValueError(UNIFIED_ROUTER_NEEDS_ZERO)
        # The InferencePool names the router's picker: with no router pod, a Gateway that
        # fails closed refuses every request.
        router = self.topology.router
        if self.gateway.inference_pool and router is not None and router.replicas == 0:
            raise ValueError(INFERENCE_POOL_NEEDS_ROUTER)
        if self.autoscaling is None:
            return self
        policies = self.autoscaling.policies()
        mode = self.topology.mode
        if "unified" in policies and mode != "unified":
            raise ValueError(AUTOSCALING_UNIFIED_ONLY)
        if {"prefill", "decode"} & policies.keys() and mode != "disaggregated":
            raise ValueError(AUTOSCALING_ROLES_ONLY)
        # A pool at zero replicas serves nothing: something must hold its requests meanwhile.
        # Disaggregated pools have the router; a unified pool that may reach zero gets one.
        zero = any(policy.min_replicas == 0 for policy in policies.values())
        if zero and router is not None and router.replicas == 0:
            raise ValueError(ZERO_NEEDS_ROUTER)
        return self

    @model_validator(mode="after")
    def _adapters_are_not_the_model(self) -> LLMDeploymentSpec:
        for adapter in self.adapters or []:
            if adapter.name == self.model.name:
                raise ValueError(f"{ADAPTER_IS_NOT_MODEL} ({adapter.name!r} is both)")
        return self

    @model_validator(mode="after")
    def _lora_needs_adapters(self) -> LLMDeploymentSpec:
        if self.lora is not None and self.adapters is None:
            raise ValueError(LORA_NEEDS_ADAPTERS)
        return self

    def has_router(self) -> bool:
        """Whether a router is in front: when disaggregated, of a pool that may reach zero, to
        serve an InferencePool's endpoint picker, or to give a canary its share of requests."""
        return (
            self.topology.mode == "disaggregated"
            or self.unified_may_reach_zero()
            or self.gateway.inference_pool
            or self.canary()
        )

    def canary(self) -> bool:
        """Whether a change of a role's pods goes to a canary pod first."""
        return self.rollout.strategy == "canary"

    def unified_may_reach_zero(self) -> bool:
        """Whether a unified pool's policy lets it go to zero: a router then stands in front."""
        policy = self.autoscaling.unified if self.autoscaling is not None else None
        return self.topology.mode == "unified" and policy is not None and policy.min_replicas == 0


class SpecError(ValueError):
    """A spec the operator cannot serve; the message is what the user sees in a condition."""


def parse_spec(spec: dict[str, Any]) -> LLMDeploymentSpec:
    """The typed spec of a resource's `spec`; SpecError names each bad field as kubectl would."""
    try:
        # As the API server reads it: camelCase only (populate_by_name is for Python callers),
        # and no coercion ("2" is not an integer, "yes" not a boolean).
        return LLMDeploymentSpec.model_validate(spec, by_alias=True, by_name=False, strict=True)
    except ValidationError as error:
        raise SpecError(_describe(error)) from None


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(["spec", *(str(part) for part in item["loc"])])
        if item["type"] == "extra_forbidden":
            lines.append(f'unknown field "{where}"')
        else:
            lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)
