"""The adaptive chunk size learns step costs and keeps mixed steps near decode-only ones,
however deep into its prompt a chunk is."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from pydantic import ValidationError

from tests.engine.test_scheduler import make_request, make_scheduler, step
from tidegate.engine.config import DEFAULT_LONG_PREFILL_STEP_SLACK, EngineArgs
from tidegate.engine.core.chunk_tuner import ChunkSizeTuner, StepMix, chunk_keys, chunk_pairs
from tidegate.engine.core.engine_core import resolve_step_limits
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.scheduler import Scheduler
from tidegate.engine.core.step_budget import StepLimits


def step_seconds(mix: StepMix) -> float:
    """A made-up machine: 20 ms per step, 2 ms per decode, 0.05 ms per prompt token and 20 ns
    per (token, key) pair of the prompt tokens' attention."""
    return 0.020 + 0.002 * mix.decodes + 0.00005 * mix.prefill_tokens + 2e-8 * mix.prefill_pairs


def chunk_mix(decodes: int, context: int, tokens: int) -> StepMix:
    return StepMix(decodes, tokens, chunk_pairs(context, tokens))


def learned_tuner(rng: random.Random, depths: list[int]) -> ChunkSizeTuner:
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048, slack=0.5)
    for _ in range(50):
        d = rng.randint(1, 32)
        tuner.observe(StepMix(d), step_seconds(StepMix(d)) * rng.uniform(0.97, 1.03))
    for context in depths:
        mix = chunk_mix(16, context, rng.choice([64, 128, 256]))
        tuner.observe(mix, step_seconds(mix) * rng.uniform(0.97, 1.03))
    # A fresh prompt's 1,024-token chunk lately: the fit is trusted up to 2,048 tokens.
    mix = chunk_mix(16, 0, 1024)
    tuner.observe(mix, step_seconds(mix))
    return tuner


def test_chunk_pairs_count_each_tokens_keys_up_to_itself():
    assert chunk_pairs(0, 1) == 1
    assert chunk_pairs(0, 4) == 1 + 2 + 3 + 4
    assert chunk_pairs(100, 2) == 101 + 102


def test_before_learning_it_takes_a_small_first_chunk_and_no_cap_without_decodes():
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    assert tuner.threshold(num_decodes=0) == 0
    assert tuner.threshold(num_decodes=8) == 64
    assert tuner.threshold(num_decodes=8, context=5000) == 64


@pytest.mark.parametrize("context", [0, 1000, 3000, 8000])
def test_learned_chunk_keeps_a_mixed_step_within_one_and_a_half_decode_steps_at_any_depth(context):
    rng = random.Random(context)
    tuner = learned_tuner(rng, [rng.randint(0, 4000) for _ in range(30)])

    chunk = tuner.threshold(16, context)

    assert chunk % 16 == 0 or chunk < 16
    base = step_seconds(StepMix(16))  # 52 ms
    assert step_seconds(chunk_mix(16, context, chunk)) <= 1.5 * base * 1.05
    # ... and uses most of what it may: one block more would break the bound.
    assert chunk < 16 or step_seconds(chunk_mix(16, context, chunk + 16)) > 1.5 * base * 0.95


def test_deep_into_a_long_prompt_a_chunk_may_be_less_than_a_block_but_never_nothing():
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048, slack=0.5)
    tuner.observe(StepMix(16), 0.030)
    tuner.token_cost, tuner.pair_cost = 1e-4, 1e-7
    # The slack buys 15 ms; 9,000 keys deep a token costs 1 ms, so a block (16 ms) is too much.
    assert tuner.threshold(16, 9000) == 14
    assert tuner.threshold(16, 10**7) == 4  # a quarter of a block, the least it gives


def test_a_queue_of_requests_waiting_to_start_widens_the_slack_and_one_waiting_does_not():
    tuner = learned_tuner(random.Random(5), [random.Random(i).randint(0, 4000) for i in range(30)])
    base = step_seconds(StepMix(16))
    alone = tuner.threshold(16, 2000)
    assert tuner.threshold(16, 2000, waiting=1) == alone
    for waiting in (2, 4):
        chunk = tuner.threshold(16, 2000, waiting)
        assert chunk > alone
        # The chunk fills what waiting times the slack allows, and no more.
        assert step_seconds(chunk_mix(16, 2000, chunk)) <= (1 + 0.5 * waiting) * base * 1.05
        bigger = step_seconds(chunk_mix(16, 2000, chunk + 16))
        assert bigger > (1 + 0.5 * waiting) * base * 0.95


def decode_streams(scheduler, max_tokens: int) -> list:
    """16 streams of `max_tokens` tokens, decoding for 30 steps on the made-up machine (which
    teaches the tuner their decode-only steps): the streams."""
    decoders = [make_request(f"d{i}", 20, max_tokens=max_tokens) for i in range(16)]
    for request in decoders:
        scheduler.add_request(request)
    for _ in range(30):
        step(scheduler)
        scheduler.record_step_time(step_seconds(scheduler.last_mix))
    return decoders


def streams_then_prompts(scheduler, prompts: list[int]) -> tuple[dict[str, int], list[tuple]]:
    """16 streams decode, then `prompts` (their lengths) arrive at once: the step at which each
    prompt got its first token, and each step's (time, requests waiting)."""
    decode_streams(scheduler, max_tokens=2000)
    names = [f"p{i}" for i in range(len(prompts))]
    for i, (name, length) in enumerate(zip(names, prompts, strict=True)):
        scheduler.add_request(make_request(name, length, max_tokens=2, base=1000 * (i + 1)))
    first, steps = {}, []
    while len(first) < len(names):
        waiting = len(scheduler.waiting)
        step(scheduler)
        steps.append((step_seconds(scheduler.last_mix), waiting))
        scheduler.record_step_time(steps[-1][0])
        for name in names:
            if name not in first and scheduler.requests[name].num_output_tokens:
                first[name] = len(steps)
    return first, steps


def test_a_burst_keeps_the_slack_and_a_queue_that_builds_up_widens_it():
    base = step_seconds(StepMix(16))
    # Two long prompts: while the second waits behind the first's chunks, steps stay within
    # 1 + slack (the default 0.25) of a decode-only step.
    scheduler = Scheduler(auto_limits(), KVCacheManager(4000, 16))
    _, steps = streams_then_prompts(scheduler, [4000, 4000])
    assert max(t for t, _ in steps[2:]) <= 1.25 * base * 1.05
    # Eight prompts at once: the queue's first chunks take more, and the last prompt starts
    # in fewer steps than eight one after another at the slack would take.
    scheduler = Scheduler(auto_limits(), KVCacheManager(4000, 16))
    first, steps = streams_then_prompts(scheduler, [1000] * 8)
    assert max(t for t, waiting in steps if waiting >= 4) > 1.25 * base * 1.02
    one = Scheduler(auto_limits(), KVCacheManager(4000, 16))
    alone, _ = streams_then_prompts(one, [1000])
    assert max(first.values()) < 0.6 * 8 * alone["p0"]
    # ... and once the queue is gone the slack bounds the steps again.
    assert all(t <= 1.25 * base * 1.05 for t, waiting in steps[-3:] if waiting <= 1)


def test_deeper_chunks_are_smaller_and_fewer_decodes_make_them_smaller_too():
    tuner = learned_tuner(random.Random(3), [random.Random(i).randint(0, 4000) for i in range(30)])
    assert tuner.threshold(16, 0) > tuner.threshold(16, 2000) > tuner.threshold(16, 6000)
    assert tuner.threshold(1, 0) < tuner.threshold(16, 0)
    assert tuner.threshold(1000, 0) == 2048
    assert tuner.pair_cost == pytest.approx(2e-8, rel=0.25)
    assert tuner.token_cost == pytest.approx(5e-5, rel=0.25)


def test_chunks_all_at_one_depth_put_the_cost_on_the_tokens():
    # Every chunk the same size at the same depth: tokens and pairs are collinear, and the
    # tuner falls back to a cost per token that prices those chunks right.
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    for _ in range(20):
        tuner.observe(StepMix(16), step_seconds(StepMix(16)))
    for _ in range(10):
        tuner.observe(chunk_mix(16, 0, 128), step_seconds(chunk_mix(16, 0, 128)))
    assert tuner.pair_cost == 0
    per_token = (step_seconds(chunk_mix(16, 0, 128)) - step_seconds(StepMix(16))) / 128
    assert tuner.token_cost == pytest.approx(per_token)


def long_prompt_under_streams(scheduler) -> tuple[list[int], list[float]]:
    """16 streams decode, a 4,000-token prompt arrives: its chunks, and every step's time.
    Every stream gets its token in every step."""
    decoders = decode_streams(scheduler, max_tokens=1000)
    scheduler.add_request(make_request("long", 4000, max_tokens=2, base=1000))
    chunks, times = [], []
    while scheduler.requests["long"].num_output_tokens == 0:
        before = [r.num_output_tokens for r in decoders]
        chunks.append(step(scheduler).num_scheduled_tokens.get("long", 0))
        times.append(step_seconds(scheduler.last_mix))
        scheduler.record_step_time(times[-1])
        assert [r.num_output_tokens for r in decoders] == [n + 1 for n in before]
    return chunks, times


def test_scheduler_with_auto_chunks_a_long_prompt_without_skipping_a_decode_or_a_step_bound():
    scheduler = make_scheduler(max_num_batched_tokens=2048)
    scheduler.limits.adaptive_chunking = True
    scheduler.chunk_tuner = ChunkSizeTuner(scheduler.block_size, 2048)
    chunks, times = long_prompt_under_streams(scheduler)
    assert sum(chunks) == 4000
    assert chunks[0] == 64  # before it knows the cost: a small first chunk
    # Once two chunks taught it both costs, no step goes past 1.5x a decode-only one, and the
    # chunks shrink as the prompt's context grows.
    base = step_seconds(StepMix(16))
    assert max(times[2:]) <= 1.5 * base * 1.02
    assert chunks[2] > chunks[-2] and chunks[-2] >= 16


def auto_limits(**flags) -> StepLimits:
    """The step limits `tidegate serve --long-prefill-token-threshold auto` resolves, with
    these other EngineArgs, a 2,048-token step budget and a 4,096-token model."""
    args = EngineArgs(
        model="m", max_num_batched_tokens=2048, long_prefill_token_threshold="auto", **flags
    )
    return resolve_step_limits(args, 4096)


def test_the_slack_flag_bounds_mixed_steps_and_trades_the_long_prompts_wait():
    base = step_seconds(StepMix(16))
    # Unset, auto takes the default.
    assert auto_limits().adaptive_slack == DEFAULT_LONG_PREFILL_STEP_SLACK == 0.25
    steps = {}
    for slack in (0.25, 0.5):
        limits = auto_limits(long_prefill_step_slack=slack)
        assert limits.adaptive_chunking and limits.adaptive_slack == slack
        scheduler = Scheduler(limits, KVCacheManager(2000, 16))
        assert scheduler.chunk_tuner.slack == slack
        chunks, times = long_prompt_under_streams(scheduler)
        assert sum(chunks) == 4000
        assert max(times[2:]) <= (1 + slack) * base * 1.02
        steps[slack] = len(chunks)
    # Half the slack: the prompt takes about twice the steps to its first token.
    assert 1.6 * steps[0.5] < steps[0.25] < 2.6 * steps[0.5]
    # The default, the engine's and the tuner's: 0.25.
    assert auto_limits().adaptive_slack == 0.25 == ChunkSizeTuner(16, 2048).slack


def test_a_step_target_longer_than_the_slack_allows_is_used_and_a_shorter_one_ignored():
    base = step_seconds(StepMix(16))  # 52 ms; the slack alone allows 68 ms

    def run(target_ms: float | None) -> tuple[list[int], list[float]]:
        limits = auto_limits(long_prefill_step_ms=target_ms)
        assert limits.adaptive_step_s == (None if target_ms is None else target_ms / 1000)
        return long_prompt_under_streams(Scheduler(limits, KVCacheManager(2000, 16)))

    slack_chunks, slack_times = run(None)
    chunks, times = run(130.0)
    assert sum(chunks) == 4000
    assert max(times[2:]) <= 0.130 * 1.02
    assert max(times[2:]) > 1.5 * base * 1.02  # the target, not the slack, bounds them
    assert len(chunks) < 0.6 * len(slack_chunks)
    # A target under what the slack allows changes nothing.
    assert run(60.0) == (slack_chunks, slack_times)


@pytest.mark.parametrize("threshold", [0, 512])
def test_the_slack_flag_without_auto_chunks_is_refused(threshold):
    with pytest.raises(ValidationError, match="long_prefill_step_slack sizes the chunks"):
        EngineArgs(model="m", long_prefill_token_threshold=threshold, long_prefill_step_slack=0.5)
    with pytest.raises(ValidationError, match="long_prefill_step_ms sizes the chunks"):
        EngineArgs(model="m", long_prefill_token_threshold=threshold, long_prefill_step_ms=50)
    with pytest.raises(ValidationError):
        EngineArgs(model="m", long_prefill_token_threshold="auto", long_prefill_step_slack=0.0)


def streaming_step_seconds(mix: StepMix) -> float:
    """The made-up machine above, where a chunk's attention also streams every key it reads
    once (2 us a key), whatever its size: a few tokens deep into a long prompt cost about
    what its context costs to read."""
    return step_seconds(mix) + 2e-6 * mix.prefill_keys


def streaming_chunk_mix(decodes: int, context: int, tokens: int) -> StepMix:
    return StepMix(decodes, tokens, chunk_pairs(context, tokens), chunk_keys(context, tokens))


def streaming_tuner(rng: random.Random) -> ChunkSizeTuner:
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048, slack=0.5)
    for _ in range(50):
        d = rng.randint(1, 32)
        tuner.observe(StepMix(d), step_seconds(StepMix(d)) * rng.uniform(0.98, 1.02))
    for _ in range(40):
        mix = streaming_chunk_mix(16, rng.randint(0, 4000), rng.choice([4, 8, 16, 64, 256]))
        tuner.observe(mix, streaming_step_seconds(mix) * rng.uniform(0.98, 1.02))
    return tuner


def test_it_learns_what_streaming_a_chunks_context_costs_apart_from_its_tokens():
    tuner = streaming_tuner(random.Random(7))
    assert tuner.key_cost == pytest.approx(2e-6, rel=0.25)
    assert tuner.pair_cost == pytest.approx(2e-8, rel=0.25)
    assert tuner.token_cost == pytest.approx(5e-5, rel=0.5)


@pytest.mark.parametrize("context", [0, 1000, 3000, 6000])
def test_with_a_cost_per_key_read_chunks_still_fill_but_keep_the_bound(context):
    tuner = streaming_tuner(random.Random(context))
    chunk = tuner.threshold(16, context)
    base = step_seconds(StepMix(16))
    assert streaming_step_seconds(streaming_chunk_mix(16, context, chunk)) <= 1.5 * base * 1.05
    assert chunk < 16 or (
        streaming_step_seconds(streaming_chunk_mix(16, context, chunk + 16)) > 1.5 * base * 0.95
    )


def test_a_context_too_long_to_read_within_the_slack_still_gets_the_smallest_chunk():
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048, slack=0.5)
    tuner.observe(StepMix(16), 0.030)
    tuner.token_cost, tuner.pair_cost, tuner.key_cost = 1e-4, 1e-8, 1e-5
    assert tuner.threshold(16, 1000) > 4  # reading 1,000 keys costs 10 ms of the 15
    assert tuner.threshold(16, 2000) == 4  # 20 ms just to read them: progress, no more


def test_it_keeps_learning_from_chunks_of_a_few_tokens():
    # Deep into a long prompt the chunks are a few tokens. When those steps take longer than
    # the tuner predicts (the machine got busier), it must learn it and shrink them.
    tuner = streaming_tuner(random.Random(11))
    mix = streaming_chunk_mix(16, 3000, 6)
    before = tuner.chunk_cost(3000, 6)
    base = tuner.base(16)
    for _ in range(30):
        tuner.observe(mix, base + 3 * before)
    assert tuner.chunk_cost(3000, 6) == pytest.approx(3 * before, rel=0.1)
    assert tuner.threshold(16, 3000) < streaming_tuner(random.Random(11)).threshold(16, 3000)


def test_chunks_grow_no_faster_than_doubling_past_what_was_measured():
    # Deep into a long prompt only 16-token chunks ran: tokens, pairs and keys are collinear
    # there, so what a fresh prompt's large chunk costs is a guess. It gets at most twice
    # the largest chunk measured lately, and grows as each size is measured.
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    for _ in range(20):
        tuner.observe(StepMix(16), step_seconds(StepMix(16)))
    for context in range(2000, 2400, 16):
        mix = streaming_chunk_mix(16, context, 16)
        tuner.observe(mix, streaming_step_seconds(mix))
    sizes = []
    context = 0
    for _ in range(6):
        chunk = tuner.threshold(16, context)
        sizes.append(chunk)
        mix = streaming_chunk_mix(16, context, chunk)
        tuner.observe(mix, streaming_step_seconds(mix))
        context += chunk
    assert sizes[0] == 64  # four blocks: twice 16 would be less
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes))
    assert sizes[-1] > sizes[0]


def test_a_few_slow_decode_steps_just_before_a_prompt_do_not_set_its_chunks_bound():
    # Decode steps of 20 ms with jitter, then a slow patch (a collection, a page fault, a
    # neighbour's burst) right before a long prompt arrives: the estimate its chunks are
    # sized against for all of its prefill stays a typical step's.
    rng = random.Random(5)
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    for _ in range(60):
        tuner.observe(StepMix(16), 0.020 * rng.uniform(0.97, 1.03))
    for slow in (0.026, 0.025, 0.027, 0.036):
        tuner.observe(StepMix(16), slow)
    assert tuner.base(16) == pytest.approx(0.020, rel=0.04)


def test_the_estimate_follows_a_lasting_change_within_half_its_window():
    # The machine got slower for good (the streams' contexts grew, a neighbour came): the
    # median moves once half the recent steps are the new ones.
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    for _ in range(40):
        tuner.observe(StepMix(16), 0.020)
    for _ in range(17):
        tuner.observe(StepMix(16), 0.030)
    assert tuner.base(16) == pytest.approx(0.030)


def test_the_estimate_of_a_step_scales_with_its_decodes_from_the_recent_level():
    # Steps of 8 to 24 decodes at 20 ms + 1 ms each: the level is a median of the steps'
    # times less their decodes' share, so each count gets its own time.
    rng = random.Random(9)
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    for _ in range(80):
        d = rng.randint(8, 24)
        tuner.observe(StepMix(d), 0.020 + 0.001 * d)
    assert tuner.base(8) == pytest.approx(0.028, rel=0.01)
    assert tuner.base(24) == pytest.approx(0.044, rel=0.01)


def test_step_trace_writes_each_steps_time_mix_and_estimate(tmp_path, monkeypatch):
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TIDEGATE_STEP_TRACE", str(trace))
    scheduler = make_scheduler(max_num_batched_tokens=2048)
    scheduler.limits.adaptive_chunking = True
    scheduler.chunk_tuner = ChunkSizeTuner(scheduler.block_size, 2048)
    for i in range(4):
        scheduler.add_request(make_request(f"d{i}", 20, max_tokens=50, base=100 * (i + 1)))
    times = []
    for _ in range(6):
        step(scheduler)
        times.append(step_seconds(scheduler.last_mix))
        scheduler.record_step_time(times[-1])
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["s"] for line in lines] == times
    # The first step computes the four prompts; the rest decode them, each step estimated
    # from the decode-only steps before it.
    assert (lines[0]["decodes"], lines[0]["prefill_tokens"], lines[0]["base"]) == (0, 80, None)
    assert [(line["decodes"], line["prefill_tokens"]) for line in lines[1:]] == [(4, 0)] * 5
    assert lines[1]["base"] is None
    assert lines[2]["base"] == pytest.approx(step_seconds(StepMix(4)))
    assert all(b["t"] >= a["t"] for a, b in itertools.pairwise(lines))
