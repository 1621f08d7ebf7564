"""The unified scheduler, driven by a fake runner: budgets, chunking, overtaking, preemption."""

from __future__ import annotations

import random

from tidegate.engine.config import SpeculativeConfig
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request
from tidegate.engine.core.scheduler import Scheduler
from tidegate.engine.core.step_budget import StepLimits
from tidegate.engine.messages import ModelRunnerOutput, SchedulerOutput
from tidegate.engine.sampling_params import SamplingParams

EOS = 2


def make_scheduler(
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 64,
    threshold: int = 0,
    max_partial: int = 1,
    max_long_partial: int = 1,
    max_model_len: int = 4096,
    caching: bool = True,
    phased: bool = False,
    speculative: SpeculativeConfig | None = None,
) -> Scheduler:
    limits = StepLimits(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=max_partial,
        max_long_partial_prefills=max_long_partial,
        max_model_len=max_model_len,
        phased=phased,
    )
    return Scheduler(
        limits,
        KVCacheManager(num_blocks, block_size, enable_caching=caching),
        speculative=speculative,
    )


def make_request(req_id: str, num_prompt: int, max_tokens: int = 8, base: int = 100) -> Request:
    prompt = [base + (i % 500) for i in range(num_prompt)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids={EOS})


def fake_run(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Sample token 7 for every request whose known tokens are all computed."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_run(scheduler, out))
    return out


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_unfinished_requests():
        outs.append(step(scheduler))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def test_long_prompt_is_chunked_while_every_decode_gets_a_token_each_step():
    scheduler = make_scheduler(max_num_batched_tokens=128, threshold=0)
    decoders = [make_request(f"d{i}", 20, max_tokens=200) for i in range(8)]
    for request in decoders:
        scheduler.add_request(request)
    step(scheduler)  # all eight prompts fit one step
    assert all(r.num_output_tokens == 1 for r in decoders)

    scheduler.add_request(make_request("long", 2000, max_tokens=4, base=1000))
    steps_with_long_chunk = 0
    while scheduler.requests["long"].num_output_tokens == 0:
        before = {r.request_id: r.num_output_tokens for r in decoders}
        out = step(scheduler)
        assert out.total_num_scheduled_tokens <= 128
        # Every running decode is in this step, with exactly one token.
        for request in decoders:
            assert out.num_scheduled_tokens[request.request_id] == 1
            assert request.num_output_tokens == before[request.request_id] + 1
        if "long" in out.num_scheduled_tokens:
            steps_with_long_chunk += 1
            long_request = scheduler.requests["long"]
            remaining = 2000 - (long_request.num_computed_tokens - out.num_scheduled_tokens["long"])
            assert out.num_scheduled_tokens["long"] == min(128 - len(decoders), remaining)
    # 2000 tokens at 120 per step: the prefill really was chunked.
    assert steps_with_long_chunk == -(-2000 // 120)


def test_threshold_caps_one_requests_tokens_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=512, threshold=7)
    scheduler.add_request(make_request("a", 50))
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 7}
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 7}


def test_short_prompts_overtake_a_long_prompts_chunks():
    scheduler = make_scheduler(
        max_num_batched_tokens=64, threshold=32, max_partial=2, max_long_partial=1
    )
    scheduler.add_request(make_request("long1", 1000, base=1000))
    scheduler.add_request(make_request("long2", 1000, base=2000))
    scheduler.add_request(make_request("short", 20, base=3000))
    out = step(scheduler)
    # long1 takes its 32-token chunk; long2 would be a second *long* partial prefill, so the
    # short prompt, which finishes its prefill in this step, overtakes it.
    assert out.num_scheduled_tokens == {"long1": 32, "short": 20}
    assert scheduler.requests["short"].num_output_tokens == 1
    assert [r.request_id for r in scheduler.waiting] == ["long2"]


def test_partial_prefill_limit_keeps_second_long_prompt_waiting_until_first_is_done():
    scheduler = make_scheduler(max_num_batched_tokens=100, threshold=50)
    scheduler.add_request(make_request("long1", 120, base=1000))
    scheduler.add_request(make_request("long2", 120, base=2000))
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"long1": 50}
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"long1": 50}
    out = step(scheduler)
    # long1's last 20 tokens complete its prefill, so long2 may start its first chunk.
    assert out.num_scheduled_tokens == {"long1": 20, "long2": 50}


def test_limits_and_block_invariants_hold_under_random_arrivals_aborts_and_preemption():
    preemptions = [random_workload(seed) for seed in range(6)]
    # Most seeds run out of blocks at some point; the invariants held through it.
    assert sum(p > 0 for p in preemptions) >= 3


def random_workload(seed: int) -> int:
    """Random arrivals and aborts on a tight pool; checks every step; returns preemptions."""
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_blocks=22,  # tight enough that preemption happens too
        max_num_batched_tokens=96,
        max_num_seqs=6,
        threshold=rng.choice([0, 13]),
        max_model_len=352,
    )
    pending = [make_request(f"r{i}", rng.randint(1, 300), rng.randint(1, 30)) for i in range(40)]
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        # Continuous batching: requests arrive between any two steps.
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop())
        # Abort at any moment: waiting, mid-prefill or decoding.
        if scheduler.requests and rng.random() < 0.05:
            scheduler.abort_requests([rng.choice(list(scheduler.requests))])
        out = step(scheduler)
        assert out.total_num_scheduled_tokens <= 96
        assert len(out.num_scheduled_tokens) <= 6
        scheduler.kv_cache_manager.check_invariants()
        steps += 1
        assert steps < 5000
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    return scheduler.num_preemptions


def test_new_request_joins_the_running_batch_at_the_next_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=50))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make_request("b", 10, max_tokens=50))
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}


def test_preemption_by_recompute_when_blocks_run_out_and_no_ping_pong():
    # 12 blocks of 4 tokens; three requests that each grow to 40 tokens cannot all fit.
    scheduler = make_scheduler(
        num_blocks=12, block_size=4, max_num_batched_tokens=64, max_model_len=48
    )
    requests = [make_request(f"r{i}", 8, max_tokens=32, base=100 + 50 * i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 32 for r in requests)
    # Each request is preempted at most a couple of times: no mutual eviction loop.
    assert max(r.num_preemptions for r in requests) <= 2
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_abort_at_any_time_frees_blocks():
    scheduler = make_scheduler(num_blocks=100, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", 100))
    scheduler.add_request(make_request("b", 10))
    step(scheduler)  # a is mid-prefill
    scheduler.abort_requests(["a", "b", "unknown"])
    out = scheduler.schedule()
    assert out.is_empty
    assert out.finished_req_ids == {"a"}  # b never reached the runner
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not scheduler.has_unfinished_requests()


def test_stats_keep_the_peak_usage_of_requests_that_came_and_went_between_them():
    scheduler = make_scheduler(num_blocks=100, max_num_batched_tokens=512)
    # Three requests of 40 distinct tokens (3 blocks each) prefill and finish in one step.
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, 40, max_tokens=1, base=100 + 40 * i))
    step(scheduler)
    assert not scheduler.has_unfinished_requests()
    stats = scheduler.make_stats()
    assert stats.kv_cache_usage == 0.0
    assert stats.kv_cache_usage_peak == 0.09


def test_stop_conditions_eos_stop_ids_min_tokens_and_max_model_len():
    scheduler = make_scheduler(max_model_len=30)
    eos_req = make_request("eos", 5, max_tokens=10)
    scheduler.add_request(eos_req)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["eos"], [[EOS]]))
    assert eos_req.status.finish_reason == "stop"

    params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9])
    req = Request("min", [5, 6, 7], params, eos_token_ids={EOS})
    scheduler.add_request(req)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["min"], [[9]]))
    assert not req.status.finished  # below min_tokens, the stop id does not stop
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["min"], [[9]]))
    assert req.status.finish_reason == "stop" and req.stop_reason == 9

    capped = make_request("cap", 25, max_tokens=100)
    scheduler.add_request(capped)
    run_to_completion(scheduler)
    assert capped.status.finish_reason == "length"
    assert capped.num_tokens == 30


def test_phased_baseline_runs_whole_prompts_alone_and_stalls_every_decode():
    # The pre-V1 behaviour unified scheduling is measured against: a long prompt arrives,
    # and while it is computed (whole, in one step) no running request gets a token.
    scheduler = make_scheduler(max_num_batched_tokens=4096, phased=True)
    decoders = [make_request(f"d{i}", 20, max_tokens=50) for i in range(4)]
    for request in decoders:
        scheduler.add_request(request)
    step(scheduler)
    scheduler.add_request(make_request("long", 2000, max_tokens=4, base=1000))
    scheduler.add_request(make_request("short", 30, max_tokens=4, base=3000))
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"long": 2000, "short": 30}
    assert all(r.num_output_tokens == 1 for r in decoders)
    out = step(scheduler)
    assert set(out.num_scheduled_tokens) == {r.request_id for r in scheduler.running}
    assert set(out.num_scheduled_tokens.values()) == {1}
    run_to_completion(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_total_blocks


def test_phased_steps_never_split_a_prompt_over_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=100, phased=True)
    scheduler.add_request(make_request("a", 60))
    scheduler.add_request(make_request("b", 60, base=2000))
    first = step(scheduler)
    assert first.num_scheduled_tokens == {"a": 60}  # b would not fit whole: it waits
    second = step(scheduler)
    assert second.num_scheduled_tokens == {"b": 60}  # a prefill step, a's decode waits
    run_to_completion(scheduler)
