"""Adaptive chunk size: a step that carries decodes stays close to a decode-only step's time.

With `--long-prefill-token-threshold auto` the scheduler asks this tuner, every step, how many
prompt tokens a request may compute. The tuner learns from the step times it is shown:
- decode-only steps fit base(d) = a + b*d, the time of a step with d decodes (b by a
  least-squares fit that follows the load, a as the median over the last 32 such steps, so
  that one slow step does not move it);
- steps with prefill tokens fit what they cost beyond base(d) as
  c_token * p + c_pair * q + c_key * k, for p prompt tokens whose attention covers q (token,
  key) pairs and reads k keys (each chunk its context and itself). A chunk deep into a long
  prompt attends to all the keys before it, so its tokens cost more than the first chunk's;
  and a chunk of a few tokens still streams its whole context through the attention kernel
  once, at about the price of a handful of tokens more. A cost per token alone would
  oversize the chunks deep into a prompt; one per pair alone would undersize the small ones.
A request `context` tokens into its prompt then gets the largest chunk p whose cost fits in
slack * base(d) (whole blocks, or down to a quarter of a block deep into a long prompt, and
at most twice the largest chunk measured lately: chunks grow step by step, each size measured
before the next), so such a step takes at most (1 + slack) times a decode-only one (slack is
--long-prefill-step-slack, 0.25 by default): a long prompt never freezes the running streams,
whatever the model, the hardware or the load. With a step target (--long-prefill-step-ms, an
inter-token latency the deployment promises) a step may take up to that target instead when
it is longer: slack alone keeps steps far under a 50 ms target on a fast decode, and the
prompts waiting behind the chunks pay for it in time to first token. With no decode running
there is nobody to protect and prompts take the whole token budget.

The slack gives prompts at most slack / (1 + slack) of the machine's time while decodes run.
That spreads a burst (a long prompt, the one behind it) over the streams, but when prompts
keep arriving faster than that share computes them, the queue grows without bound: fewer
requests start, the decode batch shrinks, and so does the step the slack is measured
against (on the serving workload, one round at slack 0.3: TTFT p50 0.18 s uncapped against
1.2 s at 2 req/s, and 0.24 against 6.7 s at 4 req/s, where the output rate fell from 291 to
160 tokens/s). So the slack is multiplied by the number of requests waiting to start (at
least 1): one prompt waiting behind the one in chunks changes nothing, and a queue that
builds up raises the prompts' share until it stops growing. The prompt chunks of one step
share its allowance (StepCaps): the last chunk of one prompt and the first of the next do not
each take all of it.
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
from typing import NamedTuple

from tidegate.common.linear import determinant, solve
from tidegate.engine.config import DEFAULT_LONG_PREFILL_STEP_SLACK

# Weight of the newest observation in the decode-only estimate: it follows the load quickly.
_LEARNING_RATE = 0.2
# ... for its slope; its level is the median over the last this many decode-only steps. A
# long prompt's chunks leave no decode-only step to learn from, so the estimate they are sized
# against is the one from just before it arrived, for all of its prefill: a mean over the
# last few steps (as the slope's fit is) made one slow step there (a page fault, a collection,
# a burst of the API server's) the bound of every chunk after it, and took chunk steps to
# 1.5 x 1.4 of a typical decode step (prefill-stall traces: an estimate of 27.7 ms frozen
# after steps of 19-20 ms with a few of 25-36).
_RECENT_STEPS = 32
# ... and in the prefill costs': three costs need more than a handful of noisy steps to be
# told apart (about the last 20 here), or the fit jumps from one term to another each step.
_PREFILL_LEARNING_RATE = 0.05
# Below this (the determinant of the costs' normalized normal equations), costs are too
# collinear in what was seen to be told apart (every chunk at about the same size and
# depth): fewer of them then carry the whole cost.
_MIN_INDEPENDENCE = 1e-3
# The costs a prefill step's excess is fitted with: per token, per pair, per key read.
_COSTS = 3


class StepMix(NamedTuple):
    """What one step computed: decodes, prompt tokens, the (token, key) pairs that the prompt
    tokens' attention covers, and the keys their chunks read."""

    decodes: int
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_keys: int = 0


def chunk_pairs(context: int, tokens: int) -> int:
    """(token, key) pairs of a chunk of `tokens` after `context` computed ones (causal)."""
    return tokens * context + tokens * (tokens + 1) // 2


def chunk_keys(context: int, tokens: int) -> int:
    """Keys a chunk of `tokens` after `context` computed ones reads: all of them, once."""
    return context + tokens


class ChunkSizeTuner:
    """Learns step costs online and turns them into a per-request prefill chunk size."""

    def __init__(
        self,
        block_size: int,
        max_tokens: int,
        slack: float = DEFAULT_LONG_PREFILL_STEP_SLACK,
        step_target_s: float | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.min_tokens = max(1, min(block_size // 4, max_tokens))
        self.slack = slack
        self.step_target_s = step_target_s
        # Exponentially weighted sums for the least-squares fit of base(d) = a + b*d.
        self._w = self._wd = self._wdd = self._wt = self._wdt = 0.0
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=_RECENT_STEPS)
        self._level = 0.0  # median over the recent decode-only steps of t - slope * d
        # ... and for excess = c . (p, q, k) (no intercept): sums of f_i * f_j, f_i * excess
        # and excess^2 over the prefill steps' features f = (tokens, pairs, keys).
        self._ff = [[0.0] * _COSTS for _ in range(_COSTS)]
        self._fe = [0.0] * _COSTS
        self._ee = 0.0
        self.token_cost: float | None = None  # seconds per prompt token
        self.pair_cost = 0.0  # seconds per (token, key) pair of a prompt token's attention
        self.key_cost = 0.0  # seconds per key a chunk reads
        # The most prompt tokens a step carried lately (decaying): the fit is trusted up to
        # twice that. Its few recent steps may not tell the costs apart (deep into a long
        # prompt every chunk has the same size), and a cost put on the wrong term would
        # size the next fresh prompt's chunk far beyond anything measured.
        self._largest = 0.0

    def base(self, num_decodes: int) -> float | None:
        """Estimated seconds of a decode-only step with this many decodes."""
        if self._w == 0.0:
            return None
        slope = self._slope()
        return max(1e-6, self._level + slope * num_decodes)

    def _slope(self) -> float:
        mean_d, mean_t = self._wd / self._w, self._wt / self._w
        var_d = self._wdd / self._w - mean_d**2
        if var_d <= 1e-9:
            return 0.0
        return max(0.0, (self._wdt / self._w - mean_d * mean_t) / var_d)

    def observe(self, mix: StepMix, seconds: float) -> None:
        """Learn from one executed step."""
        keep = 1.0 - _LEARNING_RATE
        decodes, tokens, pairs, keys = mix
        if tokens == 0:
            if decodes == 0:
                return
            self._w = self._w * keep + 1.0
            self._wd = self._wd * keep + decodes
            self._wdd = self._wdd * keep + decodes**2
            self._wt = self._wt * keep + seconds
            self._wdt = self._wdt * keep + decodes * seconds
            self._recent.append((decodes, seconds))
            slope = self._slope()
            self._level = statistics.median(t - slope * d for d, t in self._recent)
            return
        base = self.base(decodes)
        if base is None:
            return
        # Every chunk teaches, however small: deep into a long prompt the chunks are a few
        # tokens, and a tuner that stopped learning there would keep a stale cost.
        excess = max(0.0, seconds - base)
        self._largest = max(float(tokens), self._largest * keep)
        fit_keep = 1.0 - _PREFILL_LEARNING_RATE
        features = (float(tokens), float(pairs), float(keys))
        for i, fi in enumerate(features):
            for j, fj in enumerate(features):
                self._ff[i][j] = self._ff[i][j] * fit_keep + fi * fj
            self._fe[i] = self._fe[i] * fit_keep + fi * excess
        self._ee = self._ee * fit_keep + excess * excess
        self.token_cost, self.pair_cost, self.key_cost = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        """(c_token, c_pair, c_key) by least squares, all >= 0: of the subsets of the costs
        that can be told apart in what was seen and fit with no negative one, the one that
        leaves the least unexplained (the per-token cost alone on a tie)."""
        best, best_residual = [0.0] * _COSTS, math.inf
        subsets = [
            s for n in range(1, _COSTS + 1) for s in itertools.combinations(range(_COSTS), n)
        ]
        for subset in subsets:
            a = [[self._ff[i][j] for j in subset] for i in subset]
            diagonal = math.prod(a[k][k] for k in range(len(subset)))
            if diagonal <= 0.0 or determinant(a) <= _MIN_INDEPENDENCE * diagonal:
                continue
            solution = solve(a, [self._fe[i] for i in subset])
            if solution is None or min(solution) < 0.0:
                continue
            # At the least-squares solution the residual is sum e^2 - c . (sum f e).
            residual = self._ee - sum(
                c * self._fe[i] for c, i in zip(solution, subset, strict=True)
            )
            if residual < best_residual - 1e-9 * max(self._ee, 1e-30):
                best_residual = residual
                best = [0.0] * _COSTS
                for c, i in zip(solution, subset, strict=True):
                    best[i] = c
        return best[0], best[1], best[2]

    def chunk_cost(self, context: int, tokens: int) -> float:
        """Estimated seconds a chunk adds to a step (0 before anything is learned)."""
        return (
            (self.token_cost or 0.0) * tokens
            + self.pair_cost * chunk_pairs(context, tokens)
            + self.key_cost * chunk_keys(context, tokens)
        )

    def threshold(
        self, num_decodes: int, context: int = 0, waiting: int = 0, spent: float = 0.0
    ) -> int:
        """Most prompt tokens a request `context` tokens into its prompt may compute in the
        next step (0: no cap), with `waiting` requests waiting to start and chunks estimated
        at `spent` seconds already in the step (StepCaps)."""
        if num_decodes == 0:
            return 0
        base = self.base(num_decodes)
        learned = self.token_cost or self.pair_cost or self.key_cost
        if base is None or self.token_cost is None or not learned:
            # Nothing learned yet: a small first chunk, which teaches the prompt-token cost.
            return min(self.max_tokens, 4 * self.block_size)
        # cost(p) = (c_pair / 2) p^2 + linear p + fixed, with
        # pairs = p * context + p (p + 1) / 2 and keys = context + p.
        allowed = self.slack * max(1, waiting) * base
        if self.step_target_s is not None:
            allowed = max(allowed, self.step_target_s - base)
        budget = allowed - spent - self.key_cost * context
        linear = self.token_cost + self.pair_cost * (context + 0.5) + self.key_cost
        if budget <= 0.0:
            tokens = 0.0
        elif self.pair_cost > 0.0:
            half = self.pair_cost / 2
            tokens = (math.sqrt(linear * linear + 4 * half * budget) - linear) / (2 * half)
        else:
            tokens = budget / linear
        trusted = max(4 * self.block_size, 2 * self._largest)
        tokens = int(min(tokens, trusted, self.max_tokens))
        if tokens >= self.block_size:
            return tokens - tokens % self.block_size  # whole blocks
        # Deep into a long prompt even one block of tokens may cost more than the slack: a
        # chunk of a few tokens then, never none, so that the prompt still makes progress.
        return max(self.min_tokens, tokens)


class StepCaps:
    """One step's chunk caps: what the tuner allows the step's prompt chunks, less the chunks
    already given in it. Two prompts in one step (the last chunk of one, the first of the
    next) share the allowance instead of taking it twice."""

    def __init__(self, tuner: ChunkSizeTuner, num_decodes: int, waiting: int) -> None:
        self.tuner = tuner
        self.num_decodes = num_decodes
        self.waiting = waiting
        self.spent = 0.0  # estimated seconds of the chunks given so far

    def cap(self, context: int) -> int:
        """The cap of a chunk `context` tokens into its prompt, after those given."""
        return self.tuner.threshold(self.num_decodes, context, self.waiting, self.spent)

    def charge(self, context: int, tokens: int) -> None:
        """A chunk of `tokens` after `context` computed ones was given."""
        self.spent += self.tuner.chunk_cost(context, tokens)
