"""Prompts and parameters in, EngineCoreRequests out: the one place bad input is refused."""

from __future__ import annotations

import copy
import time

from tidegate.engine.kv_transfer.params import KVTransferParams
from tidegate.engine.messages import EngineCoreRequest, LoRARequest
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.tokenizer import Tokenizer


def model_eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """EOS ids of the model's configs (config.json, generation_config.json) and its tokenizer."""
    ids = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class InputProcessor:
    """Tokenizes and checks prompts against the model's limits before they reach the engine."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: set[int],
        priority_scheduling: bool = False,
        classifier: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # A sequence classifier's engine pools and classifies prompts; it samples no token.
        self.classifier = classifier
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # --scheduling-policy priority: only then does a request's priority mean anything.
        self.priority_scheduling = priority_scheduling

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens) or a checked id list."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
            raise ValueError("a token-id prompt must be a list of integers")
        return token_ids

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """A request ready for an engine core, or a ValueError that says what is allowed."""
        if priority != 0 and not self.priority_scheduling:
            # vLLM's rule: a priority that would be ignored is refused, not dropped silently.
            raise ValueError(
                f"priority {priority} needs a server started with --scheduling-policy priority; "
                "this one takes only priority 0"
            )
        if self.classifier and params.pooling is None:
            raise ValueError(
                "this model is a sequence classifier: it classifies and scores prompts "
                "(/classify, /score, /rerank), and generates no text"
            )
        if params.pooling is not None and kv_transfer is not None:
            raise ValueError("an embedding is computed on this instance: no kv_transfer_params")
        if params.prompt_logprobs is not None and kv_transfer is not None:
            raise ValueError(
                "prompt_logprobs need the prompt computed on this instance, so they cannot be "
                "combined with kv_transfer_params (disaggregated serving)"
            )
        token_ids = self.prompt_token_ids(prompt)
        if params.pooling is not None and len(token_ids) >= self.max_model_len:
            # Pooled, with room for the one token that ends the request.
            raise ValueError(
                f"the input has {len(token_ids):,} tokens; this model "
                f"{'classifies' if self.classifier else 'embeds'} at most "
                f"{self.max_model_len - 1:,} (max_model_len is {self.max_model_len:,})"
            )
        self.check_prompt(token_ids)
        if (
            params.max_tokens is not None
            and len(token_ids) + params.max_tokens > self.max_model_len
        ):
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len:,} tokens, but "
                f"{len(token_ids) + params.max_tokens:,} were requested ({len(token_ids):,} in the "
                f"prompt, {params.max_tokens:,} for the completion); lower max_tokens to at most "
                f"{self.max_model_len - len(token_ids):,}"
            )
        token_fields = {
            "stop_token_ids": params.stop_token_ids or (),
            "logit_bias": params.logit_bias or (),
            "allowed_token_ids": params.allowed_token_ids or (),
        }
        for name, ids in token_fields.items():
            token_id = next((t for t in ids if t >= self.vocab_size), None)
            if token_id is not None:
                raise ValueError(
                    f"{name} contains {token_id}; this model's vocabulary has "
                    f"{self.vocab_size:,} tokens"
                )
        params = copy.copy(params)
        if params.top_k >= self.vocab_size:
            # Keeping the whole vocabulary is no top-k, as the sampler reads it; and a huge k
            # could not cross to the engine process, whose messages carry 64-bit integers.
            params.top_k = 0
        stop_ids = set(params.stop_token_ids or [])
        params.all_stop_token_ids = stop_ids if params.ignore_eos else stop_ids | self.eos_token_ids
        if (
            params.min_tokens
            and params.allowed_token_ids is not None
            and set(params.allowed_token_ids) <= params.all_stop_token_ids
        ):
            # min_tokens forbids the stop tokens, which would leave no token to sample.
            raise ValueError(
                f"allowed_token_ids holds only stop tokens ({sorted(params.allowed_token_ids)}),"
                f" so min_tokens ({params.min_tokens}) cannot be met"
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=sorted(self.eos_token_ids),
            arrival_time=time.monotonic(),
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer.model_dump() if kv_transfer is not None else None,
            lora_request=lora_request,
            tenant=tenant,
            priority=priority,
        )

    def check_prompt(self, token_ids: list[int]) -> None:
        """Refuse empty prompts, unknown token ids and prompts that leave no room to generate."""
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside this model's vocabulary [0, {self.vocab_size:,})"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids):,} tokens; this model accepts at most "
                f"{self.max_model_len - 1:,} (max_model_len is {self.max_model_len:,}, "
                "and at least one token must be generated)"
            )
