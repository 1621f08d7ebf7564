"""The offline API as a user meets it: prefix caching, tenancy, sampling, stops, bad input."""

from __future__ import annotations

import random

import pytest

from tidegate.engine import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=1024, num_gpu_blocks=400)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 900) for _ in range(n)]


def assert_nothing_leaked(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_shared_prefix_is_computed_once(llm):
    prefix = tokens(1, 20 * BLOCK)  # a 320-token "system prompt"
    suffixes = [tokens(100 + i, 10 + i) for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.stats()
    llm.generate([[*prefix, *suffixes[0]]], greedy)
    middle = llm.stats()
    # The first request computes everything: prefix and its own suffix.
    first_computed = middle["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
    assert first_computed == len(prefix) + len(suffixes[0])

    outputs = llm.generate([[*prefix, *s] for s in suffixes[1:]], greedy)
    after = llm.stats()
    computed = after["num_computed_prompt_tokens"] - middle["num_computed_prompt_tokens"]
    hits = after["prefix_cache_hits"] - middle["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - middle["prefix_cache_queries"]
    # The seven later requests compute only their own suffixes; the prefix comes from cache.
    assert computed == sum(len(s) for s in suffixes[1:])
    assert hits == 7 * len(prefix)
    assert queries == sum(len(prefix) + len(s) for s in suffixes[1:])
    assert all(o.num_cached_tokens == len(prefix) for o in outputs)
    assert_nothing_leaked(llm)


def test_cached_and_uncached_prefixes_give_the_same_tokens(llm):
    prompt = tokens(7, 5 * BLOCK + 3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = llm.generate([prompt], greedy)[0]
    warm = llm.generate([prompt], greedy)[0]
    assert warm.num_cached_tokens == 5 * BLOCK
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_distinct_cache_salts_never_share_blocks(llm):
    prompt = tokens(3, 8 * BLOCK)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], greedy, cache_salt="tenant-a")
    before = llm.stats()
    other = llm.generate([prompt], greedy, cache_salt="tenant-b")[0]
    unsalted = llm.generate([prompt], greedy)[0]
    same = llm.generate([prompt], greedy, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == 7 * BLOCK  # the last block holds the recomputed token
    assert llm.stats()["prefix_cache_hits"] - before["prefix_cache_hits"] == 7 * BLOCK


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    prompt = tokens(11, 40)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42, max_tokens=16)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = [tokens(20 + i, 5 + 30 * i) for i in range(5)]
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [params]
    mixed_params += [SamplingParams(temperature=0, max_tokens=8)] * 3
    batch = llm.generate([others[0], others[1], prompt, *others[2:]], mixed_params)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=0.9, max_tokens=16)
    draws = {tuple(llm.generate([prompt], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1, "unseeded sampling should vary"


def test_stop_strings_and_stop_token_ids(llm):
    prompt = tokens(5, 30)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free[0].outputs[0].text
    ids = free[0].outputs[0].token_ids
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    completion = cut.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    kept = SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
    )
    assert llm.generate([prompt], kept)[0].outputs[0].text == text[: text.index(stop) + 3]

    by_id = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[5]])
    out = llm.generate([prompt], by_id)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[5]) + 1]
    assert out.stop_reason == ids[5]
    assert_nothing_leaked(llm)


def test_max_tokens_min_tokens_and_eos(llm):
    prompt = tokens(9, 12)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    # EOS is token 2 in the tiny models: forbidding it until min_tokens is honoured.
    params = SamplingParams(temperature=1.5, max_tokens=30, min_tokens=25, seed=3)
    for output in llm.generate([prompt] * 4, params):
        token_ids = output.outputs[0].token_ids
        assert len(token_ids) >= 25
        assert 2 not in token_ids[:25]
        assert output.outputs[0].finish_reason in ("stop", "length")


def test_logit_bias_and_allowed_token_ids_steer_the_whole_output(llm):
    prompt = tokens(30, 14)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    unbiased = llm.generate([prompt], plain)[0].outputs[0].token_ids
    biased = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    forced = llm.generate([prompt], SamplingParams(**biased, logit_bias={77: 100}))[0]
    assert forced.outputs[0].token_ids == [77] * 6
    banned = SamplingParams(**biased, logit_bias={unbiased[0]: -100})
    assert llm.generate([prompt], banned)[0].outputs[0].token_ids[0] != unbiased[0]
    # Random sampling over three allowed tokens, in one batch with an unconstrained request.
    allowed = SamplingParams(
        temperature=1.5, max_tokens=12, ignore_eos=True, seed=2, allowed_token_ids=[10, 11, 12]
    )
    restricted, free = llm.generate([prompt, prompt], [allowed, plain])
    assert set(restricted.outputs[0].token_ids) <= {10, 11, 12}
    assert len(set(restricted.outputs[0].token_ids)) > 1
    assert free.outputs[0].token_ids == unbiased
    assert_nothing_leaked(llm)


def test_logprobs_are_returned_per_token(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    completion = llm.generate([tokens(4, 20)], params)[0].outputs[0]
    assert len(completion.logprobs) == 6
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry
        assert entry[token_id].rank == 1  # greedy: the sampled token is the most likely
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )


def test_penalties_change_greedy_output(llm):
    # A long prompt covers much of the tiny vocabulary, so the repetition penalty bites.
    prompt = tokens(13, 400)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=2.0
    )
    a, b = llm.generate([prompt, prompt], [plain, penalised])
    ids_a, ids_b = a.outputs[0].token_ids, b.outputs[0].token_ids
    assert ids_a != ids_b
    # Penalised greedy output reuses prompt tokens less often than plain greedy output.
    seen = set(prompt)
    assert sum(t in seen for t in ids_b) < sum(t in seen for t in ids_a)


def test_text_prompts_and_chat(llm):
    outputs = llm.generate(["Hello there", "The weather today"], SamplingParams(max_tokens=5))
    assert [o.prompt for o in outputs] == ["Hello there", "The weather today"]
    assert all(o.prompt_token_ids[0] == 1 for o in outputs)  # BOS from the tokenizer
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))[0]
    assert chat.prompt_token_ids.count(1) == 1  # the template's BOS, not a second one


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], {}, "empty"),
        ([5] * 1024, {}, "1,024 tokens; this model accepts at most 1,023"),
        ([5, 100_000], {}, "outside this model's vocabulary"),
        ([5], {"temperature": -1}, "temperature"),
        ([5], {"top_p": 0}, "top_p"),
        ([5], {"max_tokens": 0}, "max_tokens"),
        ([5], {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ([5], {"stop_token_ids": [10**6]}, "stop_token_ids"),
        ([5], {"logit_bias": {1024: 5.0}}, "logit_bias contains 1024; .* 1,024 tokens"),
        ([5], {"allowed_token_ids": [7, 1024]}, "allowed_token_ids contains 1024"),
        # EOS is token 2: min_tokens forbids it, which would leave nothing to sample.
        ([5], {"allowed_token_ids": [2], "min_tokens": 1}, "only stop tokens"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error_and_leaks_nothing(llm, prompt, params, message):
    good = tokens(2, 20)
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], SamplingParams(**params))
    assert_nothing_leaked(llm)
    # The engine still serves.
    assert llm.generate([good], SamplingParams(max_tokens=2))[0].finished


def test_bad_engine_arguments_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="exceeds this model's limit"):
        LLM(model=str(tiny_llama_dir), max_model_len=10**6)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(model=str(tiny_llama_dir), max_model_len=1024, num_gpu_blocks=4)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        LLM(model=str(tiny_llama_dir), max_num_partial_prefills=1, max_long_partial_prefills=2)


def test_a_failing_step_aborts_the_batch_and_leaves_nothing_behind(llm, monkeypatch):
    real_execute = llm.engine.executor.worker.execute_model
    calls = {"n": 0}

    def failing_execute(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("worker lost")
        return real_execute(scheduler_output)

    monkeypatch.setattr(llm.engine.executor.worker, "execute_model", failing_execute)
    prompts = [tokens(30 + i, 40) for i in range(4)]
    with pytest.raises(RuntimeError, match="worker lost"):
        llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    monkeypatch.undo()
    assert_nothing_leaked(llm)
    assert not llm.output_processor.has_unfinished_requests()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)


def test_phased_scheduling_gives_the_same_greedy_tokens(tiny_llama_dir):
    prompts = [tokens(10 + i, 30 + 7 * i) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    unified = LLM(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks=256)
    phased = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_gpu_blocks=256,
        max_num_batched_tokens=64,  # phased raises the step capacity to a whole prompt
        step_composition="phased",
    )
    for a, b in zip(
        unified.generate(prompts, params), phased.generate(prompts, params), strict=True
    ):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="phased"):
        LLM(model=str(tiny_llama_dir), step_composition="phased", long_prefill_token_threshold=8)


def test_priority_scheduling_gives_the_same_greedy_tokens_and_needs_its_policy(llm, tiny_llama_dir):
    prompts = [tokens(20 + i, 20 + 5 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ranked = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks=400,
        scheduling_policy="priority",
        max_num_seqs=1,  # one at a time, in priority order
    )
    outputs = ranked.generate(prompts, params, priority=[3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, params)
    ]
    assert_nothing_leaked(ranked)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(prompts[:1], params, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        ranked.generate(prompts[:1], params, priority=[1, 2])
    assert_nothing_leaked(llm)


def test_auto_chunking_gives_the_same_greedy_tokens(tiny_llama_dir):
    prompts = [tokens(40 + i, 300 + 50 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks=256)
    auto = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_gpu_blocks=256,
        long_prefill_token_threshold="auto",
    )
    for a, b in zip(plain.generate(prompts, params), auto.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert auto.engine.scheduler.chunk_tuner is not None
