"""Prompt lookup: guess a request's next tokens from where its last few tokens occurred before.

An output that copies from its prompt (a code edit, a quote, an extraction) or repeats itself
makes the same n tokens recur; what followed them the last time is a good guess of what
follows now, and costs no model.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes `k` tokens by matching a request's last n tokens earlier in its tokens, for n
    from `max_n` down to `min_n`; the longest suffix that matches wins, and among its matches
    the most recent one. The guesses are what followed that match, as if the text from there
    on repeated."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, k: int | None = None) -> list[int]:
        """k (default self.k, at most) tokens that followed the latest earlier occurrence of the
        longest matching suffix of `token_ids`; [] when no suffix of min_n tokens recurs."""
        k = self.k if k is None else min(k, self.k)
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        # Where an occurrence could end: the earlier places of the last token (one pass over
        # the tokens; the longer suffixes are checked at those places only).
        ends = np.flatnonzero(token_ids[: length - 1] == token_ids[length - 1])
        if not len(ends):
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                if not len(hits):
                    break
                hits = hits[token_ids[hits - back] == token_ids[length - 1 - back]]
            if len(hits):
                return _continue_from(token_ids, int(hits[-1]) + 1, k)
        return []


def _continue_from(token_ids: np.ndarray, start: int, k: int) -> list[int]:
    """k tokens copied from `start` on; a copy that reaches the end goes on with the tokens it
    copied, so that a period shorter than k (a token repeated, a short cycle) still gives k
    guesses from its latest occurrence."""
    length = len(token_ids)
    guesses = token_ids[start : start + k].tolist()
    while len(guesses) < k:
        guesses.append(guesses[start + len(guesses) - length])
    return guesses
