"""The token arithmetic of one scheduling step: budget, per-request cap, partial prefills."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidegate.engine.config import DEFAULT_LONG_PREFILL_STEP_SLACK, SchedulingPolicy
from tidegate.engine.core.request import Request


@dataclass
class StepLimits:
    """The knobs that bound a step (resolved from EngineArgs)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int  # 0: no per-request cap
    max_num_partial_prefills: int
    max_long_partial_prefills: int
    max_model_len: int
    # A step is whole-prompt prefills only, or decodes only (the pre-V1 baseline).
    phased: bool = False
    # The per-request cap is learned online (ChunkSizeTuner) instead of fixed.
    adaptive_chunking: bool = False
    # ... so that a step with prompt chunks takes at most 1 + this times a decode-only step.
    adaptive_slack: float = DEFAULT_LONG_PREFILL_STEP_SLACK
    # ... or up to this many seconds, when that is longer (None: the slack alone).
    adaptive_step_s: float | None = None
    # LoRA: distinct adapters among the running requests (None: adapters are off).
    max_loras: int | None = None
    # Which waiting request goes first, and which running one is preempted first.
    policy: SchedulingPolicy = "fcfs"
    # Running requests one tenant may have; its waiting ones are passed over meanwhile.
    max_running_per_tenant: int | None = None


class StepBudget:
    """Hands out tokens for one step and keeps count of prompts left part-way through prefill.

    A prompt is *partial* in this step when its chunk ends before its last token. Allowing only
    `max_num_partial_prefills` of those at once (and `max_long_partial_prefills` long ones)
    lets short prompts that finish in one step overtake a long prompt's chunks.
    """

    def __init__(
        self,
        limits: StepLimits,
        threshold: int | None = None,
        cap: Callable[[int], int] | None = None,
        max_seqs: int | None = None,
        charge: Callable[[int, int], None] | None = None,
    ) -> None:
        self.limits = limits
        # This step's per-request cap: the fixed one, or what the chunk tuner says now for a
        # prompt's first chunk; `cap`, when given, says it for a request this many tokens in.
        self.threshold = limits.long_prefill_token_threshold if threshold is None else threshold
        self._cap = cap
        # ... and `charge`, when given, hears of each prompt chunk given (context, tokens).
        self._charge = charge
        self.tokens_left = limits.max_num_batched_tokens
        # Requests this step may still take (pipeline micro-batches share the running ones).
        self.seqs_left = limits.max_num_seqs if max_seqs is None else max_seqs
        self.num_partial = 0
        self.num_long_partial = 0

    def is_long(self, request: Request) -> bool:
        """True for prompts the threshold would split into several chunks."""
        return self.threshold > 0 and request.num_prompt_tokens > self.threshold

    def tokens_for(self, request: Request, num_computed_tokens: int) -> int:
        """How many tokens this request may compute now (0 when the budget is spent)."""
        num_new = request.num_tokens_with_placeholders - num_computed_tokens
        threshold = self.threshold if self._cap is None else self._cap(num_computed_tokens)
        if threshold > 0:
            num_new = min(num_new, threshold)
        # Never compute past the model's context: a request at the limit is finished first.
        num_new = min(num_new, self.limits.max_model_len - num_computed_tokens)
        return max(0, min(num_new, self.tokens_left))

    @staticmethod
    def is_partial(request: Request, num_computed_after: int) -> bool:
        """True when a prefill (of a prompt, or a recompute after preemption) is left unfinished.

        A decode waiting for its one token is not a partial prefill, even if it got no
        tokens this step.
        """
        remaining = request.num_tokens_with_placeholders - num_computed_after
        return remaining > 1 or (remaining == 1 and request.num_outputs_with_placeholders == 0)

    def admits_partial(self, request: Request) -> bool:
        """True when one more partial prefill (long or not) fits this step's limits."""
        if self.num_partial >= self.limits.max_num_partial_prefills:
            return False
        return not (
            self.is_long(request) and self.num_long_partial >= self.limits.max_long_partial_prefills
        )

    def count_partial(self, request: Request) -> None:
        """Record that this request stays part-way through its prefill after this step."""
        self.num_partial += 1
        if self.is_long(request):
            self.num_long_partial += 1

    @property
    def is_spent(self) -> bool:
        """True when the step can take no more tokens or no more requests."""
        return self.tokens_left <= 0 or self.seqs_left <= 0

    def spend(self, num_tokens: int, prompt_context: int | None = None) -> None:
        """Take one request's tokens out of the step's budget; `prompt_context`: the tokens
        computed before them, when they are a prompt chunk (not a decode)."""
        assert num_tokens <= self.tokens_left, "scheduled past the token budget"
        self.tokens_left -= num_tokens
        self.seqs_left -= 1
        if self._charge is not None and prompt_context is not None:
            self._charge(prompt_context, num_tokens)
