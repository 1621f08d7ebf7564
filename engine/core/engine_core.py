"""EngineCore: the scheduler, the KV cache manager and the model runner, stepped together."""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import msgspec

from tidegate.engine.config import DEFAULT_LONG_PREFILL_STEP_SLACK, EngineArgs
from tidegate.engine.core.chunk_tuner import StepMix
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request, RequestStatus
from tidegate.engine.core.request_grammar import GrammarCompiler
from tidegate.engine.core.scheduler import Scheduler
from tidegate.engine.core.step_budget import StepLimits
from tidegate.engine.executor.abstract import Executor
from tidegate.engine.kv_transfer.base import KVConnectorScheduler, create_scheduler_connector
from tidegate.engine.messages import (
    CacheEvent,
    EngineCoreOutput,
    EngineCoreRequest,
    KVEvent,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.model.dtypes import with_auto_dtype

logger = logging.getLogger(__name__)


def resolve_max_model_len(args: EngineArgs, model_config: ModelConfig) -> int:
    """The engine's context limit: the flag, else the model's, never more than the model's."""
    model_limit = model_config.max_model_len
    if args.max_model_len is None:
        return model_limit
    if args.max_model_len > model_limit:
        raise ValueError(
            f"max_model_len {args.max_model_len:,} exceeds this model's limit of "
            f"{model_limit:,} tokens (max_position_embeddings or sliding window)"
        )
    return args.max_model_len


def resolve_step_limits(args: EngineArgs, max_model_len: int) -> StepLimits:
    """Scheduler limits from the engine args, with vLLM's default chunk threshold."""
    adaptive = args.long_prefill_token_threshold == "auto"
    threshold = 0 if adaptive else int(args.long_prefill_token_threshold)
    if threshold == 0 and not adaptive and args.max_num_partial_prefills > 1:
        # Several concurrent partial prefills only make sense with a per-request cap.
        threshold = max(1, int(max_model_len * 0.04))
    return StepLimits(
        max_num_batched_tokens=args.step_token_capacity(max_model_len),
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        max_model_len=max_model_len,
        phased=args.step_composition == "phased",
        adaptive_chunking=adaptive,
        adaptive_slack=(
            args.long_prefill_step_slack
            if args.long_prefill_step_slack is not None
            else DEFAULT_LONG_PREFILL_STEP_SLACK
        ),
        adaptive_step_s=(
            args.long_prefill_step_ms / 1000 if args.long_prefill_step_ms is not None else None
        ),
        max_loras=args.max_loras if args.enable_lora else None,
        policy=args.scheduling_policy,
        max_running_per_tenant=args.max_running_per_tenant,
    )


def default_executor_class(args: EngineArgs) -> type[Executor]:
    """uni: the one worker runs in this process; mp: one worker process per rank.

    The same choice as vLLM V1's at world size 1: in-process saves a serialization and a
    shared-memory round trip per step (benchmarks/results/executor_backend_small.json).
    """
    if args.executor_backend == "mp":
        from tidegate.engine.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    from tidegate.engine.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


class EngineCore:
    """One engine instance: add requests, abort them, and step."""

    def __init__(
        self,
        args: EngineArgs,
        executor_class: type[Executor] | None = None,
        engine_index: int = 0,
    ) -> None:
        model_config = ModelConfig.from_pretrained(args.model)
        model_config.check_tensor_parallel(args.tensor_parallel_size)
        model_config.check_pipeline_parallel(args.pipeline_parallel_size)
        # The workers get the dtype auto picks here, for this machine (model/dtypes.py).
        args = with_auto_dtype(args, model_config)
        self.args = args
        self.max_model_len = resolve_max_model_len(args, model_config)
        self.model_config = model_config
        if executor_class is None:
            executor_class = default_executor_class(args)
        self.kv_connector: KVConnectorScheduler | None = None
        if args.kv_role != "none":
            self.kv_connector = create_scheduler_connector(args, engine_index)
        kv_config = self.kv_connector.worker_config() if self.kv_connector else None
        try:
            self.executor = executor_class(args, model_config, self.max_model_len, kv_config)
        except BaseException:
            if self.kv_connector is not None:
                self.kv_connector.shutdown()
            raise
        try:
            num_blocks = self.executor.num_kv_blocks()
            if num_blocks * args.block_size < self.max_model_len:
                raise ValueError(
                    f"the KV cache holds {num_blocks * args.block_size:,} tokens ({num_blocks} "
                    f"blocks of {args.block_size}), fewer than max_model_len "
                    f"{self.max_model_len:,}; raise num_gpu_blocks or kv_cache_memory, or lower "
                    "max_model_len"
                )
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=args.block_size,
            enable_caching=args.enable_prefix_caching,
            # Routers learn which blocks this core holds from these (engine/kv_events.py).
            record_events=args.kv_events_port is not None and args.enable_prefix_caching,
        )
        # Structured outputs: the grammar library loads on the first constrained request.
        self.grammar = GrammarCompiler(
            args.structured_outputs_backend,
            args.tokenizer or args.model,
            model_config.vocab_size,
            model_config.eos_token_ids,
            max_cached_grammars=args.max_cached_grammars,
        )
        # Steps that may be in flight at once: with pipeline stages, one per stage (each a
        # micro-batch of its own requests); with async scheduling, the running one and the
        # next; else one.
        self.max_in_flight = 1
        if args.pipeline_parallel_size > 1 and args.pipeline_micro_batching:
            self.max_in_flight = args.pipeline_parallel_size
        elif args.async_scheduling:
            self.max_in_flight = 2
        self.scheduler = Scheduler(
            resolve_step_limits(args, self.max_model_len),
            self.kv_cache_manager,
            kv_connector=self.kv_connector,
            kv_transfer_timeout=args.kv_transfer_timeout,
            world_size=args.tensor_parallel_size,
            async_scheduling=self.max_in_flight > 1,
            grammar=self.grammar,
            defer_grammar_bitmask=self.executor.takes_deferred_grammar_bitmask,
            pipeline_parallel_size=args.pipeline_parallel_size,
            micro_batches=self.max_in_flight if args.pipeline_parallel_size > 1 else 1,
            speculative=args.speculative_config,
        )
        # The step whose results the last step() applied (None: it applied none).
        self.last_scheduler_output: SchedulerOutput | None = None
        # Async scheduling: steps started and not yet applied, oldest first, each with its
        # mix of decodes and prompt tokens (for the chunk tuner), and when the last one
        # applied had its result (a step runs from then, or from its start, to its result).
        self._in_flight: deque[tuple[SchedulerOutput, StepMix, Future[ModelRunnerOutput]]] = deque()
        self._last_result_time = 0.0
        # KV events arrive on the connector's thread; the loop applies them between steps.
        self._kv_events: queue.SimpleQueue[KVEvent] = queue.SimpleQueue()
        # Called (from that thread) after an event is queued: wakes an idle loop.
        self.kv_wakeup: Callable[[], None] | None = None
        # The last step ran nothing while pulls were in flight: wait for an event, not spin.
        self._stalled = False
        if self.kv_connector is not None:
            self.kv_connector.start(self.executor.kv_data_ports(), self._on_kv_event)
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
            args.model,
            self.executor.describe(),
            num_blocks,
            args.block_size,
            self.max_model_len,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; it joins the batch at the next step."""
        self.scheduler.add_request(Request.from_engine_core_request(request))
        self._stalled = False

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests now and free their KV blocks."""
        self.scheduler.abort_requests(request_ids)
        self._stalled = False
        self._flush_kv()

    def has_unfinished_requests(self) -> bool:
        """True when a step would make progress (pulls in flight and grammars compiling wait
        for their events)."""
        if self._in_flight or self.scheduler.has_error_outputs:
            return True
        return self.scheduler.has_unfinished_requests() and not self._stalled

    def wake(self) -> None:
        """Something a stalled engine waits for happened (a grammar compiled): step again."""
        self._stalled = False

    def waits_for_grammar(self) -> bool:
        """True while a waiting request's grammar compiles."""
        return self.scheduler.num_waiting_for_grammar > 0

    def wait_for_grammars(self, timeout: float | None = None) -> None:
        """Block until a waiting request's grammar has compiled (or failed); offline use."""
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = [
            r.grammar.compiled
            for r in self.scheduler.waiting
            if r.status is RequestStatus.WAITING_FOR_GRAMMAR
        ]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        self._stalled = False

    def has_pending_kv(self) -> bool:
        """True while pulls are in flight or blocks are pinned for consumers."""
        return self.scheduler.kv_transfer.has_pending()

    def kv_timeout(self) -> float | None:
        """Seconds until a pin or a pull times out; None when nothing can."""
        deadline = self.scheduler.kv_transfer.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _on_kv_event(self, event: KVEvent) -> None:
        self._kv_events.put(event)
        if self.kv_wakeup is not None:
            self.kv_wakeup()

    def process_kv_events(self) -> bool:
        """Apply KV events and timeouts, tell workers and producers; True if any happened."""
        if self.kv_connector is None:
            return False
        changed = False
        while True:
            try:
                event = self._kv_events.get_nowait()
            except queue.Empty:
                break
            self.scheduler.on_kv_event(event)
            changed = True
        deadline = self.scheduler.kv_transfer.next_deadline()
        if deadline is not None and deadline <= time.monotonic():
            self.scheduler.expire_kv(time.monotonic())
            changed = True
        if changed:
            self._stalled = False
            self._flush_kv()
        return changed

    def _flush_kv(self) -> None:
        """Pins and unpins to the workers (before any later step), notices to producers."""
        if self.kv_connector is None:
            return
        pin, unpin = self.scheduler.kv_transfer.take_pin_updates()
        if pin or unpin:
            self.executor.update_kv_pins(pin, unpin)
        for params in self.scheduler.kv_transfer.take_releases():
            self.kv_connector.release_remote(params)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and apply the results.

        With async scheduling a call plans and starts the next step, then applies the
        oldest step still running once two are started (or nothing new could be planned):
        the model is never idle waiting for the scheduler, and the outputs of step N go out
        while step N+1 runs.
        """
        step_started = time.perf_counter()
        self.process_kv_events()
        scheduler_output = self.scheduler.schedule()
        if self.max_in_flight > 1:
            outputs = self._step_async(scheduler_output)
        else:
            # Kept for metrics (tokens per iteration) and for tests that inspect the schedule.
            self.last_scheduler_output = scheduler_output
            started = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            # The chunk tuner learns the model's time; the step metrics get the whole step's,
            # planning and applying included: what a stream waits between two tokens.
            self.scheduler.record_step_time(time.perf_counter() - started)
            if scheduler_output.is_empty:
                self._check_progress()
                outputs = []
            else:
                outputs = self._apply(scheduler_output, runner_output)
                self.scheduler.record_step(time.perf_counter() - step_started)
        refused = self.scheduler.take_error_outputs()
        return refused + outputs if refused else outputs

    def _step_async(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        self.last_scheduler_output = None
        was_idle = not self._in_flight
        # An empty plan reaches the workers only if it finishes requests or pulls KV.
        if not so.is_empty or so.finished_req_ids or so.kv_connector_metadata is not None:
            if was_idle:
                self._last_result_time = time.perf_counter()
            mix = self.scheduler.last_mix
            self._in_flight.append((so, mix, self.executor.execute_model_async(so)))
        elif was_idle:
            self.last_scheduler_output = so
            self._check_progress()
            return []
        if len(self._in_flight) < self.max_in_flight and not so.is_empty:
            return []  # plan the next step while this one runs
        outputs = self._apply_oldest()
        if so.is_empty:
            # Nothing new could be planned: apply what runs, and plan again from there.
            outputs.extend(self.drain())
            if was_idle:
                self._check_progress()
        return outputs

    def _apply_oldest(self) -> list[EngineCoreOutput]:
        scheduler_output, mix, future = self._in_flight.popleft()
        runner_output = future.result()
        now = time.perf_counter()
        # It ran from when the step before it returned (or from its start) until now.
        self.scheduler.record_step_time(now - self._last_result_time, mix)
        self.scheduler.record_step(now - self._last_result_time, mix)
        self._last_result_time = now
        self.last_scheduler_output = scheduler_output
        outputs = [] if scheduler_output.is_empty else self._apply(scheduler_output, runner_output)
        self._deliver_grammar_bitmask()
        return outputs

    def _deliver_grammar_bitmask(self) -> None:
        """The step now oldest in flight was planned before this one's tokens were known: its
        constrained rows wait for their bitmask, which the matchers can give now."""
        if not self._in_flight:
            return
        grammar = self._in_flight[0][0].grammar
        # The message stays as planned (an in-process worker reads this very object): each
        # step that waits for a bitmask becomes the oldest in flight exactly once, here.
        if grammar is not None and grammar.bitmask is None:
            self.executor.deliver_grammar_bitmask(self.scheduler.fill_grammar_bitmask(grammar))

    def _check_progress(self) -> None:
        """After a step with nothing to run: wait for pulls, or fail rather than spin."""
        if self.scheduler.num_pulling or (
            self.scheduler.num_waiting_for_grammar and not self.scheduler.num_running
        ):
            # Room comes back when a pull finishes; a request starts when its grammar compiles.
            self._stalled = True
        elif self.scheduler.num_waiting and not self.scheduler.num_running:
            # Nothing runs and nothing can start: looping again would hang the caller.
            raise RuntimeError(
                f"{self.scheduler.num_waiting} waiting request(s) cannot be scheduled "
                f"({self.kv_cache_manager.num_free_blocks} free KV blocks)"
            )

    def _apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        # Pins reach the workers before the outputs naming them reach anyone.
        self._flush_kv()
        return outputs

    def drain(self) -> list[EngineCoreOutput]:
        """Apply every step still running (async scheduling); their outputs."""
        outputs: list[EngineCoreOutput] = []
        while self._in_flight:
            outputs.extend(self._apply_oldest())
        return outputs

    def shutdown(self) -> None:
        """Stop the workers and the KV connector."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
        grammar = getattr(self, "grammar", None)
        if grammar is not None:
            grammar.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def take_cache_events(self) -> list[CacheEvent]:
        """How the prefix cache changed since the last call (empty unless recording)."""
        events = self.kv_cache_manager.block_pool.events
        return events.take() if events is not None else []

    def scheduler_stats(self, num_batched_tokens: int = 0) -> SchedulerStats:
        """The stats message the API server turns into metrics."""
        return self.scheduler.make_stats(num_batched_tokens)

    def stats(self) -> dict[str, float]:
        """Counters users and metrics read: blocks, prefix cache, preemptions, queue sizes."""
        # The same counters as scheduler_stats(), which alone hands over the pull latencies.
        stats = msgspec.structs.asdict(self.scheduler.make_stats(take_latencies=False))
        del stats["num_batched_tokens"], stats["kv_transfer_latencies"], stats["steps"]
        stats["num_computed_prompt_tokens"] = stats.pop("prompt_tokens_computed")
        stats["num_steps"] = self.scheduler.num_steps
        stats["num_pulling"] = self.scheduler.num_pulling
        return stats
