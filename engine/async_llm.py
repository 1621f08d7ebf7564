"""The serving API: submit a request, stream its outputs, from an asyncio program.

Tokenization, validation and detokenization happen here, in the API server process; the
scheduler and the model run in an EngineCore process reached through `EngineCoreClient`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import resolve_max_model_len
from tidegate.engine.core.messages import EngineCoreOutputs, EngineCoreRequest
from tidegate.engine.core.request import Request
from tidegate.engine.core_client import EngineCoreClient
from tidegate.engine.errors import EngineDeadError, EngineOverloadedError
from tidegate.engine.input_processor import InputProcessor, model_eos_token_ids
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.output_processor import OutputProcessor
from tidegate.engine.outputs import RequestOutput
from tidegate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One live request on the API side: its output queue and its timings."""

    num_prompt_tokens: int
    arrival_time: float
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    queue_time: float | None = None


class AsyncLLM:
    """Streams RequestOutput deltas for requests served by an engine core process."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        client: EngineCoreClient,
        max_model_len: int,
        metrics: PrometheusMetrics | None,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.client = client
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.input_processor = InputProcessor(
            tokenizer=tokenizer,
            vocab_size=model_config.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=model_eos_token_ids(model_config, tokenizer),
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._background: set[asyncio.Task] = set()
        self._output_task: asyncio.Task | None = None
        self.on_dead: Callable[[str], None] | None = None

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        max_waiting_requests: int | None = None,
        metrics: PrometheusMetrics | None = None,
    ) -> AsyncLLM:
        """Check the model folder here, start the engine core, and wait until it serves."""
        args.check_supported()
        model_config = ModelConfig.from_pretrained(args.model)
        model_config.check_tensor_parallel(args.tensor_parallel_size)
        resolve_max_model_len(args, model_config)  # a bad limit fails before any process starts
        tokenizer = Tokenizer(args.tokenizer or args.model)
        client = EngineCoreClient(args, max_waiting_requests=max_waiting_requests)
        holder: list[AsyncLLM] = []
        try:
            ready = await client.start(on_death=lambda reason: holder[0]._fail_all(reason))
        except BaseException:
            await client.shutdown()
            raise
        engine = cls(model_config, tokenizer, client, ready.max_model_len, metrics)
        holder.append(engine)
        engine._output_task = asyncio.create_task(engine._output_loop(), name="engine-outputs")
        return engine

    # -- what the HTTP layer uses -----------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.client.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    async def generate(
        self, request: Request, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a validated request and yield its deltas until it finishes.

        Closing the iterator early (the client went away) aborts the request in the engine.
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        request_id = request.request_id
        stream = _Stream(num_prompt_tokens=request.num_prompt_tokens, arrival_time=time.monotonic())
        self._streams[request_id] = stream
        self.output_processor.add_request(request, prompt, delta=True)
        finished = False
        try:
            await self.client.add_request(
                EngineCoreRequest(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    eos_token_ids=sorted(request.eos_token_ids),
                    arrival_time=stream.arrival_time,
                    cache_salt=request.cache_salt,
                )
            )
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot it (rejected or dead)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.output_processor.abort(request_id)
                self._record_finished(stream, "abort")
                self._in_background(self.client.abort_requests([request_id]))

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its iterator ends with finish_reason 'abort'."""
        output = self.output_processor.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None and output is not None:
            stream.queue.put_nowait(output)
            self._record_finished(stream, "abort")
        await self.client.abort_requests([request_id])

    async def shutdown(self) -> None:
        """Stop the engine core and its workers."""
        if self._output_task is not None:
            self._output_task.cancel()
        await self.client.shutdown()

    # -- the output loop --------------------------------------------------------------------

    async def _output_loop(self) -> None:
        """Route every engine output to its request's queue, and record metrics."""
        while True:
            outputs = await self.client.get_output()
            try:
                self._handle_outputs(outputs)
            except Exception:
                logger.exception("failed to process engine outputs")
                self.client.mark_dead("the API server could not process engine outputs")
                return

    def _handle_outputs(self, batch: EngineCoreOutputs) -> None:
        if batch.engine_dead is not None:
            self.client.mark_dead(f"the engine core failed: {batch.engine_dead}")
            return
        now = time.monotonic()
        if batch.scheduler_stats is not None and self.metrics is not None:
            self.metrics.record_scheduler_stats(batch.scheduler_stats)
        for request_id in batch.rejected_request_ids:
            self.output_processor.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(
                    EngineOverloadedError(
                        "the server's waiting queue is full "
                        f"(--max-waiting-requests {self.client.max_waiting_requests}); retry later"
                    )
                )
        for out in batch.outputs:
            stream = self._streams.get(out.req_id)
            if stream is not None:
                self._record_tokens(stream, len(out.new_token_ids), out.queue_time, now)
        request_outputs, to_abort = self.output_processor.process_outputs(batch.outputs)
        if to_abort:  # stopped by a stop string, which only the API side sees
            self._in_background(self.client.abort_requests(to_abort))
        for output in request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(output)
            if output.finished:
                self._record_finished(stream, output.outputs[0].finish_reason or "stop", now)

    def _record_tokens(
        self, stream: _Stream, num_new: int, queue_time: float | None, now: float
    ) -> None:
        if queue_time is not None:
            stream.queue_time = queue_time
        if num_new == 0:
            return
        if stream.first_token_time is None:
            stream.first_token_time = now
            if self.metrics is not None:
                self.metrics.record_first_token(now - stream.arrival_time)
                self.metrics.record_tokens(stream.num_prompt_tokens, 0)
        elif self.metrics is not None:
            self.metrics.record_inter_token(now - stream.last_token_time)
        stream.last_token_time = now
        stream.num_generation_tokens += num_new
        if self.metrics is not None:
            self.metrics.record_tokens(0, num_new)

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
        )

    def _fail_all(self, reason: str) -> None:
        """The engine is gone: every live request ends with EngineDeadError."""
        error = EngineDeadError(reason)
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        if self.on_dead is not None:
            self.on_dead(reason)

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
