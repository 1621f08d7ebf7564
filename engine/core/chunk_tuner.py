"""Adaptive chunk size: a step that carries decodes stays close to a decode-only step's time.

With `--long-prefill-token-threshold auto` the scheduler asks this tuner, every step, how many
prompt tokens a request may compute. The tuner learns from the step times it is shown:
- decode-only steps fit base(d) = a + b*d, the time of a step with d decodes;
- steps with prefill tokens fit what they cost beyond base(d) as c_token * p + c_pair * q, for
  p prompt tokens whose attention covers q (token, key) pairs. A chunk deep into a long
  prompt attends to all the keys before it, so its tokens cost more than the first chunk's:
  a cost per token alone, learned from the chunks before, would undersize nothing at the
  start and oversize every chunk after, as the context grows.
A request `context` tokens into its prompt then gets the largest chunk p with
c_token * p + c_pair * p * (context + p / 2) <= slack * base(d) (whole blocks, or down to a
quarter of a block deep into a long prompt), so such a step takes at most (1 + slack) times a
decode-only one: a long prompt never freezes the running streams,
whatever the model, the hardware or the load. With no decode running there is nobody to
protect and prompts take the whole token budget.
"""

from __future__ import annotations

import math
from typing import NamedTuple

# A step may take this much longer than a decode-only step (0.5: up to 1.5x the gap).
DEFAULT_SLACK = 0.5
# Weight of the newest observation in the running estimates.
_LEARNING_RATE = 0.2
# Steps with fewer prompt tokens say little about a prompt token's cost.
_MIN_PREFILL_SAMPLE = 8
# Below this, the two costs are too collinear in what was seen to be told apart (every chunk
# at about the same size and depth): the cost is then put on the tokens alone.
_MIN_INDEPENDENCE = 1e-3


class StepMix(NamedTuple):
    """What one step computed: decodes, prompt tokens, and the (token, key) pairs that the
    prompt tokens' attention covers."""

    decodes: int
    prefill_tokens: int = 0
    prefill_pairs: int = 0


def chunk_pairs(context: int, tokens: int) -> int:
    """(token, key) pairs of a chunk of `tokens` after `context` computed ones (causal)."""
    return tokens * context + tokens * (tokens + 1) // 2


class ChunkSizeTuner:
    """Learns step costs online and turns them into a per-request prefill chunk size."""

    def __init__(self, block_size: int, max_tokens: int, slack: float = DEFAULT_SLACK) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.min_tokens = max(1, min(block_size // 4, max_tokens))
        self.slack = slack
        # Exponentially weighted sums for the least-squares fit of base(d) = a + b*d.
        self._w = self._wd = self._wdd = self._wt = self._wdt = 0.0
        # ... and for excess = c_token * p + c_pair * q (no intercept): sums of p*p, p*q, q*q,
        # p*excess and q*excess.
        self._pp = self._pq = self._qq = self._pe = self._qe = 0.0
        self.token_cost: float | None = None  # seconds per prompt token
        self.pair_cost = 0.0  # seconds per (token, key) pair of a prompt token's attention

    def base(self, num_decodes: int) -> float | None:
        """Estimated seconds of a decode-only step with this many decodes."""
        if self._w == 0.0:
            return None
        mean_d, mean_t = self._wd / self._w, self._wt / self._w
        var_d = self._wdd / self._w - mean_d**2
        slope = 0.0
        if var_d > 1e-9:
            slope = max(0.0, (self._wdt / self._w - mean_d * mean_t) / var_d)
        return max(1e-6, mean_t + slope * (num_decodes - mean_d))

    def observe(self, mix: StepMix, seconds: float) -> None:
        """Learn from one executed step."""
        keep = 1.0 - _LEARNING_RATE
        decodes, tokens, pairs = mix
        if tokens == 0:
            if decodes == 0:
                return
            self._w = self._w * keep + 1.0
            self._wd = self._wd * keep + decodes
            self._wdd = self._wdd * keep + decodes**2
            self._wt = self._wt * keep + seconds
            self._wdt = self._wdt * keep + decodes * seconds
            return
        base = self.base(decodes)
        if base is None or tokens < _MIN_PREFILL_SAMPLE:
            return
        excess = max(0.0, seconds - base)
        p, q = float(tokens), float(pairs)
        self._pp = self._pp * keep + p * p
        self._pq = self._pq * keep + p * q
        self._qq = self._qq * keep + q * q
        self._pe = self._pe * keep + p * excess
        self._qe = self._qe * keep + q * excess
        self.token_cost, self.pair_cost = self._fit()

    def _fit(self) -> tuple[float, float]:
        """(c_token, c_pair) by least squares, both >= 0."""
        det = self._pp * self._qq - self._pq**2
        if self._qq > 0.0 and det > _MIN_INDEPENDENCE * self._pp * self._qq:
            c_token = (self._pe * self._qq - self._qe * self._pq) / det
            c_pair = (self._qe * self._pp - self._pe * self._pq) / det
            if c_token >= 0.0 and c_pair >= 0.0:
                return c_token, c_pair
            if c_token < 0.0:  # the pairs explain it all
                return 0.0, max(0.0, self._qe / self._qq)
        return max(0.0, self._pe / self._pp), 0.0

    def threshold(self, num_decodes: int, context: int = 0) -> int:
        """Most prompt tokens a request `context` tokens into its prompt may compute in the
        next step (0: no cap)."""
        if num_decodes == 0:
            return 0
        base = self.base(num_decodes)
        if base is None or self.token_cost is None or (not self.token_cost and not self.pair_cost):
            # Nothing learned yet: a small first chunk, which teaches the prompt-token cost.
            return min(self.max_tokens, 4 * self.block_size)
        budget = self.slack * base
        linear = self.token_cost + self.pair_cost * context
        if self.pair_cost > 0.0:
            # (pair_cost / 2) p^2 + linear p = budget, for its positive root.
            half = self.pair_cost / 2
            tokens = (math.sqrt(linear * linear + 4 * half * budget) - linear) / (2 * half)
        else:
            tokens = budget / linear
        tokens = int(min(tokens, self.max_tokens))
        if tokens >= self.block_size:
            return tokens - tokens % self.block_size  # whole blocks
        # Deep into a long prompt even one block of tokens may cost more than the slack: a
        # chunk of a few tokens then, never none, so that the prompt still makes progress.
        return max(self.min_tokens, tokens)
