"""POST /v1/chat/completions: a conversation through the chat template, a reply out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

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
from tidegate.engine.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_entries
from tidegate.engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tidegate.engine.entrypoints.openai.request_body import FieldError
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
from tidegate.engine.entrypoints.openai.tool_calls import ChoiceToolCalls, parser_factory
from tidegate.engine.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from tidegate.engine.messages import LoRARequest
from tidegate.engine.outputs import Logprob, RequestOutput
from tidegate.engine.tokenizer import Tokenizer


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """A conversation as text, through the model's chat template (ValueError if it refuses).

    `tools` (OpenAI's tool dicts) reach the template as Hugging Face passes them: always
    defined, None without tools. `template_kwargs` are more variables for the template.
    With `continue_final_message` the text ends where the final message's content does, so
    that the model continues it instead of closing the turn.
    """
    try:
        text = tokenizer.apply_chat_template(
            [m.for_template() for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **(template_kwargs or {}),
        )
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template could not render the conversation: {exc}") from exc
    return _cut_after_final_message(text, messages[-1]) if continue_final_message else text


def _cut_after_final_message(text: str, final: ChatMessage) -> str:
    """`text` up to the end of the final message's content (what follows closes the turn)."""
    content = final.content or ""
    # Templates often strip a message's surrounding whitespace: look for the stripped
    # content, and keep its leading and trailing whitespace where the text has them too.
    core = content.strip()
    start = text.rfind(core) if core else -1
    if start < 0:
        raise FieldError(
            "continue_final_message needs the final message's content in the rendered "
            "conversation, and this chat template does not write it there"
            if core
            else "continue_final_message needs a final message with content to continue",
            "continue_final_message",
        )
    end = start + len(core)
    trailing = content[len(content.rstrip()) :]
    if trailing and text.startswith(trailing, end):
        end += len(trailing)
    return text[:end]


def chat_prompt_token_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    """Token ids of a chat request's conversation as chat sends it to the engine."""
    text = render_chat(tokenizer, body.messages, **body.template_options())
    # The template writes BOS itself; encoding must not add a second one.
    return tokenizer.encode(text, add_special_tokens=False)


class ChatServing:
    """Runs chat completion requests against an engine.

    `tool_call_parser` (one of TOOL_PARSERS) reads outputs for calls under tool_choice "auto".
    """

    def __init__(self, engine: EngineClient, tool_call_parser: str | None = None) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser {tool_call_parser!r} is not known; "
                f"choose one of {', '.join(TOOL_PARSERS)}"
            )
        self.engine = engine
        self.tool_call_parser = tool_call_parser

    async def create(
        self,
        body: ChatCompletionRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Response:
        """Render, validate every choice, then generate; streams when body.stream."""
        request_id, engine_id = request_ids("chatcmpl", http_request)
        new_parser = parser_factory(body, self.tool_call_parser)
        token_ids = chat_prompt_token_ids(self.engine.tokenizer, body)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(
            max_tokens=body.output_limit, logprobs=num_top, prompt_logprobs=body.prompt_logprobs
        )
        subs = build_sub_requests(
            self.engine,
            engine_id,
            [token_ids],
            params,
            body.n,
            body.cache_salt,
            body.kv_transfer_params,
            lora_request,
            tenant,
            body.priority,
        )
        created = int(time.time())
        if body.stream:
            merged = await cancel_on_disconnect(http_request, start_generation(self.engine, subs))
            header = ChatCompletionChunk(
                id=request_id, created=created, model=body.model, choices=[]
            )
            calls = self._choice_calls(body, new_parser, len(subs))
            chunks = self._stream(body, header, merged, calls)
            return EventStreamResponse(sse_events(chunks), on_close=merged.aclose)

        states = await cancel_on_disconnect(http_request, run_to_completion(self.engine, subs))
        echoed = body.echoed_text()
        choices = []
        for index, (state, calls) in enumerate(
            zip(states, self._choice_calls(body, new_parser, len(states)), strict=True)
        ):
            message = AssistantMessage(content=state.text)
            finish_reason = state.finish_reason
            if calls is not None:
                message = calls.message(state.text)
                finish_reason = calls.finish_reason(finish_reason)
            if echoed:
                message.content = echoed + (message.content or "")
            choice = ChatChoice(
                index=index,
                message=message,
                logprobs=self._logprobs(body, state.token_ids, state.logprobs),
                finish_reason=finish_reason,
                stop_reason=state.stop_reason,
            )
            choices.append(choice)
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=body.model,
            choices=choices,
            usage=usage(states, body.n),
            kv_transfer_params=states[0].kv_transfer_params,
            prompt_logprobs=prompt_logprobs_entries(
                states[0].prompt_logprobs, body.prompt_logprobs
            ),
        )
        return JSONResponse(response.model_dump())

    @staticmethod
    def _choice_calls(
        body: ChatCompletionRequest,
        new_parser: Callable[[], ToolParser] | None,
        num_choices: int,
    ) -> list[ChoiceToolCalls | None]:
        """Each choice's own reader of calls (None each when tool_choice is none)."""
        if new_parser is None:
            return [None] * num_choices
        return [ChoiceToolCalls(new_parser(), body.parallel_tool_calls) for _ in range(num_choices)]

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
        calls: list[ChoiceToolCalls | None],
    ) -> AsyncIterator[list[ChatCompletionChunk]]:
        """The role of every choice (and what echo repeats) in one write, then the deltas as
        they come."""
        num_choices = len(calls)
        states = [ChoiceState() for _ in range(num_choices)]

        def chunk(index: int, output: RequestOutput) -> list[ChatCompletionChunk]:
            return self._chunks(body, header, index, output, calls[index])

        def usage_chunk() -> ChatCompletionChunk:
            return header.model_copy(update={"usage": usage(states, body.n)})

        deltas = stream_chunks(merged, states, chunk, usage_chunk if body.include_usage else None)
        try:
            first = [DeltaMessage(role="assistant", content="")]
            echoed = body.echoed_text()
            if echoed:
                first.append(DeltaMessage(content=echoed))
            yield [
                header.model_copy(update={"choices": [ChatStreamChoice(index=index, delta=delta)]})
                for index in range(num_choices)
                for delta in first
            ]
            async for chunks in deltas:
                yield chunks
        finally:
            await deltas.aclose()
            await merged.aclose()  # deltas closes it too, unless it never started

    def _chunks(
        self,
        body: ChatCompletionRequest,
        header: ChatCompletionChunk,
        index: int,
        output: RequestOutput,
        calls: ChoiceToolCalls | None,
    ) -> list[ChatCompletionChunk]:
        """One delta as chunks: none for a delta of no token, or for text a tool-call parser
        holds back (a call's prefix).

        Without calls, a step that made tokens but no text yet (a held-back stop-string
        prefix, bytes of an incomplete character) gets a chunk with empty content, as vLLM
        sends it: clients count chunks as tokens and time the gaps between them. With calls,
        a call's start and its arguments are chunks of their own; the delta's logprobs go with
        the first chunk, its finish_reason with the last.
        """
        delta = output.outputs[0]
        has_logprobs = body.logprobs and bool(delta.token_ids)
        finished = delta.finish_reason is not None
        finish_reason = delta.finish_reason
        if calls is None:
            if not delta.text and not delta.token_ids and not finished:
                return []
            messages = [DeltaMessage(content=delta.text or ("" if delta.token_ids else None))]
        else:
            messages = calls.deltas(delta.text, finished)
            finish_reason = calls.finish_reason(finish_reason)
            if not messages and not finished and not has_logprobs:
                return []
            messages = messages or [DeltaMessage()]
        choices = [ChatStreamChoice(index=index, delta=message) for message in messages]
        choices[0].logprobs = self._logprobs(body, delta.token_ids, delta.logprobs or [])
        choices[-1].finish_reason = finish_reason
        choices[-1].stop_reason = delta.stop_reason
        return [header.model_copy(update={"choices": [choice]}) for choice in choices]
