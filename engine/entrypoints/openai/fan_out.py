"""One API request, many engine requests: every prompt x choice is checked, submitted, merged.

Choice `prompt_index * n + i` of the response is engine request `<id>-<prompt_index>-<i>`.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request as HTTPRequest

from tidegate.engine.entrypoints.openai.async_iterators import (
    MergedIterators,
    aclose_all,
    first_items,
    merge_async_iterators,
)
from tidegate.engine.entrypoints.openai.engine_client import EngineClient
from tidegate.engine.entrypoints.openai.responses import PromptTokensDetails, Usage
from tidegate.engine.kv_transfer.params import (
    KVTransferParams,
    RemoteDecode,
    parse_kv_transfer_params,
)
from tidegate.engine.messages import EngineCoreRequest, LoRARequest
from tidegate.engine.outputs import Logprob, RequestOutput
from tidegate.engine.sampling_params import SEED_RANGE, SamplingParams

C = TypeVar("C")

# What an X-Request-Id may look like to be used in ids (and logs) as it is.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class SubRequest:
    """One engine request of an API request."""

    index: int  # the choice index in the response
    request: EngineCoreRequest
    prompt: str | None  # the prompt text, when the client sent text


def build_sub_requests(
    engine: EngineClient,
    request_id: str,
    prompts: Sequence[str | list[int]],
    params: SamplingParams,
    n: int,
    cache_salt: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    lora_request: LoRARequest | None = None,
    tenant: str | None = None,
    priority: int = 0,
) -> list[SubRequest]:
    """Check every prompt x choice (raising ValueError) before anything reaches the engine.

    max_tokens None means "up to the context limit"; with a seed, choice i samples with
    seed + i (wrapping around within the seed range) so that the n choices differ yet the
    response is reproducible.
    """
    kv_transfer = check_kv_transfer(engine, kv_transfer_params, len(prompts) * n)
    subs = []
    for prompt_index, prompt in enumerate(prompts):
        token_ids = engine.input_processor.prompt_token_ids(prompt)
        prompt_params = params
        if params.max_tokens is None:
            room = max(1, engine.max_model_len - len(token_ids))
            prompt_params = dataclasses.replace(params, max_tokens=room)
        for choice in range(n):
            choice_params = prompt_params
            if params.seed is not None:
                seed = (params.seed + choice) % SEED_RANGE
                choice_params = dataclasses.replace(prompt_params, seed=seed)
            request = engine.input_processor.process(
                f"{request_id}-{prompt_index}-{choice}",
                token_ids,
                choice_params,
                cache_salt,
                kv_transfer,
                lora_request,
                tenant,
                priority,
            )
            text = prompt if isinstance(prompt, str) else None
            subs.append(SubRequest(prompt_index * n + choice, request, text))
    return subs


def request_ids(prefix: str, http_request: HTTPRequest) -> tuple[str, str]:
    """The response's id and the base of its engine request ids.

    A caller's `X-Request-Id` (the router sends the same one to the prefill and the decode
    instance) names the response; the engine ids get a random part too, so that two requests
    sent with the same header never collide inside the engine.
    """
    given = http_request.headers.get("x-request-id", "")
    if given and _REQUEST_ID.fullmatch(given):
        response_id = f"{prefix}-{given}"
        return response_id, f"{response_id}-{uuid.uuid4().hex[:8]}"
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    return response_id, response_id


def check_kv_transfer(
    engine: EngineClient, raw: dict[str, Any] | None, num_requests: int
) -> KVTransferParams | None:
    """The request's KV transfer, if this server plays the role it asks for (else ValueError)."""
    params = parse_kv_transfer_params(raw)
    if params is None:
        return None
    wanted = "producer" if isinstance(params, RemoteDecode) else "consumer"
    if engine.kv_role != wanted:
        field_name = "do_remote_decode" if wanted == "producer" else "do_remote_prefill"
        raise ValueError(
            f"kv_transfer_params.{field_name} needs a server started with --kv-role {wanted}; "
            f"this one has --kv-role {engine.kv_role}"
        )
    if num_requests != 1:
        raise ValueError(
            "kv_transfer_params works with one prompt and n=1; this request makes "
            f"{num_requests} generations"
        )
    return params


async def start_generation(
    engine: EngineClient, subs: Sequence[SubRequest]
) -> MergedIterators[list[RequestOutput]]:
    """Submit every sub-request and wait for each one's first output.

    Overload (raised on the first output) and engine death thus surface before a response
    starts, as real HTTP statuses; on any failure every sub-request is aborted.
    """
    iterators = []
    try:
        for sub in subs:
            iterators.append(engine.generate(sub.request, sub.prompt))
    except BaseException:
        await aclose_all(iterators, [])
        raise
    firsts = await first_items(iterators)
    return merge_async_iterators(iterators, firsts)


@dataclass
class ChoiceState:
    """What one choice has produced so far, accumulated from the engine's delta outputs."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt (for usage, and echo): its text (None when given as token ids), ids and
    # logprobs.
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # An embedding request's pooled vector (SamplingParams.pooling), as the engine gives it.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def add(self, output: RequestOutput) -> None:
        """Fold in one delta output."""
        completion = output.outputs[0]
        self.text_parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs:
            self.logprobs.extend(completion.logprobs)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason
        self.prompt, self.prompt_token_ids = output.prompt, output.prompt_token_ids
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.pooled is not None:
            self.pooled = output.pooled
        self.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


async def collect(
    merged: MergedIterators[list[RequestOutput]], num_choices: int
) -> list[ChoiceState]:
    """Run every sub-request to the end (non-streaming responses)."""
    states = [ChoiceState() for _ in range(num_choices)]
    try:
        async for index, outputs in merged:
            for output in outputs:
                states[index].add(output)
    finally:
        await merged.aclose()
    return states


async def stream_chunks(
    merged: MergedIterators[list[RequestOutput]],
    states: Sequence[ChoiceState],
    chunks_of: Callable[[int, RequestOutput], list[C]],
    usage_chunk: Callable[[], C] | None,
) -> AsyncIterator[list[C]]:
    """A streamed response's chunks, one list per write: every delta ready since the last.

    `chunks_of` makes choice i's delta chunks (none: nothing to show yet). `usage_chunk`, when
    the client asked for usage, ends the list in which the last choice finishes. Closes
    `merged` however the stream ends.
    """
    try:
        while ready := await merged.next_batch():
            chunks = []
            for index, outputs in ready:
                for output in outputs:
                    states[index].add(output)
                    chunks.extend(chunks_of(index, output))
            if usage_chunk is not None and all(state.finished for state in states):
                chunks.append(usage_chunk())
                usage_chunk = None
            if chunks:
                yield chunks
        if usage_chunk is not None:
            yield [usage_chunk()]
    finally:
        await merged.aclose()


async def run_to_completion(engine: EngineClient, subs: Sequence[SubRequest]) -> list[ChoiceState]:
    """Submit every sub-request and accumulate each to its end (non-streaming responses)."""
    return await collect(await start_generation(engine, subs), len(subs))


def usage(states: Sequence[ChoiceState], n: int) -> Usage:
    """Token counts of a response: each prompt counted once, however many choices it has."""
    prompt_tokens = cached_tokens = 0
    for first in range(0, len(states), n):
        group = states[first : first + n]
        prompt_tokens += group[0].num_prompt_tokens
        # Cached for every choice of the prompt; never more than the prompt itself.
        cached_tokens += min(state.num_cached_tokens for state in group)
    completion_tokens = sum(len(state.token_ids) for state in states)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
