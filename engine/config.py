"""Engine arguments, declared once: the offline API, the CLI and the operator read them here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes of KV cache on CPU when nothing else is said
API_KEY_ENV = "TIDEGATE_API_KEY"  # where the API key may come from when no flag gives it
# The share of its role's requests a canary takes when --traffic-weight does not say.
DEFAULT_CANARY_WEIGHT = 0.1
# With auto chunking, a step with prompt chunks may take this much longer than a decode-only
# step (0.25: up to 1.25x the running streams' inter-token gap). The prefill-stall target (p99
# ITL during long prompts within 1.5x of before) sat on its line at 0.5: medians of 8 rounds
# 1.51 at 0.5, 1.39 at 0.35, 1.31 at 0.25 (all eight within 1.5), and 0.3 gave 1.39 over nine
# rounds, two above 1.5 (benchmarks/README.md, prefill-stall). A deployment that states an
# ITL target gives it as --long-prefill-step-ms, which lets steps take up to that.
DEFAULT_LONG_PREFILL_STEP_SLACK = 0.25
# The files of kv_curve_key_dir (and the keys of the operator's Secret that holds them).
KV_CURVE_PUBLIC_KEY_FILE = "public.key"
KV_CURVE_SECRET_KEY_FILE = "secret.key"


# The mallocs an engine process may run on (engine/allocator.py carries the choice out).
CpuAllocator = Literal["auto", "tcmalloc", "system"]
# Which revision of its role an instance serves during a rollout (router/instances.py).
Track = Literal["stable", "canary"]
# The order waiting requests are admitted in (engine/core/request_queue.py).
SchedulingPolicy = Literal["fcfs", "fair", "priority"]


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's --speculative-config): guess tokens, verify them in one step.

    Only prompt lookup (`ngram`) proposes: the last n tokens of a request (n from
    prompt_lookup_max down to prompt_lookup_min) are looked up earlier in its prompt and
    output, and the tokens that followed are the guesses. The model computes them all in one
    step, and each is kept while it is the token that sampling picks at its position, so the
    output is the one decoding token by token gives (engine/spec_decode/).
    """

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram"] = Field(
        "ngram",
        description="How tokens are proposed: ngram (prompt lookup). Draft models, EAGLE and "
        "MTP heads are not supported.",
    )
    num_speculative_tokens: int = Field(
        ge=1, le=16, description="Most tokens proposed for a request per step."
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="Longest suffix of a request's tokens looked up."
    )
    prompt_lookup_min: int = Field(
        3,
        ge=1,
        le=64,
        description="Shortest suffix looked up before giving up for the step; shorter ones "
        "recur by chance more often, and their guesses are mostly wrong.",
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="Propose nothing in a step when at least this many requests are running: a "
        "full batch is compute-bound, and guesses that fail cost it time.",
    )

    @model_validator(mode="before")
    @classmethod
    def _only_ngram(cls, data: object) -> object:
        if isinstance(data, dict):
            if "model" in data:
                raise ValueError(
                    "speculative_config names a draft model: only method 'ngram' (prompt "
                    "lookup) is supported, which needs none"
                )
            if data.get("method", "ngram") != "ngram":
                raise ValueError(
                    f"speculative_config method {data['method']!r} is not supported; the one "
                    "supported is 'ngram' (prompt lookup)"
                )
        return data

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


class EngineArgs(BaseModel):
    """Everything that shapes one engine instance. Field names are vLLM's where one exists."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="Path of a local Hugging Face model folder.")
    tokenizer: str | None = Field(None, description="Tokenizer folder; defaults to the model's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight and activation dtype. auto: the model config's, except float32 for "
        "a 16-bit checkpoint on a CPU that has no dot products for it (x86 without AVX512_BF16 "
        "or AMX) where the float32 weights fit.",
    )
    quantization: Literal["auto", "fp8", "none"] = Field(
        "auto",
        description="FP8 weights. auto: an FP8 checkpoint (config.json quantization_config) "
        "runs FP8 products where the GPU has them (compute capability 8.9 or later) and is "
        "dequantized to --dtype at load elsewhere. fp8: weights held in FP8, a 16/32-bit "
        "checkpoint quantized at load (per output channel; activations per token): half the "
        "memory of bf16 weights, emulated and slow on CPU. none: an FP8 checkpoint dequantized.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="What the KV cache stores. auto: the model's dtype. fp8: float8_e4m3fn "
        "(keys and values rounded to 3 mantissa bits, magnitudes above 448 clipped; no scales): "
        "half the bytes of a 16-bit cache, so twice the tokens in the same memory. The torch "
        "and triton attention backends read it; on CPU auto then picks torch.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt plus output; defaults to the model's limit."
    )
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block.")
    num_gpu_blocks: int | None = Field(
        None, ge=1, description="Number of KV-cache blocks; overrides kv_cache_memory."
    )
    kv_cache_memory: int | None = Field(
        None, ge=1, description="Bytes of KV cache (default 1 GiB on CPU, 90% of free on GPU)."
    )
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step: prefill chunks plus decodes."
    )
    max_num_seqs: int = Field(256, ge=1, description="Most requests in one step.")
    long_prefill_token_threshold: int | Literal["auto"] = Field(
        0,
        description="Most tokens one request may compute in a step; 0 means no cap; auto sizes "
        "chunks online so that a step with decodes takes at most 1 + long_prefill_step_slack "
        "times a decode-only step.",
    )
    long_prefill_step_slack: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="With long_prefill_token_threshold auto: how much longer than a "
        f"decode-only step a step with prompt chunks may take ({DEFAULT_LONG_PREFILL_STEP_SLACK} "
        f"when unset: {1 + DEFAULT_LONG_PREFILL_STEP_SLACK}x). Smaller keeps the "
        "running streams' inter-token latency closer to their own; a long prompt then waits "
        "longer for its first token. With several requests waiting to start, the slack is "
        "that many times larger, so that a queue does not grow without bound.",
    )
    long_prefill_step_ms: float | None = Field(
        None,
        gt=0.0,
        le=600_000.0,
        description="With long_prefill_token_threshold auto: a step with prompt chunks may "
        "take up to this many ms when that is longer than the slack allows (an inter-token "
        "latency target, such as the deployment's ITL SLO).",
    )
    max_num_partial_prefills: int = Field(
        1, ge=1, description="Prompts that may be part-way through prefill at once."
    )
    max_long_partial_prefills: int = Field(
        1,
        ge=1,
        description="Of those, prompts longer than long_prefill_token_threshold; fewer lets "
        "short prompts overtake a long one.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes.")
    step_composition: Literal["unified", "phased"] = Field(
        "unified",
        description="unified: prefill chunks and decodes share every step. phased: a step is "
        "either whole-prompt prefills or decodes, as older engines did (a baseline for benchmarks).",
    )
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="Which waiting request is admitted first (vLLM's flag). fcfs: first come, "
        "first served. priority: lowest request priority first, ties by arrival; under memory "
        "pressure the lowest priority is preempted first. fair: tenants with requests waiting "
        "share the step's tokens equally (deficit round robin), whatever their arrival rates, "
        "and each tenant with work is owed an even share of max_num_seqs: one below its share "
        "starts first and, when no slot is free, takes one back from a tenant above its share.",
    )
    max_running_per_tenant: int | None = Field(
        None,
        ge=1,
        description="Most running requests of one tenant (the cache-salt header's value, else "
        "its API key, else one anonymous tenant); its other requests wait while another "
        "tenant's may start.",
    )
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = Field(
        "auto",
        description="Attention kernels. auto: triton on CUDA; on CPU the C++ paged-attention "
        "kernel (built on first use, cached), or torch where it cannot build or fit the model.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Workers that each hold one shard of the model; must divide the number of "
        "attention heads.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Stages the model's layers are split into, each on its own worker(s) "
        "(times tensor_parallel_size); steps flow through the stages as micro-batches, so the "
        "stages overlap.",
    )
    pipeline_micro_batching: bool = Field(
        True,
        description="With pipeline_parallel_size above 1, keep one step in flight per stage, "
        "each with its share of the requests, so the stages overlap; off runs one step at a "
        "time through every stage (a baseline for benchmarks).",
    )
    nnodes: int = Field(
        1,
        ge=1,
        description="Nodes (pods) the tensor_parallel_size x pipeline_parallel_size ranks are "
        "spread over, an equal share each; node_rank 0 (the leader) runs the server and the "
        "engine core.",
    )
    node_rank: int = Field(
        0,
        ge=0,
        description="This node's index among nnodes. Above 0 the node runs only its worker "
        "ranks: it connects to the leader at master_addr, which sends it the engine's "
        "configuration, and it serves no HTTP.",
    )
    master_addr: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address of the leader (node_rank 0), where every node meets (nnodes > 1).",
    )
    master_port: int = Field(
        29500,
        ge=1,
        le=65534,
        description="The leader's rendezvous port for torch.distributed (nnodes > 1); the "
        "leader's control channel to the other nodes listens on master_port + 1.",
    )
    distributed_executor_backend: Literal["uni", "mp"] | None = Field(
        None,
        description="Where the workers run (vLLM's flag): uni runs the one worker inside the "
        "engine core process, mp runs one worker process per tensor-parallel rank. Default: uni "
        "at tensor_parallel_size 1, mp above (benchmarks/results/executor_backend_small.json).",
    )
    async_scheduling: bool = Field(
        False,
        description="Plan step N+1 while step N runs (vLLM V1's async scheduling): the "
        "scheduler counts each token in flight as a placeholder, the worker feeds the token it "
        "sampled, and step N's outputs go out while step N+1 runs. Off by default: on CPU it "
        "measured within noise of synchronous steps (benchmarks/README.md, async scheduling).",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="Speculative decoding, as a JSON object (vLLM's flag), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\': each step also computes the '
        "tokens that followed the request's last few tokens where they occurred before "
        "(prompt lookup), and keeps those that sampling confirms, so an output that repeats "
        "its prompt (code edits, quotes, extraction) takes fewer steps. Greedy and seeded "
        "outputs are the same as without it. Fields: num_speculative_tokens, "
        "prompt_lookup_max (4), prompt_lookup_min (3), disable_by_batch_size.",
    )
    data_parallel_size_local: int = Field(
        1,
        ge=1,
        description="Engine cores in this server, each with its own workers and KV cache; "
        "the server routes each request to one (serving only).",
    )
    kv_role: Literal["none", "producer", "consumer"] = Field(
        "none",
        description="Disaggregated serving: producer computes prompts (prefill) and hands its KV "
        "blocks to a consumer (decode).",
    )
    kv_connector: Literal["zmq"] = Field(
        "zmq", description="KV transport between producer and consumer: zmq (TCP)."
    )
    kv_port: int = Field(
        14579,
        ge=0,
        le=65535,
        description="First port of the KV transport: engine core i takes kv_port + i*(tp+1) "
        "(notices from consumers) and the next tp ports (blocks, one per rank); 0 picks free "
        "ports.",
    )
    kv_host: str | None = Field(
        None,
        description="Address consumers reach this producer at; default: this host name's address "
        "(a pod's IP).",
    )
    kv_events_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Publish KV-cache events (blocks stored and removed, by the prefix cache's "
        "block hashes) on a ZMQ PUB socket at this port, for routers that route by the blocks "
        "each instance holds; a new subscriber first gets a replay of every held block "
        "(serving only).",
    )
    track: Track = Field(
        "stable",
        description="Which revision of its role this instance runs during a rollout: stable, "
        "or canary (the new one, tried on a share of the role's requests, traffic_weight). "
        "Exported in /metrics as tidegate:revision_info{track,traffic_weight}, where routers "
        "read it (serving only).",
    )
    traffic_weight: float | None = Field(
        None,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="With track canary: the share of its role's requests routers send to the "
        "pool's canaries, strictly between 0 and 1; with several canaries the largest "
        f"weight counts. Default for a canary: {DEFAULT_CANARY_WEIGHT}. Refused with track "
        "stable.",
    )
    kv_transfer_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a producer keeps a finished prompt's blocks for its consumer, and "
        "a consumer waits for them before computing the prompt itself.",
    )
    kv_encryption: Literal["none", "curve"] = Field(
        "none",
        description="KV transfer over TCP: none sends blocks in the clear; curve encrypts and "
        "authenticates every KV socket with ZMQ CURVE, using the deployment's key pair in "
        "kv_curve_key_dir (both pools hold the same pair; a peer without it is refused).",
    )
    kv_curve_key_dir: str | None = Field(
        None,
        description=f"With kv_encryption curve: the folder holding the deployment's key pair, "
        f"{KV_CURVE_PUBLIC_KEY_FILE} and {KV_CURVE_SECRET_KEY_FILE}, one Z85 key each (a mounted "
        "Secret).",
    )
    compilation_level: Literal[0, 1, 2] | None = Field(
        None,
        description="0: eager; 1: torch.compile of the model (attention stays outside the "
        "graph); 2: level 1 plus CUDA graphs for decode-only steps (CUDA, with the triton "
        "attention backend). Default: $TIDEGATE_COMPILATION_LEVEL if set, else 2 on CUDA (1 "
        "with the torch backend) and 1 on CPU (benchmarks/results/compile.json).",
    )
    enforce_eager: bool = Field(
        False, description="Never compile: the same as compilation_level 0 (vLLM's flag)."
    )
    compile_cache_dir: str | None = Field(
        None,
        description="Directory for compiled artifacts (inductor's caches); one that survives "
        "restarts makes the next start's compilation a cache load. Default: "
        "$TORCHINDUCTOR_CACHE_DIR if set, else one per torch build under "
        "~/.cache/tidegate/inductor ($XDG_CACHE_HOME/tidegate/inductor).",
    )
    seed: int = Field(0, ge=0, description="Seed for requests that give none.")
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker on CPU; defaults to the CPUs this process may use "
        "(its affinity, capped by a cgroup CPU quota such as a pod's limit) divided by "
        "tensor_parallel_size times data_parallel_size_local.",
    )

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (PEFT folders) beside the base model; a request "
        "selects one by its `model` name.",
    )
    max_loras: int = Field(
        1,
        ge=1,
        description="LoRA: distinct adapters in one step (slots of stacked weights); requests "
        "of more adapters wait their turn, first come first served among adapters.",
    )
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="LoRA: the largest adapter rank accepted."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="LoRA: adapters each worker keeps loaded in host memory (least recently "
        "used one dropped first); at least max_loras, which is the default.",
    )
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance"] = Field(
        "auto",
        description="Grammar library of structured outputs (response_format, tool_choice "
        "required): xgrammar or guidance (llguidance). auto: the one measured faster "
        "(benchmarks/results/structured_backends.json).",
    )
    max_cached_grammars: int = Field(
        256,
        ge=1,
        description="Structured outputs: compiled grammars kept per engine core, by schema "
        "(least recently used dropped first).",
    )

    cpu_allocator: CpuAllocator = Field(
        "auto",
        description="malloc of the engine-core and worker processes. auto: tcmalloc on CPU "
        "where the machine has it (Debian: libtcmalloc-minimal4; more throughput under "
        "load, benchmarks/README.md), else the system's; tcmalloc: fail "
        "without it; system: glibc's. An LD_PRELOAD that already names a malloc is kept.",
    )
    cpu_huge_pages: bool = Field(
        True,
        description="On CPU, keep the weights and the KV cache on transparent huge pages "
        "where the kernel offers them (THP always or madvise): fewer TLB misses when a step "
        "reads every layer's weights (engine/huge_pages.py; benchmarks/README.md, Huge "
        "pages). Off: the allocators' 4 KiB pages.",
    )

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine core, over all nodes: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Worker ranks of one engine core on this node."""
        return self.world_size // self.nnodes

    @property
    def executor_backend(self) -> Literal["uni", "mp"]:
        """The distributed_executor_backend in force: the flag, else by world size."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def canary_weight(self) -> float | None:
        """The share of requests in force for a canary (traffic_weight or the default); None
        for a stable instance."""
        if self.track != "canary":
            return None
        return self.traffic_weight if self.traffic_weight is not None else DEFAULT_CANARY_WEIGHT

    def step_token_capacity(self, max_model_len: int) -> int:
        """Most tokens one step may compute: the budget, or a whole prompt when phased."""
        if self.step_composition == "phased":
            return max(self.max_num_batched_tokens, max_model_len)
        return self.max_num_batched_tokens

    @model_validator(mode="after")
    def _check_limits(self) -> EngineArgs:
        if self.step_composition == "phased" and (
            self.long_prefill_token_threshold != 0 or self.max_num_partial_prefills > 1
        ):
            raise ValueError(
                "step_composition 'phased' computes whole prompts: it takes no "
                "long_prefill_token_threshold and no max_num_partial_prefills above 1"
            )
        if self.long_prefill_token_threshold != "auto":
            # Unset by default, so that one given without auto, even at the value auto would
            # take, is refused rather than ignored.
            for name in ("long_prefill_step_slack", "long_prefill_step_ms"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} sizes the chunks of long_prefill_token_threshold 'auto'; the "
                        f"threshold is {self.long_prefill_token_threshold!r}"
                    )
        if self.enforce_eager and self.compilation_level not in (None, 0):
            raise ValueError(
                f"enforce_eager contradicts compilation_level {self.compilation_level}; "
                "give one of them (enforce_eager is compilation_level 0)"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            stages = self.pipeline_parallel_size
            sizes = f"tensor_parallel_size {self.tensor_parallel_size}"
            sizes += f" x pipeline_parallel_size {stages}" if stages > 1 else ""
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one worker, in the engine core; "
                f"{sizes} needs 'mp' (one process per rank)"
            )
        self._check_nodes()
        self._check_speculative()
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): every adapter of a step is also held in host memory"
            )
        if self.traffic_weight is not None and self.track != "canary":
            raise ValueError(
                f"traffic_weight {self.traffic_weight} is the share of requests a canary "
                f"takes; track {self.track!r} takes no weight (give track 'canary', or no "
                "traffic_weight)"
            )
        if self.kv_encryption == "curve" and self.kv_curve_key_dir is None:
            raise ValueError(
                "kv_encryption curve needs kv_curve_key_dir: the folder of the deployment's "
                "key pair"
            )
        if self.kv_curve_key_dir is not None and self.kv_encryption != "curve":
            raise ValueError(
                "kv_curve_key_dir is read only with kv_encryption curve: give both, or neither"
            )
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must not exceed "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        return self

    def _check_speculative(self) -> None:
        """Refuse what speculative decoding does not run with yet, saying why."""
        if self.speculative_config is None:
            return
        if self.async_scheduling:
            raise ValueError(
                "speculative_config does not run with async_scheduling: the next step's "
                "guesses depend on which of this step's were accepted"
            )
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config does not run with pipeline_parallel_size above 1: the "
                "earlier stages would need every step's guesses and accepted tokens"
            )

    def _check_nodes(self) -> None:
        """Refuse what pipeline stages and nodes cannot serve, saying what would."""
        if self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes {self.nnodes} must divide tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size}: every node runs the same number "
                "of ranks"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and self.data_parallel_size_local > 1:
            raise ValueError(
                "data_parallel_size_local above 1 runs several engine cores in one server; "
                "a model spread over nnodes > 1 runs one (scale out with more replicas)"
            )
        if self.pipeline_parallel_size > 1 and self.kv_role != "none":
            raise ValueError(
                f"kv_role {self.kv_role!r} (disaggregated serving) does not run with "
                "pipeline_parallel_size above 1 yet: each stage holds its own layers' KV blocks"
            )


@dataclass(frozen=True)
class KVPorts:
    """The TCP ports one engine core of a KV producer listens on."""

    side_channel: int  # consumers' release notices
    ranks: tuple[int, ...]  # tensor-parallel rank r serves cache blocks on ranks[r]

    @property
    def all(self) -> tuple[int, ...]:
        """The side channel, then the ranks' ports."""
        return (self.side_channel, *self.ranks)


def kv_port_layout(
    first_port: int, data_parallel_size_local: int, tensor_parallel_size: int
) -> list[KVPorts]:
    """A KV producer's ports from `first_port` on: per engine core, side channel then ranks."""
    stride = tensor_parallel_size + 1
    return [
        KVPorts(side_channel=base, ranks=tuple(range(base + 1, base + stride)))
        for base in range(first_port, first_port + data_parallel_size_local * stride, stride)
    ]


class TenancyArgs(BaseModel):
    """Who may call an HTTP entry point, and whose cached prefixes a request may reuse."""

    model_config = ConfigDict(extra="forbid")

    api_key: SecretStr | None = Field(
        None,
        description="Require `Authorization: Bearer KEY` on every API route (not on the probes "
        "or /metrics); also read from TIDEGATE_API_KEY. Visible to `ps`: prefer api_key_file.",
    )
    api_key_file: str | None = Field(
        None,
        description="File holding the API keys (a mounted Secret): one a line, blank lines and "
        "# comments skipped. Read again within a second of a change, so keys rotate without a "
        "restart; a file that turns unreadable or empty keeps the keys read before.",
    )
    cache_salt_header: str | None = Field(
        None,
        description="Request header naming the tenant (set by an authenticating gateway, e.g. "
        "x-tenant-id): its value becomes the request's cache_salt, so tenants never share "
        "cached prefix blocks; a cache_salt in the body is replaced, and dropped when the "
        "header is absent.",
    )


class ServerArgs(TenancyArgs):
    """How `tidegate serve` listens and admits requests (engine shape is EngineArgs)."""

    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    served_model_name: list[str] | None = Field(
        None, description="Names clients use in `model`; the first is reported. Default: --model."
    )
    max_waiting_requests: int | None = Field(
        None, ge=1, description="Refuse requests with 429 while this many are queued."
    )
    max_waiting_per_tenant: int | None = Field(
        None,
        ge=1,
        description="Refuse a tenant's requests with 429 while this many of its own are queued "
        "(per engine core), so that one tenant cannot fill the queue for everyone.",
    )
    request_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds a request may take from arrival to its last token; a late one is "
        "aborted (its KV blocks freed) and answered 504, or ends its stream with that error.",
    )
    metrics_compat: Literal["none", "vllm"] = Field(
        "none", description="Also export metrics under vLLM's `vllm:` names."
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, description="Seconds SIGTERM waits for in-flight requests before exiting."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of all processes."
    )
    lora_modules: list[str] | None = Field(
        None,
        description="LoRA adapters served from start-up, as name=path (PEFT folders); needs "
        "enable_lora.",
    )
    lora_modules_file: str | None = Field(
        None,
        description="YAML file listing adapters as [{name, path}] (a mounted ConfigMap); the "
        "server re-reads it when it changes and loads or unloads adapters to serve exactly "
        "those (plus lora_modules), without a restart. Needs enable_lora.",
    )
    allow_runtime_lora_updates: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "routes); needs an API key, since they read server paths.",
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        None,
        description="The model family's format of tool calls, read from its output for chat "
        "requests with tools and tool_choice 'auto' (the default with tools); without it such "
        "requests are refused (tool_choice 'required' or a named function need no parser).",
    )
    pooling: Literal["auto", "last", "mean"] = Field(
        "auto",
        description="How POST /v1/embeddings pools the final hidden states: 'last' (the last "
        "input token's, as decoder embedding models are trained), 'mean' (their average over "
        "the input), or 'auto': as the model folder's sentence-transformers modules.json says, "
        "else 'last'. The folder's Normalize module says whether vectors are normalised "
        "(without modules.json they are); a request may say otherwise (normalize).",
    )
    prefill_via_header: bool = Field(
        False,
        description="Honour the x-prefiller-host-port header an endpoint picker sets: run the "
        "request's prefill on that prefill instance, then decode here with its KV blocks "
        "(disaggregated serving through a Gateway).",
    )
    prefill_hosts: list[str] = Field(
        default_factory=list,
        description="With --prefill-via-header: the prefill instances the header may name, as "
        "host names (a headless Service's name stands for its pods' addresses, resolved again "
        "as they change) or addresses. The prompt is never sent to another host: it is "
        "computed here. Empty: any host the header names.",
    )

    @model_validator(mode="after")
    def _prefill_hosts_need_the_header(self) -> ServerArgs:
        if self.prefill_hosts and not self.prefill_via_header:
            raise ValueError(
                "prefill_hosts needs prefill_via_header: it limits the hosts that header may "
                "name, and without the flag the header is ignored"
            )
        return self


class RouterArgs(TenancyArgs):
    """How `tidegate router` finds prefill and decode instances and listens (disaggregated)."""

    prefill: list[str] = Field(
        default_factory=list,
        description="Prefill instance URLs; a headless Service's URL means every pod behind it. "
        "None: every request goes to a decode instance whole (a load balancer for a unified "
        "pool).",
    )
    decode: list[str] = Field(description="Decode instance URLs, as for prefill.")
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    health_interval: float = Field(
        5.0,
        gt=0,
        description="Seconds between health checks of every instance (and DNS re-resolution).",
    )
    connect_timeout: float = Field(
        2.0,
        gt=0,
        description="Seconds an instance may take to accept a connection before another is tried.",
    )
    prefill_timeout: float = Field(
        600.0, gt=0, description="Seconds a prefill instance may take to answer."
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, description="Seconds SIGTERM waits for in-flight requests before exiting."
    )
    max_pending: int = Field(
        256,
        ge=0,
        description="Requests held per pool while it has no healthy instance (scaled to zero, "
        "or all restarting) until one is ready; more get a 503 with Retry-After. 0: none is "
        "held, every such request gets the 503 at once.",
    )
    pending_timeout: float = Field(
        300.0,
        gt=0,
        description="Seconds a held request waits for an instance of its pool (longer than a "
        "cold start) before a 503 with Retry-After.",
    )
    tokenizer: str | None = Field(
        None,
        description="The served model's folder (tokenizer and chat template). With it the "
        "router routes by the KV blocks each instance holds: it follows every instance's "
        "KV-cache events (their --kv-events-port) and hashes prompts exactly as the engines "
        "do. Without it: rendezvous hashing of the prompt's text.",
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="The KV-events port of instances whose /metrics does not name one "
        "(tidegate:kv_events_info); needs --tokenizer.",
    )
    epp_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Also serve the Gateway API Inference Extension's endpoint picker (Envoy's "
        "ext_proc gRPC service, and gRPC health) on this port.",
    )
    epp_shed_load: float | None = Field(
        None,
        gt=0,
        description="Endpoint picker: answer 429 when even the least loaded instance carries "
        "this many requests (running + waiting); default: never shed.",
    )
    max_running_per_tenant: int | None = Field(
        None,
        ge=1,
        description="The engines' per-tenant running limit; with max_waiting_per_tenant the "
        "router answers 429 to a tenant that has (running + waiting limit) requests in flight "
        "through it per healthy instance of the pool, before any instance sees the request.",
    )
    max_waiting_per_tenant: int | None = Field(
        None,
        ge=1,
        description="The engines' per-tenant waiting limit; see max_running_per_tenant.",
    )

    @model_validator(mode="after")
    def _kv_routing_needs_the_tokenizer(self) -> RouterArgs:
        if self.kv_events_port is not None and self.tokenizer is None:
            raise ValueError(
                "kv_events_port needs tokenizer: the router hashes prompts as the engines do, "
                "so it needs the served model's folder (tokenizer and chat template)"
            )
        if (self.max_running_per_tenant is None) != (self.max_waiting_per_tenant is None):
            raise ValueError(
                "the router limits a tenant's requests in flight, running plus waiting: give "
                "max_running_per_tenant and max_waiting_per_tenant together, or neither"
            )
        return self

    @property
    def max_in_flight_per_tenant(self) -> int | None:
        """A tenant's requests in flight per healthy instance before a 429; None: no limit."""
        if self.max_running_per_tenant is None or self.max_waiting_per_tenant is None:
            return None
        return self.max_running_per_tenant + self.max_waiting_per_tenant
