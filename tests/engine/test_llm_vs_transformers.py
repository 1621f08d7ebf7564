"""Greedy output of the whole engine equals Hugging Face transformers, whatever the schedule."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from tidegate.engine import LLM, SamplingParams, tiny_model

MAX_TOKENS = 16
MAX_MODEL_LEN = 512
# As the reference's min_new_tokens: exactly MAX_TOKENS tokens, EOS never picked (ignore_eos
# would let it be picked and go on).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def make_prompts(vocab_size: int) -> list[list[int]]:
    """Eight prompts from 1 to 330 tokens; three share a 100-token prefix so caching matters."""
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared = tokens(100)
    return [
        tokens(1),
        tokens(330),
        [*shared, *tokens(5)],
        tokens(17),
        [*shared, *tokens(60)],
        tokens(64),
        [*shared, *tokens(1)],
        tokens(129),
    ]


def transformers_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_of(model.eval(), prompts, MAX_TOKENS)


def greedy_of(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """A transformers model's greedy continuations: exactly max_tokens each, EOS never picked."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


# Mistral, Gemma and Phi-3 have sliding windows far shorter than the longer prompts; Gemma 2 caps
# its attention scores (on the torch backend: the cpu kernel has no cap).
ARCHITECTURES = list(tiny_model.ARCHITECTURES)  # every one make-tiny-model writes


@pytest.fixture(
    scope="module", params=[f"tiny_{arch}_dir" for arch in ARCHITECTURES], ids=ARCHITECTURES
)
def model_and_reference(request):
    model_dir = request.getfixturevalue(request.param)
    import json

    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab_size)
    return model_dir, prompts, transformers_greedy(model_dir, prompts)


SCHEDULES = list(
    itertools.product(
        [True, False],  # prefix caching
        [0, 7],  # long_prefill_token_threshold: off, or 7 (not a multiple of the block size)
        ["large", "small"],  # budget: ample, or too few blocks and tokens (forces preemption)
    )
)


def scheduled_llm(model_dir, caching: bool, threshold: int, small: bool) -> LLM:
    """An engine on one of SCHEDULES: small is too few blocks and tokens (forces preemption)."""
    # With a per-request cap, several prompts in prefill at once is what fills a small cache.
    partial = 3 if small and threshold else 1
    return LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        enable_prefix_caching=caching,
        long_prefill_token_threshold=threshold,
        max_num_batched_tokens=48 if small else 2048,
        num_gpu_blocks=36 if small else 512,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=partial,
    )


@pytest.mark.parametrize(("caching", "threshold", "budget"), SCHEDULES)
def test_greedy_tokens_identical_to_transformers(model_and_reference, caching, threshold, budget):
    model_dir, prompts, expected = model_and_reference
    small = budget == "small"
    llm = scheduled_llm(model_dir, caching, threshold, small)
    params = GREEDY
    outputs = llm.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) differs"
    stats = llm.stats()
    if small:
        assert stats["num_preemptions"] > 0, "the small budget was meant to force preemption"
    if caching and not small:
        # The two later prompts that share the 100-token prefix read its 6 full blocks.
        assert stats["prefix_cache_hits"] >= 2 * 96
    if not caching:
        assert stats["prefix_cache_hits"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def transformers_prompt_logprobs(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, log_softmax of the logits at each position: [len(prompt), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0], dim=-1) for p in prompts]


@pytest.mark.parametrize(
    ("threshold", "budget"), [(0, "large"), (7, "small")], ids=["whole-prompts", "chunks-preempted"]
)
def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(
    model_and_reference, threshold, budget
):
    # Chunks of 7 tokens on a tight pool (preemption recomputes chunks whose logprobs were
    # already taken), or whole prompts; caching on, and the shared prefix is computed again
    # each time, since a cache hit would skip the positions whose logprobs are asked for.
    model_dir, prompts, expected = model_and_reference
    small = budget == "small"
    llm = scheduled_llm(model_dir, True, threshold, small)
    params = GREEDY
    outputs = llm.generate(prompts, dataclasses.replace(params, prompt_logprobs=2))
    reference = transformers_prompt_logprobs(model_dir, prompts)
    for i, (output, prompt, want) in enumerate(zip(outputs, prompts, reference, strict=True)):
        assert output.outputs[0].token_ids == expected[i], f"prompt {i} differs"
        got = output.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for position in range(1, len(prompt)):
            entry = want[position - 1]  # the logits before a token predict it
            token = got[position][prompt[position]]
            value = entry[prompt[position]].item()
            assert token.logprob == pytest.approx(value, abs=1e-4)
            # Its rank counts the tokens at least as likely (near-ties may fall either way).
            assert (
                int((entry > value + 1e-4).sum()) < token.rank <= int((entry >= value - 1e-4).sum())
            )
            top = sorted(lp.logprob for lp in got[position].values())[-2:]
            assert top == pytest.approx(sorted(entry.topk(2).values.tolist()), abs=1e-4)
    stats = llm.stats()
    if small:
        assert stats["num_preemptions"] > 0, "the small budget was meant to force preemption"
    assert stats["prefix_cache_hits"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # Without prompt_logprobs the same prompts hit the cache again.
    llm.generate(prompts[2:5], params)
    assert llm.stats()["prefix_cache_hits"] >= 96


def test_phi3_past_its_pretraining_length_rotates_with_the_long_factors(tiny_phi3_dir):
    """An engine serving beyond LongRoPE's 512 pretraining positions uses the long factors
    (as vLLM; transformers switches to them for a sequence that long): a 600-token prompt's
    tokens equal transformers'."""
    prompt = [3 + (37 * i) % 1000 for i in range(600)]
    expected = transformers_greedy(tiny_phi3_dir, [prompt])
    llm = LLM(model=str(tiny_phi3_dir), dtype="float32", max_model_len=1024)
    scaling = llm.engine.executor.worker.runner.model_config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["long_context"]
    assert [o.outputs[0].token_ids for o in llm.generate([prompt], GREEDY)] == expected
