"""Every message that crosses a process boundary, as typed msgspec structs.

API server -> EngineCore (ZMQ ROUTER/DEALER): `EngineCoreRequest`, aborts, shutdown.
EngineCore -> API server (ZMQ PUSH/PULL): `EngineCoreOutputs`, one per step.
API server -> routers (ZMQ XPUB/SUB): `KVEventsMessage` and `KVEventsSnapshot`.
EngineCore -> workers (shared-memory broadcast): `WorkerCommand`s carrying `SchedulerOutput`.
Worker rank 0 -> EngineCore (pipe): `WorkerReply`s carrying `ModelRunnerOutput`.
In one process the same structs are passed as plain objects.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tidegate.engine.sampling_params import SamplingParams

# -- LoRA adapters --------------------------------------------------------------------------


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """The adapter a request runs under, as the API server's registry resolved its name."""

    name: str
    # Unique per load within one server: workers cache adapter weights by it, so an adapter
    # unloaded and loaded again under the same name never reuses stale weights.
    lora_id: int
    path: str
    # sha256 of the adapter's files: the prefix-cache key, so KV computed under one adapter's
    # weights is never a hit for another (the same files under two names may share it).
    digest: str


# -- the scheduler/runner boundary --------------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the runner has not seen: everything it needs to build its inputs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the runner already holds: what changed since its last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # After preemption the request owns a fresh block list: new_block_ids replaces the old.
    resumed_from_preemption: bool = False
    # Pipeline parallelism: the sampled tokens this step reads, ending at its last position.
    # Only the last stage samples; the stages before it learn the tokens here.
    new_token_ids: list[int] = msgspec.field(default_factory=list)


class KVRecvSpec(msgspec.Struct, array_like=True):
    """Pull a request's prompt KV from a producer into these local blocks (disaggregated)."""

    req_id: str
    # The producer's name for the pinned blocks, and where its workers serve them.
    transfer_id: str
    host: str
    data_ports: list[int]
    # Producer block i holds the same tokens as local block i of the lists below.
    remote_block_ids: list[int]
    local_block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a step asks of the workers' KV connectors, beside computing tokens."""

    # Start pulling these (consumer).
    recv: list[KVRecvSpec] = msgspec.field(default_factory=list)
    # Pulled KV to write into the cache before this step's forward pass.
    load: list[str] = msgspec.field(default_factory=list)
    # Pulls whose result must be dropped (aborted, timed out, or failed on another rank).
    discard: list[str] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct):
    """One step's plan: which requests compute how many tokens, in batch order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = msgspec.field(default_factory=set)
    preempted_req_ids: set[str] = msgspec.field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Structured outputs: the grammar-constrained requests that sample a token this step.
    grammar: GrammarBitmask | None = None
    # Speculative decoding: requests that also compute guessed tokens (prompt lookup), after
    # their last known one; num_scheduled_tokens counts them. The runner samples each position.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarBitmask(msgspec.Struct, array_like=True):
    """Which tokens each constrained request may sample this step.

    `bitmask` is int32 words [len(req_ids), words] in native byte order, bit j of word i
    allowing token 32*i + j. It is None when the step was planned before the previous step's
    tokens were known (async scheduling): the worker then waits for the bitmask the engine
    core hands its executor once those tokens are applied.
    """

    req_ids: list[str]
    words: int
    bitmask: bytes | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Per sampled token: ids and logprobs (sampled token first, then the top-k), and its rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def head(self, n: int) -> LogprobsLists:
        """The entries of the first n tokens (a step's tokens past a stop are dropped)."""
        return LogprobsLists(self.token_ids[:n], self.logprobs[:n], self.sampled_token_ranks[:n])


class ModelRunnerOutput(msgspec.Struct):
    """Sampled tokens of one step; requests still mid-prefill get an empty list."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    # Requests with prompt_logprobs, on the step that samples their first token: one entry per
    # prompt token after the first (the token itself, then the top k; its rank).
    prompt_logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    # Requests with pooling, on the step that samples their first token: the pooled vector.
    pooled: dict[str, list[float]] = msgspec.field(default_factory=dict)


# -- API server <-> EngineCore --------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request, as the API server hands it to an engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    # time.monotonic() at the API server; CLOCK_MONOTONIC is shared by all processes.
    arrival_time: float
    cache_salt: str | None = None
    # Disaggregated serving: {"do_remote_decode": true} on a producer, or the producer's
    # answer (do_remote_prefill plus where the blocks are) on a consumer.
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None
    # Who sent it, for the per-tenant limits and fair scheduling: the cache-salt header's
    # value, else a digest of the API key; None is the one anonymous tenant.
    tenant: str | None = None
    # --scheduling-policy priority: lower values are admitted first (vLLM's field).
    priority: int = 0


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every message to an engine core; the second frame is the payload."""

    ADD = b"\x00"  # EngineCoreRequest
    ABORT = b"\x01"  # list[str] of request ids
    SHUTDOWN = b"\x02"  # empty: finish nothing more, stop the workers, exit 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request, on its way to the detokenizer."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    # With the first token of a request that asked for them: its prompt tokens' logprobs.
    prompt_logprobs: LogprobsLists | None = None
    # With the first token of a request with pooling: its prompt's pooled hidden states.
    pooled: list[float] | None = None
    num_cached_tokens: int = 0
    # Seconds from arrival to first being scheduled; set on a request's first output only.
    queue_time: float | None = None
    # Producer: where a consumer pulls this request's prompt KV (on its last output).
    kv_transfer_params: dict[str, Any] | None = None
    # The request was refused after it reached the engine (its grammar did not compile): the
    # reason, on its only output (finish_reason "error").
    error: str | None = None


class StepTime(msgspec.Struct, array_like=True):
    """One executed step: its wall seconds and what it computed.

    `seconds` runs from the start of the engine core's step to its outputs (schedule, model,
    update), or with async scheduling from the previous step's result to this one's: the
    time the running streams waited for this step's tokens. `decodes` counts the requests
    that computed one token past their prompt, `prompt_tokens` every other token computed
    (prompt chunks, and recomputation after a preemption).
    """

    seconds: float
    decodes: int
    prompt_tokens: int


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """The scheduler and KV cache after a step; counters are totals since the core started."""

    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_computed: int = 0
    # Speculative decoding: decodes given guesses, tokens guessed, guesses accepted (vLLM's
    # spec_decode_num_drafts, _num_draft_tokens and _num_accepted_tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # The highest kv_cache_usage since the core started, including within steps.
    kv_cache_usage_peak: float = 0.0
    # Tokens computed by the step these stats follow (0 when no step ran).
    num_batched_tokens: int = 0
    # Disaggregated serving (totals except where said).
    kv_pinned_blocks: int = 0  # gauge: producer blocks held for consumers
    kv_pins_expired: int = 0  # pins released by --kv-transfer-timeout, not by a consumer
    kv_received_bytes: int = 0
    kv_transfer_fallbacks: int = 0  # pulls that failed; the prompt was computed locally
    # Seconds each pull completed since the last stats took (consumer).
    kv_transfer_latencies: list[float] = msgspec.field(default_factory=list)
    # LoRA: adapter name -> requests running (or waiting) under it.
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    # The steps executed since the last stats took (usually the one step they follow); the
    # API server turns them into the tidegate:step_* metrics (engine/metrics.py).
    steps: list[StepTime] = msgspec.field(default_factory=list)


# -- KV-cache events (engine core -> API server -> routers) ----------------------------------


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    """Full blocks entered the prefix cache: a chain of hashes, each the next one's parent.

    `lora_digest` names the adapter the blocks were computed under (its first block's key),
    so that a router learns which digest to hash an adapter's requests with.
    """

    block_hashes: list[bytes]
    parent_hash: bytes | None
    block_size: int
    lora_name: str | None = None
    lora_digest: str | None = None


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    """Blocks left the prefix cache (evicted for new content): no request can hit them now."""

    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True):
    """The prefix cache was reset: nothing is held."""


# What a prefix cache reports (not the KV *transfer* events, KVEvent, below).
CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventsMessage(msgspec.Struct, array_like=True):
    """What a server publishes after each engine step that changed its prefix cache.

    `epoch` is random per server start and `seq` counts messages from 1 within it: a
    subscriber that sees another epoch, or skips a number, asks for a replay.
    `pool` is the engine core (data-parallel rank) whose block pool changed.
    """

    epoch: str
    seq: int
    pool: int
    events: list[CacheEvent]


class HeldBlocks(msgspec.Struct, array_like=True):
    """Everything one engine core's prefix cache holds, for a replay."""

    block_size: int
    block_hashes: list[bytes]
    # The adapters blocks were stored under, name -> digest.
    loras: dict[str, str] = msgspec.field(default_factory=dict)


class KVEventsSnapshot(msgspec.Struct, array_like=True):
    """A replay: every core's held blocks as of message `seq` of `epoch` (0: none yet)."""

    epoch: str
    seq: int
    pools: dict[int, HeldBlocks]


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """Everything an engine core reports at once: one step's outputs and its stats."""

    engine_index: int
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    # Requests refused at admission because the waiting queue was full.
    rejected_request_ids: list[str] = msgspec.field(default_factory=list)
    # Requests refused because their tenant had --max-waiting-per-tenant queued.
    rejected_tenant_request_ids: list[str] = msgspec.field(default_factory=list)
    # Set on the last message of a core that is going down: what killed it.
    engine_dead: str | None = None
    # How the prefix cache changed since the last message (only with --kv-events-port).
    kv_events: list[CacheEvent] = msgspec.field(default_factory=list)


class EngineCoreReady(msgspec.Struct):
    """An engine core's first message: it is serving, and with which limits."""

    engine_index: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    dtype: str  # what its workers compute in: --dtype, or what auto picked (model/dtypes.py)


# -- EngineCore <-> workers ----------------------------------------------------------------


class InitializeKVCache(msgspec.Struct, tag=True):
    """Allocate this many KV blocks (the smallest number every worker can hold)."""

    num_blocks: int


class ExecuteModel(msgspec.Struct, tag=True):
    """Run one step."""

    scheduler_output: SchedulerOutput


class ShutdownWorker(msgspec.Struct, tag=True):
    """Leave the loop and exit 0."""


class KVPins(msgspec.Struct, tag=True):
    """Producer: serve these blocks to consumers (pin) or stop serving them (unpin).

    A worker applies it before any later step, so a block is never read after the scheduler
    has handed it to another request.
    """

    pin: dict[str, list[int]]
    unpin: list[str]


WorkerCommand = InitializeKVCache | ExecuteModel | KVPins | ShutdownWorker


class WorkerReady(msgspec.Struct, tag=True):
    """A worker loaded its shard: how many KV blocks fit in the memory it was given."""

    rank: int
    num_kv_blocks: int
    # Where its KV connector serves blocks (0 without one).
    kv_data_port: int = 0


class WorkerWarmedUp(msgspec.Struct, tag=True):
    """A worker allocated its KV cache and warmed up (compiled) its model: it may serve."""

    rank: int


class WorkerResult(msgspec.Struct, tag=True):
    """The result of one ExecuteModel (sent by the output rank only: TP rank 0 of the last
    pipeline stage)."""

    output: ModelRunnerOutput


class WorkerFailure(msgspec.Struct, tag=True):
    """A worker could not carry out a command; it exits after sending this."""

    rank: int
    error: str


WorkerReply = WorkerReady | WorkerWarmedUp | WorkerResult | WorkerFailure


# -- leader <-> the other nodes of a model spread over nodes ---------------------------------


class NodeHello(msgspec.Struct, array_like=True):
    """A node (node_rank > 0) asks the leader for its part; repeated until answered."""

    node_rank: int
    nnodes: int
    host: str
    pid: int


class NodeStart(msgspec.Struct, array_like=True):
    """The leader's answer: the engine's arguments (EngineArgs as JSON), and where the ranks
    meet. The node starts its share of the ranks with them."""

    engine_args: bytes
    max_model_len: int
    init_method: str


# -- KV transfer (disaggregated prefill/decode) ----------------------------------------------


class KVWorkerConfig(msgspec.Struct):
    """What each worker needs to run its side of the KV connector."""

    connector: str
    role: str  # producer | consumer
    # Port of rank r's block server (producer); 0 picks a free one.
    data_port: int
    # Where workers report finished pulls to their engine core.
    events_address: str
    timeout_s: float
    # --kv-encryption curve: the folder of the deployment's key pair, which each worker reads
    # itself (the secret key never crosses a process boundary); empty: plain TCP.
    curve_key_dir: str = ""


class KVRecvDone(msgspec.Struct, tag=True):
    """A consumer worker finished (or gave up) pulling one request's blocks."""

    req_id: str
    rank: int
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class KVRelease(msgspec.Struct, tag=True):
    """Consumer -> producer engine core: the pinned blocks of this transfer may be freed."""

    transfer_id: str


KVEvent = KVRecvDone | KVRelease


class KVReadRequest(msgspec.Struct, array_like=True):
    """Consumer worker -> producer worker: these blocks of a pinned transfer, these heads."""

    transfer_id: str
    block_ids: list[int]
    head_start: int
    head_end: int


class KVReadReply(msgspec.Struct, array_like=True):
    """The header of a block read; one K and one V frame per layer follow when ok."""

    ok: bool
    error: str = ""
    dtype: str = ""
    # Of each frame: [blocks, block_size, heads, head_dim].
    shape: list[int] = msgspec.field(default_factory=list)
