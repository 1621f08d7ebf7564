"""Adaptive chunk size: a step that carries decodes stays close to a decode-only step's time.

With `--long-prefill-token-threshold auto` the scheduler asks this tuner, every step, how many
prompt tokens one request may compute. The tuner learns from the step times it is shown:
- decode-only steps fit base(d) = a + b*d, the time of a step with d decodes;
- steps with prefill tokens give the cost of one prompt token, c = (t - base(d)) / p.
The chunk is then `slack * base(d) / c` tokens, so such a step takes at most (1 + slack)
times a decode-only one: a long prompt never freezes the running streams, whatever the
model, the hardware or the load. With no decode running there is nobody to protect and
prompts take the whole token budget.
"""

from __future__ import annotations

# A step may take this much longer than a decode-only step (0.5: up to 1.5x the gap).
DEFAULT_SLACK = 0.5
# Weight of the newest observation in the running estimates.
_LEARNING_RATE = 0.2
# Steps with fewer prompt tokens say little about a prompt token's cost.
_MIN_PREFILL_SAMPLE = 8


class ChunkSizeTuner:
    """Learns step costs online and turns them into a per-step prefill chunk size."""

    def __init__(self, block_size: int, max_tokens: int, slack: float = DEFAULT_SLACK) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.slack = slack
        # Exponentially weighted sums for the least-squares fit of base(d) = a + b*d.
        self._w = self._wd = self._wdd = self._wt = self._wdt = 0.0
        self.prefill_cost: float | None = None  # seconds per prompt token

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

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """Learn from one executed step."""
        keep = 1.0 - _LEARNING_RATE
        if num_prefill_tokens == 0:
            if num_decodes == 0:
                return
            self._w = self._w * keep + 1.0
            self._wd = self._wd * keep + num_decodes
            self._wdd = self._wdd * keep + num_decodes**2
            self._wt = self._wt * keep + seconds
            self._wdt = self._wdt * keep + num_decodes * seconds
            return
        base = self.base(num_decodes)
        if base is None or num_prefill_tokens < _MIN_PREFILL_SAMPLE:
            return
        sample = max(0.0, seconds - base) / num_prefill_tokens
        if self.prefill_cost is None:
            self.prefill_cost = sample
        else:
            self.prefill_cost = keep * self.prefill_cost + _LEARNING_RATE * sample

    def threshold(self, num_decodes: int) -> int:
        """Most prompt tokens one request may compute in the next step (0: no cap)."""
        if num_decodes == 0:
            return 0
        base = self.base(num_decodes)
        if base is None or not self.prefill_cost:
            # Nothing learned yet: a small first chunk, which teaches the prompt-token cost.
            return min(self.max_tokens, 4 * self.block_size)
        tokens = int(self.slack * base / self.prefill_cost)
        tokens -= tokens % self.block_size
        return max(self.block_size, min(self.max_tokens, tokens))
