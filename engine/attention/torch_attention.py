"""The `torch` attention backend: paged KV through plain indexing and PyTorch's SDPA.

It is the CPU default and the reference the Triton backend is tested against. Host work is
O(num_seqs): all decodes (query length 1) share one batched SDPA call over K/V gathered into a
padded tensor; each prefill chunk gets its own call with an offset causal mask. A sliding
window (the calling layer's) narrows both masks, and whole blocks before it are not gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidegate.engine.attention.backend import (
    STANDARD_KV_LAYOUT,
    AttentionMetadata,
    index_copy_into,
    to_cache_dtype,
)


class TorchAttentionBackend:
    """Paged attention for mixed prefill/decode batches with PyTorch ops only."""

    name = "torch"
    # Loops over the host copies of the metadata, and syncs to skip padding slots.
    cuda_graph_safe = False
    kv_layout = STANDARD_KV_LAYOUT

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store each token's key/value at its slot; tokens with a negative slot are skipped."""
        slots = meta.slot_mapping[: meta.num_tokens]
        key, value = key[: meta.num_tokens], value[: meta.num_tokens]
        valid = slots >= 0
        # One host sync on a GPU; this backend's priority there is being obviously right.
        if not bool(valid.all()):
            key, value, slots = key[valid], value[valid], slots[valid]
        for new, cache in ((key, k_cache), (value, v_cache)):
            slots_view = cache.view(-1, *cache.shape[2:])
            index_copy_into(slots_view, slots, to_cache_dtype(new, cache.dtype))

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        sliding_window: int = 0,
        logits_soft_cap: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of each new token over its sequence's cached keys (only the last
        `sliding_window` of them, itself included, when > 0; scores capped at
        `logits_soft_cap` when > 0)."""
        out = torch.empty_like(query)
        out[meta.num_tokens :].zero_()  # padding rows, if any: defined, never read
        starts = meta.query_start_loc_cpu[: meta.num_seqs + 1].long()
        seq_lens = meta.seq_lens_cpu[: meta.num_seqs].long()
        query_lens = starts[1:] - starts[:-1]
        decodes = (query_lens == 1).nonzero().flatten()
        # A windowed decode reads at most about a window of keys, however long its sequence:
        # group by what is read, so that long windowed decodes are not split off for nothing.
        read_lens = seq_lens.clamp_max(sliding_window) if sliding_window > 0 else seq_lens
        for group in _length_groups(decodes, read_lens):
            rows = starts[group].to(query.device)
            tables = meta.block_table[group.to(query.device)]
            q = query.index_select(0, rows)
            o = _decode_batch(
                q,
                k_cache,
                v_cache,
                tables,
                seq_lens[group],
                softmax_scale,
                sliding_window,
                logits_soft_cap,
            )
            out.index_copy_(0, rows, o)
        for i in (query_lens > 1).nonzero().flatten().tolist():
            start, end = int(starts[i]), int(starts[i + 1])
            out[start:end] = attend_chunk(
                query[start:end],
                k_cache,
                v_cache,
                meta.block_table[i],
                int(seq_lens[i]),
                softmax_scale,
                sliding_window,
                logits_soft_cap,
            )
        return out


def _length_groups(decodes: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Decodes split into groups of similar length, each padded only to its own longest.

    One batch padded to the longest sequence would make a single 4k-token conversation
    multiply the attention work of a hundred short ones; within a group the longest is at
    most twice the shortest (plus a little), so padding at most doubles a group's work.
    """
    if decodes.numel() == 0:
        return []
    lens = seq_lens[decodes]
    order = lens.argsort()
    decodes, lens = decodes[order], lens[order].tolist()
    groups, first = [], 0
    for i, length in enumerate(lens):
        if length > 2 * lens[first] + 64:
            groups.append(decodes[first:i])
            first = i
    groups.append(decodes[first:])
    return groups


def _decode_batch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    cap: float = 0.0,
) -> torch.Tensor:
    """One SDPA call for D single-token queries [D, H, Dh], keys padded to the longest.

    seq_lens: a host tensor. With a window W > 0 each query sees its last W keys only.
    """
    block_size = k_cache.shape[1]
    if window >= int(seq_lens.max()):
        window = 0  # every key is inside the window: no extra mask, nothing to skip
    if window > 0:
        # Whole blocks before the window are not gathered: each sequence's keys start at the
        # block holding its first visible key, and positions below count from there (the
        # causal and window masks only compare positions, so a shift changes neither).
        first = (seq_lens - window).clamp_min(0) // block_size  # [D] first block read
        seq_lens = seq_lens - first * block_size
        num_blocks = -(-int(seq_lens.max()) // block_size)
        # Columns past a sequence's own blocks (a shorter one, padded) are clamped into the
        # table; the keys they point to lie past its seq_len and are masked out.
        columns = first[:, None] + torch.arange(num_blocks)
        columns = columns.clamp_max(block_tables.shape[1] - 1).to(block_tables.device)
        tables = block_tables.long().gather(1, columns)
    else:
        num_blocks = -(-int(seq_lens.max()) // block_size)
        tables = block_tables[:, :num_blocks].long()
    # Block-table padding may hold anything (even -1); the keys it points to are masked out.
    tables = tables.clamp_min(0)
    keys = _heads_first(
        _gather_blocks(k_cache, tables, query.dtype).flatten(1, 2)
    )  # [D, Hkv, S, Dh]
    values = _heads_first(_gather_blocks(v_cache, tables, query.dtype).flatten(1, 2))
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    # The query heads sharing a KV head act as that head's "query positions" (GQA), so no
    # K/V is repeated; the mask [D, 1, 1, S] hides each sequence's padding.
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    key_pos = torch.arange(keys.shape[2], device=query.device)
    seq_lens = seq_lens.to(query.device)[:, None]
    mask = key_pos[None, :] < seq_lens
    if window > 0:
        mask &= key_pos[None, :] >= seq_lens - window
    o = _attention(q, keys, values, mask[:, None, None], scale, cap)
    return o.reshape(num_decodes, num_heads, head_dim)


def _attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float,
    gqa: bool = False,
) -> torch.Tensor:
    """SDPA with a boolean mask; with a cap C > 0 the same attention written out, each
    scaled score s as C * tanh(s / C) before the mask and an fp32 softmax (SDPA has no cap).
    `gqa`: query heads outnumber the key heads, each group of them reading one."""
    if not cap:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    if gqa:
        group = query.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    scores = (query @ keys.transpose(-1, -2)).float() * scale
    scores = (torch.tanh(scores / cap) * cap).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).to(values.dtype) @ values


def _gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """cache[block_ids] for any shape of ids, in `dtype` (an FP8 cache's blocks widened to the
    queries' dtype); index_select is several times faster on CPU."""
    picked = cache.index_select(0, block_ids.reshape(-1)).to(dtype)
    return picked.view(*block_ids.shape, *cache.shape[1:])


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[..., S, H, D] -> [..., H, S, D]."""
    return x.transpose(-3, -2)


def attend_chunk(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of one sequence's chunk of L new tokens, after seq_len - L cached ones."""
    block_size = k_cache.shape[1]
    first = 0
    if sliding_window > 0:
        # The chunk's first token sees no key before context_len - W + 1, and the later ones
        # none before that either: whole blocks before it are not gathered. The masks only
        # compare positions, so counting them from the first block read changes nothing.
        context_len = seq_len - query.shape[0]
        first = max(0, context_len - sliding_window + 1) // block_size
    blocks = block_table[first : -(-seq_len // block_size)].long()
    keys = _gather_blocks(k_cache, blocks, query.dtype).flatten(0, 1)  # [S up to blocks, Hkv, Dh]
    values = _gather_blocks(v_cache, blocks, query.dtype).flatten(0, 1)
    seq_len -= first * block_size
    return attend_gathered(query, keys, values, seq_len, scale, sliding_window, logits_soft_cap)


def attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """`attend_chunk` over keys and values already gathered: [>= seq_len, Hkv, Dh], the
    sequence's positions in order (a last block's tail past seq_len is ignored)."""
    query_len = query.shape[0]
    context_len = seq_len - query_len
    if sliding_window >= seq_len:
        sliding_window = 0  # every key is inside the window: the plain causal paths serve
    keys = _heads_first(keys[:seq_len])  # [Hkv, S, Dh]
    values = _heads_first(values[:seq_len])
    # A leading batch dimension matters: SDPA's fused CPU kernel takes only 4-D inputs, and
    # 3-D ones fall back to the quadratic-memory math path (10x slower on 2k-token prompts).
    q = _heads_first(query)[None]  # [1, H, L, Dh]
    keys, values = keys[None], values[None]
    if context_len == 0 and sliding_window == 0 and not logits_soft_cap:
        o = F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # SDPA's is_causal aligns to the top-left; the chunk sits at the bottom-right. It has
        # no window either: a windowed chunk needs this explicit mask even without context.
        key_pos = torch.arange(seq_len, device=query.device)
        query_pos = torch.arange(context_len, seq_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if sliding_window > 0:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        o = _attention(q, keys, values, mask, scale, logits_soft_cap, gqa=True)
    o = o[0]
    return _heads_first(o)
