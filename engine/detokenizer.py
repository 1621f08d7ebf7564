"""Incremental detokenization with stop strings that never leak into what was handed out."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.tokenizer import Tokenizer

# Prompt tokens fed to the stream first, so the first generated token decodes in context
# (a leading space is kept, a split UTF-8 character is completed).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a request's generated tokens into text one token at a time and watches for stops.

    Streaming callers take `text_delta()`; it holds back the last characters that could still
    be the start of a stop string, so a stop string is never sent and then taken back.
    """

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings: list[str] = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
            skip_special_tokens=params.skip_special_tokens,
        )
        self.output_text = ""
        self.stopped_on: str | None = None
        self.num_decoded = 0
        self._hold_back = 0
        if self.stop_strings and not self.include_stop:
            self._hold_back = max(len(s) for s in self.stop_strings) - 1
        self._sent = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode new tokens; return the stop string if one now appears (text is cut there).

        `num_decoded` says how many of the new tokens were read: all of them, or those up to
        the one that completed the stop string (a step may yield several tokens).
        """
        self.num_decoded = 0
        for token_id in new_token_ids:
            before = len(self.output_text)
            piece = self.stream.step(self.tokenizer.hf, token_id)
            self.num_decoded += 1
            if piece:
                self.output_text += piece
            if self.stop_strings and len(self.output_text) > before:
                stop = self._find_stop(before)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, new_from: int) -> str | None:
        """Look for a stop string that overlaps the text added since `new_from`."""
        best_at, best = -1, None
        for stop in self.stop_strings:
            at = self.output_text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best_at == -1 or at < best_at):
                best_at, best = at, stop
        if best is None:
            return None
        end = best_at + len(best) if self.include_stop else best_at
        self.output_text = self.output_text[:end]
        self.stopped_on = best
        return best

    def text_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back a possible stop-string prefix."""
        limit = len(self.output_text) if finished else len(self.output_text) - self._hold_back
        if limit <= self._sent:
            return ""
        delta = self.output_text[self._sent : limit]
        self._sent = limit
        return delta
