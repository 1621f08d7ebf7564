"""POST /v1/chat/completions: a conversation through the chat template, a reply out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import jinja2
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
from tidegate.engine.entrypoints.openai.logprobs import chat_logprobs
from tidegate.engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tidegate.engine.entrypoints.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
)
from tidegate.engine.entrypoints.openai.sse import EventStreamResponse, sse_events
from tidegate.engine.messages import LoRARequest
from tidegate.engine.outputs import Logprob, RequestOutput
from tidegate.engine.tokenizer import Tokenizer


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> str:
    """A conversation as text, through the model's chat template (ValueError if it refuses)."""
    try:
        return tokenizer.apply_chat_template(
            [m.for_template() for m in messages], add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template could not render the conversation: {exc}") from exc


def chat_prompt_token_ids(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of a conversation as chat sends it to the engine."""
    # The template writes BOS itself; encoding must not add a second one.
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)


class ChatServing:
    """Runs chat completion requests against an engine."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def create(
        self,
        body: ChatCompletionRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
    ) -> Response:
        """Render, validate every choice, then generate; streams when body.stream."""
        request_id, engine_id = request_ids("chatcmpl", http_request)
        token_ids = chat_prompt_token_ids(self.engine.tokenizer, body.messages)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens=body.output_limit, logprobs=num_top)
        subs = build_sub_requests(
            self.engine,
            engine_id,
            [token_ids],
            params,
            body.n,
            body.cache_salt,
            body.kv_transfer_params,
            lora_request,
        )
        created = int(time.time())
        if body.stream:
            merged = await cancel_on_disconnect(http_request, start_generation(self.engine, subs))
            header = ChatCompletionChunk(
                id=request_id, created=created, model=body.model, choices=[]
            )
            chunks = self._stream(body, header, merged, len(subs))
            return EventStreamResponse(sse_events(chunks), on_close=merged.aclose)

        states = await cancel_on_disconnect(http_request, run_to_completion(self.engine, subs))
        choices = [
            ChatChoice(
                index=index,
                message=AssistantMessage(content=state.text),
                logprobs=self._logprobs(body, state.token_ids, state.logprobs),
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
            )
            for index, state in enumerate(states)
        ]
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=body.model,
            choices=choices,
            usage=usage(states, body.n),
            kv_transfer_params=states[0].kv_transfer_params,
        )
        return JSONResponse(response.model_dump())

    def _logprobs(
        self,
        body: ChatCompletionRequest,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob]],
    ) -> ChatLogprobs | None:
        if not body.logprobs:
            return None
        return chat_logprobs(self.engine.tokenizer, token_ids, logprobs, body.top_logprobs or 0)

    async def _stream(
        self,
        body: ChatCompletionRequest,
        header: ChatCompletionChunk,
        merged: MergedIterators[list[RequestOutput]],
        num_choices: int,
    ) -> AsyncIterator[list[ChatCompletionChunk]]:
        """The role of every choice in one write, then the deltas as they come."""
        states = [ChoiceState() for _ in range(num_choices)]

        def chunk(index: int, output: RequestOutput) -> ChatCompletionChunk | None:
            return self._chunk(body, header, index, output)

        def usage_chunk() -> ChatCompletionChunk:
            return header.model_copy(update={"usage": usage(states, body.n)})

        deltas = stream_chunks(merged, states, chunk, usage_chunk if body.include_usage else None)
        try:
            role = DeltaMessage(role="assistant", content="")
            yield [
                header.model_copy(update={"choices": [ChatStreamChoice(index=index, delta=role)]})
                for index in range(num_choices)
            ]
            async for chunks in deltas:
                yield chunks
        finally:
            await deltas.aclose()
            await merged.aclose()  # deltas closes it too, unless it never started

    def _chunk(
        self,
        body: ChatCompletionRequest,
        header: ChatCompletionChunk,
        index: int,
        output: RequestOutput,
    ) -> ChatCompletionChunk | None:
        """One delta as a chunk; None for a held-back stop-string prefix (nothing to show)."""
        delta = output.outputs[0]
        has_logprobs = body.logprobs and bool(delta.token_ids)
        if not delta.text and delta.finish_reason is None and not has_logprobs:
            return None
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=self._logprobs(body, delta.token_ids, delta.logprobs or []),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        return header.model_copy(update={"choices": [choice]})
