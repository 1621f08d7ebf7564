"""Structured outputs in the scheduler, with a scripted grammar: WAITING_FOR_GRAMMAR keeps a
request's place, a failed grammar refuses the request alone, matchers follow exactly the output
tokens (through preemption), and each step's bitmask covers its sampling constrained rows."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from tests.engine.test_scheduler import EOS, make_scheduler
from tidegate.engine.config import SpeculativeConfig
from tidegate.engine.core.request import Request, RequestStatus
from tidegate.engine.messages import ModelRunnerOutput, SchedulerOutput
from tidegate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tidegate.engine.spec_decode.verify import accepted_tokens

VOCAB = 64


class SequenceMatcher:
    """A grammar that accepts exactly one token sequence, then EOS."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated() or token_id != self._next():
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def _next(self) -> int:
        return self.tokens[len(self.accepted)] if len(self.accepted) < len(self.tokens) else EOS

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        token = self._next()
        bitmask[row, token // 32] |= np.int32(1 << (token % 32)) if token % 32 < 31 else -(2**31)

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == EOS


class FakeManager:
    def __init__(self) -> None:
        self.matchers: list[SequenceMatcher] = []

    def new_matcher(self, compiled: list[int]) -> SequenceMatcher:
        self.matchers.append(SequenceMatcher(compiled))
        return self.matchers[-1]

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        return np.zeros((num_rows, -(-VOCAB // 32)), dtype=np.int32)

    def fill_bitmasks(self, matchers, bitmask: np.ndarray) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)


class FakeCompiler:
    """Compiles `choice=["a b c"]` to the token ids [a, b, c]; futures resolve when told."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.manager = FakeManager()
        self.pending: list[tuple[Future, StructuredOutputsParams]] = []

    def compile(self, params: StructuredOutputsParams) -> Future:
        future: Future = Future()
        self.pending.append((future, params))
        return future

    def finish_all(self) -> None:
        for future, params in self.pending:
            if params.regex == "fail":
                future.set_exception(ValueError("regex: nothing to repeat at position 0"))
            else:
                future.set_result([int(t) for t in params.choice[0].split()])
        self.pending.clear()


def scheduler_with(compiler: FakeCompiler, **kwargs):
    scheduler = make_scheduler(**kwargs)
    scheduler.grammar = compiler
    return scheduler


def constrained(req_id: str, tokens: list[int], max_tokens: int = 16, prompt: int = 20) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(choice=[" ".join(map(str, tokens))]),
    )
    return Request(req_id, list(range(100, 100 + prompt)), params, eos_token_ids={EOS})


def free(req_id: str, prompt: int = 20) -> Request:
    return Request(req_id, list(range(200, 200 + prompt)), SamplingParams(max_tokens=4))


def run_masked(out: SchedulerOutput, scheduler) -> ModelRunnerOutput:
    """Sample, for each sampling row, its lowest allowed token (token 7 for free rows)."""
    masks = {}
    if out.grammar is not None:
        bits = np.frombuffer(out.grammar.bitmask, dtype=np.int32).reshape(-1, out.grammar.words)
        for req_id, row in zip(out.grammar.req_ids, bits, strict=True):
            allowed = [t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1]
            masks[req_id] = allowed[0]
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([masks.get(req_id, 7)] if done else [])
        assert not done or request.grammar is None or req_id in masks
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def drive(scheduler, max_steps: int = 200) -> dict[str, list[int]]:
    """Run until idle; every request's output tokens and finish reason."""
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        for output in scheduler.update_from_output(out, run_masked(out, scheduler)):
            results.setdefault(output.req_id, []).extend(output.new_token_ids)
    return results


def test_waiting_for_grammar_keeps_its_place_while_free_requests_pass():
    compiler = FakeCompiler()
    scheduler = scheduler_with(compiler)
    scheduler.add_request(constrained("c", [11, 12, 13]))
    scheduler.add_request(free("f"))
    out = scheduler.schedule()
    assert scheduler.requests["c"].status is RequestStatus.WAITING_FOR_GRAMMAR
    assert list(out.num_scheduled_tokens) == ["f"]
    assert out.grammar is None
    assert scheduler.num_waiting_for_grammar == 1
    assert scheduler.waiting.peek().request_id == "c"  # still first in line
    scheduler.update_from_output(out, run_masked(out, scheduler))
    compiler.finish_all()
    results = drive(scheduler)
    assert results["c"] == [11, 12, 13, EOS]
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_total_blocks


def test_grammar_terminates_the_request_and_the_bitmask_names_only_sampling_rows():
    compiler = FakeCompiler()
    # A prompt longer than a step's budget: its first steps sample nothing, so no bitmask row.
    scheduler = scheduler_with(compiler, max_num_batched_tokens=32)
    scheduler.add_request(constrained("c", [5, 6], prompt=70))
    compiler.finish_all()
    outs = []
    results: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        outs.append(out)
        for output in scheduler.update_from_output(out, run_masked(out, scheduler)):
            results.setdefault(output.req_id, []).extend(output.new_token_ids)
            finish = output.finish_reason
    assert [o.grammar is not None for o in outs] == [False, False, True, True, True]
    assert results["c"] == [5, 6, EOS] and finish == "stop"


def test_a_grammar_that_fails_refuses_its_request_only():
    compiler = FakeCompiler()
    scheduler = scheduler_with(compiler)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="fail"))
    scheduler.add_request(Request("bad", [1, 2, 3], params, eos_token_ids={EOS}))
    scheduler.add_request(constrained("good", [9]))
    compiler.finish_all()
    out = scheduler.schedule()
    errors = scheduler.take_error_outputs()
    assert [(e.req_id, e.finish_reason) for e in errors] == [("bad", "error")]
    assert "nothing to repeat" in errors[0].error
    assert "bad" not in scheduler.requests
    assert list(out.num_scheduled_tokens) == ["good"]


def test_preemption_keeps_the_matcher_in_step_with_the_output():
    compiler = FakeCompiler()
    # Few blocks: the two requests cannot both grow, so one is preempted and recomputed.
    scheduler = scheduler_with(compiler, num_blocks=6, block_size=4)
    target = list(range(10, 22))
    scheduler.add_request(constrained("a", target, prompt=6))
    scheduler.add_request(constrained("b", target, prompt=6))
    compiler.finish_all()
    results = drive(scheduler)
    assert scheduler.num_preemptions > 0
    assert results["a"] == results["b"] == [*target, EOS]
    # EOS ends the request before the matcher sees it; every other token went through it once.
    for matcher in compiler.manager.matchers:
        assert matcher.accepted == target


def test_async_scheduling_defers_the_bitmask_of_rows_with_a_token_in_flight():
    compiler = FakeCompiler()
    scheduler = scheduler_with(compiler)
    scheduler.async_scheduling = True
    scheduler.defer_grammar_bitmask = True
    scheduler.add_request(constrained("c", [3, 4, 5]))
    compiler.finish_all()
    first = scheduler.schedule()  # the prompt: nothing in flight, the bitmask is filled now
    assert first.grammar is not None and first.grammar.bitmask is not None
    second = scheduler.schedule()  # planned before the first token is known
    assert second.grammar is not None and second.grammar.bitmask is None
    scheduler.update_from_output(first, run_masked(first, scheduler))
    second.grammar.bitmask = scheduler.fill_grammar_bitmask(second.grammar)
    scheduler.update_from_output(second, run_masked(second, scheduler))
    assert scheduler.requests["c"].output_token_ids == [3, 4]


def test_async_scheduling_without_deferral_waits_for_the_token_in_flight():
    compiler = FakeCompiler()
    scheduler = scheduler_with(compiler)
    scheduler.async_scheduling = True
    scheduler.add_request(constrained("c", [3, 4, 5]))
    scheduler.add_request(free("f"))
    compiler.finish_all()
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert "c" not in second.num_scheduled_tokens and "f" in second.num_scheduled_tokens
    scheduler.update_from_output(first, run_masked(first, scheduler))
    scheduler.update_from_output(second, run_masked(second, scheduler))
    third = scheduler.schedule()
    assert third.grammar is not None and third.grammar.bitmask is not None


def test_a_producer_does_not_compile_the_grammar_its_consumer_applies():
    from tidegate.engine.kv_transfer.params import parse_kv_transfer_params

    compiler = FakeCompiler()
    scheduler = scheduler_with(compiler)
    request = constrained("p", [1])
    request.kv_transfer = parse_kv_transfer_params({"do_remote_decode": True})
    scheduler.add_request(request)
    assert compiler.pending == [] and request.grammar is None


# -- speculative decoding ------------------------------------------------------------------


def allowed_tokens(row: np.ndarray) -> list[int]:
    return [t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1]


def run_guessing(out: SchedulerOutput, scheduler) -> ModelRunnerOutput:
    """As the runner: sample each position's lowest allowed token (its row of the bitmask, in
    order), keep the guesses that match."""
    rows: dict[str, list[np.ndarray]] = {}
    if out.grammar is not None:
        bits = np.frombuffer(out.grammar.bitmask, dtype=np.int32).reshape(-1, out.grammar.words)
        for req_id, row in zip(out.grammar.req_ids, bits, strict=True):
            rows.setdefault(req_id, []).append(row)
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        guesses = out.scheduled_spec_decode_tokens.get(req_id, [])
        assert len(rows.get(req_id, [])) == 1 + len(guesses)
        tokens = [allowed_tokens(row)[0] for row in rows[req_id]]
        sampled.append(accepted_tokens(tokens, [guesses])[0])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def test_guesses_stop_where_the_grammar_does_and_each_position_gets_its_own_row():
    """The grammar takes one sequence, whose start repeats: prompt lookup guesses its
    continuation from the output so far, the guesses past what the grammar takes are never
    made, and every guessed position's row allows exactly the token the grammar expects there."""
    sequence = [30, 31, 32, 30, 31, 32, 30, 31, 40, 41]
    compiler = FakeCompiler()
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    scheduler = scheduler_with(compiler, speculative=spec)
    scheduler.add_request(constrained("c", sequence, max_tokens=20))
    scheduler.schedule()  # waits for its grammar
    compiler.finish_all()
    outputs: list[int] = []
    guessed: list[list[int]] = []
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        guessed.append(out.scheduled_spec_decode_tokens.get("c", []))
        for output in scheduler.update_from_output(out, run_guessing(out, scheduler)):
            outputs.extend(output.new_token_ids)
            matcher = compiler.manager.matchers[0]
            # Back where the output is after every step (a stop token ends the request first).
            assert matcher.accepted == [t for t in outputs if t != EOS]
    assert outputs == [*sequence, EOS]
    # After 30 31 32 30 31, prompt lookup proposes 32 30 31 32 (what followed "30 31" the
    # first time, copied on); the grammar leaves the cycle for 40 there, so the fourth guess
    # is never made. All three are kept, and 40 with them.
    assert [32, 30, 31] in guessed
    assert all(len(guesses) < 4 for guesses in guessed)
    assert scheduler.num_spec_accepted_tokens == 3
