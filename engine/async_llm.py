"""The serving API: submit a request, stream its outputs, from an asyncio program.

Tokenization, validation and detokenization happen here, in the API server process; the
scheduler and the model run in EngineCore processes (one per data-parallel rank), each
reached through its own `EngineCoreClient`; a `DataParallelRouter` picks one per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tidegate.engine.config import EngineArgs
from tidegate.engine.core.block_hash import append_block_hashes
from tidegate.engine.core.engine_core import resolve_max_model_len
from tidegate.engine.core_client import EngineCoreClient
from tidegate.engine.data_parallel import DataParallelRouter
from tidegate.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestRefusedError,
    RequestTimeoutError,
)
from tidegate.engine.input_processor import InputProcessor, model_eos_token_ids
from tidegate.engine.kv_events import KVEventPublisher
from tidegate.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
)
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.output_processor import OutputProcessor, RequestOutputCollector
from tidegate.engine.outputs import RequestOutput
from tidegate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One live request on the API side: its outputs waiting to be read, and its timings."""

    num_prompt_tokens: int
    arrival_time: float
    engine_index: int
    queue: RequestOutputCollector = field(default_factory=RequestOutputCollector)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    queue_time: float | None = None


class AsyncLLM:
    """Streams RequestOutput deltas for requests served by engine core processes."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        clients: list[EngineCoreClient],
        max_model_len: int,
        block_size: int,
        router: DataParallelRouter,
        metrics: PrometheusMetrics | None,
        kv_role: str = "none",
        request_timeout: float | None = None,
        scheduling_policy: str = "fcfs",
        dtype: str | None = None,
    ) -> None:
        self.model_config = model_config
        self.dtype = dtype  # the engine cores' (None where not told)
        self.kv_role = kv_role
        self.request_timeout = request_timeout
        self.tokenizer = tokenizer
        self.clients = clients
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.router = router
        self.metrics = metrics
        self.input_processor = InputProcessor(
            tokenizer=tokenizer,
            vocab_size=model_config.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=model_eos_token_ids(model_config, tokenizer),
            priority_scheduling=scheduling_policy == "priority",
            classifier=model_config.is_classifier,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._background: set[asyncio.Task] = set()
        self._output_tasks: list[asyncio.Task] = []
        self.on_dead: Callable[[str], None] | None = None
        # With --kv-events-port: every core's prefix-cache changes, for routers.
        self.kv_events: KVEventPublisher | None = None

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        max_waiting_requests: int | None = None,
        metrics: PrometheusMetrics | None = None,
        request_timeout: float | None = None,
        max_waiting_per_tenant: int | None = None,
    ) -> AsyncLLM:
        """Check the model folder here, start the engine cores, and wait until all serve."""
        model_config = ModelConfig.from_pretrained(args.model)
        model_config.check_tensor_parallel(args.tensor_parallel_size)
        model_config.check_pipeline_parallel(args.pipeline_parallel_size)
        resolve_max_model_len(args, model_config)  # a bad limit fails before any process starts
        tokenizer = Tokenizer(args.tokenizer or args.model)
        clients = [
            EngineCoreClient(
                args,
                engine_index=i,
                max_waiting_requests=max_waiting_requests,
                max_waiting_per_tenant=max_waiting_per_tenant,
            )
            for i in range(args.data_parallel_size_local)
        ]
        holder: list[AsyncLLM] = []

        def on_death(reason: str) -> None:
            if holder:
                holder[0]._fail_all(reason)

        try:
            # Every core finishes starting (or fails) before any is stopped.
            started = await asyncio.gather(
                *(client.start(on_death) for client in clients), return_exceptions=True
            )
            failure = next((r for r in started if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure
        except BaseException:  # a failed start, or cancelled (stopped while starting)
            await asyncio.gather(*(client.shutdown() for client in clients))
            raise
        readies = [r for r in started if isinstance(r, EngineCoreReady)]
        if metrics is not None:
            # cache_config_info is complete from the start, not from each core's first step.
            for ready in readies:
                metrics.record_kv_blocks(ready.num_kv_blocks, ready.engine_index)
        # Remember about as many prefix blocks per core as its KV cache holds.
        router = DataParallelRouter(
            len(clients), max_hashes_per_core=min(r.num_kv_blocks for r in readies)
        )
        max_model_len = min(r.max_model_len for r in readies)
        engine = cls(
            model_config,
            tokenizer,
            clients,
            max_model_len,
            args.block_size,
            router,
            metrics,
            kv_role=args.kv_role,
            request_timeout=request_timeout,
            scheduling_policy=args.scheduling_policy,
            dtype=readies[0].dtype,
        )
        holder.append(engine)
        if args.kv_events_port is not None:
            try:
                engine.kv_events = KVEventPublisher(args.kv_events_port)
            except OSError:
                await asyncio.gather(*(client.shutdown() for client in clients))
                raise
            if metrics is not None:
                metrics.record_kv_events_port(engine.kv_events.port)
        dead = next((c.dead_reason for c in clients if c.dead_reason is not None), None)
        if dead is not None:
            engine._fail_all(dead)
        engine._output_tasks = [
            asyncio.create_task(engine._output_loop(client), name=f"engine-outputs-{i}")
            for i, client in enumerate(clients)
        ]
        return engine

    # -- what the HTTP layer uses -----------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the first engine core to die died; None while all serve."""
        return next((c.dead_reason for c in self.clients if c.dead_reason is not None), None)

    async def generate(
        self, request: EngineCoreRequest, prompt: str | None = None
    ) -> AsyncIterator[list[RequestOutput]]:
        """Submit a validated request and yield its deltas until it finishes.

        Each item is every delta that arrived since the last (one per engine step, in order;
        several when the consumer fell behind), so that the consumer can write them at once.
        Closing the iterator early (the client went away) aborts the request in the engine,
        and so does --request-timeout running out, which raises RequestTimeoutError.
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        request_id = request.request_id
        stream = _Stream(
            num_prompt_tokens=len(request.prompt_token_ids),
            arrival_time=request.arrival_time,
            engine_index=self._route(request),
        )
        client = self.clients[stream.engine_index]
        self._streams[request_id] = stream
        self.output_processor.add_request(request, prompt, delta=True)
        finished = False
        try:
            await client.add_request(request)
            while True:
                outputs: list[RequestOutput] = []
                error: BaseException | None = None
                for item in await self._next_outputs(stream):
                    if isinstance(item, BaseException):
                        error = item
                        break
                    outputs.append(item)
                    if item.finished:
                        break
                if outputs:
                    finished = outputs[-1].finished
                    yield outputs
                    if finished:
                        return
                if error is not None:
                    finished = True  # the engine already forgot it (rejected or dead)
                    raise error
        finally:
            self._streams.pop(request_id, None)
            # Still tracked means still running: a request whose last output waits unread in
            # its queue has finished already, and was counted then.
            if not finished and self.output_processor.abort(request_id) is not None:
                self._record_finished(stream, "abort")
                self._in_background(client.abort_requests([request_id]))

    async def _next_outputs(self, stream: _Stream) -> list[RequestOutput | BaseException]:
        if self.request_timeout is None:
            return await stream.queue.get()
        deadline = stream.arrival_time + self.request_timeout  # the loop's clock is monotonic
        if time.monotonic() >= deadline:
            raise RequestTimeoutError(self.request_timeout)
        if stream.queue:
            return await stream.queue.get()  # ready: no timer (wait_for would start a task)
        try:
            async with asyncio.timeout_at(deadline):
                return await stream.queue.get()
        except TimeoutError:
            raise RequestTimeoutError(self.request_timeout) from None

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its iterator ends with finish_reason 'abort'."""
        output = self.output_processor.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None and output is not None:
            stream.queue.put(output)
            self._record_finished(stream, "abort")
        # A request this server no longer tracks may be anywhere: tell every core.
        clients = [self.clients[stream.engine_index]] if stream is not None else self.clients
        for client in clients:
            await client.abort_requests([request_id])

    async def shutdown(self) -> None:
        """Stop the engine cores and their workers."""
        for task in self._output_tasks:
            task.cancel()
        await asyncio.gather(*(client.shutdown() for client in self.clients))
        if self.kv_events is not None:
            self.kv_events.close()

    def _route(self, request: EngineCoreRequest) -> int:
        """The engine core for a request: by load, or by where its prefix blocks are."""
        if self.router.num_cores == 1:
            return 0
        # The KV cache manager's own hashes (cache_salt and adapter included), so equal means
        # cached.
        block_hashes: list[bytes] = []
        lora = request.lora_request
        append_block_hashes(
            block_hashes,
            request.prompt_token_ids,
            self.block_size,
            request.cache_salt,
            lora.digest if lora is not None else None,
        )
        return self.router.choose(block_hashes)

    # -- the output loop --------------------------------------------------------------------

    async def _output_loop(self, client: EngineCoreClient) -> None:
        """Route every output of one engine core to its request's queue, and record metrics."""
        while True:
            outputs = await client.get_output()
            try:
                self._handle_outputs(outputs)
            except Exception:
                logger.exception("failed to process engine outputs")
                client.mark_dead("the API server could not process engine outputs")
                return

    def _overloaded(self, request_ids: list[str], message: str) -> None:
        """Requests an engine core refused at admission: each stream raises a 429's error."""
        for request_id in request_ids:
            self.output_processor.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put(EngineOverloadedError(message))

    def _handle_outputs(self, batch: EngineCoreOutputs) -> None:
        client = self.clients[batch.engine_index]
        if batch.engine_dead is not None:
            client.mark_dead(
                f"engine core {batch.engine_index} failed: {batch.engine_dead}"
                if len(self.clients) > 1
                else f"the engine core failed: {batch.engine_dead}"
            )
            return
        now = time.monotonic()
        if batch.kv_events and self.kv_events is not None:
            self.kv_events.publish(batch.engine_index, batch.kv_events)
        if batch.scheduler_stats is not None:
            self.router.record_stats(batch.engine_index, batch.scheduler_stats)
            if self.metrics is not None:
                self.metrics.record_scheduler_stats(batch.scheduler_stats, batch.engine_index)
        if batch.rejected_request_ids:
            self._overloaded(
                batch.rejected_request_ids,
                "the server's waiting queue is full "
                f"(--max-waiting-requests {client.max_waiting_requests}); retry later",
            )
        if batch.rejected_tenant_request_ids:
            self._overloaded(
                batch.rejected_tenant_request_ids,
                "this tenant's waiting requests are at its limit "
                f"(--max-waiting-per-tenant {client.max_waiting_per_tenant}); retry later",
            )
        outputs = batch.outputs
        if any(out.error is not None for out in outputs):
            outputs = self._refuse([out for out in outputs if out.error is not None], outputs)
        num_generated = 0
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is not None:
                # A pooling request's one token only ends it: it was not generated.
                generated = 0 if out.pooled is not None else len(out.new_token_ids)
                self._record_tokens(stream, len(out.new_token_ids), generated, out.queue_time, now)
                num_generated += generated
        if num_generated and self.metrics is not None:  # one count per step, not per request
            self.metrics.record_tokens(0, num_generated, batch.engine_index)
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:  # stopped by a stop string, which only the API side sees
            self._in_background(client.abort_requests(to_abort))
        for output in request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.queue.put(output)
            if output.finished:
                self._record_finished(stream, output.outputs[0].finish_reason or "stop", now)

    def _refuse(
        self, refused: list[EngineCoreOutput], outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """Fail the streams of requests the engine refused; the other outputs."""
        for out in refused:
            self.output_processor.abort(out.req_id)
            stream = self._streams.get(out.req_id)
            if stream is not None:
                stream.queue.put(RequestRefusedError(out.error))
                self._record_finished(stream, "error")
        return [out for out in outputs if out.error is None]

    def _record_tokens(
        self,
        stream: _Stream,
        num_new: int,
        generated: int,
        queue_time: float | None,
        now: float,
    ) -> None:
        """Timings of a request's `num_new` tokens, of which `generated` count as generated."""
        if queue_time is not None:
            stream.queue_time = queue_time
        if num_new == 0:
            return
        if stream.first_token_time is None:
            stream.first_token_time = now
            if self.metrics is not None:
                self.metrics.record_first_token(now - stream.arrival_time, stream.engine_index)
                self.metrics.record_tokens(stream.num_prompt_tokens, 0, stream.engine_index)
        elif self.metrics is not None:
            self.metrics.record_inter_token(now - stream.last_token_time, stream.engine_index)
        stream.last_token_time = now
        stream.num_generation_tokens += generated

    def _record_finished(self, stream: _Stream, reason: str, now: float | None = None) -> None:
        if self.metrics is None:
            return
        now = time.monotonic() if now is None else now
        self.metrics.record_finished(
            finish_reason=reason,
            e2e_s=now - stream.arrival_time,
            queue_time_s=stream.queue_time,
            prompt_tokens=stream.num_prompt_tokens,
            generation_tokens=stream.num_generation_tokens,
            engine=stream.engine_index,
        )

    def _fail_all(self, reason: str) -> None:
        """The engine is gone: every live request ends with EngineDeadError."""
        error = EngineDeadError(reason)
        for stream in self._streams.values():
            stream.queue.put(error)
        if self.on_dead is not None:
            self.on_dead(reason)

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
