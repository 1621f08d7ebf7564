"""Tuning: the engine flags of each role, chosen from the spec by a stated cost model.

Every value is a Choice with a reason, which users read in `kubectl get llmd -o yaml` and in
`tidegate plan`. A value the user set wins, but is still checked against the same refusals.

The cost model (estimates; each reason shows the arithmetic with the numbers it used):
- Weights take parameterCount x dtype bytes (dtype auto: 2 B, as nearly every checkpoint is
  16-bit). Tensor parallelism (TP) splits them evenly over TP accelerators.
- A prompt token costs 2 x parameterCount FLOPs (a multiply and an add per weight).
  Attention's share, which grows with the context, is left out: it is small for chunks of a
  few thousand tokens, and the MFU below is low enough to absorb it.
- One engine core computes TP x peak x ASSUMED_MFU FLOP/s. peak is accelerator.peakTflops
  (dense 16-bit), else the product DEFAULT_PRODUCTS assumes for the resource name. float32
  matmuls run slower than that: set peakTflops to the fp32 rate when serving float32.
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
and the engine's ChunkSizeTuner sizes chunks online from the step times it measures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tidegate.engine.config import EngineArgs
from tidegate.operator.spec import LLMDeploymentSpec, ModelSpec, RoleSpec, SpecError

GIB = 1 << 30
# Weights may fill this much of one accelerator; the rest holds the KV cache (which decides
# how many requests run at once), activations and the runtime's own memory. With less than a
# fifth left a pod serves only a handful of requests, so a wider TP is the better deal.
WEIGHT_MEMORY_FRACTION = 0.8
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
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

# Tensor-parallel ranks a CPU pod may run (worker processes, gloo between them).
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
    data_parallel_size_local: Choice
    max_num_batched_tokens: Choice
    long_prefill_token_threshold: Choice
    accelerated: bool = True

    def choices(self) -> dict[str, Choice]:
        """The choices by their CRD (camelCase) names, in the order status shows them."""
        return {
            "tensorParallelSize": self.tensor_parallel_size,
            "dataParallelSizeLocal": self.data_parallel_size_local,
            "longPrefillTokenThreshold": self.long_prefill_token_threshold,
            "maxNumBatchedTokens": self.max_num_batched_tokens,
        }

    def engine_args(self) -> dict[str, int | str]:
        """The values as EngineArgs fields."""
        return {
            "tensor_parallel_size": self.tensor_parallel_size.value,
            "data_parallel_size_local": self.data_parallel_size_local.value,
            "long_prefill_token_threshold": self.long_prefill_token_threshold.value,
            "max_num_batched_tokens": self.max_num_batched_tokens.value,
        }

    def to_status(self) -> dict[str, int | str]:
        """The values under their camelCase status names."""
        return {name: choice.value for name, choice in self.choices().items()}

    def accelerators_per_pod(self) -> int:
        """Accelerators one pod of this role requests (0 on CPU)."""
        if not self.accelerated:
            return 0
        return int(self.tensor_parallel_size.value) * int(self.data_parallel_size_local.value)


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
    tp = _tensor_parallel(spec, name, role)
    dp = _data_parallel(spec, int(tp.value))
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
    return RoleTuning(name, tp, dp, budget, threshold, spec.accelerator is not None)


def _setting(
    role_value: int | str | None, pool_value: int | str, role: str, field: str, section: str
) -> tuple[int | str, str]:
    """The value that applies (a role's override wins) and where it was set."""
    if role_value is not None:
        return role_value, f"spec.topology.{role}.{field}"
    return pool_value, f"spec.{section}.{field}"


# --- tensor and data parallelism --------------------------------------------------------------


def _tensor_parallel(spec: LLMDeploymentSpec, name: str, role: RoleSpec) -> Choice:
    tp, where = _setting(
        role.tensor_parallel_size,
        spec.parallelism.tensor_parallel_size,
        name,
        "tensorParallelSize",
        "parallelism",
    )
    if spec.accelerator is None:
        if tp in ("auto", 1):
            return Choice(1, "no accelerator: CPU pods run one worker", user_set=tp == 1)
        return _cpu_tensor_parallel(spec, int(tp), where)
    if tp == "auto":
        return _auto_tensor_parallel(spec)
    return _checked_tensor_parallel(spec, int(tp), where)


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


def _auto_tensor_parallel(spec: LLMDeploymentSpec) -> Choice:
    """The smallest power of two whose weight share fits and that divides the heads."""
    assert spec.accelerator is not None
    weights, heads = _weight_bytes(spec.model), _heads(spec.model)
    if weights is None:
        return Choice(1, "model.parameterCount not given, so the weights' size is unknown: TP 1")
    capacity, room = _weight_room(spec)
    count = spec.accelerator.count
    largest = 1 << (count.bit_length() - 1)  # largest power of two <= count
    sizes = [1 << k for k in range(largest.bit_length())]
    needed = next((n for n in sizes if weights / n <= capacity), None)
    if needed is None:
        raise TuningError(
            f"{_weights_text(spec.model)} do not fit: {_gb(weights / largest)} per accelerator "
            f"even at TP {largest} (accelerator.count {count}) exceeds {room}; allowed: more "
            "accelerator memory (accelerator.memoryGiB), more accelerators per pod "
            "(accelerator.count), or a smaller dtype"
        )
    # Powers of two that divide a head count are 1, 2, ... up to some limit: the heads can only
    # forbid the size the weights need, never ask for a larger one.
    if not _divides(needed, heads):
        usable = [n for n in sizes if _divides(n, heads)]
        raise TuningError(
            f"{_weights_text(spec.model)} need TP {needed} to fit {room}, but "
            f"{' and '.join(f'model.{f} {c}' for f, c in heads)} divide only by "
            f"{', '.join(map(str, usable))}; allowed: accelerators with more memory"
        )
    smaller = [str(n) for n in sizes if n < needed]
    if smaller:
        fit = f" does not fit {room} at TP {' or '.join(smaller)}; TP {needed} fits "
        fit += f"({_gb(weights / needed)} per accelerator)"
    else:
        fit = f" fits {room} at TP 1"
    return Choice(needed, f"{_weights_text(spec.model)}{fit}{_heads_note(needed, heads)}")


def _checked_tensor_parallel(spec: LLMDeploymentSpec, tp: int, where: str) -> Choice:
    """A user's TP, refused when the pod lacks the accelerators, heads or memory for it."""
    assert spec.accelerator is not None
    count, heads = spec.accelerator.count, _heads(spec.model)
    if tp > count:
        raise TuningError(
            f"{where} {tp} is larger than accelerator.count {count}; "
            f"allowed: at most {count}, the accelerators of one pod"
        )
    for field, heads_count in heads:
        if heads_count % tp:
            allowed = [n for n in range(1, count + 1) if _divides(n, heads)]
            raise TuningError(
                f"{where} {tp} does not divide model.{field} {heads_count}; allowed: "
                f"{', '.join(map(str, allowed))} (or auto)"
            )
    reason = f"set in {where}{_heads_note(tp, heads)}"
    weights = _weight_bytes(spec.model)
    if weights is None:
        return Choice(tp, reason, user_set=True)
    # The user may knowingly leave less than the usual room for the KV cache; only weights
    # that cannot load at all are refused.
    share, memory = weights / tp, spec.accelerator.memory_gi_b
    if share > memory * GIB:
        raise TuningError(
            f"{where} {tp}: {_weights_text(spec.model)} is {_gb(share)} per accelerator, more "
            f"than accelerator.memoryGiB {memory:g}; allowed: a larger tensorParallelSize, or auto"
        )
    capacity, room = _weight_room(spec)
    fits = "within" if share <= capacity else "above (little room left for the KV cache)"
    return Choice(tp, f"{reason}; {_gb(share)} of weights per accelerator, {fits} {room}", True)


def _weight_room(spec: LLMDeploymentSpec) -> tuple[float, str]:
    """Bytes the weights may take on one accelerator, and how that was worked out."""
    assert spec.accelerator is not None
    memory = spec.accelerator.memory_gi_b
    capacity = WEIGHT_MEMORY_FRACTION * memory * GIB
    return capacity, f"{WEIGHT_MEMORY_FRACTION:g} x {memory:g} GiB ({_gb(capacity)})"


def _data_parallel(spec: LLMDeploymentSpec, tp: int) -> Choice:
    dp = spec.parallelism.data_parallel_size_local
    accelerator = spec.accelerator
    if accelerator is None:
        if dp not in ("auto", 1):
            raise TuningError(
                f"spec.parallelism.dataParallelSizeLocal is {dp}, but spec.accelerator is absent "
                "and CPU pods run one engine core; allowed: 1 or auto"
            )
        return Choice(1, "no accelerator: CPU pods run one engine core", user_set=dp == 1)
    count = accelerator.count
    if dp != "auto":
        if tp * dp > count:
            raise TuningError(
                f"tensorParallelSize {tp} x spec.parallelism.dataParallelSizeLocal {dp} = "
                f"{tp * dp} accelerators, but accelerator.count is {count}; allowed: a "
                f"dataParallelSizeLocal of at most {count // tp}"
            )
        reason = f"set in spec.parallelism.dataParallelSizeLocal; TP {tp} x DP {dp} uses {tp * dp}"
        return Choice(dp, f"{reason} of {count} accelerators", user_set=True)
    dp = max(1, count // tp)
    reason = f"{count} accelerators // TP {tp} = {dp} engine core(s) per pod, one model copy each"
    if count - tp * dp:
        reason += f"; {count - tp * dp} accelerators left unused"
    return Choice(dp, reason)


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


def _weight_bytes(model: ModelSpec) -> float | None:
    if model.parameter_count is None:
        return None
    return model.parameter_count * DTYPE_BYTES[model.dtype]


def _weights_text(model: ModelSpec) -> str:
    assumed = " (dtype auto: 16-bit assumed)" if model.dtype == "auto" else ""
    return (
        f"{model.parameter_count / 1e9:.3g}e9 params x {DTYPE_BYTES[model.dtype]} B{assumed} = "
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
