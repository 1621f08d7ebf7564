"""The xgrammar backend: grammars compiled ahead into per-rule token masks (imports torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xgrammar as xgr

from tidegate.engine.structured_output.backend import (
    MAX_JSON_WHITESPACE,
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
    byte_level_alphabet,
)
from tidegate.engine.structured_output.schema_check import (
    SchemaPolicy,
    check_schema,
    parse_schema,
    subschemas,
)

POLICY = SchemaPolicy(
    backend="xgrammar",
    # The formats llguidance implements too. xgrammar's are looser: its dates may be February 31
    # and its IPv4 octets may have leading zeros (a real model rarely writes either).
    formats=frozenset(
        {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
    ),
    # strict_mode: an object gets the properties its schema names, no others.
    extra_properties_by_default=False,
    single_keyword_nodes=True,
)
# The largest minLength/maxLength rewritten as a pattern (see _rewrite): its compile time grows
# quickly with the bound (54 ms at 256, 0.8 s at 1,000, 27 s at 5,000 on the small tokenizer).
MAX_STRING_LENGTH_BOUND = 256
# Batches at least this large fill their masks on xgrammar's threads (smaller: one by one).
BATCH_FILL_MIN = 16


class XGrammarMatcher(GrammarMatcher):
    """An xgrammar GrammarMatcher behind the common interface."""

    def __init__(self, matcher: xgr.GrammarMatcher, backend: XGrammarBackend) -> None:
        super().__init__(backend.eos_token_ids, backend.eos_row, backend.tokenizer_size)
        self.matcher = matcher
        # Whether only an EOS can come, known for the state it was computed in.
        self._state = 0
        self._exhausted_state = -1
        self._exhausted = False
        self._scratch: np.ndarray | None = None  # a one-row bitmask for that query

    def _advance(self, token_id: int) -> bool:
        if not self.matcher.accept_token(token_id):
            return False
        self._state += 1
        return True

    def _undo(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self._state += 1

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def _is_complete(self) -> bool:
        return self.matcher.is_completed()

    def _is_exhausted(self) -> bool:
        # xgrammar has no "nothing more can come" query: the mask says it. It is computed only
        # when the output is complete, at most once per state.
        if self._exhausted_state != self._state:
            self._exhausted_state = self._state
            self._exhausted = False
            if self.matcher.is_completed():
                if self._scratch is None:
                    self._scratch = np.zeros((1, len(self._eos_row)), dtype=np.int32)
                self.matcher.fill_next_token_bitmask(self._scratch, 0)
                self._exhausted = bool(np.array_equal(self._scratch[0], self._eos_row))
        return self._exhausted

    def _restart(self) -> None:
        self.matcher.reset()
        self._state += 1


class XGrammarBackend(StructuredOutputBackend):
    """Compiles with xgrammar's GrammarCompiler over the tokenizer's decoded vocabulary."""

    name = "xgrammar"

    def __init__(
        self, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        super().__init__(tokenizer_folder, vocab_size, eos_token_ids)
        self.tokenizer_info = tokenizer_info(
            json.loads(self.tokenizer_json), vocab_size, sorted(self.eos_token_ids)
        )
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        # The manager caches compiled grammars (bounded); xgrammar's own cache would not be.
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=threads, cache_enabled=False
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        """A matcher at the start of a compiled grammar."""
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Fill row i for matchers[i]; large batches on xgrammar's threads."""
        live = [(i, m) for i, m in enumerate(matchers) if not m.ended]
        if len(live) < BATCH_FILL_MIN:
            super().fill_bitmasks(matchers, bitmask)
            return
        for i, matcher in enumerate(matchers):
            if matcher.ended:
                matcher.fill_bitmask(bitmask, i)
        self._batch.batch_fill_next_token_bitmask(
            [m.matcher for _, m in live], bitmask, [i for i, _ in live]
        )

    def _compile_json(self, schema_text: str) -> xgr.CompiledGrammar:
        schema = parse_schema(schema_text)
        check_schema(schema, POLICY)
        return self.compiler.compile_json_schema(
            json.dumps(_rewrite(schema)),
            any_whitespace=True,
            max_whitespace_cnt=MAX_JSON_WHITESPACE,
            strict_mode=True,
        )

    def _compile_json_object(self) -> xgr.CompiledGrammar:
        return self.compiler.compile_json_schema(
            '{"type": "object"}',
            any_whitespace=True,
            max_whitespace_cnt=MAX_JSON_WHITESPACE,
            strict_mode=False,  # any properties
        )

    def _compile_regex(self, regex: str) -> xgr.CompiledGrammar:
        return self.compiler.compile_regex(regex)

    def _compile_choice(self, choices: list[str]) -> xgr.CompiledGrammar:
        # JSON string escapes are valid EBNF string literals.
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
        return self.compiler.compile_grammar(f"root ::= {alternatives}")

    def _compile_grammar(self, grammar: str) -> xgr.CompiledGrammar:
        if "::=" in grammar:
            return self.compiler.compile_grammar(grammar)
        return self.compiler.compile_lark(grammar)


def tokenizer_info(tokenizer: dict[str, Any], vocab_size: int, eos: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a tokenizer.json, built without transformers.

    Special added tokens are given as empty strings: xgrammar would otherwise read "<|user|>"
    as text that a JSON string may contain, and the detokenizer drops special tokens.
    """
    vocab = tokenizer.get("model", {}).get("vocab", {})
    pieces = dict(vocab) if isinstance(vocab, dict) else {p[0]: i for i, p in enumerate(vocab)}
    vocab_type, add_prefix_space = _vocab_type(tokenizer)
    encoded = [""] * (max(pieces.values(), default=-1) + 1)
    for piece, token_id in pieces.items():
        encoded[token_id] = piece
    for added in tokenizer.get("added_tokens") or []:
        encoded += [""] * (added["id"] + 1 - len(encoded))
        if added.get("special"):
            encoded[added["id"]] = ""
        elif vocab_type == xgr.VocabType.BYTE_LEVEL:
            encoded[added["id"]] = _byte_level(added["content"])
        else:
            encoded[added["id"]] = added["content"]
    return xgr.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=eos,
        add_prefix_space=add_prefix_space,
    )


def _vocab_type(tokenizer: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """How the vocabulary encodes bytes (GPT-2 byte level, <0xNN> byte fallback, or raw)."""
    decoder = tokenizer.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps if isinstance(step, dict)}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL, False
    # SentencePiece-style: "▁" stands for a space and a leading one is added to the text.
    add_prefix_space = "Metaspace" in json.dumps(tokenizer.get("pre_tokenizer")) or (
        "Prepend" in json.dumps(tokenizer.get("normalizer"))
    )
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK, add_prefix_space
    return xgr.VocabType.RAW, add_prefix_space


def _byte_level(text: str) -> str:
    """text in the GPT-2 byte-to-unicode alphabet that byte-level vocabularies use."""
    return "".join(_BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


_BYTE_TO_CHAR = byte_level_alphabet()


def _rewrite(schema: Any) -> Any:
    """The schema as xgrammar generates it right, changed in place.

    minLength/maxLength become a pattern: xgrammar generates a length-bounded string from a
    character class that admits raw control characters (invalid JSON), while its pattern
    strings escape them. oneOf becomes anyOf: check_schema has proved the branches disjoint,
    which xgrammar cannot always do (it then warns on stderr at every compile).
    """
    for _, node in subschemas(schema):
        if "oneOf" in node:
            node["anyOf"] = node.pop("oneOf")
        if "minLength" not in node and "maxLength" not in node:
            continue
        if "pattern" in node or "format" in node:
            continue  # refused by the policy
        low, high = node.pop("minLength", 0), node.pop("maxLength", None)
        if not isinstance(low, int) or not (high is None or isinstance(high, int)):
            raise GrammarError("json schema: minLength and maxLength must be integers")
        if max(low, high or 0) > MAX_STRING_LENGTH_BOUND:
            raise GrammarError(
                f"json schema: a string length bound above {MAX_STRING_LENGTH_BOUND} (got "
                f"{max(low, high or 0)}) is not supported by xgrammar; the guidance backend "
                "supports it"
            )
        node["pattern"] = f"^.{{{low},{'' if high is None else high}}}$"
    return schema
