"""Speculative decoding (prompt lookup) with the real model (tiny, fp32): the same tokens,
text, finish reasons and logprobs as decoding token by token, greedy or seeded, with
penalties, stops and min_tokens, on a roomy pool and on one tight enough to preempt; guesses
are accepted; nothing leaks; the prefix cache holds only KV of real tokens; guesses never
take a decode's budget."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.engine.test_async_scheduling_model import PROMPTS as ASYNC_PROMPTS
from tests.engine.test_async_scheduling_model import assert_same_logprobs
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.lora.tiny_adapter import make_tiny_adapter
from tidegate.engine.messages import EngineCoreRequest
from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.tiny_model import EOS_ID

SPEC = {"speculative_config": {"num_speculative_tokens": 4}}
# A few allowed tokens make the output repeat itself, which prompt lookup predicts: accepted
# and rejected guesses in the same run.
FEW = [5, 6, 7]
SOME = [5, 6, 7, 8, 9, 10]
PROMPTS = [*ASYNC_PROMPTS, "Salt and", [5, 6, 5, 6, 7] * 4, "Low tide at noon"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=70, ignore_eos=True, allowed_token_ids=FEW),
    SamplingParams(
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        max_tokens=90,
        ignore_eos=True,
        allowed_token_ids=SOME,
    ),
    SamplingParams(temperature=0, max_tokens=60, stop=["e"], logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=50, ignore_eos=True, logprobs=1),
    SamplingParams(
        temperature=0,
        max_tokens=80,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        ignore_eos=True,
        allowed_token_ids=SOME,
    ),
    # EOS is masked until 30 tokens are out, at every position a step samples.
    SamplingParams(temperature=0, max_tokens=60, min_tokens=30, allowed_token_ids=[EOS_ID, *FEW]),
    SamplingParams(
        temperature=0, max_tokens=60, stop_token_ids=[7], min_tokens=3, allowed_token_ids=FEW
    ),
    SamplingParams(temperature=1.0, seed=99, max_tokens=64, ignore_eos=True, allowed_token_ids=FEW),
]
TIGHT = {"max_model_len": 256, "max_num_batched_tokens": 48, "num_gpu_blocks": 16}


def generate(model_dir, **engine_args):
    with LLM(str(model_dir), dtype="float32", **engine_args) as llm:
        outputs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats()
        llm.engine.kv_cache_manager.check_invariants()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    results = [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]
    return results, [o.outputs[0].logprobs for o in outputs], stats


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return {
        "roomy": generate(tiny_llama_dir),
        "tight": generate(tiny_llama_dir, **TIGHT),
    }


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_guesses_change_no_token(tiny_llama_dir, reference, pool):
    results, logprobs, _ = reference[pool]
    spec_results, spec_logprobs, stats = generate(
        tiny_llama_dir, **SPEC, **(TIGHT if pool == "tight" else {})
    )
    for expected, got in zip(results, spec_results, strict=True):
        assert got == expected
    assert_same_logprobs(logprobs, spec_logprobs)
    # Guesses were made, some kept and some not.
    assert stats["spec_decode_num_drafts"] > 20
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    if pool == "tight":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_guesses_change_no_token_under_sliding_windows(arch, request):
    # A step's guessed positions each see their own window (24 tokens, far shorter than the
    # outputs); Gemma 2's capped scores run on the torch backend, Gemma 3 on the cpu kernel.
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    results, logprobs, _ = generate(model_dir)
    spec_results, spec_logprobs, stats = generate(model_dir, **SPEC)
    for expected, got in zip(results, spec_results, strict=True):
        assert got == expected
    assert_same_logprobs(logprobs, spec_logprobs)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_outputs_are_cut_at_max_tokens_and_the_context(tiny_llama_dir):
    """Guesses stop short of max_tokens and of max_model_len, however many would match."""
    prompt = [5] * 40
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, **SPEC) as llm:
        outputs = llm.generate(
            [prompt, prompt],
            [
                SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, allowed_token_ids=[5]),
                SamplingParams(
                    temperature=0, max_tokens=None, ignore_eos=True, allowed_token_ids=[5]
                ),
            ],
        )
        stats = llm.stats()
    assert outputs[0].outputs[0].token_ids == [5] * 9
    assert outputs[1].outputs[0].token_ids == [5] * 24  # up to the 64-token context
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    # Every guess was right, so the 24 tokens took about a fifth of the steps.
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_steps"] <= 12


def test_cached_prefix_computed_with_guesses_holds_the_real_tokens_kv(tiny_llama_dir):
    """A prompt that extends an earlier request's prompt and output hits the blocks computed
    in steps with rejected guesses: its tokens equal an engine's without prefix caching."""
    first_params = SamplingParams(
        temperature=0, max_tokens=70, ignore_eos=True, allowed_token_ids=SOME
    )
    then_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 6
    with LLM(str(tiny_llama_dir), dtype="float32", **SPEC) as llm:
        first = llm.generate([prompt], first_params)[0].outputs[0].token_ids
        follow = prompt + first
        hits_before = llm.stats()["prefix_cache_hits"]
        cached = llm.generate([follow], then_params)[0]
        assert llm.stats()["prefix_cache_hits"] - hits_before >= 80
        assert (
            llm.stats()["spec_decode_num_accepted_tokens"]
            < llm.stats()["spec_decode_num_draft_tokens"]
        )
    with LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False) as llm:
        fresh = llm.generate([follow], then_params)[0]
    assert cached.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_disable_by_batch_size_guesses_nothing_in_a_full_batch(tiny_llama_dir):
    spec = {"num_speculative_tokens": 4, "disable_by_batch_size": 2}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, allowed_token_ids=[5])
    with LLM(str(tiny_llama_dir), dtype="float32", speculative_config=spec) as llm:
        llm.generate([[5] * 10, [5] * 12], params)
        assert llm.stats()["spec_decode_num_drafts"] == 0
        llm.generate([[5] * 10], params)
        assert llm.stats()["spec_decode_num_drafts"] > 0


def request(req_id: str, prompt: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        eos_token_ids=[EOS_ID],
        arrival_time=0.0,
    )


def test_guesses_take_only_the_budget_decodes_leave(tiny_llama_dir):
    """Six decodes and a budget of eight tokens: every decode gets its token each step, and
    the guesses share the two tokens left; aborting them all frees every block."""
    args = EngineArgs(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_num_batched_tokens=8,
        speculative_config={"num_speculative_tokens": 4},
    )
    core = EngineCore(args)
    try:
        params = SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True, allowed_token_ids=[5]
        )
        for i in range(6):
            core.add_request(request(f"r{i}", [5] * 7, params))
        guessed = 0
        for _ in range(40):
            core.step()
            so = core.last_scheduler_output
            if len(core.scheduler.running) == 6 and all(
                r.num_output_tokens for r in core.scheduler.running
            ):
                assert set(so.num_scheduled_tokens) == {f"r{i}" for i in range(6)}
                assert so.total_num_scheduled_tokens <= 8
                guessed += sum(map(len, so.scheduled_spec_decode_tokens.values()))
        assert guessed > 0
        core.abort_requests([f"r{i}" for i in range(6)])
        core.step()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_total_blocks
        core.kv_cache_manager.check_invariants()
    finally:
        core.shutdown()


ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"],
        "additionalProperties": False,
    },
    "minItems": 6,
    "maxItems": 6,
}
CONSTRAINED = [
    ("Say ab twenty times", SamplingParams(temperature=0, max_tokens=120), {"regex": "(ab){20}"}),
    (
        "Letters:",
        SamplingParams(temperature=1.0, seed=4, max_tokens=120),
        {"regex": "[a-c]{40}"},
    ),
    ("Items:", SamplingParams(temperature=0, max_tokens=200), {"json": json.dumps(ITEMS)}),
    (
        "Query:",
        SamplingParams(temperature=0.8, seed=2, max_tokens=200),
        {"grammar": 'root ::= "SELECT " name (", " name)* " FROM t"\nname ::= [a-d] [a-d]?\n'},
    ),
]


def generate_constrained(model_dir, backend: str, **engine_args) -> tuple[list[str], dict]:
    prompts = [prompt for prompt, _, _ in CONSTRAINED]
    params = [
        dataclasses.replace(p, structured_outputs=StructuredOutputsParams(**constraint))
        for _, p, constraint in CONSTRAINED
    ]
    with LLM(
        str(model_dir), dtype="float32", structured_outputs_backend=backend, **engine_args
    ) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.stats()
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs], stats


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_constrained_outputs_with_guesses_equal_those_without(tiny_llama_dir, backend):
    """Guesses a grammar forbids are never made; each guessed position samples under the
    grammar as it stands after the guesses before it; the matchers end where the output does."""
    expected, _ = generate_constrained(tiny_llama_dir, backend)
    got, stats = generate_constrained(tiny_llama_dir, backend, **SPEC)
    assert got == expected
    texts, reasons = zip(*got, strict=True)
    assert texts[0] == "ab" * 20
    assert re.fullmatch("[a-c]{40}", texts[1])
    assert re.fullmatch("SELECT [a-d]{1,2}(, [a-d]{1,2})* FROM t", texts[3])
    assert reasons[:2] == ("stop", "stop") and reasons[3] == "stop"
    # JSON lets the random model write whitespace for ever: it may run to max_tokens, but
    # never out of the schema.
    if reasons[2] == "stop":
        assert len(json.loads(texts[2])) == 6
    else:
        assert texts[2].lstrip().startswith("[")
    assert stats["spec_decode_num_accepted_tokens"] > 10


def generate_with_adapters(model_dir, adapters: dict, **engine_args) -> tuple[list, dict]:
    """Every prompt under each adapter and the base model, mixed in one batch."""
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=3, **engine_args) as llm:
        loras = [None] + [llm.load_lora(name, str(path)) for name, path in adapters.items()]
        prompts = [p for p in PROMPTS[:6] for _ in loras]
        per_prompt = [lora for _ in PROMPTS[:6] for lora in loras]
        params = [PARAMS[i] for i in range(6) for _ in loras]
        outputs = llm.generate(prompts, params, lora_request=per_prompt)
        stats = llm.stats()
    return [o.outputs[0].token_ids for o in outputs], stats


def test_guesses_under_adapters_change_no_token(tiny_llama_dir, tmp_path):
    """Guessed positions run under their request's adapter, as the tokens before them do."""
    adapters = {
        "a": make_tiny_adapter(tiny_llama_dir, tmp_path / "a", rank=8, seed=1),
        "b": make_tiny_adapter(tiny_llama_dir, tmp_path / "b", rank=4, alpha=8, seed=2),
    }
    expected, _ = generate_with_adapters(tiny_llama_dir, adapters)
    got, stats = generate_with_adapters(tiny_llama_dir, adapters, **SPEC)
    assert got == expected
    assert len({tuple(tokens) for tokens in expected[:3]}) == 3  # the adapters matter
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_compiled_model_with_guesses_gives_the_eager_tokens(tiny_llama_dir):
    """torch.compile at level 1 (dynamic token counts) runs the steps with guesses."""
    expected, expected_logprobs, _ = generate(tiny_llama_dir, compilation_level=0)
    got, logprobs, stats = generate(tiny_llama_dir, compilation_level=1, **SPEC)
    assert got == expected
    assert_same_logprobs(expected_logprobs, logprobs)
    assert stats["spec_decode_num_accepted_tokens"] > 0
