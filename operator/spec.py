"""The LLMDeployment resource as typed values; crds/llmdeployment.yaml is the source of truth.

Field names are the CRD's camelCase names (aliases); Python code reads the snake_case
attributes. A test walks the CRD's openAPIV3Schema and this model side by side, so the two
cannot drift. The cross-field rules that the CRD checks with CEL are checked here again, so
that `tidegate plan` and the operator give the same message a `kubectl apply` would.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

GROUP = "tidegate.dev"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
API_VERSION = f"{GROUP}/{VERSION}"


def _int_or_auto(value: Any) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be 'auto' or an integer of at least 1, not {value!r}")
    return value


# The CRD declares these as x-kubernetes-int-or-string with a CEL rule; one validator gives
# one message instead of one per branch of a union.
PositiveIntOrAuto = Annotated[
    int | Literal["auto"],
    PlainValidator(_int_or_auto),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"enum": ["auto"]}]}),
]


class SpecModel(BaseModel):
    """Base of every spec part: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class PVCSource(SpecModel):
    """A model folder on a PersistentVolumeClaim, mounted read-only."""

    claim_name: str = Field(min_length=1, max_length=253)
    path: str = Field("", description="Folder inside the volume; empty means its root.")

    @field_validator("path")
    @classmethod
    def _inside_the_volume(cls, path: str) -> str:
        if ".." in path:
            raise ValueError("path must not contain '..'")
        return path


class HostPathSource(SpecModel):
    """A model folder on every node's disk (single-node clusters, pre-seeded nodes)."""

    path: str = Field(min_length=1, pattern=r"^/")


class ModelSource(SpecModel):
    """Where the weights come from: exactly one of pvc, hostPath, uri."""

    pvc: PVCSource | None = None
    host_path: HostPathSource | None = None
    uri: str | None = Field(
        None,
        pattern=r"^(https?|file)://",
        description="A .tar or .tar.gz of the model folder, fetched by an init container.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [name for name in ("pvc", "host_path", "uri") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of pvc, hostPath or uri must be set")
        return self


class ModelSpec(SpecModel):
    """The model to serve and what the tuner may know about it."""

    name: str = Field(min_length=1, max_length=253, description="Served model name.")
    source: ModelSource
    parameter_count: float | None = Field(None, gt=0, description="Weights, for tuning.")
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


class RoleSpec(SpecModel):
    """One engine pool; the optional fields override spec.parallelism and spec.scheduling."""

    replicas: int = Field(1, ge=0, le=1000)
    tensor_parallel_size: PositiveIntOrAuto | None = None
    long_prefill_token_threshold: PositiveIntOrAuto | None = None
    max_num_batched_tokens: PositiveIntOrAuto | None = None


class RouterSpec(SpecModel):
    """The pods that send each request to a prefill pod and then a decode pod."""

    replicas: int = Field(1, ge=0, le=1000)


class TopologySpec(SpecModel):
    """One unified pool, or prefill and decode pools behind a router."""

    mode: Literal["unified", "disaggregated"] = "unified"
    unified: RoleSpec | None = None
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    router: RouterSpec | None = None

    @model_validator(mode="after")
    def _roles_match_mode(self) -> TopologySpec:
        if self.mode == "disaggregated":
            if self.prefill is None or self.decode is None:
                raise ValueError("prefill and decode are required when mode is disaggregated")
            if self.unified is not None:
                raise ValueError("unified is only allowed when mode is unified")
        elif any(role is not None for role in (self.prefill, self.decode, self.router)):
            raise ValueError(
                "prefill, decode and router are only allowed when mode is disaggregated"
            )
        return self

    def roles(self) -> dict[str, RoleSpec]:
        """The engine pools this topology runs, by role name."""
        if self.mode == "disaggregated":
            assert self.prefill is not None and self.decode is not None
            return {"prefill": self.prefill, "decode": self.decode}
        return {"unified": self.unified or RoleSpec()}


class AcceleratorSpec(SpecModel):
    """The accelerators of one pod; absent means the engine runs on CPU."""

    resource: str = Field("nvidia.com/gpu", min_length=1)
    count: int = Field(1, ge=1, le=64)
    memory_gi_b: float = Field(gt=0, le=4096, alias="memoryGiB")
    peak_tflops: float | None = Field(
        None, gt=0, description="Dense bf16 TFLOP/s of one accelerator, for tuning."
    )


class ResourcesSpec(SpecModel):
    """CPU and memory of each engine container (requests; memory is also the limit)."""

    cpu: str | None = Field(None, pattern=r"^[0-9]+(\.[0-9]+)?m?$")
    memory: str | None = Field(None, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")


class ParallelismSpec(SpecModel):
    """How many accelerators hold one model copy, and how many copies one pod runs."""

    tensor_parallel_size: PositiveIntOrAuto = "auto"
    data_parallel_size_local: PositiveIntOrAuto = "auto"


class SLOSpec(SpecModel):
    """The latency targets that `auto` tunes for."""

    ttft_ms: int = Field(800, ge=1)
    itl_ms: int = Field(50, ge=1)


class SchedulingSpec(SpecModel):
    """The engine's step budget and cache switches."""

    long_prefill_token_threshold: PositiveIntOrAuto = "auto"
    max_num_batched_tokens: PositiveIntOrAuto = "auto"
    max_num_seqs: int = Field(256, ge=1, le=65536)
    enable_prefix_caching: bool = True
    block_size: Literal[16, 32, 64] = 16
    slo: SLOSpec = SLOSpec()


class ServiceSpec(SpecModel):
    """The in-cluster OpenAI-compatible endpoint."""

    port: int = Field(8000, ge=1, le=65535)
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class SecretKeyRef(SpecModel):
    """A key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class AuthSpec(SpecModel):
    """Who may call the endpoint."""

    api_key_secret_ref: SecretKeyRef | None = None


class LLMDeploymentSpec(SpecModel):
    """spec of an LLMDeployment."""

    model: ModelSpec
    image: str | None = Field(
        None, min_length=1, description="Engine image; the operator's default when absent."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    topology: TopologySpec = TopologySpec()
    accelerator: AcceleratorSpec | None = None
    resources: ResourcesSpec | None = None
    parallelism: ParallelismSpec = ParallelismSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    service: ServiceSpec = ServiceSpec()
    auth: AuthSpec | None = None


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
