"""The attention backend interface: one metadata object per step, shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and where its KV lives.

    The batch is flattened: sequence i owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; its keys are the ``seq_lens[i]`` tokens of
    context *including* the new ones, found through ``block_table[i]``. A new token at query
    offset ``j`` attends to key positions ``< seq_lens[i] - query_len_i + j + 1``.
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; block_id * block_size + offset, -1 = skip
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    # Host copies of the small per-sequence arrays, so CPU backends need no device sync.
    query_start_loc_cpu: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens_cpu: torch.Tensor  # int32 [num_seqs]


class KVLayout:
    """How a backend stores one layer's paged keys and values.

    This base class is the standard layout: k_cache and v_cache each
    `[num_blocks, block_size, num_kv_heads, head_dim]`, as the torch and triton backends keep
    them and as KV transfer sends them. A backend whose kernel reads another order subclasses
    it; the conversions take and give whole blocks.
    """

    name = "standard"

    def shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The shape of one layer's k_cache (v_cache has the same)."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def to_standard(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks as stored (e.g. `cache.index_select(0, ids)`) -> standard `[n, block_size,
        num_kv_heads, head_dim]` keys and values."""
        return keys, values

    def from_standard(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard blocks -> blocks as stored, for `cache.index_copy_(0, ids, ...)`."""
        return keys, values


STANDARD_KV_LAYOUT = KVLayout()

# --kv-cache-dtype: what the caches store, beside "auto" (the model's dtype). FP8 keys and
# values have no scales: a value keeps 3 mantissa bits, and magnitudes above 448 are clipped
# (a cast would make them NaN), which keys and values of trained models stay far below.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV caches for --kv-cache-dtype `name`."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv cache dtype {name!r} is not one of auto, {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name]


def index_copy_into(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """cache.index_copy_(0, index, rows), for FP8 caches too: torch copies those as bytes
    (it has no FP8 index_copy_ on CPU), which is what a copy of one dtype into itself is."""
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(0, index, rows)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as the cache stores them (FP8: clipped to its range, then rounded)."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype.itemsize == 1 and cache_dtype.is_floating_point:
        limit = torch.finfo(cache_dtype).max
        x = x.clamp(-limit, limit)
    return x.to(cache_dtype)


class AttentionBackend(Protocol):
    """What every backend (torch, triton, cpu) provides; the model calls only these two.

    `attend`'s `sliding_window` is the calling layer's own, since layers of one model may
    differ (Gemma 3 windows five layers in six): with W > 0 the token at position p sees only
    keys at positions p - W < k <= p (W keys, itself included), as Hugging Face's masks
    define it; 0 means full causal attention. `logits_soft_cap` C > 0 (Gemma 2's
    attn_logit_softcapping) replaces each scaled score s by C * tanh(s / C) before the
    softmax; 0 leaves scores as they are.

    `cuda_graph_safe`: during a step the backend reads only device tensors of the metadata
    (never its host copies or a device value synced to the host), so a CUDA graph captured
    with one metadata object stays right when the buffers behind it change.

    `kv_layout`: how k_cache and v_cache are laid out; the model runner allocates them with
    its `shape`, and KV transfer converts blocks through it to and from the standard layout.
    """

    name: str
    cuda_graph_safe: bool
    kv_layout: KVLayout

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # shaped by kv_layout
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        sliding_window: int = 0,
        logits_soft_cap: float = 0.0,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]
