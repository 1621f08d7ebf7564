"""Engine-core outputs in, detokenized RequestOutputs out; stop strings end requests here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tidegate.engine.detokenizer import IncrementalDetokenizer
from tidegate.engine.messages import EngineCoreOutput, EngineCoreRequest, LogprobsLists
from tidegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tidegate.engine.tokenizer import Tokenizer


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    # Streaming callers get only what is new at each update (held-back text stays back).
    delta: bool


class RequestOutputCollector:
    """One request's outputs on their way to its consumer, handed over all at once.

    The output loop puts without awaiting, and wakes a waiting consumer once however many
    outputs it puts; `get` takes everything queued, so a consumer that fell behind by several
    engine steps catches up in one go (and the HTTP layer writes them in one go). Errors are
    queued in order, like outputs.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[RequestOutput | BaseException] = []
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> list[RequestOutput | BaseException]:
        """Everything queued, in order; waits only while nothing is."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class OutputProcessor:
    """Keeps one detokenizer per live request and builds what the caller sees."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        # Token id -> its text alone, as logprobs show candidates (a prompt's logprobs may
        # name tens of thousands of them in one output).
        self._token_texts: dict[int, str] = {}

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, delta: bool = False
    ) -> None:
        """Start tracking a request; with `delta`, each update carries only what is new."""
        params = request.sampling_params
        self._states[request.request_id] = _RequestState(
            output=RequestOutput(
                request_id=request.request_id,
                prompt=prompt,
                prompt_token_ids=request.prompt_token_ids,
                outputs=[
                    CompletionOutput(
                        index=0,
                        text="",
                        token_ids=[],
                        logprobs=[] if params.logprobs is not None else None,
                        cumulative_logprob=0.0 if params.logprobs is not None else None,
                    )
                ],
            ),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params, request.prompt_token_ids),
            want_logprobs=params.logprobs is not None,
            delta=delta,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop tracking a request; returns its last state marked as aborted."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        completion = state.output.outputs[0]
        completion.finish_reason = completion.finish_reason or "abort"
        state.output.finished = True
        return self._delta(state, 0) if state.delta else state.output

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs; return updated RequestOutputs and ids to abort (stopped)."""
        updated: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self._states.get(out.req_id)
            if state is None:
                continue
            completion = state.output.outputs[0]
            stop = state.detokenizer.update(out.new_token_ids)
            new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            if stop is not None and state.detokenizer.num_decoded < len(new_token_ids):
                # A step yielded tokens past the one that completed a stop string (speculative
                # decoding): they are not part of the output.
                n = state.detokenizer.num_decoded
                new_token_ids = new_token_ids[:n]
                if new_logprobs is not None:
                    new_logprobs = new_logprobs.head(n)
            completion.token_ids.extend(new_token_ids)
            state.output.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                state.output.kv_transfer_params = out.kv_transfer_params
            if state.want_logprobs and new_logprobs is not None:
                self._append_logprobs(completion, new_logprobs)
            if out.prompt_logprobs is not None:
                state.output.prompt_logprobs = [None, *self._entries(out.prompt_logprobs)]
            if out.pooled is not None:
                state.output.pooled = out.pooled
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if stop is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", stop
                to_abort.append(out.req_id)
            elif stop is not None:
                finish_reason, stop_reason = "stop", stop
            completion.text = state.detokenizer.output_text
            if finish_reason is not None:
                completion.finish_reason = finish_reason
                completion.stop_reason = stop_reason
                state.output.finished = True
                del self._states[out.req_id]
            if state.delta:
                delta = self._delta(state, len(new_token_ids))
                # Streaming callers get the prompt's logprobs once, with the first token.
                if out.prompt_logprobs is not None:
                    delta.prompt_logprobs = state.output.prompt_logprobs
                delta.pooled = out.pooled
                updated.append(delta)
            else:
                updated.append(state.output)
        return updated, to_abort

    def _delta(self, state: _RequestState, num_new_tokens: int) -> RequestOutput:
        """The update as a delta: new tokens, new logprobs, and text that is safe to send."""
        full = state.output
        completion = full.outputs[0]
        new_logprobs = None
        if completion.logprobs is not None:
            new_logprobs = completion.logprobs[len(completion.logprobs) - num_new_tokens :]
        return RequestOutput(
            request_id=full.request_id,
            prompt=full.prompt,
            prompt_token_ids=full.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=state.detokenizer.text_delta(finished=full.finished),
                    token_ids=completion.token_ids[len(completion.token_ids) - num_new_tokens :],
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    cumulative_logprob=completion.cumulative_logprob,
                    logprobs=new_logprobs,
                )
            ],
            finished=full.finished,
            num_cached_tokens=full.num_cached_tokens,
            kv_transfer_params=full.kv_transfer_params,
        )

    def _append_logprobs(self, completion: CompletionOutput, lists: LogprobsLists) -> None:
        completion.logprobs.extend(self._entries(lists))
        completion.cumulative_logprob += sum(values[0] for values in lists.logprobs)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def _entries(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """One dict a position: its token (sampled, or the prompt's) first, then the top k."""
        entries = []
        for ids, values, rank in zip(
            lists.token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
        ):
            entry: dict[int, Logprob] = {}
            for position, (token_id, value) in enumerate(zip(ids, values, strict=True)):
                if token_id in entry:
                    continue
                entry[token_id] = Logprob(
                    token_id=token_id,
                    logprob=value,
                    rank=rank if position == 0 else position,
                    decoded_token=self._token_text(token_id),
                )
            entries.append(entry)
        return entries
