"""The llguidance backend: an Earley parser over a token trie, masks computed lazily per step."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

from tidegate.engine.structured_output.backend import (
    MAX_JSON_WHITESPACE,
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
)
from tidegate.engine.structured_output.schema_check import SchemaPolicy, check_schema, parse_schema

POLICY = SchemaPolicy(
    backend="guidance",
    formats=frozenset(
        {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
    ),
    # JSON Schema's default: properties beyond 'properties' are allowed unless it says false.
    extra_properties_by_default=True,
)
JSON_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}",
    # Set so that a schema's own "x-guidance" cannot make the compiler ignore keywords.
    "lenient": False,
    # oneOf is compiled as anyOf: check_schema has refused any oneOf whose branches overlap.
    "coerce_one_of": True,
}
# Batches at least this large fill their masks on llguidance's threads (smaller: one by one).
BATCH_FILL_MIN = 16


class GuidanceMatcher(GrammarMatcher):
    """An llguidance LLMatcher behind the common interface."""

    def __init__(self, matcher: llguidance.LLMatcher, backend: GuidanceBackend) -> None:
        super().__init__(backend.eos_token_ids, backend.eos_row, backend.tokenizer_size)
        self.matcher = matcher

    def _advance(self, token_id: int) -> bool:
        # A refused token would leave the LLMatcher in its error state for good: ask first.
        if self.matcher.validate_tokens([token_id]) != 1:
            return False
        return self.matcher.consume_token(token_id)

    def _undo(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():
            # An internal limit was hit mid-output: end it rather than allow nothing.
            bitmask[row] = self._eos_row

    def _is_complete(self) -> bool:
        return self.matcher.is_accepting() or self.matcher.is_error()

    def _is_exhausted(self) -> bool:
        return self.matcher.is_stopped()

    def _restart(self) -> None:
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    """Compiles with llguidance over an LLTokenizer read straight from tokenizer.json."""

    name = "guidance"

    def __init__(
        self, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        super().__init__(tokenizer_folder, vocab_size, eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(
            self.tokenizer_json, n_vocab=vocab_size, eos_token=sorted(self.eos_token_ids)
        )
        self._executor = llguidance.LLExecutor(num_threads=max(1, (os.cpu_count() or 2) // 2))

    def new_matcher(self, compiled: llguidance.LLMatcher) -> GuidanceMatcher:
        """A matcher at the start of a compiled grammar (a copy of the compiled one)."""
        return GuidanceMatcher(compiled.deep_copy(), self)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Fill row i for matchers[i]; large batches on llguidance's threads."""
        live = [(m.matcher, i) for i, m in enumerate(matchers) if not m.ended]
        if len(live) < BATCH_FILL_MIN:
            super().fill_bitmasks(matchers, bitmask)
            return
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, bitmask)
        for i, matcher in enumerate(matchers):
            if matcher.ended or matcher.matcher.is_error():
                bitmask[i] = self.eos_row

    def _compile_json(self, schema_text: str) -> llguidance.LLMatcher:
        schema = parse_schema(schema_text)
        check_schema(schema, POLICY)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        return self._matcher("json schema", grammar)

    def _compile_json_object(self) -> llguidance.LLMatcher:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_OPTIONS
        )
        return self._matcher("json_object", grammar)

    def _compile_regex(self, regex: str) -> llguidance.LLMatcher:
        return self._matcher("regex", llguidance.LLMatcher.grammar_from_regex(regex))

    def _compile_choice(self, choices: list[str]) -> llguidance.LLMatcher:
        return self._matcher("choice", llguidance.grammar_from("choice", json.dumps(choices)))

    def _compile_grammar(self, grammar: str) -> llguidance.LLMatcher:
        return self._matcher("grammar", llguidance.grammar_from("grammar", grammar))

    def _matcher(self, kind: str, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar: a matcher at its start, which new matchers copy."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{kind}: {_guidance_message(matcher.get_error(), kind)}")
        return matcher


def _guidance_message(error: str, kind: str) -> str:
    """llguidance's error in one line, with unimplemented keywords named like schema_check's."""
    lines = [line.strip() for line in error.strip().splitlines()] or ["invalid grammar"]
    first = lines[0]
    if first.startswith("Unimplemented keys: "):
        keys = json.loads(first.removeprefix("Unimplemented keys: "))
        return f"{', '.join(repr(k) for k in keys)} is not supported by guidance"
    if kind == "regex":
        # The regex was wrapped as the Lark rule `start: /.../`: its positions are the rule's.
        first = re.sub(r"^at \d+\(\d+\): ", "", first).removesuffix(
            " (in regex): regex parse error:"
        )
        reason = next((line[len("error: ") :] for line in lines if line.startswith("error: ")), "")
        return f"{first}: {reason}" if reason else first
    return first
