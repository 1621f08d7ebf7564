"""The unified scheduler: every step mixes prefill chunks and decodes under one token budget."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Iterable

from tidegate.engine.config import SpeculativeConfig
from tidegate.engine.core.chunk_tuner import (
    ChunkSizeTuner,
    StepCaps,
    StepMix,
    chunk_keys,
    chunk_pairs,
)
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.kv_coordinator import KVTransferCoordinator
from tidegate.engine.core.request import Request, RequestStatus
from tidegate.engine.core.request_grammar import (
    GrammarCompiler,
    RequestGrammar,
    allowed_prefix,
    bitmask_array,
    build_bitmask,
    fill_guessed_rows,
)
from tidegate.engine.core.request_queue import Tenant, WaitingQueue, waiting_queue
from tidegate.engine.core.step_budget import StepBudget, StepLimits
from tidegate.engine.kv_transfer.base import KVConnectorScheduler
from tidegate.engine.kv_transfer.params import RemoteDecode
from tidegate.engine.messages import (
    CachedRequestData,
    EngineCoreOutput,
    GrammarBitmask,
    KVEvent,
    KVRecvDone,
    KVRelease,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    StepTime,
)
from tidegate.engine.spec_decode.acceptance import GuessRecord
from tidegate.engine.spec_decode.ngram import NgramProposer
from tidegate.engine.structured_output import bitmask_words

logger = logging.getLogger(__name__)

# Steps kept for the next stats (make_stats hands them over, and the engine core's loop takes
# stats after every step): a bound for the offline LLM, which never takes any.
_STEP_LOG_MAX = 4096


class Scheduler:
    """Decides, step by step, which requests compute how many tokens; owns the KV cache manager.

    There are no prefill and decode phases: each request has `num_computed_tokens` and a step
    advances it. RUNNING requests are served first, then WAITING ones, each in the order of
    the scheduling policy (`StepLimits.policy`; engine/core/request_queue.py for WAITING). When
    blocks run out the last running request in that order is preempted by recompute: the
    newest (fcfs), the lowest priority (priority), or the newest of the tenant running most
    (fair). Under fair each tenant with work is also owed an even share of the running slots:
    while a tenant below its share waits, tenants above theirs start nothing, and it takes a
    slot back from a tenant above its share when none is free (`_reclaim_slots`).

    With `async_scheduling` the next step is planned while this one runs: a step that will
    sample a token for a request leaves a placeholder (`num_output_placeholders`), which the
    next plan counts as a known token whose KV that step computes; the runner feeds it the
    token it sampled itself. `update_from_output` swaps the placeholder for the real token.

    With `speculative` decoding, a decode that has budget and blocks left after every other
    request is served also computes the tokens prompt lookup guesses will follow, as many as
    its guesses so far say are worth it (`_schedule_proposals`, engine/spec_decode/).
    `update_from_output` takes back the computed count of the guesses the runner did not
    keep, so their KV is computed again from the real tokens.

    With pipeline parallelism only the last stage samples, so a request with a token in flight
    waits for it, and each plan tells the earlier stages the sampled tokens it reads
    (`CachedRequestData.new_token_ids`). With `micro_batches` steps in flight at once, each
    takes at most its share of the requests, so that the next step has requests to run while
    this one is in the later stages.
    """

    def __init__(
        self,
        limits: StepLimits,
        kv_cache_manager: KVCacheManager,
        kv_connector: KVConnectorScheduler | None = None,
        kv_transfer_timeout: float = 30.0,
        world_size: int = 1,
        async_scheduling: bool = False,
        grammar: GrammarCompiler | None = None,
        defer_grammar_bitmask: bool = False,
        pipeline_parallel_size: int = 1,
        micro_batches: int = 1,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.limits = limits
        self.async_scheduling = async_scheduling
        self.pipeline = pipeline_parallel_size > 1
        self.micro_batches = micro_batches
        # Structured outputs: compiles grammars; None refuses constrained requests.
        self.grammar = grammar
        # Async scheduling: True when the executor takes a step's bitmask after the step has
        # started (the in-process worker); else a constrained request with a token in flight
        # waits for it before its next step.
        self.defer_grammar_bitmask = defer_grammar_bitmask
        # Requests finished without running (their grammar failed): outputs for the next step.
        self._error_outputs: list[EngineCoreOutput] = []
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = waiting_queue(limits.policy)
        self.running: list[Request] = []
        # Ids the runner must forget at its next step.
        self._finished_req_ids: set[str] = set()
        # Requests the runner has state for (new ones are sent whole, once).
        self._known_to_runner: set[str] = set()
        self.chunk_tuner: ChunkSizeTuner | None = None
        if limits.adaptive_chunking:
            self.chunk_tuner = ChunkSizeTuner(
                self.block_size,
                limits.max_num_batched_tokens,
                slack=limits.adaptive_slack,
                step_target_s=limits.adaptive_step_s,
            )
        # (decodes, prompt tokens) of the last planned step, for the chunk tuner and the step
        # metrics; the tuner's attention pairs and keys too when it runs.
        self._last_mix = StepMix(0)
        # Executed steps not yet handed over in stats (record_step), oldest first.
        self._step_log: deque[StepTime] = deque(maxlen=_STEP_LOG_MAX)
        # TIDEGATE_STEP_TRACE=FILE: a JSON line per executed step (when it ended, its time, its
        # mix and the chunk tuner's decode-only estimate), to see what a latency is made of.
        trace = os.environ.get("TIDEGATE_STEP_TRACE")
        self._step_trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        self.num_preemptions = 0
        self.num_steps = 0
        # Speculative decoding: the proposer, and totals of proposals (requests given some),
        # proposed tokens and accepted ones (vLLM's spec_decode_* counters).
        self.speculative = speculative
        self.proposer: NgramProposer | None = None
        if speculative is not None:
            self.proposer = NgramProposer(
                speculative.num_speculative_tokens,
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
            )
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        # Prompt tokens whose KV was computed (not read from the prefix cache), recomputes included.
        self.num_computed_prompt_tokens = 0
        self.kv_transfer = KVTransferCoordinator(
            kv_connector, kv_cache_manager, kv_transfer_timeout, world_size
        )

    # -- the request set --------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request; it may join the batch at the next step."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        constraint = request.sampling_params.structured_outputs
        # A producer's one token is thrown away (the consumer samples the first token itself
        # and constrains it), so its grammar would be compiled for nothing.
        if constraint is not None and not isinstance(request.kv_transfer, RemoteDecode):
            if self.grammar is None:
                self._finish_error(request, "this engine serves no structured outputs")
                return
            request.grammar = RequestGrammar(self.grammar.compile(constraint), self.grammar)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests now and free their blocks; unknown ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.status.finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
            else:
                self.kv_transfer.unpin_request(req_id)

    def has_unfinished_requests(self) -> bool:
        """True while some request waits or runs (not counting pulls in flight)."""
        return bool(self.waiting or self.running)

    @property
    def num_pulling(self) -> int:
        """Consumer requests parked until their KV arrives."""
        return self.kv_transfer.num_parked

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_waiting_of(self, tenant: Tenant) -> int:
        """Waiting requests of one tenant."""
        return self.waiting.num_of(tenant)

    @property
    def num_waiting_for_grammar(self) -> int:
        """Waiting requests whose grammar is still compiling."""
        return sum(1 for r in self.waiting if r.status is RequestStatus.WAITING_FOR_GRAMMAR)

    @property
    def has_error_outputs(self) -> bool:
        """True when refused requests wait to be reported."""
        return bool(self._error_outputs)

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests refused since the last call (their grammar failed)."""
        outputs, self._error_outputs = self._error_outputs, []
        return outputs

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones, within the budget."""
        self._order_running()
        max_seqs = None
        if self.micro_batches > 1:
            # This micro-batch's share of the requests (the others run, or will, in the rest).
            max_seqs = -(-(len(self.running) + len(self.waiting)) // self.micro_batches)
        budget = StepBudget(self.limits, max_seqs=max_seqs)
        if self.chunk_tuner is not None:
            # Each prompt's chunk sized for its depth: deeper chunks attend to more keys.
            # A queue that builds up widens the prompts' share (chunk_tuner's docstring), and
            # the step's chunks share one allowance.
            caps = StepCaps(
                self.chunk_tuner, sum(map(_is_decoding, self.running)), len(self.waiting)
            )
            budget = StepBudget(
                self.limits, caps.cap(0), cap=caps.cap, max_seqs=max_seqs, charge=caps.charge
            )
        scheduled: dict[str, int] = {}
        proposals: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        if self.limits.policy == "fair":
            self._reclaim_slots(preempted)
        # Requests sent back to make room for another tenant's do not stop admission.
        reclaimed = len(preempted)

        if self.limits.phased and self.waiting:
            # Phased baseline: admit whole prompts and run nothing else this step.
            self._schedule_waiting(budget, scheduled, new_reqs, cached_reqs)
            if scheduled:
                return self._finish_step(scheduled, new_reqs, cached_reqs, preempted)
        self._schedule_running(budget, scheduled, cached_reqs, preempted)
        # vLLM's rule: a step that had to preempt for blocks admits nobody new.
        if len(preempted) == reclaimed and not self.limits.phased:
            self._schedule_waiting(budget, scheduled, new_reqs, cached_reqs)
        if self.proposer is not None:
            self._schedule_proposals(budget, scheduled, cached_reqs, proposals)
        return self._finish_step(scheduled, new_reqs, cached_reqs, preempted, proposals)

    @property
    def last_mix(self) -> StepMix:
        """Decodes, prompt tokens and their attention's (token, key) pairs of the last planned
        step."""
        return self._last_mix

    def record_step_time(self, seconds: float, mix: StepMix | None = None) -> None:
        """How long a step took to execute (teaches the chunk tuner): the last planned one,
        or (async scheduling, where a later one is planned by then) the one of `mix`."""
        mix = mix or self._last_mix
        if self._step_trace is not None:
            self._trace_step(seconds, mix)
        if self.chunk_tuner is not None:
            self.chunk_tuner.observe(mix, seconds)

    def _trace_step(self, seconds: float, mix: StepMix) -> None:
        base = self.chunk_tuner.base(mix.decodes) if self.chunk_tuner is not None else None
        line = {"t": time.time(), "s": seconds, **mix._asdict(), "base": base}
        self._step_trace.write(json.dumps(line) + "\n")

    def record_step(self, seconds: float, mix: StepMix | None = None) -> None:
        """A step's wall time for the step metrics (the next stats hand it over): the last
        planned step, or the one of `mix`. A step that computed nothing is not counted."""
        decodes, tokens = (mix or self._last_mix)[:2]
        if decodes or tokens:
            self._step_log.append(StepTime(seconds, decodes, tokens))

    def _order_running(self) -> None:
        """Running requests in the policy's order: served from the front, preempted from the
        back. fcfs keeps admission order; priority sorts by (priority, arrival); fair puts
        every tenant's k-th oldest before anyone's (k+1)-th, so that a short step's prompt
        tokens go to each tenant's first requests before any tenant's second."""
        if self.limits.policy == "priority":
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        elif self.limits.policy == "fair":
            seen: Counter[Tenant] = Counter()
            ranks = []
            for request in self.running:
                ranks.append(seen[request.tenant])
                seen[request.tenant] += 1
            order = sorted(range(len(self.running)), key=ranks.__getitem__)
            self.running[:] = [self.running[i] for i in order]

    def _slot_shares(self) -> tuple[int, Counter[Tenant], int]:
        """fair: the running slots each tenant is owed (max_num_seqs split evenly among the
        tenants with requests running or waiting), each tenant's running requests, and the
        slots owed to waiting requests of tenants below their share."""
        running_of = Counter(r.tenant for r in self.running)
        waiting_of = self.waiting.tenants
        share = max(1, self.limits.max_num_seqs // max(1, len(running_of.keys() | waiting_of)))
        # A tenant at its own running cap is owed nothing more: it could not start one.
        most = min(share, self.limits.max_running_per_tenant or share)
        owed = sum(
            min(count, most - running_of[tenant])
            for tenant, count in waiting_of.items()
            if running_of[tenant] < most
        )
        return share, running_of, owed

    def _reclaim_slots(self, preempted: set[str]) -> None:
        """fair: when tenants below their share of the slots have requests waiting and too
        few slots are free, the newest requests of the tenants furthest above their share go
        back to WAITING (recompute; with prefix caching their full blocks stay cached), so
        that a flood holding every slot delays another tenant's start by one step at most."""
        share, running_of, owed = self._slot_shares()
        free = self.limits.max_num_seqs - len(self.running)
        while owed > free:
            tenant, most = running_of.most_common(1)[0]
            if most <= share:
                return
            victim = next(
                (r for r in reversed(self.running) if r.tenant == tenant),
                None,
            )
            if victim is None or victim.num_output_placeholders:
                return  # its token is in flight: the slot comes back at a later step
            self.running.remove(victim)
            self._preempt(victim)
            preempted.add(victim.request_id)
            running_of[tenant] -= 1
            free += 1

    def _spend(self, budget: StepBudget, request: Request, num_tokens: int) -> None:
        """Take a request's tokens out of the step's budget and charge them to its tenant."""
        # The chunk tuner charges prompt chunks to the step's allowance (decodes are in base).
        prompt = None
        if self.chunk_tuner is not None and not _is_decoding(request):
            prompt = request.num_computed_tokens
        budget.spend(num_tokens, prompt)
        self.waiting.charge(request.tenant, num_tokens)

    def _schedule_running(
        self,
        budget: StepBudget,
        scheduled: dict[str, int],
        cached_reqs: list[CachedRequestData],
        preempted: set[str],
    ) -> None:
        """Give running requests their tokens in order, preempting from the back if needed."""
        index = 0
        while index < len(self.running) and not budget.is_spent:
            request = self.running[index]
            if request.num_output_placeholders and (
                self.pipeline
                or self._finishes_in_flight(request)
                or (request.grammar is not None and not self.defer_grammar_bitmask)
            ):
                # The first stage needs the token in flight, which the last samples. Or it is
                # its last: nothing more to compute. Or its grammar needs that token to say
                # what may follow, and this executor cannot wait.
                index += 1
                continue
            num_new = budget.tokens_for(request, request.num_computed_tokens)
            if num_new == 0:
                index += 1
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            cached_reqs.append(
                CachedRequestData(
                    req_id=request.request_id,
                    new_block_ids=[block.block_id for block in new_blocks],
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            scheduled[request.request_id] = num_new
            self._spend(budget, request, num_new)
            index += 1

        # Prompts that stay part-way through prefill count against the partial-prefill limits,
        # whether or not they got tokens this step.
        for request in self.running:
            computed = request.num_computed_tokens + scheduled.get(request.request_id, 0)
            if budget.is_partial(request, computed):
                budget.count_partial(request)

    def _schedule_proposals(
        self,
        budget: StepBudget,
        scheduled: dict[str, int],
        cached_reqs: list[CachedRequestData],
        proposals: dict[str, list[int]],
    ) -> None:
        """Speculative decoding: add prompt-lookup guesses to the step's decodes, in running
        order, with the budget every other request left. A guess never displaces a token
        that is certain: it takes neither budget nor the free block each running request
        keeps to grow into, and a request whose guesses would end past max_tokens or the
        context gets fewer."""
        assert self.proposer is not None and self.speculative is not None
        limit = self.speculative.disable_by_batch_size
        if limit is not None and len(self.running) >= limit:
            return
        kv = self.kv_cache_manager
        data_of: dict[str, CachedRequestData] | None = None
        for request in self.running:
            if budget.tokens_left <= 0:
                break
            rid = request.request_id
            if scheduled.get(rid) != 1 or not _is_decoding(request):
                continue
            grammar = request.grammar
            if grammar is not None and (grammar.matcher is None or grammar.is_terminated):
                continue
            # The token after the last guess is sampled too: it must fit as well.
            room = min(
                budget.tokens_left,
                request.max_tokens - request.num_output_tokens - 1,
                self.limits.max_model_len - request.num_tokens - 1,
            )
            if room <= 0:
                continue
            guesses = self.proposer.propose(request.token_array(), room)
            if not guesses:
                continue
            record = request.guess_record
            if record is None:
                record = request.guess_record = GuessRecord()
            worth = record.worth(len(guesses))
            if worth == 0:
                record.shadow = guesses[0]  # judged against the token this step samples
                continue
            guesses = guesses[:worth]
            if grammar is not None:
                # Only guesses the grammar takes: the sampler would mask the others anyway.
                guesses = guesses[: allowed_prefix(grammar, guesses)]
                if not guesses:
                    continue
            num_tokens = request.num_computed_tokens + 1 + len(guesses)
            needed = -(-num_tokens // self.block_size) - kv.num_held_blocks(rid)
            if needed > 0 and kv.num_free_blocks - needed < len(self.running):
                continue
            new_blocks = kv.allocate_slots(request, 1 + len(guesses))
            if new_blocks is None:
                continue
            if data_of is None:
                data_of = {data.req_id: data for data in cached_reqs}
            data_of[rid].new_block_ids.extend(block.block_id for block in new_blocks)
            proposals[rid] = guesses
            scheduled[rid] += len(guesses)
            self._spend(budget, request, len(guesses))

    def _finish_step(
        self,
        scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
        preempted: set[str],
        proposals: dict[str, list[int]] | None = None,
    ) -> SchedulerOutput:
        """Package the plan and advance every scheduled request's computed-token count."""
        total = sum(scheduled.values())
        assert total <= self.limits.max_num_batched_tokens
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            kv_connector_metadata=self.kv_transfer.take_connector_metadata(),
            scheduled_spec_decode_tokens=proposals or {},
        )
        self._finished_req_ids = set()
        grammar_rows: list[Request] = []
        cached_by_id = {data.req_id: data for data in cached_reqs} if self.pipeline else {}
        # The step's mix (decodes, prompt tokens; and for the tuner alone, the prompt tokens'
        # attention pairs and keys), each request counted before it advances. Without the
        # tuner a decode is one token past the prompt, a comparison of what is at hand (the
        # tuner's test differs only for a recompute one token at a time).
        tuned = self.chunk_tuner is not None
        num_decodes = pairs = keys = 0
        # Advance now so the next schedule() sees this step's work as done.
        for req_id, num in scheduled.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens
            prompt_len = request.num_prompt_tokens
            guessed = len(proposals.get(req_id, ())) if proposals else 0
            if guessed:
                # A decode with guesses: one decode, and its guesses a chunk one token on.
                num_decodes += 1
                if tuned:
                    pairs += chunk_pairs(start + 1, guessed)
                    keys += chunk_keys(start + 1, guessed)
            elif num == 1 and (_is_decoding(request) if tuned else start >= prompt_len):
                num_decodes += 1
            elif tuned:
                pairs += chunk_pairs(start, num)
                keys += chunk_keys(start, num)
            self.num_computed_prompt_tokens += min(start + num, prompt_len) - min(start, prompt_len)
            if start + num > prompt_len and req_id in cached_by_id:
                # Sampled tokens this step reads (a decode's last; a recompute's outputs).
                read = request.all_token_ids[max(start, prompt_len) : start + num]
                cached_by_id[req_id].new_token_ids = read
            request.num_computed_tokens += num
            samples = request.num_computed_tokens >= request.num_tokens_with_placeholders
            if samples and request.grammar is not None:
                grammar_rows.append(request)
            if self.async_scheduling and samples:
                request.num_output_placeholders += 1  # this step samples its next token
        self._last_mix = StepMix(num_decodes, total - num_decodes, pairs, keys)
        if grammar_rows:
            output.grammar = self._grammar_bitmask(grammar_rows, proposals)
        self.num_steps += 1
        return output

    def _grammar_bitmask(
        self, rows: list[Request], proposals: dict[str, list[int]] | None = None
    ) -> GrammarBitmask:
        """The step's bitmask message, filled now unless a token it depends on is in flight.
        A request with guesses has a row per position it samples, in order (its id repeated).
        """
        assert self.grammar is not None
        proposals = proposals or {}
        req_ids = [
            r.request_id for r in rows for _ in range(1 + len(proposals.get(r.request_id, ())))
        ]
        message = GrammarBitmask(req_ids=req_ids, words=bitmask_words(self.grammar.vocab_size))
        # This step's own placeholder is already counted: more than one means an earlier step.
        if all(r.num_output_placeholders <= int(self.async_scheduling) for r in rows):
            message.bitmask = self.fill_grammar_bitmask(message, proposals)
        return message

    def fill_grammar_bitmask(
        self, message: GrammarBitmask, proposals: dict[str, list[int]] | None = None
    ) -> bytes:
        """The rows of a step's bitmask from the matchers as they are now (every earlier step
        applied); a request that finished meanwhile gets a row that allows everything (its
        token is dropped). A request's later rows (its guessed positions) come from its
        matcher taken through the guesses before them."""
        assert self.grammar is not None
        grammars: list[RequestGrammar | None] = []
        guessed_rows: dict[str, list[int]] = {}
        for row, req_id in enumerate(message.req_ids):
            request = self.requests.get(req_id)
            live = request is not None and request.grammar is not None
            grammar = request.grammar if live and not request.grammar.is_terminated else None
            if row > 0 and message.req_ids[row - 1] == req_id:
                guessed_rows.setdefault(req_id, []).append(row)
                grammar = None  # filled below
            grammars.append(grammar)
        if not guessed_rows:
            return build_bitmask(self.grammar, grammars)
        bitmask = bitmask_array(self.grammar, grammars)
        for req_id, rows in guessed_rows.items():
            request = self.requests.get(req_id)
            guesses = (proposals or {}).get(req_id, [])
            if request is not None and request.grammar is not None and len(guesses) == len(rows):
                fill_guessed_rows(bitmask, rows, request.grammar, guesses)
        return bitmask.tobytes()

    def _grammar_ready(self, request: Request) -> bool:
        """True once the request's grammar compiled; refuses the request if it did not."""
        try:
            ready = request.grammar.poll()
        except ValueError as error:
            self._finish_error(request, str(error))
            return False
        except Exception as error:  # a library failure is this request's, not the engine's
            self._finish_error(request, f"the grammar could not be compiled: {error}")
            return False
        if ready:
            request.status = RequestStatus.WAITING
        return ready

    def _finish_error(self, request: Request, message: str) -> None:
        """Refuse a request that never ran; its output carries the reason."""
        request.error = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._error_outputs.append(
            EngineCoreOutput(
                req_id=request.request_id, new_token_ids=[], finish_reason="error", error=message
            )
        )

    def _schedule_waiting(
        self,
        budget: StepBudget,
        scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
    ) -> None:
        """Admit waiting requests in the policy's order. Those passed over keep their places:
        a prompt that would exceed the partial limits, one whose adapter would be one too many
        for a step (`max_loras`), and every request of a tenant with `max_running_per_tenant`
        running."""
        try:
            self._admit_waiting(budget, scheduled, new_reqs, cached_reqs)
        finally:
            self.waiting.end_pass()

    def _admit_waiting(
        self,
        budget: StepBudget,
        scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
    ) -> None:
        waiting = self.waiting
        adapters = _AdapterSlots(self.limits.max_loras, self.running)
        cap = self.limits.max_running_per_tenant
        fair = self.limits.policy == "fair"
        if fair:
            share, running_of, owed = self._slot_shares()
        else:  # counted only for the running cap
            share, owed = 0, 0
            running_of = Counter(r.tenant for r in self.running) if cap is not None else Counter()
        # fair: while a tenant below its share has a request waiting, tenants at or above
        # theirs start none (their prompts would lengthen the step that gives its first token,
        # or take the slot owed to it); nor in a step that started one of its requests.
        started_owed = False
        while not budget.is_spent and len(self.running) < self.limits.max_num_seqs:
            request = waiting.peek()
            if request is None:
                break
            if cap is not None and running_of[request.tenant] >= cap:
                waiting.exclude(request.tenant)
                continue
            below_share = running_of[request.tenant] < share
            if fair and not below_share and (started_owed or owed):
                waiting.exclude(request.tenant)
                continue
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it resumes once the token is known
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
                ready = self._grammar_ready(request)
                if not ready:
                    # Compiling (it keeps its place), or refused (gone from the queue).
                    if request in waiting:
                        waiting.set_aside()
                    continue
            if not adapters.admits(request):
                waiting.set_aside()
                continue
            if self.kv_transfer.wants_pull(request):
                parked = self._park_for_pull(request)
                if parked is None:
                    break  # no room for its blocks yet
                if parked:
                    continue
            # A request that already holds blocks had its prompt pulled (or the pull failed).
            held = self.kv_cache_manager.num_held_blocks(request.request_id)
            if held:
                computed_blocks, num_cached = [], request.num_computed_tokens
            else:
                computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_new = budget.tokens_for(request, num_cached)
            if num_new == 0:
                break
            partial = budget.is_partial(request, num_cached + num_new)
            if partial and self.limits.phased:
                break  # phased steps never split a prompt; it waits for a step of its own
            if partial and not budget.admits_partial(request):
                waiting.set_aside()
                continue
            if not self._leaves_headroom(request, computed_blocks, num_cached + num_new, held):
                break
            num_hit = 0 if held else num_cached
            if (
                self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks, num_hit)
                is None
            ):
                break
            waiting.pop(request)
            if partial:
                budget.count_partial(request)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.monotonic()
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            if request.request_id in self._known_to_runner:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=request.request_id,
                        new_block_ids=list(block_ids),
                        num_computed_tokens=num_cached,
                        resumed_from_preemption=True,
                    )
                )
            else:
                self._known_to_runner.add(request.request_id)
                self.kv_transfer.schedule_load(request.request_id)
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=list(request.all_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=list(block_ids),
                        num_computed_tokens=num_cached,
                        lora_request=request.lora_request,
                    )
                )
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            adapters.add(request)
            running_of[request.tenant] += 1
            if fair and below_share:
                started_owed, owed = True, max(0, owed - 1)
            scheduled[request.request_id] = num_new
            self._spend(budget, request, num_new)

    def _leaves_headroom(
        self, request: Request, computed_blocks: list, num_tokens: int, held: int = 0
    ) -> bool:
        """True when admitting leaves a free block for each running request to grow into.

        Without this margin a newly admitted (or resumed) request is preempted again as soon
        as the running ones cross a block boundary, and two requests can evict each other
        step after step.
        """
        if not self.running:
            return True
        needed = -(-num_tokens // self.block_size) - len(computed_blocks) - held
        revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        free_after = self.kv_cache_manager.num_free_blocks - needed - revived
        return free_after >= len(self.running)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and put it back at the front of WAITING (recompute)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # -- after the model ran ----------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        for req_id, token_ids in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.status.finished or not token_ids:
                continue  # finished (or aborted) while this step ran: its token is dropped
            if request.num_output_placeholders:
                request.num_output_placeholders -= len(token_ids)
            guesses = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if guesses:
                # The runner keeps the guesses sampling confirmed, then one token of its own;
                # the KV of the others was computed from wrong tokens: compute it again.
                accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(guesses) - accepted
                self.num_spec_drafts += 1
                self.num_spec_draft_tokens += len(guesses)
                self.num_spec_accepted_tokens += accepted
                if request.guess_record is not None:
                    request.guess_record.record(len(guesses), accepted)
            elif request.guess_record is not None:
                request.guess_record.record_shadow(token_ids[0])
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    break
                if request.grammar is not None and not request.grammar.accept(token_id):
                    # The sampler masks every token the grammar forbids: this is a bug.
                    logger.error(
                        "request %s sampled token %d its grammar forbids", req_id, token_id
                    )
                    request.stop_reason = "grammar"
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    break
                if request.grammar is not None and request.grammar.is_terminated:
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    break
            logprobs = runner_output.logprobs.get(req_id)
            if logprobs is not None and len(logprobs.token_ids) > len(new_token_ids):
                logprobs = logprobs.head(len(new_token_ids))  # tokens past a stop are dropped
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=logprobs,
                    prompt_logprobs=runner_output.prompt_logprobs.get(req_id),
                    pooled=runner_output.pooled.get(req_id),
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    queue_time=self._queue_time(request, len(new_token_ids)),
                    kv_transfer_params=request.kv_transfer_params_out,
                )
            )
        return outputs

    @staticmethod
    def _queue_time(request: Request, num_new_tokens: int) -> float | None:
        """Seconds from arrival to first schedule, reported with the request's first tokens."""
        if request.num_output_tokens != num_new_tokens or request.first_scheduled_time is None:
            return None
        return max(0.0, request.first_scheduled_time - request.arrival_time)

    def _finishes_in_flight(self, request: Request) -> bool:
        """True when the tokens a step in flight samples will end the request by length: the
        next step would compute a token nobody reads. (A stop token cannot be foreseen; a
        request that meets one had a step more scheduled, whose token is dropped.)"""
        return (
            request.num_outputs_with_placeholders >= request.max_tokens
            or request.num_tokens_with_placeholders >= self.limits.max_model_len
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Move a request out of the queues, free its blocks and tell the runner next step."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_transfer.forget_pull(request)
        if status is not RequestStatus.FINISHED_ABORTED and self.kv_transfer.wants_pin(request):
            self.kv_transfer.pin(request)
        else:
            self.kv_cache_manager.free(request)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # -- KV transfer (disaggregated prefill/decode) -------------------------------------------

    def _park_for_pull(self, request: Request) -> bool | None:
        """Consumer: allocate blocks and start pulling the prompt's KV (True), or compute the
        prompt here (False: nothing to pull, or the producer's answer does not fit), or wait
        for room (None)."""
        kv = self.kv_cache_manager
        computed_blocks, num_cached = kv.get_computed_blocks(request)
        # Every prompt token but the last: computing that one yields the first token's logits.
        num_remote = request.num_prompt_tokens - 1 - num_cached
        if num_remote <= 0:
            self.kv_transfer.skip_pull(request)  # the prefix cache has it all
            return False
        problem = self.kv_transfer.pull_problem(request, num_cached + num_remote)
        if problem:
            self.kv_transfer.skip_pull(request, problem)
            return False
        if not self._leaves_headroom(request, computed_blocks, num_cached + num_remote):
            return None
        if kv.allocate_slots(request, num_remote, computed_blocks, num_cached, cache=False) is None:
            return None
        self.waiting.pop(request)
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = num_cached
        request.first_scheduled_time = time.monotonic()
        self.kv_transfer.park(request, num_cached, num_remote)
        return True

    def on_kv_event(self, event: KVEvent) -> None:
        """A worker finished a pull, or a consumer is done with a pin."""
        if isinstance(event, KVRelease):
            self.kv_transfer.unpin(event.transfer_id)
            return
        assert isinstance(event, KVRecvDone)
        request = self.kv_transfer.record_pull(event)
        if request is not None:
            self.waiting.prepend(request)

    def expire_kv(self, now: float) -> None:
        """Free pins nobody claimed in time; compute prompts whose pull never finished."""
        for request in self.kv_transfer.expire(now):
            self.waiting.prepend(request)

    # -- stats --------------------------------------------------------------------------------

    def make_stats(
        self, num_batched_tokens: int = 0, take_latencies: bool = True
    ) -> SchedulerStats:
        """The scheduler and its KV cache now; `take_latencies` hands over the pull times and
        the steps recorded since the last call."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_total_blocks=kv.num_total_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            kv_cache_usage_peak=kv.peak_usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            prompt_tokens_computed=self.num_computed_prompt_tokens,
            spec_decode_num_drafts=self.num_spec_drafts,
            spec_decode_num_draft_tokens=self.num_spec_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_spec_accepted_tokens,
            num_batched_tokens=num_batched_tokens,
            kv_pinned_blocks=self.kv_transfer.num_pinned_blocks,
            kv_pins_expired=self.kv_transfer.num_pins_expired,
            kv_received_bytes=self.kv_transfer.num_received_bytes,
            kv_transfer_fallbacks=self.kv_transfer.num_fallbacks,
            kv_transfer_latencies=self.kv_transfer.take_latencies() if take_latencies else [],
            running_lora_adapters=_count_adapters(self.running),
            waiting_lora_adapters=_count_adapters(self.waiting),
            steps=self._take_steps() if take_latencies else [],
        )

    def _take_steps(self) -> list[StepTime]:
        if not self._step_log:
            return []
        steps = list(self._step_log)
        self._step_log.clear()
        return steps


class _AdapterSlots:
    """The LoRA adapters of one step, capped at max_loras, first come first served.

    Every running request may compute in the next step, so the adapters of the running ones
    hold slots. A waiting request whose adapter is not among them takes a free slot if there
    is one; if not, it waits, and so does every later request of an adapter that is not
    running yet, but also every later request of a running one: otherwise a busy adapter
    would keep its slot forever and starve the one that asked first. Base-model requests use
    no slot and pass.
    """

    def __init__(self, max_loras: int | None, running: list[Request]) -> None:
        self.max_loras = max_loras
        self.held = {r.lora_request.lora_id for r in running if r.lora_request is not None}
        self.blocked = False

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        if self.blocked:
            return False
        if lora.lora_id in self.held or len(self.held) < self.max_loras:
            return True
        self.blocked = True  # the first to wait for a slot: nobody with an adapter overtakes
        return False

    def add(self, request: Request) -> None:
        if request.lora_request is not None:
            self.held.add(request.lora_request.lora_id)


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Adapter name -> how many of these requests run under it."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
    return counts


def _is_decoding(request: Request) -> bool:
    """True for a request past its prompt that needs one token computed (a decode)."""
    return (
        request.num_outputs_with_placeholders > 0
        and request.num_tokens_with_placeholders - request.num_computed_tokens == 1
    )
