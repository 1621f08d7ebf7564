"""The batched sampler: each sampling parameter does what a user of vLLM or OpenAI expects."""

from __future__ import annotations

import pytest
import torch

from tidegate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tidegate.engine.worker.penalties import apply_penalties, pad_token_ids
from tidegate.engine.worker.sampler import Sampler, SamplerOutput, build_sampling_metadata

VOCAB = 32
sampler = Sampler()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplerOutput:
    n, vocab = logits.shape
    meta = build_sampling_metadata(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or {},
        vocab,
        "cpu",
    )
    return sampler(logits, meta)


def random_logits(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_argmax() -> None:
    logits = random_logits(5, seed=0)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_plain_greedy_batch_builds_no_optional_tensors() -> None:
    meta = build_sampling_metadata(
        [SamplingParams(temperature=0.0)] * 3, [[1]] * 3, [[2]] * 3, {}, VOCAB, "cpu"
    )
    assert meta.all_greedy
    optional = [meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.prompt_token_ids]
    optional += [meta.output_token_ids, meta.repetition_penalties, meta.min_tokens_mask]
    assert all(x is None for x in optional) and meta.max_num_logprobs is None


def test_all_greedy_batch_touches_no_generator() -> None:
    own = torch.Generator().manual_seed(7)
    own_state, default_state = own.get_state(), torch.get_rng_state()
    params = [SamplingParams(temperature=0.0, seed=7), SamplingParams(temperature=0.0)]
    sample(random_logits(2, seed=1), params, generators={0: own})
    assert torch.equal(own.get_state(), own_state)
    assert torch.equal(torch.get_rng_state(), default_state)


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    draws = 20_000
    torch.manual_seed(0)
    out = sample(logits.expand(draws, -1).clone(), [SamplingParams(temperature=0.7)] * draws)
    observed = torch.bincount(out.sampled_token_ids, minlength=8).double()
    expected = torch.softmax(logits.double() / 0.7, -1) * draws
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 26.0  # 7 degrees of freedom: p < 0.0005 under the right distribution


def test_top_k_never_samples_outside_the_top_k() -> None:
    logits = random_logits(1, seed=2).expand(2000, -1).clone()
    torch.manual_seed(1)
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 2000)
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.sampled_token_ids.tolist()) == allowed


def test_top_p_never_samples_outside_the_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.1])
    logits = probs.log().expand(2000, -1).clone()
    torch.manual_seed(2)
    # 0.5 + 0.3 is the smallest set reaching 0.75.
    out = sample(logits, [SamplingParams(top_p=0.75)] * 2000)
    assert set(out.sampled_token_ids.tolist()) == {1, 3}


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(2000, -1).clone()
    torch.manual_seed(3)
    # Threshold 0.2 * 0.5 = 0.1: token 0 goes, token 2 stays.
    out = sample(logits, [SamplingParams(min_p=0.2)] * 2000)
    assert set(out.sampled_token_ids.tolist()) == {1, 2, 3}


def test_top_k_top_p_and_greedy_rows_mix_in_one_batch() -> None:
    logits = random_logits(4, seed=4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=0.0, top_k=5),
    ]
    out = sample(logits, params)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def reference_penalties(
    logits: torch.Tensor,
    prompts: list[list[int]],
    outputs: list[list[int]],
    params: list[SamplingParams],
) -> torch.Tensor:
    """Token-by-token penalties as Hugging Face (repetition) and OpenAI (presence, frequency)."""
    result = logits.clone()
    for row, p in enumerate(params):
        for token in set(prompts[row]) | set(outputs[row]):
            value = result[row, token]
            pen = p.repetition_penalty
            result[row, token] = value / pen if value > 0 else value * pen
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            result[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return result


def test_penalties_match_a_reference_implementation() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = random_logits(4, seed=5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 0, 9, 5)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 4, 0, 12)]
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(),
    ]
    meta = build_sampling_metadata(params, prompts, outputs, {}, VOCAB, "cpu")
    got = apply_penalties(
        logits,
        meta.prompt_token_ids,
        meta.output_token_ids,
        meta.repetition_penalties,
        meta.presence_penalties,
        meta.frequency_penalties,
    )
    torch.testing.assert_close(got, reference_penalties(logits, prompts, outputs, params))
    # Greedy picks the argmax of the penalized logits.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.7)] * 4
    expected = reference_penalties(logits, prompts, outputs, greedy).argmax(-1)
    assert torch.equal(sample(logits, greedy, outputs, prompts).sampled_token_ids, expected)


def test_pad_token_ids_keeps_row_order() -> None:
    padded = pad_token_ids([[1, 2], [], [3, 4, 5]], pad_id=9, device="cpu")
    assert padded.tolist() == [[1, 2, 9], [9, 9, 9], [3, 4, 5]]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 3], logits[0, 11] = 9.0, 8.0, 7.0  # EOS, stop id, ordinary token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    params.all_stop_token_ids = {7}
    assert sample(logits, [params], outputs=[[11]]).sampled_token_ids.tolist() == [11]
    assert sample(logits, [params], outputs=[[11, 11]]).sampled_token_ids.tolist() == [7]


def step_logits(step: int, vocab: int = VOCAB) -> torch.Tensor:
    return random_logits(1, seed=100 + step, vocab=vocab)[0]


def test_seeded_request_is_reproducible_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=0.8, top_k=4, min_p=0.1, presence_penalty=1.0),
        SamplingParams(temperature=1.2),
    ]
    steps = 8

    alone_gen = torch.Generator().manual_seed(1234)
    alone = [
        sample(step_logits(s)[None], [seeded], generators={0: alone_gen}).sampled_token_ids.item()
        for s in range(steps)
    ]

    torch.manual_seed(0)  # the default generator's state must not matter either
    batch_gen, other_gen = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(99)
    batched = []
    for s in range(steps):
        # The batch grows and shrinks and the request moves through every position.
        params = others[: 1 + s % len(others)]
        row = s % (len(params) + 1)
        params = [*params[:row], seeded, *params[row:]]
        logits = random_logits(len(params), seed=s)
        logits[row] = step_logits(s)
        generators = {row: batch_gen}
        generators.update({i: other_gen for i, p in enumerate(params) if p.seed == 99})
        outputs = [[1, 2, 3]] * len(params)
        out = sample(logits, params, outputs, generators=generators)
        batched.append(out.sampled_token_ids[row].item())

    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled rather than collapsing to one token


def test_logprobs_come_from_raw_logits_with_ranks() -> None:
    logits = random_logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.9, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=4, frequency_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    torch.manual_seed(4)
    out = sample(logits, params, outputs=[[0, 1], [int(logits[1].argmax())] * 3, []])
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == out.logprob_token_ids.shape == (3, 5)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(4, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    expected_ranks = [1 + int((raw[r] > raw[r, sampled[r]]).sum()) for r in range(3)]
    assert out.sampled_token_ranks.tolist() == expected_ranks
    # The frequency penalty pushed row 1 off its raw argmax.
    assert expected_ranks[1] > 1 and expected_ranks[2] == 1


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = random_logits(2, seed=7)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)]
    out = sample(logits, params)
    assert out.logprobs is not None and out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(-1))


@pytest.mark.parametrize("top_k", [0, VOCAB, VOCAB + 5])
def test_top_k_at_or_beyond_vocab_means_off(top_k: int) -> None:
    meta = build_sampling_metadata([SamplingParams(top_k=top_k)], [[]], [[]], {}, VOCAB, "cpu")
    assert meta.top_k is None


def test_token_bitmask_forbids_exactly_the_clear_bits_of_the_constrained_rows():
    from tidegate.engine.worker.sampler import apply_token_bitmask

    gen = torch.Generator().manual_seed(3)
    vocab, words = 70, 3  # 96 bits for 70 tokens: the tail bits are ignored
    logits = torch.randn(5, vocab, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=gen)
    rows = torch.tensor([1, 3])
    masked = logits.clone()
    apply_token_bitmask(masked, rows, bits)
    for r in range(5):
        for t in range(vocab):
            allowed = r not in (1, 3) or (int(bits[[1, 3].index(r), t // 32]) >> (t % 32)) & 1
            expected = logits[r, t].item() if allowed else float("-inf")
            assert masked[r, t].item() == expected


def test_constrained_rows_sample_only_allowed_tokens_greedy_and_random():
    vocab = 40
    allowed = [[5, 17], [33]]
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)
    constraint = StructuredOutputsParams(regex="x")
    params = [
        SamplingParams(temperature=0, structured_outputs=constraint),
        SamplingParams(temperature=1.0, seed=4, structured_outputs=constraint, min_tokens=3),
        SamplingParams(temperature=0),
    ]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    meta = build_sampling_metadata(
        params, [[1]] * 3, [[]] * 3, {1: torch.Generator().manual_seed(4)}, vocab, "cpu"
    )
    meta.grammar_bitmask = (torch.tensor([0, 1]), bitmask)
    # min_tokens does not hold a constrained row open: its grammar decides when it ends.
    assert meta.min_tokens_mask is None
    tokens = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t]) and tokens[1] == 33
    assert tokens[2] == int(logits[2].argmax())


def test_logit_bias_moves_greedy_and_random_rows_and_leaves_the_others():
    logits = random_logits(4, seed=11)
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}),  # all but forces token 3
        SamplingParams(temperature=0.0, logit_bias={top[1]: -100.0}),  # bans the argmax
        SamplingParams(temperature=1.0, logit_bias={t: -100.0 for t in range(VOCAB) if t != 9}),
        SamplingParams(temperature=0.0, logprobs=1),  # no bias: argmax, raw logprobs
    ]
    out = sample(logits, params, generators={2: torch.Generator().manual_seed(1)})
    tokens = out.sampled_token_ids.tolist()
    runner_up = logits[1].clone()
    runner_up[top[1]] -= 100.0
    assert tokens == [3, int(runner_up.argmax()), 9, top[3]]
    # Logprobs describe the raw logits, as for penalties: the bias is not in them.
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    )


def test_logit_bias_adds_to_the_logit_before_temperature():
    # Two tokens whose logits differ by 1; a bias of +1 on the lower one makes them equally
    # likely, so a random row draws each about half the time.
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, 4], logits[0, 5] = 2.0, 1.0
    params = SamplingParams(temperature=0.7, seed=5, logit_bias={5: 1.0})
    generator = torch.Generator().manual_seed(5)
    meta = build_sampling_metadata([params], [[]], [[]], {0: generator}, VOCAB, "cpu")
    draws = [sampler(logits, meta).sampled_token_ids.item() for _ in range(400)]
    assert set(draws) == {4, 5} and 160 <= draws.count(5) <= 240


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    logits = random_logits(3, seed=12)
    allowed = [[1, 2, 3], [30]]
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed[0]),
        SamplingParams(temperature=2.0, top_p=0.5, allowed_token_ids=allowed[1]),
        SamplingParams(temperature=0.0),
    ]
    meta = build_sampling_metadata(params, [[]] * 3, [[]] * 3, {}, VOCAB, "cpu")
    rows, mask = meta.allowed_tokens
    assert rows.tolist() == [0, 1] and mask.shape == (2, VOCAB)
    assert [torch.nonzero(m).flatten().tolist() for m in mask] == allowed
    tokens = sampler(logits, meta).sampled_token_ids.tolist()
    assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t]) and tokens[1] == 30
    assert tokens[2] == int(logits[2].argmax())
    assert (
        build_sampling_metadata([SamplingParams()], [[]], [[]], {}, VOCAB, "cpu").allowed_tokens
        is None
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {5: 100.5}}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids must be non-negative"),
        (
            {"allowed_token_ids": [3], "structured_outputs": StructuredOutputsParams(regex="a")},
            "cannot be combined with structured outputs",
        ),
    ],
)
def test_bad_bias_or_allowed_tokens_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_an_empty_logit_bias_is_none():
    assert SamplingParams(logit_bias={}).logit_bias is None
