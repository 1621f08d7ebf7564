"""Tuning: the engine flags of each role, chosen from the spec by a stated cost model.

Every value is a Choice with a reason, which users read in `kubectl get llmd -o yaml` and in
`tidegate plan`. A value the user set wins, but is still checked against the same refusals.

The cost model (estimates; each reason shows the arithmetic with the numbers it used):
- Weights take parameterCount x dtype bytes (dtype auto: 2 B, as nearly every checkpoint is
  16-bit), or 1 B under model.quantization fp8, whatever the dtype. Under quantization auto an
  FP8 checkpoint is still counted by dtype: the operator does not read the checkpoint, and the
  over-estimate errs towards a wider TP, never towards weights that do not load. Tensor
  parallelism (TP) splits the weights evenly over TP accelerators.
- A prompt token costs 2 x parameterCount FLOPs (a multiply and an add per weight).
  Attention's share, which grows with the context, is left out: it is small for chunks of a
  few thousand tokens, and the MFU below is low enough to absorb it.
- Pipeline parallelism (PP) splits the layers into stages, each on TP accelerators: the
  weights take parameterCount x dtype bytes / (TP x PP) per accelerator. A step passes the
  stages one after another, so its latency is the TP-only figure below; PP adds room for
  weights (and, with several steps in flight, throughput), not speed. TP stays within a node
  (it all-reduces inside every layer); a replica that needs more accelerators than a node has
  (accelerator.perNode) takes whole nodes, a pod on each, with stages across them.
- One engine core computes TP x peak x ASSUMED_MFU FLOP/s. peak is accelerator.peakTflops
  (dense 16-bit), else the product DEFAULT_PRODUCTS assumes for the resource name. float32
  matmuls run slower than that: set peakTflops to the fp32 rate when serving float32. FP8
  matmuls are counted at the 16-bit rate too: where the device has them they run faster, and
  the slower estimate only makes chunks smaller than the SLO would allow; elsewhere the
  engine emulates them, many times slower, and quantization fp8 is not for serving there.
- A decode step reads every weight once: weight bytes / TP / the product's memory bandwidth.
  Reads of the running requests' KV cache are left out, so this is a lower bound.
- Unified pods: a step that carries a prompt chunk must still meet the ITL SLO, so the chunk
  is the prompt tokens whose compute fits in (itlMs - decode step).
- Prefill pods carry no decodes: a step may take the whole TTFT SLO.
- Decode pods compute only the occasional local prompt tail: DECODE_CHUNK_TOKENS, or the
  unified chunk when that is smaller.
- Chunks are whole KV blocks, from MIN_CHUNK_BLOCKS blocks up to a maximum or maxModelLen. An
  SLO that even the smallest chunk misses gets that chunk and a reason saying the SLO is out
  of reach; it is not refused. maxNumBatchedTokens = threshold + maxNumSeqs (a decode token
  for every running request); on prefill pods it is the chunk itself.
Without parameterCount, or on CPU, a step's cost is unknown: the threshold is then "auto",
and the engine's ChunkSizeTuner sizes chunks online from the step times it measures. Unified
and decode pods then also get the ITL SLO as the tuner's step target (longPrefillStepMs): a
step that carries prompt chunks may take up to itlMs, the same budget a known cost gives it
above, where the engine's own slack (1 + slack times a decode-only step) would allow less.
Without it, steps on a fast decode stay far under the SLO and the prompts waiting behind the
chunks pay in TTFT (benchmarks/README.md, "Auto chunking under sustained load": TTFT p50 at
2 req/s 960 ms at the default slack alone, 228 ms with a 50 ms target, ITL p99 43 and 55 ms).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tidegate.engine.config import EngineArgs
from tidegate.operator.spec import (
    MAX_PARALLEL_SIZE,
    LLMDeploymentSpec,
    ModelSpec,
    RoleSpec,
    SpecError,
)

GIB = 1 << 30
# Weights may fill this much of one accelerator; the rest holds the KV cache (which decides
# how many requests run at once), activations and the runtime's own memory. With less than a
# fifth left a pod serves only a handful of requests, so a wider TP is the better deal.
WEIGHT_MEMORY_FRACTION = 0.8
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
# model.quantization fp8 holds each weight in one byte, whatever the dtype (the activations'
# type then). Layers the engine keeps in dtype (such as the embeddings) are left out: a few
# percent of a large model's weights, within the room WEIGHT_MEMORY_FRACTION leaves.
FP8_BYTES = 1
# Model FLOPs utilisation of prefill: large GEMMs reach 40-60% on current GPUs; the low end
# keeps the chunks on the safe side of the SLO.
ASSUMED_MFU = 0.4


@dataclass(frozen=True)
class Product:
    """The figures the cost model assumes for an accelerator nobody described."""

    name: str
    peak_tflops: float  # dense bf16
    bandwidth_tbps: float  # memory, TB/s


DEFAULT_PRODUCTS = {
    "nvidia.com/gpu": Product("H100 SXM", 989.0, 3.35),
    "amd.com/gpu": Product("MI300X", 1307.0, 5.3),
}
# Any other resource name gets the H100's figures, and its reasons say so.
FALLBACK_PRODUCT = DEFAULT_PRODUCTS["nvidia.com/gpu"]

# Worker ranks (TP x PP on its node) a CPU pod may run: processes with gloo between them.
MAX_CPU_TENSOR_PARALLEL = 8
# The smallest chunk, in KV blocks: below it a step spends more on overhead than on the prompt.
MIN_CHUNK_BLOCKS = 4
# Activation memory grows with a step's tokens, and a longer step is a longer stall anyway.
MAX_UNIFIED_CHUNK_TOKENS = 16384
MAX_PREFILL_CHUNK_TOKENS = 32768
# Decode pods see a prompt only for the tail a prefill pod did not compute, or a local
# fallback: a few blocks of chunk is enough, and keeps every step a decode step.
DECODE_CHUNK_TOKENS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS: int = EngineArgs.model_fields["max_num_batched_tokens"].default


class TuningError(SpecError):
    """A spec no tuning can serve; the message says which values and what is allowed."""


@dataclass(frozen=True)
class Choice:
    """One tuned value and why: `value` is an int, or "auto" for the engine's chunk tuner."""

    value: int | str
    reason: str
    user_set: bool = False


@dataclass(frozen=True)
class RoleTuning:
    """The tuned engine flags of one pool (unified, prefill or decode)."""

    role: str
    tensor_parallel_size: Choice
    pipeline_parallel_size: Choice
    nodes: Choice  # nodesPerReplica: pods one replica spans
    data_parallel_size_local: Choice
    max_num_batched_tokens: Choice
    long_prefill_token_threshold: Choice
    accelerated: bool = True
    # With an auto threshold on a pool whose steps carry decodes: the chunk tuner's step
    # target (None: none is passed, the engine's slack alone bounds a step).
    long_prefill_step_ms: Choice | None = None

    def choices(self) -> dict[str, Choice]:
        """The choices by their CRD (camelCase) names, in the order status shows them."""
        choices = {
            "tensorParallelSize": self.tensor_parallel_size,
            "pipelineParallelSize": self.pipeline_parallel_size,
            "nodesPerReplica": self.nodes,
            "dataParallelSizeLocal": self.data_parallel_size_local,
            "longPrefillTokenThreshold": self.long_prefill_token_threshold,
            "maxNumBatchedTokens": self.max_num_batched_tokens,
        }
        if self.long_prefill_step_ms is not None:
            choices["longPrefillStepMs"] = self.long_prefill_step_ms
        return choices

    def engine_choices(self) -> dict[str, Choice]:
        """The choices by EngineArgs field, in the order the config file lists them. Pipeline
        stages and nodes only above 1: a one-node replica's file reads (and hashes) as it did
        before they existed."""
        choices = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size_local": self.data_parallel_size_local,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
        }
        if self.pipeline_parallel_size.value != 1:
            choices["pipeline_parallel_size"] = self.pipeline_parallel_size
        if self.nodes.value != 1:
            choices["nnodes"] = self.nodes
        if self.long_prefill_step_ms is not None:
            choices["long_prefill_step_ms"] = self.long_prefill_step_ms
        return choices

    def engine_args(self) -> dict[str, int | str]:
        """The values as EngineArgs fields."""
        return {field: choice.value for field, choice in self.engine_choices().items()}

    @property
    def nodes_per_replica(self) -> int:
        """Pods one replica spans: above 1 its pool is a LeaderWorkerSet."""
        return int(self.nodes.value)

    def to_status(self) -> dict[str, int | str]:
        """The values under their camelCase status names."""
        return {name: choice.value for name, choice in self.choices().items()}

    def accelerators_per_pod(self) -> int:
        """Accelerators one pod of this role requests (0 on CPU): its share of the ranks."""
        if not self.accelerated:
            return 0
        ranks = int(self.tensor_parallel_size.value) * int(self.pipeline_parallel_size.value)
        return ranks * int(self.data_parallel_size_local.value) // self.nodes_per_replica


@dataclass(frozen=True)
class Tuning:
    """The tuned flags of every role of a deployment."""

    roles: dict[str, RoleTuning]

    def reasons(self) -> list[str]:
        """One line per value of every role, as "role.field=value: reason"."""
        return [
            f"{role.role}.{name}={choice.value}: {choice.reason}"
            for role in self.roles.values()
            for name, choice in role.choices().items()
        ]

    def to_status(self) -> dict:
        """The effective values and their reasons, for the resource's status."""
        roles = {name: role.to_status() for name, role in self.roles.items()}
        return {"roles": roles, "reasons": self.reasons()}


@dataclass(frozen=True)
class MeasuredChunks:
    """A role's chunk threshold and step budget from closed-loop tuning (operator/step_fit.py:
    fitted to the steps its engines measured), with why."""

    threshold: int
    budget: int
    reason: str


def tune(spec: LLMDeploymentSpec, measured: Mapping[str, MeasuredChunks] | None = None) -> Tuning:
    """The engine flags of every role, each with its reason; TuningError when none can work.

    `measured` (spec.tuning.mode closed-loop) replaces the cost model's threshold and budget
    of the roles it names, where the spec leaves them auto.
    """
    roles = {
        name: _tune_role(spec, name, role, (measured or {}).get(name))
        for name, role in spec.topology.roles().items()
    }
    for role in roles.values():
        _check_spread(spec, role)
    if "prefill" in roles:
        prefill = roles["prefill"].tensor_parallel_size.value
        decode = roles["decode"].tensor_parallel_size.value
        if prefill > decode:
            raise TuningError(
                f"prefill tensorParallelSize {prefill} is larger than decode tensorParallelSize "
                f"{decode}: the KV transport cannot reshard blocks from a wider prefill to a "
                "narrower decode; allowed: a prefill TP of at most the decode TP "
                "(spec.topology.prefill/decode.tensorParallelSize)"
            )
    return Tuning(roles)


def _tune_role(
    spec: LLMDeploymentSpec, name: str, role: RoleSpec, measured: MeasuredChunks | None
) -> RoleTuning:
    tp, pp, nodes, dp = _parallelism(spec, name, role)
    threshold, budget = _chunks(spec, name, role, _step_cost(spec, int(tp.value)))
    if measured is not None and not threshold.user_set and not budget.user_set:
        threshold = Choice(measured.threshold, f"closed-loop: {measured.reason}")
        budget = step_budget(
            measured.threshold, spec.scheduling.max_num_seqs, spec.scheduling.block_size
        )
        if measured.budget != budget.value:
            budget = Choice(
                measured.budget,
                "closed-loop: the fitted chunk plus a decode token for every running request",
            )
    return RoleTuning(
        name,
        tp,
        pp,
        nodes,
        dp,
        budget,
        threshold,
        spec.accelerator is not None,
        _step_target(spec, name, threshold),
    )


def _step_target(spec: LLMDeploymentSpec, name: str, threshold: Choice) -> Choice | None:
    """The chunk tuner's step target of a pool with auto chunks whose steps carry decodes: the
    ITL SLO (None elsewhere: a fixed threshold has no tuner, prefill pods run no decodes)."""
    if threshold.value != "auto" or name == "prefill":
        return None
    itl = spec.scheduling.slo.itl_ms
    return Choice(
        itl,
        f"the ITL SLO {itl} ms (spec.scheduling.slo.itlMs): with auto chunks a step that "
        "carries prompt chunks may take up to it, where the engine's slack alone (1 + "
        "--long-prefill-step-slack times a decode-only step) would allow less",
    )


def _check_spread(spec: LLMDeploymentSpec, role: RoleTuning) -> None:
    """Refuse what a pool with pipeline stages, or over several nodes, cannot run yet."""
    stages, nodes = int(role.pipeline_parallel_size.value), role.nodes_per_replica
    if role.role in ("prefill", "decode") and stages > 1:
        raise TuningError(
            f"the {role.role} pool needs pipelineParallelSize {stages} "
            f"({role.pipeline_parallel_size.reason}), but disaggregated pools run one pipeline "
            "stage: the engine's KV transfer does not move the blocks of several stages yet; "
            "allowed: a model that one node holds at TP alone, or topology.mode unified"
        )
    if nodes == 1:
        return
    where = f"the {role.role} pool spans {nodes} nodes per replica (a LeaderWorkerSet)"
    policies = spec.autoscaling.policies() if spec.autoscaling is not None else {}
    if role.role in policies:
        raise TuningError(
            f"autoscaling.{role.role}: {where}, and autoscaling such a pool is not supported "
            f"yet; allowed: fixed replicas (topology.{role.role}.replicas, no "
            f"autoscaling.{role.role})"
        )
    if spec.canary():
        raise TuningError(
            f"rollout.strategy canary: {where}, and a canary of such a pool is not supported "
            "yet; allowed: rollout.strategy rolling (the LeaderWorkerSet replaces one group "
            "at a time, a new one ready before an old one goes)"
        )


def _setting(
    role_value: int | str | None, pool_value: int | str, role: str, field: str, section: str
) -> tuple[int | str, str]:
    """The value that applies (a role's override wins) and where it was set."""
    if role_value is not None:
        return role_value, f"spec.topology.{role}.{field}"
    return pool_value, f"spec.{section}.{field}"


# --- parallelism: tensor, pipeline, nodes and data --------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """The accelerators one replica may use: a node's, and the replica's as the spec gives them."""

    size: int  # of one node: accelerator.perNode, else count (a replica is one pod)
    count: int | None  # of one replica; None: sized from the weights (perNode given, no count)
    per_node: bool  # whether accelerator.perNode is given: only then may a replica span nodes

    @property
    def budget(self) -> int:
        """The most accelerators one replica may use."""
        return self.count if self.count is not None else MAX_PARALLEL_SIZE

    @property
    def spans(self) -> bool:
        """Whether accelerator.count itself asks for more than one node."""
        return self.count is not None and self.count > self.size


def _shape(spec: LLMDeploymentSpec) -> _Shape:
    accelerator = spec.accelerator
    assert accelerator is not None
    count = accelerator.count
    if count is None and accelerator.per_node is None:
        count = 1
    return _Shape(accelerator.node_size(), count, accelerator.per_node is not None)


def _parallelism(
    spec: LLMDeploymentSpec, name: str, role: RoleSpec
) -> tuple[Choice, Choice, Choice, Choice]:
    """(tensorParallelSize, pipelineParallelSize, nodesPerReplica, dataParallelSizeLocal)."""
    tp_set, where = _setting(
        role.tensor_parallel_size,
        spec.parallelism.tensor_parallel_size,
        name,
        "tensorParallelSize",
        "parallelism",
    )
    if spec.accelerator is None:
        return _cpu_parallelism(spec, tp_set, where)
    shape = _shape(spec)
    pp_set = spec.parallelism.pipeline_parallel_size
    if tp_set == "auto":
        tp = _auto_tensor_parallel(spec, shape, pp_set)
    else:
        tp = _checked_tensor_parallel(spec, shape, int(tp_set), where)
    pp = _pipeline_parallel(spec, shape, tp, pp_set)
    tp, pp = _loadable(spec, tp, pp, where)
    nodes = _nodes(spec, shape, int(tp.value), int(pp.value))
    dp = _data_parallel(spec, shape, int(tp.value), int(pp.value), int(nodes.value))
    return tp, pp, nodes, dp


def _cpu_parallelism(
    spec: LLMDeploymentSpec, tp_set: int | str, where: str
) -> tuple[Choice, Choice, Choice, Choice]:
    """CPU pods: ranks are worker processes that share a pod's CPUs and meet over gloo, in the
    pod or, with nodesPerReplica, across pods. Nothing here is worth auto-picking: the user
    sets TP (one rank per NUMA node pays), PP and the nodes (a model too large for one
    machine's memory, or a test of the multi-node path)."""
    pp_set = spec.parallelism.pipeline_parallel_size
    nodes_set = spec.parallelism.nodes_per_replica
    if pp_set != "auto":
        pp = Choice(
            int(pp_set),
            f"set in spec.parallelism.pipelineParallelSize: the layers split into {pp_set} "
            "stages, each its own worker process(es), handing activations on over gloo",
            user_set=True,
        )
    elif nodes_set != "auto" and nodes_set > 1:
        pp = Choice(
            int(nodes_set),
            f"no accelerator: one stage per node of spec.parallelism.nodesPerReplica {nodes_set}",
        )
    else:
        pp = Choice(
            1, "no accelerator: one stage, unless spec.parallelism.pipelineParallelSize says more"
        )
    stages = int(pp.value)
    if tp_set in ("auto", 1):
        worker = "one worker" if stages == 1 else "one worker per pipeline stage"
        tp = Choice(1, f"no accelerator: CPU pods run {worker}", user_set=tp_set == 1)
    else:
        tp = _cpu_tensor_parallel(spec, int(tp_set), where)
    ranks = int(tp.value) * stages
    if nodes_set == "auto":
        nodes = Choice(
            1, "no accelerator: one pod, unless spec.parallelism.nodesPerReplica says more"
        )
    else:
        _check_node_split(
            int(nodes_set), int(tp.value), stages, MAX_CPU_TENSOR_PARALLEL, "a CPU pod runs at most"
        )
        nodes = Choice(
            nodes_set,
            f"set in spec.parallelism.nodesPerReplica: {nodes_set} pod(s) of {ranks // nodes_set} "
            "worker process(es), meeting over TCP (torch.distributed over gloo)",
            user_set=True,
        )
    per_pod = ranks // int(nodes.value)
    if per_pod > MAX_CPU_TENSOR_PARALLEL:
        raise TuningError(
            f"TP {tp.value} x PP {stages} over {nodes.value} pod(s) is {per_pod} worker processes "
            f"per pod, but a CPU pod runs at most {MAX_CPU_TENSOR_PARALLEL}; allowed: more "
            "spec.parallelism.nodesPerReplica, or fewer ranks"
        )
    return tp, pp, nodes, _cpu_data_parallel(spec)


def _cpu_tensor_parallel(spec: LLMDeploymentSpec, tp: int, where: str) -> Choice:
    """A user's TP on CPU pods: ranks are worker processes that share the pod's CPUs and
    all-reduce over gloo. Worth it only where one process cannot use the machine well (one
    rank per NUMA node, as vLLM's CPU backend advises); auto never picks it."""
    if tp > MAX_CPU_TENSOR_PARALLEL:
        raise TuningError(
            f"{where} is {tp}, but spec.accelerator is absent and a CPU pod runs at most "
            f"{MAX_CPU_TENSOR_PARALLEL} worker ranks; allowed: 1 to {MAX_CPU_TENSOR_PARALLEL}, "
            "or auto"
        )
    heads = _heads(spec.model)
    for field, count in heads:
        if count % tp:
            raise TuningError(
                f"{where} {tp} does not divide model.{field} {count}; allowed: "
                f"{', '.join(str(n) for n in range(1, MAX_CPU_TENSOR_PARALLEL + 1) if _divides(n, heads))}"
            )
    return Choice(
        tp,
        f"set in {where}: {tp} CPU worker processes share the pod's CPUs and all-reduce over "
        f"gloo (one per NUMA node is what pays){_heads_note(tp, heads)}",
        user_set=True,
    )


def _cpu_data_parallel(spec: LLMDeploymentSpec) -> Choice:
    dp = spec.parallelism.data_parallel_size_local
    if dp not in ("auto", 1):
        raise TuningError(
            f"spec.parallelism.dataParallelSizeLocal is {dp}, but spec.accelerator is absent "
            "and CPU pods run one engine core; allowed: 1 or auto"
        )
    return Choice(1, "no accelerator: CPU pods run one engine core", user_set=dp == 1)


def _powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`."""
    return [1 << k for k in range(limit.bit_length())]


def _node_tensor_parallel(size: int, heads: list[tuple[str, int]]) -> int:
    """The widest TP of a replica over nodes: a power of two that divides a node's
    accelerators (each node holds whole tensor-parallel groups) and the heads."""
    return max(n for n in _powers_of_two(size) if size % n == 0 and _divides(n, heads))


def _auto_tensor_parallel(spec: LLMDeploymentSpec, shape: _Shape, pp_set: int | str) -> Choice:
    """Within a node: the smallest power of two whose weight share fits and that divides the
    heads. Over nodes (the weights need more than a node, or accelerator.count asks for more):
    as wide as a node allows, with pipeline stages across the nodes."""
    weights, heads = _weight_bytes(spec.model), _heads(spec.model)
    if shape.spans:
        tp = _node_tensor_parallel(shape.size, heads)
        reason = (
            f"accelerator.count {shape.count} spans {shape.count // shape.size} nodes of "
            f"accelerator.perNode {shape.size}: TP {tp}, the widest that divides perNode "
            f"{shape.size}{_heads_note(tp, heads)}; pipeline stages take the other nodes"
        )
        if weights is not None:
            capacity, _ = _weight_room(spec)
            if weights / shape.budget > capacity:
                raise _does_not_fit(spec, shape)
            fits = _needed(weights, capacity, shape.size)
            if fits is not None:
                reason += f" (the weights would fit {fits} accelerator(s) of one node)"
        return Choice(tp, reason)
    if weights is None:
        return Choice(1, "model.parameterCount not given, so the weights' size is unknown: TP 1")
    capacity, room = _weight_room(spec)
    if pp_set != "auto":
        return _stages_tensor_parallel(spec, shape, int(pp_set))
    needed = _needed(weights, capacity, shape.budget)
    if needed is None:
        raise _does_not_fit(spec, shape)
    if needed > shape.size:
        tp = _node_tensor_parallel(shape.size, heads)
        return Choice(
            tp,
            f"{_weights_text(spec.model)} need {needed} accelerators to fit {room}, more than "
            f"one node has (accelerator.perNode {shape.size}): TP {tp}, the widest that "
            f"divides perNode {shape.size}{_heads_note(tp, heads)}; pipeline stages take the "
            "other nodes",
        )
    sizes = _powers_of_two(needed)
    # Powers of two that divide a head count are 1, 2, ... up to some limit: the heads can
    # only forbid the size the weights need, never ask for a larger one.
    if not _divides(needed, heads):
        tp = max(n for n in sizes if _divides(n, heads))
        return Choice(
            tp,
            f"{_weights_text(spec.model)} need {needed} accelerators to fit {room}, but "
            f"{' and '.join(f'model.{f} {c}' for f, c in heads)} divide only by "
            f"{', '.join(str(n) for n in sizes if _divides(n, heads))}: TP {tp}, and pipeline "
            "stages hold the rest",
        )
    smaller = [str(n) for n in sizes if n < needed]
    if smaller:
        fit = f" does not fit {room} at TP {' or '.join(smaller)}; TP {needed} fits "
        fit += f"({_gb(weights / needed)} per accelerator)"
    else:
        fit = f" fits {room} at TP 1"
    return Choice(needed, f"{_weights_text(spec.model)}{fit}{_heads_note(needed, heads)}")


def _needed(weights: float, capacity: float, budget: int) -> int | None:
    """The fewest accelerators, a power of two up to `budget`, whose weight share fits."""
    return next((n for n in _powers_of_two(budget) if weights / n <= capacity), None)


def _stages_tensor_parallel(spec: LLMDeploymentSpec, shape: _Shape, pp: int) -> Choice:
    """TP for a user's pipelineParallelSize: the smallest power of two, within a node and the
    heads, at which each stage's share fits; else the widest, and `_loadable` decides."""
    weights, heads = _weight_bytes(spec.model), _heads(spec.model)
    assert weights is not None
    capacity, room = _weight_room(spec)
    usable = [
        n for n in _powers_of_two(shape.size) if _divides(n, heads) and n * pp <= shape.budget
    ] or [1]
    tp = next((n for n in usable if weights / (n * pp) <= capacity), usable[-1])
    share = weights / (tp * pp)
    fits = "fits" if share <= capacity else "does not fit"
    return Choice(
        tp,
        f"{_weights_text(spec.model)} over spec.parallelism.pipelineParallelSize {pp} stages "
        f"{fits} {room} at TP {tp} ({_gb(share)} per accelerator){_heads_note(tp, heads)}",
    )


def _checked_tensor_parallel(spec: LLMDeploymentSpec, shape: _Shape, tp: int, where: str) -> Choice:
    """A user's TP, refused when a node lacks the accelerators or the heads do not divide."""
    heads = _heads(spec.model)
    if shape.per_node and tp > shape.budget:
        raise TuningError(
            f"{where} {tp} is larger than accelerator.count {shape.count}; allowed: at most "
            f"{shape.count}, the accelerators of one replica"
        )
    if tp > shape.size:
        if shape.per_node:
            raise TuningError(
                f"{where} {tp} is larger than accelerator.perNode {shape.size}: tensor "
                "parallelism all-reduces inside every layer and stays within a node; allowed: "
                f"at most {shape.size}, and pipelineParallelSize for more accelerators"
            )
        raise TuningError(
            f"{where} {tp} is larger than accelerator.count {shape.size}; "
            f"allowed: at most {shape.size}, the accelerators of one pod"
        )
    for field, heads_count in heads:
        if heads_count % tp:
            allowed = [n for n in range(1, shape.size + 1) if _divides(n, heads)]
            raise TuningError(
                f"{where} {tp} does not divide model.{field} {heads_count}; allowed: "
                f"{', '.join(map(str, allowed))} (or auto)"
            )
    return Choice(tp, f"set in {where}{_heads_note(tp, heads)}", user_set=True)


def _pipeline_parallel(
    spec: LLMDeploymentSpec, shape: _Shape, tp_choice: Choice, pp_set: int | str
) -> Choice:
    """Stages: the fewest (a power of two) at which the weights fit beside TP, within the
    replica's accelerators; beside a user's TP, the fewest at which they load at all (the
    user may knowingly leave less room for the KV cache). accelerator.count above a node
    fills its nodes."""
    tp = int(tp_choice.value)
    if pp_set != "auto":
        pp = int(pp_set)
        if tp * pp > shape.budget:
            raise TuningError(
                f"tensorParallelSize {tp} x spec.parallelism.pipelineParallelSize {pp} = "
                f"{tp * pp} accelerators, but accelerator.count is {shape.count}; allowed: a "
                f"pipelineParallelSize of at most {shape.budget // tp}"
            )
        return Choice(
            pp,
            f"set in spec.parallelism.pipelineParallelSize: {pp} stages of TP {tp}, "
            f"{tp * pp} accelerators",
            user_set=True,
        )
    if shape.spans:
        assert shape.count is not None
        if shape.count % tp:
            raise TuningError(
                f"accelerator.count {shape.count} is not a multiple of tensorParallelSize {tp}: "
                "every pipeline stage holds the same TP; allowed: a tensorParallelSize that "
                f"divides accelerator.perNode {shape.size}, or auto"
            )
        pp = shape.count // tp
        return Choice(
            pp,
            f"accelerator.count {shape.count} / TP {tp} = {pp} stages; stages run one after "
            f"another, so a step takes about as long as at TP {tp} alone",
        )
    weights = _weight_bytes(spec.model)
    if weights is None:
        return Choice(
            1, "model.parameterCount not given, so the weights' size is unknown: one stage"
        )
    assert spec.accelerator is not None
    capacity, room = _weight_room(spec)
    if tp_choice.user_set:
        memory = spec.accelerator.memory_gi_b
        capacity, room = memory * GIB, f"accelerator.memoryGiB {memory:g}"
    stages = _powers_of_two(shape.budget // tp) or [1]
    pp = next((s for s in stages if weights / (tp * s) <= capacity), None)
    if pp is None:
        return Choice(
            1,
            f"one stage: more would need more than the {shape.budget} accelerators of "
            f"{'accelerator.count' if shape.count is not None else 'one replica'}",
        )
    if pp == 1:
        return Choice(1, f"the weights fit at TP {tp}: one stage")
    return Choice(
        pp,
        f"{_weights_text(spec.model)} do not fit {room} at TP {tp} alone: {pp} stages of TP "
        f"{tp} hold {_gb(weights / (tp * pp))} per accelerator; stages run one after another, "
        f"so a step takes about as long as at TP {tp} alone",
    )


def _loadable(spec: LLMDeploymentSpec, tp: Choice, pp: Choice, where: str) -> tuple[Choice, Choice]:
    """A user's TP or PP: refused when a share of the weights cannot load; else its reason
    says how much room it leaves. The user may knowingly leave less than the usual room for
    the KV cache."""
    weights = _weight_bytes(spec.model)
    if weights is None or not (tp.user_set or pp.user_set):
        return tp, pp
    assert spec.accelerator is not None
    size, stages = int(tp.value), int(pp.value)
    share, memory = weights / (size * stages), spec.accelerator.memory_gi_b
    if share > memory * GIB:
        setting = (
            f"{where} {size}" if tp.user_set else f"spec.parallelism.pipelineParallelSize {stages}"
        )
        raise TuningError(
            f"{setting}: {_weights_text(spec.model)} is {_gb(share)} per accelerator, more "
            f"than accelerator.memoryGiB {memory:g}; allowed: a larger tensorParallelSize or "
            "pipelineParallelSize, or auto"
        )
    capacity, room = _weight_room(spec)
    fits = "within" if share <= capacity else "above (little room left for the KV cache)"
    note = f"; {_gb(share)} of weights per accelerator, {fits} {room}"
    if tp.user_set:
        return Choice(tp.value, tp.reason + note, True), pp
    return tp, Choice(pp.value, pp.reason + note, True)


def _does_not_fit(spec: LLMDeploymentSpec, shape: _Shape) -> TuningError:
    """Weights that no TP x PP of the replica holds: what was tried, and what would hold them."""
    weights = _weight_bytes(spec.model)
    assert weights is not None
    capacity, room = _weight_room(spec)
    most = shape.budget if shape.spans else _powers_of_two(shape.budget)[-1]
    need = _needed(weights, capacity, 1 << 30)
    assert need is not None
    size = shape.size
    whole = -(-need // size) * size  # whole nodes
    text = f"{_weights_text(spec.model)} do not fit: {_gb(weights / most)} per accelerator"
    memory = "more accelerator memory (accelerator.memoryGiB)"
    smaller = _smaller_weights(spec.model)
    if not shape.per_node:
        options = [memory, "more accelerators per pod (accelerator.count)", *smaller]
        if whole <= MAX_PARALLEL_SIZE:
            options.append(
                f"a replica over {whole // size} nodes: accelerator.perNode {size} with count "
                f"{whole} (or no count, to size it from the weights)"
            )
        return TuningError(
            f"{text} even at TP {most} (accelerator.count {shape.count}) exceeds {room}; "
            f"allowed: {_either(options)}"
        )
    nodes = f"{-(-most // size)} node(s) of accelerator.perNode {size}"
    if shape.count is None:
        return TuningError(
            f"{text} even at {most} accelerators ({nodes}, the most one replica may have) "
            f"exceeds {room}; allowed: {_either([memory, *smaller])}"
        )
    hint = (
        f"accelerator.count {whole} ({whole // size} nodes), or no count to size the replica "
        "from the weights"
        if whole <= MAX_PARALLEL_SIZE
        else _either([memory, *smaller])
    )
    return TuningError(
        f"{text} even at accelerator.count {shape.count} ({nodes}) exceeds {room}; they need "
        f"{need} accelerators; allowed: {hint}"
    )


def _smaller_weights(model: ModelSpec) -> list[str]:
    """A refusal's ways to shrink the weights themselves: none is left under fp8."""
    if model.quantization == "fp8":
        return []
    return ["a smaller dtype", "model.quantization fp8 (1 B per parameter)"]


def _either(options: list[str]) -> str:
    """'a', 'a or b', 'a, b, or c'."""
    if len(options) < 3:
        return " or ".join(options)
    return f"{', '.join(options[:-1])}, or {options[-1]}"


def _check_node_split(nodes: int, tp: int, pp: int, per_pod: int, limit: str) -> None:
    """nodesPerReplica: each node runs whole pipeline stages, at most `per_pod` ranks."""
    allowed = [n for n in range(1, pp + 1) if pp % n == 0 and tp * pp // n <= per_pod]
    shown = ", ".join(map(str, allowed)) or "none at this TP and PP"
    if pp % nodes:
        raise TuningError(
            f"spec.parallelism.nodesPerReplica {nodes} does not divide pipelineParallelSize "
            f"{pp}: each node runs whole pipeline stages (a tensor-parallel group all-reduces "
            f"inside every layer, and stays within a node); allowed: {shown}"
        )
    if tp * pp // nodes > per_pod:
        raise TuningError(
            f"spec.parallelism.nodesPerReplica {nodes}: TP {tp} x PP {pp} puts "
            f"{tp * pp // nodes} ranks on each pod, but {limit} {per_pod}; allowed: {shown}"
        )


def _nodes(spec: LLMDeploymentSpec, shape: _Shape, tp: int, pp: int) -> Choice:
    """Pods of one replica: the fewest that hold its ranks, each node whole stages."""
    ranks = tp * pp
    nodes_set = spec.parallelism.nodes_per_replica
    if nodes_set != "auto":
        if nodes_set > 1 and not shape.per_node:
            raise TuningError(
                f"spec.parallelism.nodesPerReplica {nodes_set} needs accelerator.perNode: "
                "without it a replica is one pod of accelerator.count accelerators"
            )
        _check_node_split(int(nodes_set), tp, pp, shape.size, "accelerator.perNode is")
        return Choice(
            nodes_set,
            f"set in spec.parallelism.nodesPerReplica: {ranks // nodes_set} of the {ranks} "
            "ranks on each pod",
            user_set=True,
        )
    if ranks <= shape.size:
        where = f"accelerator.perNode {shape.size}" if shape.per_node else "accelerator.count"
        return Choice(1, f"TP {tp} x PP {pp} = {ranks} ranks fit one pod ({where})")
    per_node = shape.size // tp
    nodes = next(n for n in range(1, pp + 1) if pp % n == 0 and pp // n <= per_node)
    return Choice(
        nodes,
        f"TP {tp} x PP {pp} = {ranks} ranks, {ranks // nodes} per node of accelerator.perNode "
        f"{shape.size} (whole tensor-parallel groups): {nodes} pods per replica, run as one "
        "LeaderWorkerSet group",
    )


def _data_parallel(spec: LLMDeploymentSpec, shape: _Shape, tp: int, pp: int, nodes: int) -> Choice:
    dp = spec.parallelism.data_parallel_size_local
    if nodes > 1:
        if dp not in ("auto", 1):
            raise TuningError(
                f"spec.parallelism.dataParallelSizeLocal is {dp}, but a replica spans {nodes} "
                "nodes and runs one engine core; allowed: 1 or auto (more copies: more replicas)"
            )
        return Choice(
            1,
            f"a replica over {nodes} nodes runs one engine core, one model copy; more copies "
            "are more replicas",
            user_set=dp == 1,
        )
    count = shape.size if shape.count is None else min(shape.count, shape.size)
    ranks = tp * pp
    shown = f"TP {tp}" if pp == 1 else f"(TP {tp} x PP {pp})"
    if dp != "auto":
        if ranks * dp > count:
            total = "accelerator.count is" if shape.count is not None else "accelerator.perNode is"
            raise TuningError(
                f"tensorParallelSize {tp} x "
                + (f"pipelineParallelSize {pp} x " if pp > 1 else "")
                + f"spec.parallelism.dataParallelSizeLocal {dp} = {ranks * dp} accelerators, "
                f"but {total} {count}; allowed: a dataParallelSizeLocal of at most {count // ranks}"
            )
        reason = (
            f"set in spec.parallelism.dataParallelSizeLocal; {shown} x DP {dp} uses {ranks * dp}"
        )
        return Choice(dp, f"{reason} of {count} accelerators", user_set=True)
    dp = max(1, count // ranks)
    reason = f"{count} accelerators // {shown} = {dp} engine core(s) per pod, one model copy each"
    if count - ranks * dp:
        reason += f"; {count - ranks * dp} accelerators left unused"
    return Choice(dp, reason)


def _weight_room(spec: LLMDeploymentSpec) -> tuple[float, str]:
    """Bytes the weights may take on one accelerator, and how that was worked out."""
    assert spec.accelerator is not None
    memory = spec.accelerator.memory_gi_b
    capacity = WEIGHT_MEMORY_FRACTION * memory * GIB
    return capacity, f"{WEIGHT_MEMORY_FRACTION:g} x {memory:g} GiB ({_gb(capacity)})"


def _heads(model: ModelSpec) -> list[tuple[str, int]]:
    known = [
        ("numKeyValueHeads", model.num_key_value_heads),
        ("numAttentionHeads", model.num_attention_heads),
    ]
    return [(field, count) for field, count in known if count is not None]


def _divides(tp: int, heads: list[tuple[str, int]]) -> bool:
    return all(count % tp == 0 for _, count in heads)


def _heads_note(tp: int, heads: list[tuple[str, int]]) -> str:
    if not heads:
        return "; head counts not given, so divisibility is not checked"
    names = {"numKeyValueHeads": "KV heads", "numAttentionHeads": "attention heads"}
    return f" and divides {' and '.join(f'{c} {names[f]}' for f, c in heads)}"


def _bytes_per_parameter(model: ModelSpec) -> tuple[int, str]:
    """What one weight takes on an accelerator, and the note a reason shows beside it."""
    if model.quantization == "fp8":
        return FP8_BYTES, " (fp8)"
    assumed = " (dtype auto: 16-bit assumed)" if model.dtype == "auto" else ""
    return DTYPE_BYTES[model.dtype], assumed


def _weight_bytes(model: ModelSpec) -> float | None:
    if model.parameter_count is None:
        return None
    return model.parameter_count * _bytes_per_parameter(model)[0]


def _weights_text(model: ModelSpec) -> str:
    size, note = _bytes_per_parameter(model)
    return (
        f"{model.parameter_count / 1e9:.3g}e9 params x {size} B{note} = "
        f"{_gb(_weight_bytes(model) or 0)}"
    )


# --- chunk sizes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _StepCost:
    """The cost model at one TP, with the arithmetic behind each figure."""

    token_s: float  # compute seconds of one prompt token
    decode_s: float  # seconds of a decode-only step
    token_why: str
    decode_why: str


def _step_cost(spec: LLMDeploymentSpec, tp: int) -> _StepCost | None:
    accelerator, params = spec.accelerator, spec.model.parameter_count
    weights = _weight_bytes(spec.model)
    if accelerator is None or params is None or weights is None:
        return None
    product = DEFAULT_PRODUCTS.get(accelerator.resource, FALLBACK_PRODUCT)
    peak = accelerator.peak_tflops or product.peak_tflops
    source = (
        "accelerator.peakTflops"
        if accelerator.peak_tflops
        else f"{product.name}, assumed for {accelerator.resource}"
    )
    token_s = 2 * params / (tp * peak * 1e12 * ASSUMED_MFU)
    decode_s = weights / tp / (product.bandwidth_tbps * 1e12)
    return _StepCost(
        token_s,
        decode_s,
        f"2 x {params / 1e9:.3g}e9 FLOP / (TP {tp} x {peak:g} TFLOP/s [{source}] x MFU "
        f"{ASSUMED_MFU:g})",
        f"{_gb(weights)} / TP {tp} / {product.bandwidth_tbps:g} TB/s of an {product.name}",
    )


def _chunks(
    spec: LLMDeploymentSpec, name: str, role: RoleSpec, cost: _StepCost | None
) -> tuple[Choice, Choice]:
    """(longPrefillTokenThreshold, maxNumBatchedTokens) of one role."""
    scheduling = spec.scheduling
    threshold = _user_choice(
        role.long_prefill_token_threshold,
        scheduling.long_prefill_token_threshold,
        name,
        "longPrefillTokenThreshold",
    )
    budget = _user_choice(
        role.max_num_batched_tokens, scheduling.max_num_batched_tokens, name, "maxNumBatchedTokens"
    )
    if cost is None:
        return _unknown_cost_chunks(spec, name, threshold, budget)
    if name == "prefill":
        return _prefill_chunks(spec, cost, threshold, budget)
    return _mixed_chunks(spec, name, cost, threshold, budget)


def _user_choice(
    role_value: int | str | None, pool_value: int | str, role: str, field: str
) -> Choice | None:
    value, where = _setting(role_value, pool_value, role, field, "scheduling")
    return None if value == "auto" else Choice(value, f"set in {where}", user_set=True)


def _unknown_cost_chunks(
    spec: LLMDeploymentSpec, name: str, threshold: Choice | None, budget: Choice | None
) -> tuple[Choice, Choice]:
    unknown = (
        "there is no accelerator"
        if spec.accelerator is None
        else "model.parameterCount is not given"
    )
    threshold = threshold or Choice(
        "auto",
        f"{unknown}, so a prompt token's cost is unknown: auto lets the engine size chunks "
        "online from the step times it measures",
    )
    default = Choice(DEFAULT_MAX_NUM_BATCHED_TOKENS, f"the engine's default, since {unknown}")
    if budget is None and isinstance(threshold.value, int):
        # A user's chunk larger than the default budget gets a budget that holds it.
        decodes = 0 if name == "prefill" else spec.scheduling.max_num_seqs
        held = step_budget(threshold.value, decodes, spec.scheduling.block_size)
        budget = held if held.value > default.value else default
    return threshold, budget or default


def _prefill_chunks(
    spec: LLMDeploymentSpec, cost: _StepCost, threshold: Choice | None, budget: Choice | None
) -> tuple[Choice, Choice]:
    ttft = spec.scheduling.slo.ttft_ms
    tokens, why = _fit(
        spec,
        ttft / 1000 / cost.token_s,
        MAX_PREFILL_CHUNK_TOKENS,
        f"prefill pods carry no decodes, so a step may take the whole TTFT {ttft} ms",
        cost,
        f"TTFT {ttft} ms",
    )
    if budget is None:
        budget = Choice(tokens, why)
        if threshold is not None and int(threshold.value) > tokens:
            budget = step_budget(int(threshold.value), 0, spec.scheduling.block_size)
    return threshold or Choice(
        budget.value,
        "equal to maxNumBatchedTokens: prefill pods carry no decodes, so one prompt may take a "
        "whole step (0, no cap, would do the same)",
    ), budget


def _mixed_chunks(
    spec: LLMDeploymentSpec,
    name: str,
    cost: _StepCost,
    threshold: Choice | None,
    budget: Choice | None,
) -> tuple[Choice, Choice]:
    """Unified and decode pods: steps carry decodes, whose ITL a prompt chunk must not break."""
    if threshold is None:
        tokens, why = _itl_chunk(spec, cost)
        if name == "decode":
            if tokens >= DECODE_CHUNK_TOKENS:
                tokens, why = DECODE_CHUNK_TOKENS, f"within the {tokens} the ITL budget allows"
            why = f"decode pods compute only the occasional local prompt tail: {tokens}, {why}"
        if budget is not None and tokens > int(budget.value):
            tokens = int(budget.value)
            why += f"; capped at maxNumBatchedTokens {tokens} ({budget.reason})"
        threshold = Choice(tokens, why)
    scheduling = spec.scheduling
    # Room in a step for one decode token of every running request.
    return threshold, budget or step_budget(
        int(threshold.value), scheduling.max_num_seqs, scheduling.block_size
    )


def _itl_chunk(spec: LLMDeploymentSpec, cost: _StepCost) -> tuple[int, str]:
    """Prompt tokens that a step with decodes may carry and still meet the ITL SLO."""
    itl = spec.scheduling.slo.itl_ms
    left = itl / 1000 - cost.decode_s
    head = f"ITL {itl} ms - decode step {_ms(cost.decode_s)} ({cost.decode_why})"
    head += f" leaves {_ms(left)}"
    if left <= 0:
        lower = _bounds(spec, MAX_UNIFIED_CHUNK_TOKENS)[0]
        return lower, (
            f"ITL {itl} ms is out of reach: the decode step alone takes {_ms(cost.decode_s)} "
            f"({cost.decode_why}); chose the floor of {lower} tokens"
        )
    return _fit(spec, left / cost.token_s, MAX_UNIFIED_CHUNK_TOKENS, head, cost, f"ITL {itl} ms")


def _fit(
    spec: LLMDeploymentSpec,
    raw: float,
    maximum: int,
    head: str,
    cost: _StepCost,
    slo: str,
) -> tuple[int, str]:
    """`raw` tokens in whole blocks, clamped to the role's range, with the arithmetic."""
    block = spec.scheduling.block_size
    lower, upper, upper_name = _bounds(spec, maximum)
    count = int(raw)
    tokens = count - count % block
    body = f"{head}: {count} prompt tokens at {_us(cost.token_s)} each ({cost.token_why})"
    if tokens < lower:
        return lower, f"{slo} is out of reach: {body}; chose the floor of {lower} tokens"
    if tokens > upper:
        return upper, f"{body}, clamped to {upper_name}"
    if tokens != count:
        body += f", {tokens} in whole {block}-token blocks"
    return tokens, body


def _bounds(spec: LLMDeploymentSpec, maximum: int) -> tuple[int, int, str]:
    """The smallest and largest chunk of a role, and what sets the largest."""
    return chunk_bounds(spec.scheduling.block_size, spec.model.max_model_len, maximum)


def chunk_bounds(block: int, max_model_len: int | None, maximum: int) -> tuple[int, int, str]:
    """The smallest and largest chunk (MIN_CHUNK_BLOCKS blocks; `maximum` or the longest whole
    blocks within maxModelLen), and what sets the largest. Also used by operator/step_fit.py."""
    upper, name = maximum, f"the {maximum}-token maximum"
    longest = max_model_len
    if longest is not None and longest - longest % block < upper:
        upper, name = max(block, longest - longest % block), f"maxModelLen {longest}"
    return min(MIN_CHUNK_BLOCKS * block, upper), upper, name


def step_budget(threshold: int, decodes: int, block: int) -> Choice:
    """A step budget of one chunk plus `decodes` decode tokens, in whole blocks."""
    total = threshold + decodes
    rounded = -(-total // block) * block
    reason = (
        f"threshold {threshold} + maxNumSeqs {decodes} (a decode token for every running "
        f"request) = {total}"
        if decodes
        else f"one chunk of {threshold} tokens"
    )
    if rounded != total:
        reason += f", rounded up to whole {block}-token blocks"
    return Choice(rounded, reason)


def _gb(size: float) -> str:
    return f"{size / 1e9:.3g} GB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"
