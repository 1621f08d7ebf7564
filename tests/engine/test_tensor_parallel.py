"""Tensor parallelism on CPU (gloo): two worker processes give the tokens one worker gives."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.server import ServerProcess
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Longer than the step budget below, so its prefill is computed in chunks.
LONG_PROMPT = "The tide comes in and the tide goes out, " * 12
PROMPTS = ["Hello, my name is", LONG_PROMPT, [5, 6, 7, 8, 9] * 20]
ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 64, "num_gpu_blocks": 128}
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
# Rank 0 samples under the grammar; the other rank must append the same tokens.
CONSTRAINED = [
    SamplingParams(
        temperature=0,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
    ),
    SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}(-[0-9]{2})?"),
    ),
]


def _generate(
    model_dir: Path, tensor_parallel_size: int
) -> tuple[list[list[int]], float, list[list[tuple[int, float]]]]:
    """Token ids of every prompt, twice (the second pass hits the prefix cache), hits, and
    the long prompt's prompt logprobs (its chunks' logits, gathered over the ranks)."""
    with LLM(str(model_dir), tensor_parallel_size=tensor_parallel_size, **ENGINE) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        hits_before = llm.stats()["prefix_cache_hits"]
        second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        hits = llm.stats()["prefix_cache_hits"] - hits_before
        constrained = llm.generate(PROMPTS[:2], CONSTRAINED)
        scored = llm.generate([LONG_PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert first == second
    assert json.loads(constrained[0].outputs[0].text).keys() == {"id", "ok"}
    prompt_logprobs = [
        [(lp.token_id, lp.logprob) for lp in entry.values()]
        for entry in scored[0].prompt_logprobs[1:]
    ]
    return first + [o.outputs[0].token_ids for o in constrained], hits, prompt_logprobs


# Qwen3-MoE and Mixtral: every expert's intermediate features split over the ranks. Gemma 3:
# its norms and windows on each rank's heads.
@pytest.mark.parametrize(
    "model",
    [
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        "tiny_gemma3_dir",
        "tiny_phi3_dir",
        "tiny_qwen3_moe_dir",
        "tiny_mixtral_dir",
    ],
)
def test_two_ranks_generate_the_tokens_of_one(model, request):
    model_dir = request.getfixturevalue(model)
    one, hits_one, scored_one = _generate(model_dir, 1)
    two, hits_two, scored_two = _generate(model_dir, 2)
    assert two == one
    assert hits_two == hits_one > 0
    assert len(scored_two) == len(scored_one) > 64  # more than one chunk
    for got, want in zip(scored_two, scored_one, strict=True):
        assert got[0][0] == want[0][0]  # the prompt's token, then the top two
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-3)


# FP8 checkpoints: each rank's rows of the merged q/k/v and gate/up, and its columns of o_proj
# and down_proj, with their scales (32 x 32 blocks: row-parallel splits on a block boundary, so
# the activations' K-groups are the ones a single rank has). Per-row activation scales differ
# between one rank's whole row and two ranks' halves, so fp8 products of the per-channel layout
# are compared dequantized only.
@pytest.mark.parametrize(
    ("arch", "quantize", "quantization"),
    [
        ("llama", "fp8-block", "fp8"),
        ("llama", "fp8-block", "auto"),
        ("llama", "fp8-channel", "auto"),
        ("qwen3_moe", "fp8-block", "auto"),
        ("qwen3_moe", "fp8-block", "fp8"),
    ],
)
def test_two_ranks_hold_fp8_checkpoints_as_one(tiny_fp8_model, arch, quantize, quantization):
    folder = tiny_fp8_model(arch, quantize)
    outputs = []
    for size in (1, 2):
        with LLM(
            str(folder), tensor_parallel_size=size, quantization=quantization, **ENGINE
        ) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)])
    assert outputs[1] == outputs[0]


def test_two_ranks_with_speculation_give_the_tokens_of_one_without(tiny_llama_dir):
    """Rank 0 samples every guessed position and broadcasts; both ranks keep the same tokens
    and take back the same guesses."""
    from tests.engine.test_async_scheduling_model import assert_same_logprobs
    from tests.engine.test_spec_decode_model import SPEC, generate

    one, logprobs_one, _ = generate(tiny_llama_dir)
    two, logprobs_two, stats = generate(tiny_llama_dir, tensor_parallel_size=2, **SPEC)
    assert two == one
    assert_same_logprobs(logprobs_one, logprobs_two)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.slow
def test_two_ranks_with_async_scheduling_constrain_as_one_rank_does(tiny_llama_dir):
    """Worker processes cannot wait for a bitmask after a step starts: a constrained request
    skips the step planned before its token is known, and its tokens stay the same."""
    with LLM(str(tiny_llama_dir), **ENGINE) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], CONSTRAINED)]
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, async_scheduling=True, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], CONSTRAINED)]
    assert got == want


def test_two_ranks_with_async_scheduling_embed_as_one_rank_does(tiny_llama_dir):
    """The pooled vector is rank 0's, and goes out with the token that ends the request, in
    the step async scheduling planned before that token was known."""
    embeddings = {}
    for size, overlapped in ((1, False), (2, True)):
        with LLM(
            str(tiny_llama_dir),
            tensor_parallel_size=size,
            async_scheduling=overlapped,
            **ENGINE,
        ) as llm:
            embeddings[size] = [
                o.embedding for pooling in ("last", "mean") for o in llm.embed(PROMPTS, pooling)
            ]
    for got, want in zip(embeddings[2], embeddings[1], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_two_ranks_classify_as_one_rank_does(tmp_path):
    """The score head is whole on every rank, over the same gathered hidden state."""
    folder = make_tiny_model(tmp_path / "classifier", arch="llama", num_labels=3)
    logits = {}
    for size in (1, 2):
        with LLM(str(folder), tensor_parallel_size=size, async_scheduling=True, **ENGINE) as llm:
            logits[size] = [o.logits for o in llm.classify(PROMPTS)]
    for got, want in zip(logits[2], logits[1], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def _generate_with_adapters(
    model_dir: Path, adapters: list[Path], tensor_parallel_size: int
) -> list[list[int]]:
    """Every prompt under the base model and each adapter, in one mixed batch."""
    with LLM(
        str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        enable_lora=True,
        max_loras=len(adapters),
        **ENGINE,
    ) as llm:
        loras = [None] + [llm.load_lora(p.name, str(p)) for p in adapters]
        prompts = [prompt for prompt in PROMPTS for _ in loras]
        per_prompt = loras * len(PROMPTS)
        outputs = llm.generate(prompts, GREEDY, lora_request=per_prompt)
    return [o.outputs[0].token_ids for o in outputs]


# Qwen3-MoE: its dense first layer's MLP is adapted, its experts are not.
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_moe_dir"])
def test_two_ranks_serve_adapters_as_one_does(model, request, tmp_path):
    """A and B are sliced as their base layers are: column-parallel q/k/v and gate/up keep
    their rows of B, row-parallel o and down their columns of A (the all-reduce sums the
    delta with the rest)."""
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    model_dir = request.getfixturevalue(model)
    adapters = [
        make_tiny_adapter(model_dir, tmp_path / "all", rank=8, seed=1),
        make_tiny_adapter(
            model_dir, tmp_path / "some", rank=4, seed=2, targets=["k_proj", "o_proj", "up_proj"]
        ),
    ]
    one = _generate_with_adapters(model_dir, adapters, 1)
    assert _generate_with_adapters(model_dir, adapters, 2) == one
    assert one[0] != one[1] != one[2]  # base, and each adapter, differ


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .* 4 attention"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **ENGINE)


def test_serve_refuses_a_size_that_does_not_divide_the_heads(tiny_llama_dir, tmp_path):
    server = ServerProcess(tiny_llama_dir, tmp_path, "--tensor-parallel-size", "3")
    try:
        assert server.wait_exit(timeout=60) != 0
        assert "tensor_parallel_size 3 does not divide" in server.log()
    finally:
        server.stop()


@pytest.fixture
def tp_server(tiny_llama_dir, tmp_path):
    server = ServerProcess(
        tiny_llama_dir, tmp_path, "--tensor-parallel-size", "2", "--max-model-len", "512"
    ).wait_healthy()
    try:
        yield server
    finally:
        server.stop()


def test_serve_with_two_ranks_answers_as_one_rank_does(tp_server, tiny_llama_dir):
    assert {"tidegate::worker_tp0", "tidegate::worker_tp1"} <= set(tp_server.children())
    with LLM(str(tiny_llama_dir), **ENGINE) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], GREEDY)]
    for prompt, text in zip(PROMPTS[:2], expected, strict=True):
        response = httpx.post(
            f"{tp_server.base_url}/v1/completions",
            json={
                "model": str(tiny_llama_dir),
                "prompt": prompt,
                "max_tokens": GREEDY.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == text


def test_killing_one_rank_takes_the_server_down(tp_server, tiny_llama_dir):
    children = tp_server.children()
    victim = children["tidegate::worker_tp1"]
    others = [p for title, p in children.items() if title != "tidegate::worker_tp1"]

    async def stream_until_killed() -> list[dict]:
        async with httpx.AsyncClient(base_url=tp_server.base_url, timeout=30) as client:
            body = {
                "model": str(tiny_llama_dir),
                "prompt": "The tide comes in and",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = []
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[len("data: ") :]))
                        if len(events) == 1:  # producing tokens: now kill one rank
                            victim.send_signal(signal.SIGKILL)
                return events

    killed_at = time.monotonic()
    events = asyncio.run(stream_until_killed())
    assert "error" in events[-1], events[-1]
    code = tp_server.wait_exit(timeout=15)
    assert time.monotonic() - killed_at < 15
    assert code != 0
    _, alive = psutil.wait_procs(others, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
