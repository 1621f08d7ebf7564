"""Tuning turns a spec into engine flags a user can check: each value, its reason, its refusals."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.engine.config import EngineArgs
from tidegate.operator.spec import SpecError, parse_spec
from tidegate.operator.tuning import MeasuredChunks, TuningError, tune

B = 1e9  # parameters


def make_spec(
    params: float | None = None,
    *,
    dtype: str = "auto",
    quantization: str | None = None,
    gpus: int | None = None,
    memory: float = 80,
    kv: int | None = None,
    heads: int | None = None,
    max_model_len: int | None = None,
    itl: int = 50,
    ttft: int = 800,
    **spec: Any,
) -> dict[str, Any]:
    """A camelCase spec: the model and accelerator from the arguments, other parts as given."""
    model: dict[str, Any] = {"name": "m", "source": {"uri": "https://models/m.tar"}, "dtype": dtype}
    for key, value in [
        ("quantization", quantization),
        ("parameterCount", params),
        ("numKeyValueHeads", kv),
        ("numAttentionHeads", heads),
        ("maxModelLen", max_model_len),
    ]:
        if value is not None:
            model[key] = value
    result: dict[str, Any] = {"model": model, **spec}
    if gpus is not None:
        result.setdefault("accelerator", {"count": gpus, "memoryGiB": memory})
    scheduling = result.setdefault("scheduling", {})
    scheduling.setdefault("slo", {"itlMs": itl, "ttftMs": ttft})
    return result


def disaggregated(prefill: dict | None = None, decode: dict | None = None) -> dict[str, Any]:
    return {"mode": "disaggregated", "prefill": prefill or {}, "decode": decode or {}}


MULTINODE_405B = {
    "tensorParallelSize": 8,
    "pipelineParallelSize": 2,
    "nodesPerReplica": 2,
    "dataParallelSizeLocal": 1,
}


def flags(tp: int, dp: int, threshold: int | str, budget: int) -> dict[str, int | str]:
    return {
        "tensorParallelSize": tp,
        "dataParallelSizeLocal": dp,
        "longPrefillTokenThreshold": threshold,
        "maxNumBatchedTokens": budget,
    }


# Worked numbers, with the module's defaults (H100 SXM: 989 TFLOP/s, 3.35 TB/s; MFU 0.4):
# 8.03e9 bf16 at TP 1: 16.1 GB; a prompt token 40.6 us; a decode step 4.79 ms.
#   ITL 50 ms -> 45.2 ms / 40.6 us = 1113 tokens -> 1104 (16-token blocks); + 256 seqs = 1360.
# 70.6e9 bf16 at TP 4: 141 GB, 35.3 GB each; a token 89.2 us; a decode step 10.5 ms.
#   ITL 50 ms -> 39.5 ms -> 442 tokens -> 432; + 256 = 688.
# 70.6e9 fp32 at TP 8: 282 GB, 35.3 GB each; a token 44.6 us; decode 10.5 ms -> 884 -> 880.
# 70.6e9 fp8 at TP 2: 70.6 GB, 35.3 GB each; a token 178 us (FP8 matmuls counted at the
#   16-bit rate); a decode step 10.5 ms. ITL 50 ms -> 39.5 ms -> 221 tokens -> 208; + 256 = 464.
TUNED = [
    pytest.param(
        make_spec(8.03 * B, gpus=1, kv=8, heads=32),
        {"unified": flags(1, 1, 1104, 1360)},
        [
            "fits 0.8 x 80 GiB (68.7 GB) at TP 1",
            "divides 8 KV heads and 32 attention heads",
            "16-bit assumed",
            "1113 prompt tokens",
            "1104 in whole 16-token blocks",
            "threshold 1104 + maxNumSeqs 256",
        ],
        id="8B-1x80G-tp1",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, kv=8, heads=64),
        {"unified": flags(4, 2, 432, 688)},
        [
            "141 GB does not fit 0.8 x 80 GiB (68.7 GB) at TP 1 or 2",
            "TP 4 fits (35.3 GB",
            "divides 8 KV heads",
            "8 accelerators // TP 4 = 2 engine core(s)",
            "89.2 us",
        ],
        id="70B-8x80G-tp4-dp2",
    ),
    pytest.param(
        make_spec(70.6 * B, dtype="float32", gpus=8, kv=8),
        {"unified": flags(8, 1, 880, 1136)},
        ["x 4 B = 282 GB", "at TP 1 or 2 or 4", "TP 8 fits (35.3 GB"],
        id="70B-fp32-8x80G-tp8",
    ),
    pytest.param(
        make_spec(70.6 * B, quantization="fp8", gpus=8, kv=8),
        {"unified": flags(2, 4, 208, 464)},
        [
            "70.6e9 params x 1 B (fp8) = 70.6 GB does not fit 0.8 x 80 GiB (68.7 GB) at TP 1; "
            "TP 2 fits (35.3 GB per accelerator)",
            "8 accelerators // TP 2 = 4 engine core(s)",
            "decode step 10.5 ms (70.6 GB / TP 2",
            "178 us",
        ],
        id="70B-fp8-8x80G-tp2-dp4",
    ),
    pytest.param(
        make_spec(405 * B, quantization="fp8", gpus=8, kv=8),
        {"unified": flags(8, 1, 128, 384)},
        ["405e9 params x 1 B (fp8) = 405 GB", "TP 8 fits (50.6 GB per accelerator)"],
        id="405B-fp8-fits-one-8x80G-pod",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=6, kv=8),
        {"unified": flags(4, 1, 432, 688)},
        ["TP 4 fits", "2 accelerators left unused"],
        id="70B-6-gpus-leaves-two",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, memory=192, kv=8),
        {"unified": flags(1, 8, 64, 320)},
        [
            "fits 0.8 x 192 GiB (165 GB) at TP 1",
            "ITL 50 ms is out of reach",
            "leaves 7.85 ms: 21 prompt tokens",
        ],
        id="70B-8x192G-tp1-dp8",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=8, kv=8, parallelism={"tensorParallelSize": 2}),
        {"unified": flags(2, 4, 2336, 2592)},
        ["set in spec.parallelism.tensorParallelSize", "within 0.8 x 80 GiB", "divides 8 KV"],
        id="user-tp-wins",
    ),
    pytest.param(
        make_spec(
            8.03 * B,
            gpus=8,
            kv=8,
            parallelism={"tensorParallelSize": 2, "dataParallelSizeLocal": 2},
            topology={"unified": {"tensorParallelSize": 4}},
        ),
        {"unified": {"tensorParallelSize": 4, "dataParallelSizeLocal": 2}},
        ["set in spec.topology.unified.tensorParallelSize", "TP 4 x DP 2 uses 8 of 8"],
        id="role-tp-overrides-parallelism",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, kv=8, max_model_len=8192, topology=disaggregated()),
        {"prefill": flags(4, 2, 8192, 8192), "decode": flags(4, 2, 256, 512)},
        [
            "prefill pods carry no decodes",
            "TTFT 800 ms",
            "clamped to maxModelLen 8192",
            "equal to maxNumBatchedTokens",
            "decode pods compute only the occasional local prompt",
            "within the 432 the ITL budget allows",
        ],
        id="disaggregated-prefill-large-decode-small",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=1, ttft=2000, topology=disaggregated()),
        {"prefill": flags(1, 1, 32768, 32768)},
        ["clamped to the 32768-token maximum"],
        id="disaggregated-prefill-capped",
    ),
    pytest.param(
        make_spec(8.03 * B, kv=8),
        {"unified": flags(1, 1, "auto", 2048)},
        [
            "no accelerator: CPU pods run one worker",
            "no accelerator: CPU pods run one engine core",
            "there is no accelerator",
            "auto lets the engine size chunks online",
            "the engine's default, since there is no accelerator",
        ],
        id="cpu",
    ),
    pytest.param(
        make_spec(None, gpus=8, topology=disaggregated()),
        {"prefill": flags(1, 8, "auto", 2048), "decode": flags(1, 8, "auto", 2048)},
        [
            "model.parameterCount not given",
            "model.parameterCount is not given, so a prompt token",
            "auto lets the engine size chunks online",
        ],
        id="no-parameter-count-auto",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, itl=10),
        {"unified": flags(4, 2, 64, 320)},
        ["ITL 10 ms is out of reach", "the decode step alone takes 10.5 ms", "floor of 64"],
        id="tight-itl-below-decode-step-floor",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, itl=12, scheduling={"blockSize": 64, "slo": {"itlMs": 12}}),
        {"unified": flags(4, 2, 256, 512)},
        ["ITL 12 ms is out of reach", "16 prompt tokens", "floor of 256"],
        id="tight-itl-floor-is-four-blocks",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, itl=10, topology=disaggregated()),
        {"decode": flags(4, 2, 64, 320)},
        ["decode pods compute only", "ITL 10 ms is out of reach"],
        id="decode-tight-itl-smaller-than-256",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=1, itl=1000),
        {"unified": flags(1, 1, 16384, 16640)},
        ["clamped to the 16384-token maximum"],
        id="loose-itl-capped",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=1, scheduling={"longPrefillTokenThreshold": 500}),
        {"unified": flags(1, 1, 500, 768)},
        ["set in spec.scheduling.longPrefillTokenThreshold", "= 756, rounded up"],
        id="user-threshold-sets-budget",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=1, scheduling={"maxNumBatchedTokens": 512}),
        {"unified": flags(1, 1, 512, 512)},
        ["capped at maxNumBatchedTokens 512 (set in spec.scheduling.maxNumBatchedTokens)"],
        id="user-budget-caps-threshold",
    ),
    pytest.param(
        make_spec(
            8.03 * B,
            accelerator={
                "resource": "amd.com/gpu",
                "count": 1,
                "memoryGiB": 192,
                "peakTflops": 500,
            },
        ),
        {"unified": flags(1, 1, 576, 832)},
        ["500 TFLOP/s [accelerator.peakTflops]", "5.3 TB/s of an MI300X", "80.3 us"],
        id="amd-with-peak-tflops",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=2, kv=8, parallelism={"tensorParallelSize": 2}),
        {"unified": flags(2, 1, 160, 416)},
        ["70.6 GB of weights per accelerator, above (little room left for the KV cache)"],
        id="user-tp-tight-but-loadable",
    ),
    pytest.param(
        make_spec(
            70.6 * B,
            gpus=8,
            max_model_len=8192,
            scheduling={"longPrefillTokenThreshold": 1000},
            topology=disaggregated(decode={"longPrefillTokenThreshold": 128}),
        ),
        {"prefill": flags(4, 2, 1000, 8192), "decode": flags(4, 2, 128, 384)},
        [
            "prefill.longPrefillTokenThreshold=1000: set in spec.scheduling.",
            "decode.longPrefillTokenThreshold=128: set in spec.topology.decode.",
        ],
        id="role-threshold-overrides-scheduling",
    ),
    pytest.param(
        make_spec(None, gpus=1, scheduling={"longPrefillTokenThreshold": 4096}),
        {"unified": flags(1, 1, 4096, 4352)},
        ["threshold 4096 + maxNumSeqs 256"],
        id="no-parameter-count-user-threshold-gets-room",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, kv=2, heads=64),
        {"unified": {**flags(2, 2, 160, 416), "pipelineParallelSize": 2, "nodesPerReplica": 1}},
        [
            "need 4 accelerators to fit",
            "model.numKeyValueHeads 2 and model.numAttentionHeads 64 divide only by 1, 2: TP 2",
            "2 stages of TP 2 hold 35.3 GB per accelerator",
            "8 accelerators // (TP 2 x PP 2) = 2 engine core(s)",
        ],
        id="heads-cap-tp-pipeline-stages-hold-the-rest",
    ),
    # 405e9 bf16: 810 GB; 16 accelerators of 80 GiB hold it (50.6 GB each); a node has 8.
    pytest.param(
        make_spec(405 * B, kv=8, accelerator={"perNode": 8, "memoryGiB": 80}),
        {"unified": {**MULTINODE_405B, "longPrefillTokenThreshold": 64}},
        [
            "810 GB need 16 accelerators to fit 0.8 x 80 GiB (68.7 GB), more than one node has "
            "(accelerator.perNode 8): TP 8, the widest that divides perNode 8",
            "2 stages of TP 8 hold 50.6 GB per accelerator",
            "a step takes about as long as at TP 8 alone",
            "TP 8 x PP 2 = 16 ranks, 8 per node",
            "2 pods per replica, run as one LeaderWorkerSet group",
            "a replica over 2 nodes runs one engine core",
            "decode step 30.2 ms (810 GB / TP 8",
        ],
        id="405B-per-node-8-sized-from-the-weights",
    ),
    pytest.param(
        make_spec(405 * B, kv=8, accelerator={"count": 16, "perNode": 8, "memoryGiB": 80}),
        {"unified": MULTINODE_405B},
        [
            "accelerator.count 16 spans 2 nodes of accelerator.perNode 8: TP 8",
            "accelerator.count 16 / TP 8 = 2 stages",
        ],
        id="405B-count-16-per-node-8",
    ),
    pytest.param(
        make_spec(70.6 * B, kv=8, accelerator={"count": 16, "perNode": 8, "memoryGiB": 80}),
        {"unified": {"tensorParallelSize": 8, "pipelineParallelSize": 2, "nodesPerReplica": 2}},
        ["(the weights would fit 4 accelerator(s) of one node)"],
        id="count-asks-for-two-nodes-the-weights-would-fit-one",
    ),
    pytest.param(
        make_spec(70.6 * B, kv=8, accelerator={"perNode": 8, "memoryGiB": 80}),
        {"unified": {**flags(4, 2, 432, 688), "pipelineParallelSize": 1, "nodesPerReplica": 1}},
        ["the weights fit at TP 4: one stage", "4 ranks fit one pod (accelerator.perNode 8)"],
        id="per-node-fits-one-node-as-count-would",
    ),
    pytest.param(
        make_spec(
            405 * B,
            kv=8,
            accelerator={"perNode": 8, "memoryGiB": 80},
            parallelism={"pipelineParallelSize": 4},
        ),
        {"unified": {"tensorParallelSize": 4, "pipelineParallelSize": 4, "nodesPerReplica": 2}},
        [
            "over spec.parallelism.pipelineParallelSize 4 stages fits 0.8 x 80 GiB (68.7 GB) at "
            "TP 4 (50.6 GB per accelerator)",
            "50.6 GB of weights per accelerator, within",
            "TP 4 x PP 4 = 16 ranks, 8 per node",
        ],
        id="user-pp-sizes-tp",
    ),
    pytest.param(
        make_spec(
            405 * B,
            kv=8,
            accelerator={"perNode": 8, "memoryGiB": 80},
            parallelism={"tensorParallelSize": 4, "nodesPerReplica": 4},
        ),
        {"unified": {"tensorParallelSize": 4, "pipelineParallelSize": 4, "nodesPerReplica": 4}},
        ["set in spec.parallelism.nodesPerReplica: 4 of the 16 ranks on each pod"],
        id="user-nodes-spread-thinner",
    ),
    pytest.param(
        make_spec(1 * B, parallelism={"pipelineParallelSize": 2, "nodesPerReplica": 2}),
        {
            "unified": {
                "tensorParallelSize": 1,
                "pipelineParallelSize": 2,
                "nodesPerReplica": 2,
                "dataParallelSizeLocal": 1,
            }
        },
        [
            "CPU pods run one worker per pipeline stage",
            "handing activations on over gloo",
            "2 pod(s) of 1 worker process(es), meeting over TCP",
        ],
        id="cpu-two-stages-two-nodes",
    ),
    pytest.param(
        make_spec(1 * B, parallelism={"nodesPerReplica": 2}),
        {"unified": {"pipelineParallelSize": 2, "nodesPerReplica": 2}},
        ["one stage per node of spec.parallelism.nodesPerReplica 2"],
        id="cpu-nodes-give-the-stages",
    ),
    pytest.param(
        make_spec(1 * B, parallelism={"pipelineParallelSize": 2}),
        {"unified": {"pipelineParallelSize": 2, "nodesPerReplica": 1}},
        ["no accelerator: one pod, unless spec.parallelism.nodesPerReplica says more"],
        id="cpu-two-stages-in-one-pod",
    ),
]


@pytest.mark.parametrize(("spec", "expected", "phrases"), TUNED)
def test_tuning_table(spec: dict, expected: dict, phrases: list[str]) -> None:
    tuning = tune(parse_spec(spec))
    status = tuning.to_status()
    for role, want in expected.items():
        got = status["roles"][role]
        assert {key: got[key] for key in want} == want, tuning.reasons()
    text = "\n".join(tuning.reasons())
    for phrase in phrases:
        assert phrase in text


REFUSED = [
    pytest.param(
        make_spec(405 * B, gpus=8, kv=8),
        [
            "810 GB do not fit",
            "101 GB per accelerator even at TP 8",
            "accelerator.memoryGiB",
            "model.quantization fp8 (1 B per parameter)",
        ],
        id="405B-8x80G",
    ),
    pytest.param(
        make_spec(405 * B, kv=8, accelerator={"count": 8, "perNode": 8, "memoryGiB": 80}),
        [
            "810 GB do not fit: 101 GB per accelerator even at accelerator.count 8 (1 node(s) "
            "of accelerator.perNode 8)",
            "they need 16 accelerators; allowed: accelerator.count 16 (2 nodes), or no count",
        ],
        id="405B-count-of-one-node",
    ),
    pytest.param(
        make_spec(405 * B, kv=8, accelerator={"count": 8, "memoryGiB": 80}),
        ["or a replica over 2 nodes: accelerator.perNode 8 with count 16 (or no count"],
        id="405B-one-pod-names-the-nodes-it-needs",
    ),
    pytest.param(
        make_spec(5000 * B, accelerator={"perNode": 8, "memoryGiB": 80}),
        [
            "156 GB per accelerator even at 64 accelerators (8 node(s) of accelerator.perNode "
            "8, the most one replica may have)",
            "allowed: more accelerator memory (accelerator.memoryGiB), a smaller dtype, or "
            "model.quantization fp8 (1 B per parameter)",
        ],
        id="5T-no-replica-holds-it",
    ),
    pytest.param(
        make_spec(
            8.03 * B,
            accelerator={"perNode": 8, "memoryGiB": 80},
            parallelism={"tensorParallelSize": 16},
        ),
        [
            "tensorParallelSize 16 is larger than accelerator.perNode 8",
            "stays within a node; allowed: at most 8, and pipelineParallelSize",
        ],
        id="tp-above-per-node",
    ),
    pytest.param(
        make_spec(
            8.03 * B, gpus=8, parallelism={"tensorParallelSize": 4, "pipelineParallelSize": 4}
        ),
        ["4 x spec.parallelism.pipelineParallelSize 4 = 16 accelerators", "at most 2"],
        id="tp-times-pp-above-count",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=8, parallelism={"nodesPerReplica": 2}),
        ["nodesPerReplica 2 needs accelerator.perNode"],
        id="nodes-without-per-node",
    ),
    pytest.param(
        make_spec(
            405 * B,
            kv=8,
            accelerator={"perNode": 8, "memoryGiB": 80},
            parallelism={"nodesPerReplica": 3},
        ),
        ["nodesPerReplica 3 does not divide pipelineParallelSize 2", "allowed: 2"],
        id="nodes-not-whole-stages",
    ),
    pytest.param(
        make_spec(
            405 * B,
            kv=8,
            accelerator={"perNode": 8, "memoryGiB": 80},
            parallelism={"dataParallelSizeLocal": 2},
        ),
        ["dataParallelSizeLocal is 2, but a replica spans 2 nodes and runs one engine core"],
        id="dp-over-nodes",
    ),
    pytest.param(
        make_spec(
            405 * B, kv=8, accelerator={"perNode": 8, "memoryGiB": 80}, topology=disaggregated()
        ),
        ["the prefill pool needs pipelineParallelSize 2", "disaggregated pools run one pipeline"],
        id="disaggregated-over-nodes",
    ),
    pytest.param(
        make_spec(
            405 * B,
            kv=8,
            accelerator={"perNode": 8, "memoryGiB": 80},
            autoscaling={"unified": {"maxReplicas": 3}},
        ),
        ["autoscaling.unified: the unified pool spans 2 nodes per replica (a LeaderWorkerSet)"],
        id="autoscaled-over-nodes",
    ),
    pytest.param(
        make_spec(
            1 * B,
            parallelism={"nodesPerReplica": 2},
            topology={"router": {"replicas": 1}},
            rollout={"strategy": "canary"},
        ),
        ["rollout.strategy canary: the unified pool spans 2 nodes per replica"],
        id="canary-over-nodes",
    ),
    pytest.param(
        make_spec(1 * B, parallelism={"tensorParallelSize": 8, "pipelineParallelSize": 2}),
        ["is 16 worker processes per pod, but a CPU pod runs at most 8"],
        id="cpu-too-many-ranks-per-pod",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=8, kv=8, heads=32, parallelism={"tensorParallelSize": 3}),
        [
            "spec.parallelism.tensorParallelSize 3 does not divide model.numKeyValueHeads 8",
            "allowed: 1, 2, 4, 8",
        ],
        id="user-tp-does-not-divide-heads",
    ),
    pytest.param(
        make_spec(8.03 * B, gpus=8, parallelism={"tensorParallelSize": 16}),
        ["tensorParallelSize 16 is larger than accelerator.count 8", "at most 8"],
        id="tp-above-count",
    ),
    pytest.param(
        make_spec(
            8.03 * B,
            gpus=8,
            parallelism={"tensorParallelSize": 4, "dataParallelSizeLocal": 4},
        ),
        ["4 x spec.parallelism.dataParallelSizeLocal 4 = 16 accelerators", "at most 2"],
        id="tp-times-dp-above-count",
    ),
    pytest.param(
        make_spec(
            8.03 * B,
            gpus=8,
            topology=disaggregated({"tensorParallelSize": 4}, {"tensorParallelSize": 2}),
        ),
        [
            "prefill tensorParallelSize 4 is larger than decode tensorParallelSize 2",
            "cannot reshard blocks from a wider prefill to a narrower decode",
        ],
        id="prefill-wider-than-decode",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=8, topology=disaggregated(decode={"tensorParallelSize": 2})),
        ["prefill tensorParallelSize 4 is larger than decode tensorParallelSize 2"],
        id="auto-prefill-wider-than-user-decode",
    ),
    pytest.param(
        make_spec(70.6 * B, gpus=1, parallelism={"tensorParallelSize": 1}),
        ["141 GB per accelerator, more than accelerator.memoryGiB 80"],
        id="user-tp-weights-overflow",
    ),
    pytest.param(
        make_spec(8.03 * B, parallelism={"tensorParallelSize": 16}),
        ["spec.accelerator is absent", "at most 8 worker ranks", "allowed: 1 to 8, or auto"],
        id="cpu-tp-16",
    ),
    pytest.param(
        make_spec(8.03 * B, kv=8, parallelism={"tensorParallelSize": 3}),
        ["tensorParallelSize 3 does not divide model.numKeyValueHeads 8", "allowed: 1, 2, 4, 8"],
        id="cpu-tp-3-heads",
    ),
    pytest.param(
        make_spec(8.03 * B, parallelism={"dataParallelSizeLocal": 2}),
        ["dataParallelSizeLocal is 2, but spec.accelerator is absent"],
        id="cpu-dp-2",
    ),
]


@pytest.mark.parametrize(("spec", "phrases"), REFUSED)
def test_refusals_name_the_values_and_what_is_allowed(spec: dict, phrases: list[str]) -> None:
    with pytest.raises(TuningError) as refused:
        tune(parse_spec(spec))
    for phrase in phrases:
        assert phrase in str(refused.value)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32"])
def test_fp8_weights_take_one_byte_each_so_fewer_gpus_hold_them(dtype: str) -> None:
    # 49.9e9 parameters: 99.8 GB in 16 bits need two 80 GiB GPUs, 49.9 GB in fp8 one.
    bf16 = tune(parse_spec(make_spec(49.9 * B, dtype="bfloat16", gpus=8, kv=8)))
    fp8 = tune(parse_spec(make_spec(49.9 * B, dtype=dtype, quantization="fp8", gpus=8, kv=8)))
    bf16_tp = bf16.roles["unified"].tensor_parallel_size
    fp8_tp = fp8.roles["unified"].tensor_parallel_size
    assert (bf16_tp.value, fp8_tp.value) == (2, 1)
    assert bf16_tp.reason.startswith(
        "49.9e9 params x 2 B = 99.8 GB does not fit 0.8 x 80 GiB (68.7 GB) at TP 1; TP 2 fits"
    )
    # The dtype is then the activations' type: it does not change the weights' size.
    assert fp8_tp.reason.startswith(
        "49.9e9 params x 1 B (fp8) = 49.9 GB fits 0.8 x 80 GiB (68.7 GB) at TP 1"
    )


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32"])
def test_quantization_none_sizes_the_weights_by_dtype_as_auto_does(dtype: str) -> None:
    auto = tune(parse_spec(make_spec(70.6 * B, dtype=dtype, gpus=8, kv=8)))
    none = tune(parse_spec(make_spec(70.6 * B, dtype=dtype, quantization="none", gpus=8, kv=8)))
    assert none.to_status() == auto.to_status()
    assert none.reasons() == auto.reasons()


def test_an_fp8_refusal_offers_no_smaller_weights() -> None:
    spec = make_spec(5000 * B, quantization="fp8", accelerator={"perNode": 8, "memoryGiB": 80})
    with pytest.raises(TuningError) as refused:
        tune(parse_spec(spec))
    assert str(refused.value).startswith("5e+03e9 params x 1 B (fp8) = 5e+03 GB do not fit")
    # Already a byte per weight: neither a dtype nor fp8 makes them smaller.
    assert str(refused.value).endswith("; allowed: more accelerator memory (accelerator.memoryGiB)")


def test_a_refusal_is_a_spec_error() -> None:
    assert issubclass(TuningError, SpecError)


def test_every_value_has_a_reason_in_role_and_field_order() -> None:
    tuning = tune(parse_spec(make_spec(70.6 * B, gpus=8, topology=disaggregated())))
    keys = [line.split(":", 1)[0] for line in tuning.reasons()]
    assert keys == [
        f"{role}.{field}={tuning.roles[role].to_status()[field]}"
        for role in ("prefill", "decode")
        for field in (
            "tensorParallelSize",
            "pipelineParallelSize",
            "nodesPerReplica",
            "dataParallelSizeLocal",
            "longPrefillTokenThreshold",
            "maxNumBatchedTokens",
        )
    ]
    assert all(len(line.split(": ", 1)[1]) > 10 for line in tuning.reasons())
    assert tuning.to_status() == {
        "roles": {role: tuning.roles[role].to_status() for role in ("prefill", "decode")},
        "reasons": tuning.reasons(),
    }


def test_auto_chunks_take_the_itl_slo_as_the_tuners_step_target() -> None:
    unified = tune(parse_spec(make_spec(8.03 * B, itl=80))).roles["unified"]
    assert unified.long_prefill_token_threshold.value == "auto"
    target = unified.long_prefill_step_ms
    assert target is not None and target.value == 80
    assert "the ITL SLO 80 ms (spec.scheduling.slo.itlMs)" in target.reason
    assert unified.engine_args()["long_prefill_step_ms"] == 80
    assert unified.to_status()["longPrefillStepMs"] == 80
    args = EngineArgs(model="m", **unified.engine_args())
    assert (args.long_prefill_token_threshold, args.long_prefill_step_ms) == ("auto", 80)
    # P/D with auto chunks: decode steps carry decodes; prefill steps carry none.
    pools = tune(parse_spec(make_spec(None, gpus=8, topology=disaggregated()))).roles
    assert pools["prefill"].long_prefill_step_ms is None
    assert "long_prefill_step_ms" not in pools["prefill"].engine_args()
    decode = pools["decode"].long_prefill_step_ms
    assert decode is not None and decode.value == 50


@pytest.mark.parametrize(
    ("spec", "measured"),
    [
        pytest.param(make_spec(8.03 * B, gpus=1), None, id="known-cost"),
        pytest.param(
            make_spec(8.03 * B, scheduling={"longPrefillTokenThreshold": 256}), None, id="user-set"
        ),
        pytest.param(
            make_spec(8.03 * B),
            {"unified": MeasuredChunks(256, 512, "fitted")},
            id="closed-loop",
        ),
    ],
)
def test_a_fixed_threshold_has_no_step_target(spec: dict, measured: dict | None) -> None:
    unified = tune(parse_spec(spec), measured).roles["unified"]
    assert isinstance(unified.long_prefill_token_threshold.value, int)
    assert unified.long_prefill_step_ms is None
    assert "long_prefill_step_ms" not in unified.engine_args()
    assert "longPrefillStepMs" not in unified.to_status()


@pytest.mark.parametrize(
    "spec", [param.values[0] for param in TUNED], ids=[param.id for param in TUNED]
)
def test_engine_args_are_valid_engine_flags(spec: dict) -> None:
    for role in tune(parse_spec(spec)).roles.values():
        EngineArgs(model="m", **role.engine_args())


def test_accelerators_per_pod() -> None:
    on_gpus = tune(parse_spec(make_spec(70.6 * B, gpus=8)))
    assert on_gpus.roles["unified"].accelerators_per_pod() == 8
    on_cpu = tune(parse_spec(make_spec(70.6 * B)))
    assert on_cpu.roles["unified"].accelerators_per_pod() == 0
    # Over two nodes: each pod requests its node's share of the 16 ranks.
    over_nodes = tune(parse_spec(make_spec(405 * B, accelerator={"perNode": 8, "memoryGiB": 80})))
    assert over_nodes.roles["unified"].accelerators_per_pod() == 8


def test_user_set_values_are_marked() -> None:
    spec = make_spec(8.03 * B, gpus=8, parallelism={"tensorParallelSize": 2})
    unified = tune(parse_spec(spec)).roles["unified"]
    assert unified.tensor_parallel_size.user_set
    assert not unified.data_parallel_size_local.user_set


models = st.builds(
    dict,
    params=st.floats(1e8, 1e12),
    dtype=st.sampled_from(["auto", "bfloat16", "float32"]),
    quantization=st.sampled_from(["auto", "fp8", "none"]),
    gpus=st.integers(1, 64),
    kv=st.sampled_from([None, 1, 2, 4, 8, 16, 12]),
    mode=st.sampled_from(["unified", "disaggregated"]),
)


def _spec(model: dict, memory: float, itl: int) -> dict:
    topology = disaggregated() if model["mode"] == "disaggregated" else {"mode": "unified"}
    return make_spec(
        model["params"],
        dtype=model["dtype"],
        quantization=model["quantization"],
        gpus=model["gpus"],
        memory=memory,
        kv=model["kv"],
        itl=itl,
        topology=topology,
    )


@settings(max_examples=150, deadline=None)
@given(models, st.floats(1, 4096), st.integers(1, 2000), st.integers(1, 2000))
def test_a_looser_itl_never_gives_a_smaller_threshold(
    model: dict, memory: float, itl: int, looser_by: int
) -> None:
    try:
        tight = tune(parse_spec(_spec(model, memory, itl)))
    except TuningError:
        return
    loose = tune(parse_spec(_spec(model, memory, itl + looser_by)))
    for role, tuned in tight.roles.items():
        before = tuned.long_prefill_token_threshold.value
        after = loose.roles[role].long_prefill_token_threshold.value
        assert isinstance(before, int) and isinstance(after, int)
        assert after >= before


@settings(max_examples=150, deadline=None)
@given(models, st.floats(1, 4096), st.floats(1, 4096))
def test_more_accelerator_memory_never_gives_a_larger_tp(
    model: dict, memory: float, more: float
) -> None:
    small, large = sorted([memory, more])
    try:
        less_memory = tune(parse_spec(_spec(model, small, 50)))
    except TuningError:
        return
    more_memory = tune(parse_spec(_spec(model, large, 50)))  # must not refuse either
    for role, tuned in less_memory.roles.items():
        assert (
            more_memory.roles[role].tensor_parallel_size.value <= tuned.tensor_parallel_size.value
        )
