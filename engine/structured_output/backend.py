"""The grammar backend interface of structured outputs: compile a constraint, then match tokens.

Two libraries implement it: xgrammar (`xgrammar_backend.py`) and llguidance
(`guidance_backend.py`). Both compile the same constraints (`StructuredOutputsParams`), refuse
the JSON schema keywords they would otherwise ignore (`schema_check.py`) and fill the same
bitmask: int32 words, bit `i % 32` of word `i // 32` set when token `i` may come next.

Why "auto" is guidance (benchmarks/structured_backends.py, results/structured_backends.json;
small model's tokenizer, 32,000 logits, 2 busy cores): a fresh engine core serves the whole
corpus once in 0.6 s with llguidance against 9.1 s with xgrammar. xgrammar's import brings
torch and transformers into the engine core (8.6 s there, 2.6 s on a quiet machine, and 267 MB
against 52 MB), which the first constrained request waits for; its compiles are slower (median
3.9 ms against 0.7 ms, worst 126 ms against 2 ms: it precomputes token masks per rule, where
llguidance computes them lazily). Once grammars are cached xgrammar is the faster one per token
(28 against 48 us for a fill and an accept; a 16-row step's fill about the same, 152 against
157 us), a small share of a CPU decode step either way. llguidance also refuses what it does
not implement where xgrammar ignores it, and its outputs were valid UTF-8 in every random walk
(xgrammar let through a surrogate or overlong byte sequence in 1 to 4 strings of 200).
"""

from __future__ import annotations

import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tidegate.engine.sampling_params import StructuredOutputsParams

BACKENDS = ("xgrammar", "guidance")
# The measured default (see the module docstring).
DEFAULT_BACKEND = "guidance"
# The install that brings each grammar library: llguidance comes with the engine, xgrammar
# (which pulls transformers and triton) with an extra of its own.
PIP_EXTRA = {"llguidance": "tidegate[engine]", "xgrammar": "tidegate[xgrammar]"}
# Whitespace a generated JSON may hold between two tokens of its syntax: room for a newline and
# deep indentation, but a model cannot spend its whole budget on blanks.
MAX_JSON_WHITESPACE = 32


class GrammarError(ValueError):
    """An invalid or unsupported constraint; the message names the problem and its place."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words one row of the bitmask takes: ceil(vocab_size / 32)."""
    return -(-vocab_size // 32)


def token_bits(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """A bitmask row (int32 words) with exactly the given tokens allowed."""
    words = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
    for token_id in token_ids:
        words[token_id // 32] |= np.uint32(1 << (token_id % 32))
    return words.view(np.int32)


class GrammarMatcher(ABC):
    """One request's place in its grammar: which tokens may come next.

    The EOS tokens are handled here, not by the libraries (each treats an EOS differently on
    rollback): an EOS is accepted once the output is complete, and ends the matcher.
    """

    def __init__(self, eos_token_ids: frozenset[int], eos_row: np.ndarray, tokenizer_size: int):
        self._eos_token_ids = eos_token_ids
        self._eos_row = eos_row
        self._tokenizer_size = tokenizer_size
        self._num_tokens = 0  # accepted tokens the library holds (an EOS is not one)
        self._ended = False  # an EOS was accepted

    def accept_token(self, token_id: int) -> bool:
        """Advance over one token; False (and the state unchanged) if the grammar forbids it."""
        if self._ended or not 0 <= token_id < self._tokenizer_size:
            return False
        if token_id in self._eos_token_ids:
            self._ended = self._is_complete()
            return self._ended
        if not self._advance(token_id):
            return False
        self._num_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        accepted = self._num_tokens + self._ended
        if not 0 <= num_tokens <= accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {accepted} were accepted")
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            self._undo(num_tokens)
            self._num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (only EOS once the matcher ended)."""
        if self._ended:
            bitmask[row] = self._eos_row
        else:
            self._fill(bitmask, row)

    def is_terminated(self) -> bool:
        """True once an EOS was accepted, or when the grammar can take nothing but an EOS."""
        return self._ended or self._is_exhausted()

    @property
    def ended(self) -> bool:
        """True once an EOS was accepted."""
        return self._ended

    def reset(self) -> None:
        """Go back to the start of the grammar."""
        self._ended = False
        self._num_tokens = 0
        self._restart()

    @abstractmethod
    def _advance(self, token_id: int) -> bool:
        """Accept a non-EOS token in the library; False and no change if it is forbidden."""

    @abstractmethod
    def _undo(self, num_tokens: int) -> None:
        """Roll the library back over num_tokens non-EOS tokens."""

    @abstractmethod
    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        """The library's mask for the next token, EOS ids included when complete."""

    @abstractmethod
    def _is_complete(self) -> bool:
        """True when the output so far satisfies the grammar (an EOS may come)."""

    @abstractmethod
    def _is_exhausted(self) -> bool:
        """True when no token but an EOS can come."""

    @abstractmethod
    def _restart(self) -> None:
        """Reset the library's state."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and makes matchers over the compiled grammars."""

    name: str

    def __init__(
        self, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        path = Path(tokenizer_folder) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{tokenizer_folder} has no tokenizer.json (structured outputs need it)"
            )
        self.tokenizer_json = path.read_text(encoding="utf-8")
        self.tokenizer_size = tokenizer_size(json.loads(self.tokenizer_json))
        if vocab_size < self.tokenizer_size:
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer's {self.tokenizer_size} "
                "tokens; it must be the model's logits width, at least the tokenizer's size"
            )
        self.vocab_size = vocab_size
        eos_token_ids = list(eos_token_ids)
        # An EOS id the tokenizer lacks could never be sampled under a mask: it is left out.
        self.eos_token_ids = frozenset(t for t in eos_token_ids if 0 <= t < self.tokenizer_size)
        if not self.eos_token_ids:
            raise ValueError(
                f"no EOS token id below the tokenizer's size {self.tokenizer_size} "
                f"(got {sorted(eos_token_ids)}); constrained outputs could never end"
            )
        self.eos_row = token_bits(self.eos_token_ids, vocab_size)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile a constraint (thread-safe); raises GrammarError when it is invalid."""
        kind = params.kind
        try:
            if kind == "json":
                return self._compile_json(params.json)
            if kind == "json_object":
                return self._compile_json_object()
            if kind == "regex":
                return self._compile_regex(params.regex)
            if kind == "choice":
                return self._compile_choice(params.choice)
            return self._compile_grammar(params.grammar)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as error:
            # The libraries raise plain errors for bad input; they become the user's error.
            label = "json schema" if kind == "json" else kind
            raise GrammarError(f"{label}: {library_message(error)}") from error

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of a compiled grammar."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Fill row i of bitmask for matchers[i]."""
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)

    @abstractmethod
    def _compile_json(self, schema_text: str) -> Any: ...

    @abstractmethod
    def _compile_json_object(self) -> Any: ...

    @abstractmethod
    def _compile_regex(self, regex: str) -> Any: ...

    @abstractmethod
    def _compile_choice(self, choices: list[str]) -> Any: ...

    @abstractmethod
    def _compile_grammar(self, grammar: str) -> Any: ...


def tokenizer_size(tokenizer: dict[str, Any]) -> int:
    """Token ids a Hugging Face tokenizer.json defines: its largest id plus one."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    # BPE and WordPiece map tokens to ids; Unigram lists [piece, score] in id order.
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
    ids += [added["id"] for added in tokenizer.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def library_message(error: BaseException) -> str:
    """A library's error as one line, without the C++ source location xgrammar puts first."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    # xgrammar: "[18:06:52] /project/cpp/json_schema_converter.cc:5082: the message"
    if first.startswith("[") and ".cc:" in first:
        first = first.split(": ", 1)[-1]
    return first


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character table: how byte-level BPE vocabularies spell each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return [table[b] for b in range(256)]


def require_library(name: str) -> str:
    """The backend `name` ("auto", "xgrammar" or "guidance") stands for, once its library is
    known to be installed (a ValueError naming the install otherwise); imports nothing."""
    if name == "auto":
        name = DEFAULT_BACKEND
    if name not in BACKENDS:
        raise ValueError(
            f"structured outputs backend {name!r} is not known; choose auto, xgrammar or guidance"
        )
    library = "xgrammar" if name == "xgrammar" else "llguidance"
    if importlib.util.find_spec(library) is None:
        raise ValueError(
            f"structured outputs backend {name!r} needs the {library} package, which is not "
            f"installed; install it with pip install '{PIP_EXTRA[library]}'"
        )
    return name


def create_backend(
    name: str, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: Iterable[int]
) -> StructuredOutputBackend:
    """The backend called name ("auto", "xgrammar" or "guidance") for a tokenizer folder."""
    name = require_library(name)
    if name == "xgrammar":
        from tidegate.engine.structured_output.xgrammar_backend import XGrammarBackend as cls
    else:
        from tidegate.engine.structured_output.guidance_backend import GuidanceBackend as cls
    return cls(tokenizer_folder, vocab_size, eos_token_ids)
