"""Async scheduling: the real EngineCore and Scheduler, driven with a fake executor whose
runner keeps its own tokens as the model runner does, against synchronous scheduling.

The fake runner's token for a request depends only on the request and how many tokens it
holds, so both modes must deliver the same tokens whatever the batches. It also checks the
protocol the placeholders rely on: no step asks it for a token it has not sampled itself.
"""

from __future__ import annotations

import hashlib
import random
import time
from concurrent.futures import Future

import pytest

from tidegate.engine import LLM
from tidegate.engine.config import EngineArgs
from tidegate.engine.core.chunk_tuner import StepMix
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.executor.abstract import Executor
from tidegate.engine.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from tidegate.engine.sampling_params import SamplingParams

EOS = 2


def fake_token(req_id: str, num_tokens: int) -> int:
    """The 'model': a pseudo-random token from the request and its length (EOS now and then)."""
    digest = hashlib.blake2b(f"{req_id}:{num_tokens}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 60


class FakeRunnerExecutor(Executor):
    """Runs steps in order on a dict of request states, like ModelRunner does on tensors."""

    def __init__(self, args, model_config, max_model_len, kv_config=None) -> None:
        super().__init__(args, model_config, max_model_len, kv_config)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.steps_started = 0
        self.steps_returned = 0
        self.max_started_ahead = 0  # steps started beyond the ones the engine has collected
        self.rows_per_request: dict[str, int] = {}

    def num_kv_blocks(self) -> int:
        return self.args.num_gpu_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            assert cached.req_id in self.tokens, f"{cached.req_id} was finished, then scheduled"
            self.computed[cached.req_id] = cached.num_computed_tokens
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id, num in so.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            end = self.computed[req_id] + num
            # The placeholder contract: every token a step computes is one the runner holds.
            assert end <= len(tokens), f"{req_id}: asked to compute {end} of {len(tokens)} tokens"
            self.computed[req_id] = end
            self.rows_per_request[req_id] = self.rows_per_request.get(req_id, 0) + 1
            if end == len(tokens):
                tokens.append(fake_token(req_id, len(tokens)))
                sampled.append([tokens[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def execute_model_async(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self.steps_started += 1
        future: Future[ModelRunnerOutput] = _CountedFuture(self)
        future.set_result(self.execute_model(so))
        self.max_started_ahead = max(
            self.max_started_ahead, self.steps_started - self.steps_returned
        )
        return future

    def kv_data_ports(self) -> list[int]:
        return [0]

    def update_kv_pins(self, pin, unpin) -> None:
        pass

    def describe(self) -> str:
        return "fake runner"


class _CountedFuture(Future):
    def __init__(self, executor: FakeRunnerExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout=None):
        self._executor.steps_returned += 1
        return super().result(timeout)


def make_core(model_dir, async_scheduling: bool, **kwargs) -> EngineCore:
    args = EngineArgs(
        model=str(model_dir),
        async_scheduling=async_scheduling,
        max_model_len=kwargs.pop("max_model_len", 512),
        num_gpu_blocks=kwargs.pop("num_gpu_blocks", 200),
        block_size=kwargs.pop("block_size", 16),
        **kwargs,
    )
    return EngineCore(args, executor_class=FakeRunnerExecutor)


def random_requests(seed: int, n: int) -> list[tuple[int, EngineCoreRequest, int | None]]:
    """(arrival step, request, abort after this many tokens or None)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 60) for _ in range(rng.choice([0, 16, 40]))]
    plan = []
    for i in range(n):
        prompt = shared + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 120))]
        max_tokens = rng.randrange(1, 100)
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            min_tokens=min(max_tokens, rng.choice([0, 0, 3])),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(3, 60), rng.choice([0, 0, 1, 2])),
        )
        request = EngineCoreRequest(f"r{i}", prompt, params, [EOS], arrival_time=time.monotonic())
        abort_after = rng.randrange(0, 10) if rng.random() < 0.2 else None
        plan.append((rng.randrange(0, 30), request, abort_after))
    return plan


def run(core: EngineCore, plan, max_steps: int = 5000):
    """Add requests at their steps and abort when a request has delivered enough tokens;
    returns each request's delivered tokens and finish reason."""
    delivered: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    abort_after = {req.request_id: after for _, req, after in plan if after is not None}
    pending = sorted(plan, key=lambda item: item[0])
    step = 0
    while pending or core.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            core.add_request(pending.pop(0)[1])
        if core.has_unfinished_requests():
            for output in core.step():
                tokens = delivered.setdefault(output.req_id, [])
                tokens.extend(output.new_token_ids)
                if output.finish_reason is not None:
                    finished[output.req_id] = output.finish_reason
                elif len(tokens) >= abort_after.get(output.req_id, 1 << 30):
                    core.abort_requests([output.req_id])
                    finished[output.req_id] = "abort"
            core.kv_cache_manager.check_invariants()
        step += 1
        assert step < max_steps, "the engine did not finish"
    return delivered, finished


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_gpu_blocks", [200, 17])
def test_async_delivers_the_same_tokens_as_sync_under_arrivals_stops_aborts_and_preemption(
    tiny_llama_dir, seed, num_gpu_blocks
):
    plan = random_requests(seed, 24)
    results = {}
    for mode in (False, True):
        core = make_core(tiny_llama_dir, mode, num_gpu_blocks=num_gpu_blocks, max_model_len=256)
        results[mode] = run(core, plan)
        stats = core.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
        assert not core.scheduler.requests
        if num_gpu_blocks == 17:
            assert stats["num_preemptions"] > 0, "the tight pool should preempt"
        if mode:
            assert core.executor.max_started_ahead == 2, "async should keep two steps going"
        else:
            assert core.executor.max_started_ahead == 0
    assert results[True] == results[False]


def test_a_length_capped_request_is_never_scheduled_past_its_last_token(tiny_llama_dir):
    core = make_core(tiny_llama_dir, True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", list(range(3, 40)), params, [EOS], arrival_time=0.0))
    run(core, [])
    # One step for the prompt, then four decodes: the fifth token's step is the last.
    assert core.executor.rows_per_request["a"] == 5
    near_limit = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    core.add_request(
        EngineCoreRequest("b", list(range(3, 40)), near_limit, [EOS], arrival_time=0.0)
    )
    delivered, finished = run(core, [])
    assert len(delivered["b"]) == 512 - 37 and finished["b"] == "length"
    assert core.executor.rows_per_request["b"] == 1 + (512 - 37 - 1)


def test_a_stop_token_costs_at_most_one_dropped_step(tiny_llama_dir):
    core = make_core(tiny_llama_dir, True)
    prompt = list(range(3, 40))
    # Find the fourth token this request will sample, and stop on it.
    tokens = []
    for _ in range(4):
        tokens.append(fake_token("s", len(prompt) + len(tokens)))
    params = SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[tokens[3]])
    core.add_request(EngineCoreRequest("s", prompt, params, [EOS], arrival_time=0.0))
    delivered, finished = run(core, [])
    first_stop = next(i for i, t in enumerate(tokens) if t in (tokens[3], EOS))
    assert delivered["s"] == tokens[: first_stop + 1] and finished["s"] == "stop"
    # The step after the stop was already running when the stop was seen; nothing more.
    assert core.executor.rows_per_request["s"] == first_stop + 2


def test_an_abort_while_two_steps_run_drops_their_tokens_and_frees_everything(tiny_llama_dir):
    core = make_core(tiny_llama_dir, True)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    core.add_request(EngineCoreRequest("x", list(range(3, 40)), params, [EOS], arrival_time=0.0))
    core.add_request(EngineCoreRequest("y", list(range(3, 30)), params, [EOS], arrival_time=0.0))
    assert core.step() == []  # step 1 started, nothing applied yet
    outputs = core.step()  # step 2 started, step 1 applied
    assert {o.req_id for o in outputs} == {"x", "y"}
    core.abort_requests(["x"])
    rest = core.drain()
    assert {o.req_id for o in rest} == {"y"}
    delivered, _ = run(core, [])
    assert len(delivered["y"]) == 50 - 2
    stats = core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert "x" not in core.executor.tokens  # the runner was told at the next step


def test_a_decode_is_planned_before_its_last_token_is_known(tiny_llama_dir):
    """One request: every step computes the token the step before it sampled."""
    core = make_core(tiny_llama_dir, True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    core.add_request(EngineCoreRequest("d", list(range(3, 40)), params, [EOS], arrival_time=0.0))
    calls = []
    while core.has_unfinished_requests():
        calls.append(sum(len(o.new_token_ids) for o in core.step()))
    # The first call only starts a step; each call after it applies one token.
    assert calls == [0] + [1] * 20
    assert core.executor.steps_started == 20


def test_the_chunk_tuner_learns_each_step_with_its_own_mix(tiny_llama_dir):
    """With a step planned ahead, the time measured is the older step's: the tuner must pair
    it with that step's decodes and prompt tokens, not with the newer plan's."""
    core = make_core(tiny_llama_dir, True, long_prefill_token_threshold="auto")
    tuner = core.scheduler.chunk_tuner
    assert tuner is not None
    observed, planned = [], []
    original_observe, original_schedule = tuner.observe, core.scheduler.schedule

    def observe(mix, seconds):
        observed.append(mix)
        original_observe(mix, seconds)

    def schedule():
        so = original_schedule()
        if not so.is_empty:
            planned.append(core.scheduler.last_mix)
        return so

    tuner.observe, core.scheduler.schedule = observe, schedule
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plan = [
        (
            step,
            EngineCoreRequest(f"m{step}", list(range(3, 3 + 20 * (step + 1))), params, [EOS], 0.0),
            None,
        )
        for step in range(4)
    ]
    run(core, plan)
    # Empty plans (only finished ids for the runner) teach the tuner nothing.
    assert [mix for mix in observed if mix != StepMix(0)] == planned and len(planned) > 8
    assert any(mix.decodes and mix.prefill_tokens for mix in planned)  # mixed steps among them
    # Each prompt token attends to itself at least: a chunk has as many pairs as tokens or more.
    assert all(mix.prefill_pairs >= mix.prefill_tokens for mix in planned)


def test_prompt_logprobs_are_those_of_synchronous_scheduling(tiny_llama_dir):
    # Prompts in chunks of 32 tokens, one of them shorter than a chunk: the logprobs go out
    # with each request's first token, whichever step plans its next one meanwhile.
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 900) for _ in range(n)] for n in (70, 5, 130)]
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1)
    results = []
    for async_scheduling in (False, True):
        llm = LLM(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_num_batched_tokens=32,
            max_model_len=512,
            num_gpu_blocks=64,
            async_scheduling=async_scheduling,
        )
        outputs = llm.generate(prompts, params)
        results.append(
            [
                (
                    o.outputs[0].token_ids,
                    [
                        None if e is None else [(t, lp.logprob) for t, lp in e.items()]
                        for e in o.prompt_logprobs
                    ],
                )
                for o in outputs
            ]
        )
    assert results[1] == results[0]
    assert [len(logprobs) for _, logprobs in results[1]] == [70, 5, 130]
