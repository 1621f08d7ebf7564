"""Random walks through a grammar: the tokens a constrained model could write, found without one.

Each step fills the bitmask, checks that no id outside the tokenizer is allowed, and picks an
allowed token with a seeded RNG, biased so that outputs end: an EOS as soon as one is allowed,
else often a token that closes a string, object or array, else a random first byte and then a
random token starting with it (so rare characters such as '@' or '"' come up as often as
letters).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tidegate.engine.structured_output import GrammarMatcher, bitmask_words
from tidegate.engine.structured_output.backend import byte_level_alphabet

EOS_ID = 2  # tidegate.engine.tiny_model.EOS_ID
CLOSERS = b'"}]'


class Vocab:
    """The first byte of every token of a byte-level BPE tokenizer.json (-1: special)."""

    def __init__(self, folder: Path, vocab_size: int) -> None:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        char_to_byte = {c: b for b, c in enumerate(byte_level_alphabet())}
        self.first_byte = np.full(vocab_size, -1, dtype=np.int32)
        for piece, token_id in tokenizer["model"]["vocab"].items():
            self.first_byte[token_id] = char_to_byte.get(piece[0], -1)
        for added in tokenizer["added_tokens"]:
            self.first_byte[added["id"]] = -1
        self.tokenizer_size = 1 + max(tokenizer["model"]["vocab"].values())
        self.ids: dict[str, int] = tokenizer["model"]["vocab"]  # byte-level spelling -> id
        self.vocab_size = vocab_size


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def walk(
    matcher: GrammarMatcher, vocab: Vocab, seed: int, max_tokens: int = 400
) -> tuple[list[int], bool]:
    """Generate until EOS (or max_tokens); the tokens without the EOS, and whether it ended."""
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, bitmask_words(vocab.vocab_size)), dtype=np.int32)
    tokens: list[int] = []
    for _ in range(max_tokens):
        bitmask[:] = -1
        matcher.fill_bitmask(bitmask, 0)
        ids = allowed_ids(bitmask[0], vocab.vocab_size)
        assert len(ids), f"nothing allowed after {tokens}"
        assert ids.max() < vocab.tokenizer_size, f"id {ids.max()} is beyond the tokenizer"
        token = _pick(ids, vocab, rng)
        assert matcher.accept_token(token), f"allowed token {token} was refused after {tokens}"
        if token == EOS_ID:
            assert matcher.is_terminated()
            return tokens, True
        tokens.append(token)
    return tokens, False


def _pick(ids: np.ndarray, vocab: Vocab, rng: np.random.Generator) -> int:
    if EOS_ID in ids:
        return EOS_ID
    first = vocab.first_byte[ids]
    closing = ids[np.isin(first, list(CLOSERS))]
    if len(closing) and rng.random() < 0.5:
        return int(rng.choice(closing))
    byte = rng.choice(np.unique(first))
    return int(rng.choice(ids[first == byte]))
