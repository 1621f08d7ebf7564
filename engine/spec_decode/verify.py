"""Which proposed tokens a step keeps.

The runner samples a token at every position a step computed for a request: after its last
known token, and after each proposed one. Proposed token j is kept while it is the token
sampled at its position, and the first sampled token that differs (or the one after the last
proposal, when all are kept) is kept too. A proposal is a single token (its probability is
one), so this is rejection sampling: a kept token has exactly the probability sampling gives
it, and a greedy request's output is its argmax chain, as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(sampled: Sequence[int], proposals: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per request, the tokens a step yields.

    `sampled` holds len(p) + 1 tokens for each request's proposals p, request after request:
    those sampled after its last known token and after each of its proposed tokens.
    """
    expected = sum(len(p) + 1 for p in proposals)
    if len(sampled) != expected:
        raise ValueError(f"{len(sampled)} sampled tokens for {expected} positions")
    result: list[list[int]] = []
    at = 0
    for proposed in proposals:
        kept: list[int] = []
        for guess in proposed:
            token = sampled[at + len(kept)]
            kept.append(token)
            if token != guess:
                break
        else:
            kept.append(sampled[at + len(proposed)])
        result.append(kept)
        at += len(proposed) + 1
    return result
