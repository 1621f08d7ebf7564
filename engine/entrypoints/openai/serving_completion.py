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
from tidegate.engine.entrypoints.openai.logprobs import (
    completion_logprobs,
    prompt_logprobs_entries,
)
from tidegate.engine.entrypoints.openai.protocol import CompletionRequest
from tidegate.engine.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from tidegate.engine.entrypoints.openai.sse import EventStreamResponse, sse_events
from tidegate.engine.messages import LoRARequest
from tidegate.engine.outputs import CompletionOutput, Logprob, RequestOutput


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
        params = body.sampling_params(
            max_tokens=1 if body.echo_only else body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=body.num_prompt_logprobs,
        )
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
        if body.echo_only:
            for state in states:
                state.text_parts, state.token_ids, state.logprobs = [], [], []
                state.finish_reason, state.stop_reason = "length", None
        choices = [
            CompletionChoice(
                index=index,
                text=self._echo(body, state) + state.text,
                logprobs=self._logprobs(body, state.token_ids, state.logprobs, state),
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
                prompt_logprobs=prompt_logprobs_entries(
                    state.prompt_logprobs, body.prompt_logprobs
                ),
            )
            for index, state in enumerate(states)
        ]
        response = header.model_copy(
            update={
                "choices": choices,
                "usage": self._usage(body, states),
                "kv_transfer_params": states[0].kv_transfer_params,
            }
        )
        return JSONResponse(response.model_dump())

    def _echo(self, body: CompletionRequest, prompt: ChoiceState | RequestOutput) -> str:
        """The prompt's text when echo asks for it: as given, or decoded from its ids."""
        if not body.echo:
            return ""
        if prompt.prompt is not None:
            return prompt.prompt
        return self.engine.tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)

    def _logprobs(
        self,
        body: CompletionRequest,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob]],
        echoed: ChoiceState | RequestOutput | None = None,
        text_offset: int = 0,
    ) -> CompletionLogprobs | None:
        """The tokens' logprobs; with echo, those of `echoed`'s prompt tokens first."""
        if body.logprobs is None:
            return None
        tokenizer = self.engine.tokenizer
        result = None
        if body.echo and echoed is not None:
            prompt_ids = echoed.prompt_token_ids
            # The first prompt token has none (nothing predicts it): listed with null.
            prompt_logprobs = echoed.prompt_logprobs or [None] * len(prompt_ids)
            result = completion_logprobs(
                tokenizer, prompt_ids, prompt_logprobs, body.logprobs, text_offset
            )
            text_offset += sum(len(token) for token in result.tokens)
        return completion_logprobs(
            tokenizer, token_ids, logprobs, body.logprobs, text_offset, result
        )

    @staticmethod
    def _usage(body: CompletionRequest, states: Sequence[ChoiceState]) -> Usage:
        counts = usage(states, body.n)
        if not body.echo_only:
            return counts
        # The token sampled to end each prompt was never returned.
        return counts.model_copy(
            update={"completion_tokens": 0, "total_tokens": counts.prompt_tokens}
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
        # Echo prepends the prompt to each choice's first chunk.
        echo_pending = [bool(body.echo)] * num_choices

        def chunk(index: int, output: RequestOutput) -> list[CompletionResponse]:
            made = self._chunk(body, header, index, output, text_offsets, echo_pending)
            return [made] if made is not None else []

        def usage_chunk() -> CompletionResponse:
            return header.model_copy(update={"usage": self._usage(body, states)})

        return stream_chunks(merged, states, chunk, usage_chunk if body.include_usage else None)

    def _chunk(
        self,
        body: CompletionRequest,
        header: CompletionResponse,
        index: int,
        output: RequestOutput,
        text_offsets: list[int],
        echo_pending: list[bool],
    ) -> CompletionResponse | None:
        """One delta as a chunk; None for a delta of no token (nothing happened).

        A step that made tokens but no text yet (a held-back stop-string prefix, or bytes of
        a character still incomplete) still gets its chunk, with empty text, as vLLM sends
        it: clients and benchmarks count chunks as tokens and time the gaps between them.
        """
        delta = output.outputs[0]
        if body.echo_only:  # the prompt alone: its one sampled token is dropped
            done = "length" if delta.finish_reason is not None else None
            delta = CompletionOutput(index=0, text="", token_ids=[], finish_reason=done)
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return None
        echoed = output if echo_pending[index] else None
        echo_pending[index] = False
        logprobs = self._logprobs(
            body, delta.token_ids, delta.logprobs or [], echoed, text_offsets[index]
        )
        if logprobs is not None:
            text_offsets[index] += sum(len(token) for token in logprobs.tokens)
        choice = CompletionChoice(
            index=index,
            text=(self._echo(body, output) if echoed else "") + delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            prompt_logprobs=prompt_logprobs_entries(output.prompt_logprobs, body.prompt_logprobs),
        )
        return header.model_copy(update={"choices": [choice]})
