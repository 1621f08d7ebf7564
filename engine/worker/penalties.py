"""Repetition, presence and frequency penalties over a batch of token histories."""

from __future__ import annotations

from itertools import chain

import torch


def pad_token_ids(
    token_ids: list[list[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """Stack ragged token lists into one [N, max_len] int64 tensor, padded with pad_id."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    width = int(lengths.max()) if len(token_ids) else 0
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)
    padded = torch.full((len(token_ids), width), pad_id, dtype=torch.int64)
    # A row-major boolean mask visits the slots in the same order as the flattened lists.
    padded[torch.arange(width) < lengths[:, None]] = flat
    return padded.to(device)


def token_counts(padded_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """How often each vocab id occurs in each row of a tensor padded with vocab_size."""
    counts = torch.zeros(padded_ids.shape[0], vocab_size + 1, dtype=dtype, device=padded_ids.device)
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids, dtype=dtype))
    # The extra column collected the padding; drop it.
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """Return logits with the penalties applied; a None penalty tensor means no row uses it."""
    if repetition_penalties is None and presence_penalties is None:
        return logits
    assert output_token_ids is not None
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.dtype)
    if repetition_penalties is not None:
        # Hugging Face semantics: any token seen in prompt or output is made less likely,
        # dividing positive logits and multiplying negative ones.
        assert prompt_token_ids is not None
        prompt_counts = token_counts(prompt_token_ids, vocab_size, logits.dtype)
        seen = (prompt_counts > 0) | (output_counts > 0)
        penalty = repetition_penalties[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if presence_penalties is not None:
        # OpenAI semantics: only generated tokens count, not the prompt.
        assert frequency_penalties is not None
        logits = (
            logits
            - frequency_penalties[:, None] * output_counts
            - presence_penalties[:, None] * (output_counts > 0).to(logits.dtype)
        )
    return logits
