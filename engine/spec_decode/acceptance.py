"""How many guesses a request is worth: each one costs a token of compute, and pays only when
it is kept.

Guess j is kept only if every guess before it is, so with a per-guess acceptance rate r it is
kept with probability about r**j. A request makes guess j while that is at least
`GUESS_WORTH`. On the 2-core CPU of benchmarks/results/spec_decode.json a guessed token cost
about 0.07 of a request's step at 1 request and 0.18 at 16 (what the `cycle` workload lost
with every guess made), so 0.25 never makes a guess that costs more than it is worth there.
"""

from __future__ import annotations

# The least chance of being kept that a guess must have to be made.
GUESS_WORTH = 0.25
# Each new observation weighs this much against the request's history.
_DECAY = 0.8


class GuessRecord:
    """One request's guesses: a decayed count of the positions judged and of those kept.

    It starts at one kept of one (a request guesses fully until its guesses fail). A request
    that guesses nothing still has its first guess judged against the token the step samples
    (`shadow`), so a request whose text starts to repeat starts guessing again.
    """

    __slots__ = ("judged", "kept", "shadow")

    def __init__(self) -> None:
        self.kept = 1.0
        self.judged = 1.0
        # The first guess of a step that made none: judged when the step's token is known.
        self.shadow: int | None = None

    @property
    def rate(self) -> float:
        return self.kept / self.judged

    def worth(self, available: int) -> int:
        """How many of `available` guesses to make."""
        rate, chance, count = self.rate, self.rate, 0
        while count < available and chance >= GUESS_WORTH:
            count += 1
            chance *= rate
        return count

    def record(self, guessed: int, kept: int) -> None:
        """A step verified `guessed` guesses and kept the first `kept`: those were judged,
        and so was the one after them, unless all were kept."""
        self._add(kept, min(kept + 1, guessed))

    def record_shadow(self, token_id: int) -> None:
        """The token sampled where the unmade guess `shadow` would have been."""
        if self.shadow is not None:
            self._add(int(token_id == self.shadow), 1)
            self.shadow = None

    def _add(self, kept: int, judged: int) -> None:
        self.kept = _DECAY * self.kept + kept
        self.judged = _DECAY * self.judged + judged
