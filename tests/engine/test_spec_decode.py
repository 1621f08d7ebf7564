"""Speculative decoding's parts: prompt lookup, which guesses a step keeps, the seeds of
positions, the logits rows of a step, stop strings inside a step's tokens, and the config."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tidegate.engine.config import EngineArgs, SpeculativeConfig
from tidegate.engine.entrypoints.args import add_engine_args, engine_args_from
from tidegate.engine.messages import EngineCoreOutput, EngineCoreRequest, LogprobsLists
from tidegate.engine.output_processor import OutputProcessor
from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.spec_decode.acceptance import GUESS_WORTH, GuessRecord
from tidegate.engine.spec_decode.ngram import NgramProposer
from tidegate.engine.spec_decode.verify import accepted_tokens
from tidegate.engine.tokenizer import Tokenizer
from tidegate.engine.worker.input_batch import InputBuilder, PersistentBatch
from tidegate.engine.worker.sampler import position_seed


def propose(tokens: list[int], k: int = 4, min_n: int = 2, max_n: int = 4) -> list[int]:
    return NgramProposer(k, min_n, max_n).propose(np.asarray(tokens, dtype=np.int64))


# -- prompt lookup ------------------------------------------------------------------------


def test_the_tokens_after_the_latest_match_are_guessed():
    # "3 4" occurs twice before the end: the later occurrence is followed by 9.
    assert propose([1, 3, 4, 5, 6, 2, 3, 4, 9, 8, 7, 0, 3, 4]) == [9, 8, 7, 0]


def test_the_longest_matching_suffix_wins():
    # The 3-token suffix "2 3 4" matches once, the 2-token "3 4" more recently.
    tokens = [2, 3, 4, 7, 7, 7, 3, 4, 8, 8, 8, 2, 3, 4]
    assert propose(tokens) == [7, 7, 7, 3]
    assert propose(tokens, max_n=2) == [8, 8, 8, 2]


def test_a_short_period_repeats_to_fill_the_guesses():
    assert propose([5] * 10) == [5, 5, 5, 5]
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], k=6) == [3, 1, 2, 3, 1, 2]


def test_no_guess_without_a_match_of_min_n_tokens():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 9, 2]) == []  # only "2" recurs: shorter than min_n
    assert propose([1, 2, 3, 9, 2], min_n=1) == [3, 9, 2, 3]
    assert propose([7]) == []
    assert propose([]) == []


def test_k_caps_the_guesses():
    assert propose([5] * 10, k=2) == [5, 5]
    proposer = NgramProposer(4, 2, 4)
    assert proposer.propose(np.asarray([5] * 10), 1) == [5]
    assert proposer.propose(np.asarray([5] * 10), 9) == [5] * 4  # never above the config's
    assert proposer.propose(np.asarray([5] * 10), 0) == []


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by its definition: longest suffix first, latest occurrence, copy on."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[len(tokens) :]
    return []


def test_lookup_agrees_with_its_definition_on_random_tokens():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        length, vocab = int(rng.integers(0, 40)), int(rng.integers(1, 6))
        tokens = rng.integers(0, vocab, length).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        assert propose(tokens, k, min_n, max_n) == brute_force(tokens, k, min_n, max_n), tokens


def test_a_bad_lookup_range_is_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 3, 2)


# -- which guesses a step keeps ---------------------------------------------------------------


def test_guesses_are_kept_while_sampling_confirms_them():
    # Request 1: guesses 7 8 9, sampled 7 8 5 (5 replaces 9), bonus position unused.
    # Request 2: no guesses, one token. Request 3: both guesses kept, plus the next token.
    sampled = [7, 8, 5, 1, 4, 3, 6, 2]
    proposals = [[7, 8, 9], [], [3, 6]]
    assert accepted_tokens(sampled, proposals) == [[7, 8, 5], [4], [3, 6, 2]]


def test_the_first_guess_wrong_keeps_one_token():
    assert accepted_tokens([9, 9, 9], [[1, 2]]) == [[9]]


def test_a_row_count_that_does_not_fit_the_guesses_is_an_error():
    with pytest.raises(ValueError, match="3 sampled tokens for 4 positions"):
        accepted_tokens([1, 2, 3], [[1, 2], []])


# -- how many guesses a request is worth ------------------------------------------------------


def test_a_request_guesses_fully_until_its_guesses_fail():
    record = GuessRecord()
    assert record.worth(4) == 4 and record.worth(2) == 2
    for _ in range(3):
        record.record(guessed=4, kept=0)  # the first guess wrong each time
    assert record.rate < GUESS_WORTH
    assert record.worth(4) == 0


def test_a_fair_rate_makes_only_the_guesses_likely_to_be_kept():
    record = GuessRecord()
    for _ in range(30):
        record.record(guessed=4, kept=1)  # one kept, the next wrong: a rate of 1/2
    assert record.rate == pytest.approx(0.5, abs=0.02)
    assert record.worth(4) == 2  # kept with chance 0.5 and 0.25; the third 0.125


def test_a_request_without_guesses_starts_again_when_its_text_repeats():
    record = GuessRecord()
    for _ in range(5):
        record.record(guessed=2, kept=0)
    assert record.worth(4) == 0
    for _ in range(12):
        record.shadow = 7
        record.record_shadow(7)  # the guess it did not make would have been right
    assert record.shadow is None
    assert record.worth(4) >= 2
    record.record_shadow(3)  # nothing pending: nothing judged
    assert record.rate > GUESS_WORTH


# -- seeds of positions ------------------------------------------------------------------------


def test_position_seeds_are_fixed_distinct_and_in_range():
    seeds = {position_seed(seed, pos) for seed in range(50) for pos in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 1 << 64 for s in seeds)
    assert position_seed(1234, 7) == position_seed(1234, 7)
    assert position_seed((1 << 63) - 1, 1 << 20) < 1 << 64


# -- a step's logits rows --------------------------------------------------------------------


def test_a_request_with_guesses_samples_at_each_of_its_positions():
    batch = PersistentBatch(max_num_seqs=4, max_model_len=64, max_blocks_per_seq=4)
    builder = InputBuilder(
        max_num_tokens=64,
        max_num_seqs=4,
        max_blocks_per_seq=4,
        block_size=16,
        device=torch.device("cpu"),
    )
    decoding = batch.add(list(range(10, 20)), [0], num_computed=9)  # 10 known, 9 computed
    prefill = batch.add(list(range(30, 60)), [1, 2], num_computed=0)  # a chunk of a prompt
    guessing = batch.add(list(range(70, 76)), [3], num_computed=5)
    batch.write_guesses(guessing, [1, 2, 3])
    rows = np.asarray([decoding, prefill, guessing])
    step = builder.build(batch, rows, [1, 12, 4], np.asarray([0, 0, 3]))
    # Flat positions: decoding 0; prefill 1-12 (no sample: its prompt goes on); guessing 13-16.
    assert step.logits_indices.tolist() == [0, 13, 14, 15, 16]
    assert step.sampling_rows == [0, 2]
    assert step.input_ids.tolist()[13:] == [75, 1, 2, 3]
    assert batch.num_tokens[guessing] == 6  # guesses stay unknown until kept
    batch.append_token_lists([guessing, decoding], [[1, 2, 9], [4]])
    assert batch.token_ids[guessing, :9].tolist() == [70, 71, 72, 73, 74, 75, 1, 2, 9]
    assert batch.num_tokens[guessing] == 9 and batch.num_tokens[decoding] == 11


# -- stop strings inside a step's tokens ---------------------------------------------------


def test_tokens_after_a_stop_string_are_dropped_with_their_logprobs(tiny_llama_dir):
    tokenizer = Tokenizer(tiny_llama_dir)
    ids = tokenizer.encode("alpha beta STOP gamma delta", add_special_tokens=False)
    stop_at = next(i for i in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:i]))
    assert stop_at < len(ids)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["STOP"], logprobs=0)
    processor.add_request(
        EngineCoreRequest("r", [1], params, eos_token_ids=[2], arrival_time=0.0), prompt=None
    )
    logprobs = LogprobsLists([[t] for t in ids], [[-0.5] for _ in ids], [1 for _ in ids])
    (output,), to_abort = processor.process_outputs(
        [EngineCoreOutput("r", new_token_ids=ids, new_logprobs=logprobs)]
    )
    completion = output.outputs[0]
    assert to_abort == ["r"]
    assert completion.text == "alpha beta "
    assert completion.token_ids == ids[:stop_at]
    assert len(completion.logprobs) == stop_at
    assert completion.finish_reason == "stop" and completion.stop_reason == "STOP"


# -- configuration ---------------------------------------------------------------------------


def test_the_flag_takes_vllms_json():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--model", "/m", "--speculative-config"]
    spec = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    args = engine_args_from(parser.parse_args([*flags, spec]))
    assert args.speculative_config == SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_max=3
    )
    assert engine_args_from(parser.parse_args(["--model", "/m"])).speculative_config is None
    for bad in ("{not json", "[4]"):
        with pytest.raises(SystemExit):
            parser.parse_args([*flags, bad])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
        ({"model": "tiny-draft", "num_speculative_tokens": 3}, "names a draft model"),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 5}, "must not exceed"),
        ({"num_speculative_tokens": 0}, "greater than or equal to 1"),
        ({}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "typo": 1}, "Extra inputs are not permitted"),
    ],
)
def test_a_config_we_cannot_run_is_refused_with_the_reason(spec, message):
    with pytest.raises(ValidationError, match=message):
        EngineArgs(model="/m", speculative_config=spec)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"async_scheduling": True}, "does not run with async_scheduling"),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
            "pipeline_parallel_size above 1",
        ),
    ],
)
def test_speculation_is_refused_where_it_cannot_run(other, message):
    with pytest.raises(ValidationError, match=message):
        EngineArgs(model="/m", speculative_config={"num_speculative_tokens": 2}, **other)
