"""A request as the scheduler sees it: token ids, progress, status, and its block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

import numpy as np

from tidegate.engine.core.request_grammar import RequestGrammar
from tidegate.engine.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from tidegate.engine.messages import EngineCoreRequest, LoRARequest
from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.spec_decode.acceptance import GuessRecord


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; the finished ones carry their reason."""

    WAITING = enum.auto()
    # Structured outputs: queued while its grammar compiles (vLLM's WAITING_FOR_FSM).
    WAITING_FOR_GRAMMAR = enum.auto()
    # Disaggregated consumer: blocks allocated, the prompt's KV on its way from a producer.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Refused after it reached the engine (its grammar did not compile); `error` says why.
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Prompt plus generated tokens, and how many of them already have KV in the cache."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = frozenset(),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # None: the anonymous tenant. Lower priority values go first (--scheduling-policy).
        self.tenant = tenant
        self.priority = priority
        self.lora_request = lora_request
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Why the engine refused it (FINISHED_ERROR), for the API server's 400.
        self.error: str | None = None
        # Structured outputs: the grammar and its matcher (the scheduler sets it when queued).
        self.grammar: RequestGrammar | None = None

        self.num_prompt_tokens = len(prompt_token_ids)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens a step in flight will sample for this request, counted as
        # if known (their KV is computed in the next step) until the step's output arrives.
        self.num_output_placeholders = 0
        # Prompt tokens found in the prefix cache when first scheduled (for usage reporting).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # time.monotonic() when first scheduled: arrival to here is the request's queue time.
        self.first_scheduled_time: float | None = None
        # Content hashes of this request's full blocks, extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        # Speculative decoding: the tokens as an array, kept up to date as they grow
        # (token_array), for prompt lookup's vectorized search.
        self._token_buffer: np.ndarray | None = None
        self._num_buffered = 0
        # How often its guesses were kept (the scheduler makes it with the first guess).
        self.guess_record: GuessRecord | None = None
        # Disaggregated serving: what was asked, whether the pull was tried (once only), and
        # a producer's answer, set when the request finishes.
        self.kv_transfer = kv_transfer
        self.kv_pull_tried = False
        self.kv_transfer_params_out: dict | None = None

    @classmethod
    def from_engine_core_request(cls, message: EngineCoreRequest) -> Request:
        """The scheduler's request for one the API server (or the offline LLM) handed over."""
        return cls(
            request_id=message.request_id,
            prompt_token_ids=message.prompt_token_ids,
            sampling_params=message.sampling_params,
            eos_token_ids=message.eos_token_ids,
            cache_salt=message.cache_salt,
            arrival_time=message.arrival_time,
            kv_transfer=parse_kv_transfer_params(message.kv_transfer_params),
            lora_request=message.lora_request,
            tenant=message.tenant,
            priority=message.priority,
        )

    @property
    def lora_name(self) -> str | None:
        """The adapter this request runs under, or None for the base model."""
        return self.lora_request.name if self.lora_request is not None else None

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those a step in flight will sample (async scheduling)."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_outputs_with_placeholders(self) -> int:
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def is_prefill_done(self) -> bool:
        """True once every known token has KV: the next step produces a new token."""
        return self.num_computed_tokens >= self.num_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def token_array(self) -> np.ndarray:
        """All tokens as an int64 array view; tokens only ever append, so each call copies
        just those added since the last."""
        n = len(self._all_token_ids)
        buffer = self._token_buffer
        if buffer is None or len(buffer) < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buffer is not None:
                grown[: self._num_buffered] = buffer[: self._num_buffered]
            self._token_buffer = buffer = grown
        if self._num_buffered < n:
            buffer[self._num_buffered : n] = self._all_token_ids[self._num_buffered : n]
            self._num_buffered = n
        return buffer[:n]

    def token_ids_array(self, start: int, end: int) -> np.ndarray:
        return np.asarray(self._all_token_ids[start:end], dtype=np.int64)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed; None in the params means up to the model's context."""
        max_tokens = self.sampling_params.max_tokens
        return max_tokens if max_tokens is not None else 1 << 62
