"""Paged attention as one opaque op, so that torch.compile can take the rest of the model.

The backends read per-step metadata (host copies of sequence lengths, Python loops over
prefill chunks) that a compiled graph would either specialise on, recompiling every step, or
fail to trace. So the model calls `paged_attention(q, k, v, layer, scale, sliding_window)`:
eagerly it is a plain call; under torch.compile it is the custom op `tidegate::paged_attention`,
which the compiler treats as a black box with a known output shape (piecewise compilation, as
vLLM's `unified_attention`). The step's metadata, KV caches and backend are not op arguments:
the model sets them for the duration of one forward with `attention_context(...)`, and the op
looks them up, so the compiled graph sees only the token-sized q/k/v. The sliding window (0:
none) is an argument, not part of the context, because it is the layer's own: one step serves
windowed and full layers alike (Gemma 3).

A backend may also do a whole layer in one op of its own (`layer_op`, the `cpu` backend's
C++ op): it then gets the step's caches and metadata through `begin_step` when the context
opens (and `end_step` when it closes), and the model calls that op instead of this one, with
no Python per layer (`layer_attention_op`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tidegate.engine.attention.backend import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), in the backend's kv_layout


@dataclass
class _AttentionContext:
    backend: AttentionBackend
    kv_caches: list[KVCache]
    meta: AttentionMetadata


_context: _AttentionContext | None = None


@contextmanager
def attention_context(
    backend: AttentionBackend, kv_caches: list[KVCache], meta: AttentionMetadata
) -> Iterator[None]:
    """Make one step's backend, caches and metadata visible to every layer's attention."""
    global _context
    previous, _context = _context, _AttentionContext(backend, kv_caches, meta)
    begin_step = getattr(backend, "begin_step", None)
    if begin_step is not None:
        begin_step(kv_caches, meta)
    try:
        yield
    finally:
        _context = previous
        if begin_step is not None:
            backend.end_step()
        # A backend's step state is per process, as this context: an enclosing step's again.
        if previous is not None and hasattr(previous.backend, "begin_step"):
            previous.backend.begin_step(previous.kv_caches, previous.meta)


def layer_attention_op(backend: AttentionBackend):
    """The backend's op for a whole layer (q, k, v, layer, scale, sliding_window,
    logits_soft_cap) -> out, or None: then the model calls `paged_attention`."""
    return getattr(backend, "layer_op", None)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Write this layer's new keys/values to its cache, then attend (only the last
    `sliding_window` keys when > 0, scores capped at `logits_soft_cap` when > 0); [T, H, D]
    out."""
    args = (query, key, value, layer, scale, sliding_window, logits_soft_cap)
    if torch.compiler.is_compiling():
        return torch.ops.tidegate.paged_attention(*args)
    return _paged_attention(*args)


@torch.library.custom_op("tidegate::paged_attention", mutates_args=())
def _paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
) -> torch.Tensor:
    # The cache write is a side effect the compiler never sees: nothing in the graph reads
    # the caches, and this op's output (which depends on the write) keeps it from being dropped.
    if _context is None:
        raise RuntimeError("paged_attention called outside attention_context(...)")
    k_cache, v_cache = _context.kv_caches[layer]
    _context.backend.write_kv(key, value, k_cache, v_cache, _context.meta)
    return _context.backend.attend(
        query, k_cache, v_cache, _context.meta, scale, sliding_window, logits_soft_cap
    )


@_paged_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
):
    return torch.empty_like(query)
