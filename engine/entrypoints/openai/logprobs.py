"""The engine's per-token logprobs in OpenAI's two formats (legacy completions, chat)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tidegate.engine.entrypoints.openai.responses import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from tidegate.engine.outputs import Logprob
from tidegate.engine.tokenizer import Tokenizer

# OpenAI reports -inf (a token the sampler could never pick) as -9999.0; JSON has no -inf.
_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return _FLOOR if math.isnan(logprob) else max(logprob, _FLOOR)


def _token_text(tokenizer: Tokenizer, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, Logprob], num: int) -> list[Logprob]:
    """The num most likely candidates at one position (the sampled token may be among them)."""
    ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else math.inf)
    return ranked[:num]


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int = 0,
    result: CompletionLogprobs | None = None,
) -> CompletionLogprobs:
    """Legacy format; each top_logprobs dict also holds the sampled token (up to num_top + 1).

    An entry of None (a prompt's first token, echoed) is listed with null logprobs. `result`
    is extended when given (an echoed prompt's tokens, then the completion's).
    """
    result = result if result is not None else CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        sampled = entry.get(token_id) if entry is not None else None
        token = _token_text(tokenizer, token_id, sampled)
        result.tokens.append(token)
        result.token_logprobs.append(_value(sampled.logprob) if sampled is not None else None)
        top = None
        if entry is not None:
            top = {
                _token_text(tokenizer, lp.token_id, lp): _value(lp.logprob)
                for lp in _top(entry, num_top)
            }
            if sampled is not None:
                top.setdefault(token, _value(sampled.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
) -> ChatLogprobs:
    """Chat format: per token its text, logprob, UTF-8 bytes and the num_top most likely."""

    def top_logprob(token_id: int, logprob: Logprob | None) -> TopLogprob:
        token = _token_text(tokenizer, token_id, logprob)
        value = _value(logprob.logprob) if logprob is not None else _FLOOR
        return TopLogprob(token=token, logprob=value, bytes=list(token.encode("utf-8")))

    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        sampled = top_logprob(token_id, entry.get(token_id))
        content.append(
            ChatLogprobToken(
                **sampled.model_dump(),
                top_logprobs=[top_logprob(lp.token_id, lp) for lp in _top(entry, num_top)],
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs_entries(
    logprobs: Sequence[dict[int, Logprob] | None] | None, num_top: int | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt token its own entry and the num_top most likely;
    None unless the request asked (num_top) and they came (logprobs)."""
    if num_top is None or logprobs is None:
        return None
    entries: list[dict[str, PromptLogprob] | None] = []
    for position in logprobs:
        if position is None:
            entries.append(None)
            continue
        # The dict lists the prompt's token first, then the top k in rank order.
        kept = list(position.values())[: num_top + 1]
        entries.append(
            {
                str(lp.token_id): {
                    "logprob": _value(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for lp in kept
            }
        )
    return entries
