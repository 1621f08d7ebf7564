"""POST /v1/completions: prompts in, text out, whole or as server-sent events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from tidegate.engine.entrypoints.openai.async_iterators import MergedIterators
from tidegate.engine.entrypoints.openai.disconnect import cancel_on_disconnect
from tidegate.engine.entrypoints.openai.engine_client import EngineClient
from tidegate.engine.entrypoints.openai.fan_out import (
    ChoiceState,
    build_sub_requests,
    request_ids,
    run_to_completion,
    start_generation,
    stream_chunks,
    usage,
)
from tidegate.engine.entrypoints.openai.logprobs import completion_logprobs
from tidegate.engine.entrypoints.openai.protocol import CompletionRequest
from tidegate.engine.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)
from tidegate.engine.entrypoints.openai.sse import EventStreamResponse, sse_events
from tidegate.engine.messages import LoRARequest
from tidegate.engine.outputs import Logprob, RequestOutput


class CompletionServing:
    """Runs completion requests against an engine."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def create(
        self,
        body: CompletionRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Response:
        """Validate every prompt x choice, then generate; streams when body.stream."""
        request_id, engine_id = request_ids("cmpl", http_request)
        params = body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs)
        subs = build_sub_requests(
            self.engine,
            engine_id,
            body.prompts(),
            params,
            body.n,
            body.cache_salt,
            body.kv_transfer_params,
            lora_request,
            tenant,
            body.priority,
        )
        header = CompletionResponse(
            id=request_id, created=int(time.time()), model=body.model, choices=[]
        )
        if body.stream:
            merged = await cancel_on_disconnect(http_request, start_generation(self.engine, subs))
            chunks = self._stream(body, header, merged, len(subs))
            return EventStreamResponse(sse_events(chunks), on_close=merged.aclose)

        states = await cancel_on_disconnect(http_request, run_to_completion(self.engine, subs))
        choices = [
            CompletionChoice(
                index=index,
                text=state.text,
                logprobs=self._logprobs(body, state.token_ids, state.logprobs, 0),
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
            )
            for index, state in enumerate(states)
        ]
        response = header.model_copy(
            update={
                "choices": choices,
                "usage": usage(states, body.n),
                "kv_transfer_params": states[0].kv_transfer_params,
            }
        )
        return JSONResponse(response.model_dump())

    def _logprobs(
        self,
        body: CompletionRequest,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob]],
        text_offset: int,
    ) -> CompletionLogprobs | None:
        if body.logprobs is None:
            return None
        return completion_logprobs(
            self.engine.tokenizer, token_ids, logprobs, body.logprobs, text_offset
        )

    def _stream(
        self,
        body: CompletionRequest,
        header: CompletionResponse,
        merged: MergedIterators[list[RequestOutput]],
        num_choices: int,
    ) -> AsyncIterator[list[CompletionResponse]]:
        states = [ChoiceState() for _ in range(num_choices)]
        text_offsets = [0] * num_choices

        def chunk(index: int, output: RequestOutput) -> list[CompletionResponse]:
            made = self._chunk(body, header, index, output, text_offsets)
            return [made] if made is not None else []

        def usage_chunk() -> CompletionResponse:
            return header.model_copy(update={"usage": usage(states, body.n)})

        return stream_chunks(merged, states, chunk, usage_chunk if body.include_usage else None)

    def _chunk(
        self,
        body: CompletionRequest,
        header: CompletionResponse,
        index: int,
        output: RequestOutput,
        text_offsets: list[int],
    ) -> CompletionResponse | None:
        """One delta as a chunk; None for a delta of no token (nothing happened).

        A step that made tokens but no text yet (a held-back stop-string prefix, or bytes of
        a character still incomplete) still gets its chunk, with empty text, as vLLM sends
        it: clients and benchmarks count chunks as tokens and time the gaps between them.
        """
        delta = output.outputs[0]
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return None
        logprobs = self._logprobs(body, delta.token_ids, delta.logprobs or [], text_offsets[index])
        if logprobs is not None:
            text_offsets[index] += sum(len(token) for token in logprobs.tokens)
        choice = CompletionChoice(
            index=index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        return header.model_copy(update={"choices": [choice]})
