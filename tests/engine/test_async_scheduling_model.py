"""Async scheduling with the real model (tiny, fp32): the same tokens as synchronous steps, in
process and in worker processes, with one rank or two, on a pool tight enough to preempt."""

from __future__ import annotations

import pytest

from tidegate.engine import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The tide comes in and the tide goes out, " * 3,
    [5, 6, 7, 8, 9] * 8,
    "Once upon a time",
    "A B C D E F G",
    [11, 12, 13] * 12,
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=90, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=60, stop=["e"], logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=1, ignore_eos=True),
    SamplingParams(
        temperature=0, max_tokens=80, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True
    ),
]
# Small steps and a pool that cannot hold every request at once: chunked prefills, and
# requests preempted and recomputed while others decode.
TIGHT = {"max_model_len": 256, "max_num_batched_tokens": 48, "num_gpu_blocks": 16}


def generate(model_dir, **engine_args):
    with LLM(str(model_dir), dtype="float32", **engine_args) as llm:
        outputs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    results = [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]
    logprobs = [o.outputs[0].logprobs for o in outputs]
    return results, logprobs, stats


def assert_same_logprobs(a, b) -> None:
    for rows_a, rows_b in zip(a, b, strict=True):
        if rows_a is None:
            assert rows_b is None
            continue
        for row_a, row_b in zip(rows_a, rows_b, strict=True):
            assert row_a.keys() == row_b.keys()
            for token in row_a:
                assert row_a[token].logprob == pytest.approx(row_b[token].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def sync_reference(tiny_llama_dir):
    return generate(tiny_llama_dir, **TIGHT)


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_async_steps_give_the_tokens_of_sync_steps(tiny_llama_dir, sync_reference, backend):
    results, logprobs, stats = generate(
        tiny_llama_dir, async_scheduling=True, distributed_executor_backend=backend, **TIGHT
    )
    expected, expected_logprobs, sync_stats = sync_reference
    assert sync_stats["num_preemptions"] > 0 and stats["num_preemptions"] > 0
    assert results == expected
    assert_same_logprobs(logprobs, expected_logprobs)
    assert [r[2] for r in results] == ["length", "length", "length", "stop", "length", "length"]


def test_async_steps_on_two_ranks_give_the_tokens_of_one(tiny_llama_dir, sync_reference):
    results, _, _ = generate(tiny_llama_dir, async_scheduling=True, tensor_parallel_size=2, **TIGHT)
    assert results == sync_reference[0]
