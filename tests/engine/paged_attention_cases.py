"""Paged-attention test cases shared by the kernel tests of every backend.

A batch is a list of (context_len, query_len) pairs; its sequences get shuffled block ids,
a -1-padded, strided block table and a cache poisoned with NaN wherever no sequence has a
token, so that a stray read shows. The reference is dense fp32 attention per sequence.
Caches here are in the standard layout `[blocks, block_size, kv_heads, head_dim]`; tests of
the cpu backend pack them (`cpu_attention.pack_kv`) before handing them over.
"""

from __future__ import annotations

import random

import torch

from tidegate.engine.attention.backend import AttentionMetadata

NUM_KV_HEADS = 2


def paged_batch(
    chunks: list[tuple[int, int]], block_size: int, rng: random.Random, device: str = "cpu"
) -> tuple[AttentionMetadata, list[list[int]], int]:
    """Metadata for sequences given as (context_len, query_len), on shuffled block ids.

    Returns the metadata, each sequence's block ids and the number of cache blocks. The
    block table is padded with -1 and is a column slice of a wider tensor (row stride >
    width), and a few blocks belong to nobody.
    """
    needed = [-(-(c + q) // block_size) for c, q in chunks]
    num_blocks = sum(needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    slots, starts = [], [0]
    for (context_len, query_len), table in zip(chunks, tables, strict=True):
        seq_len = context_len + query_len
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(context_len, seq_len)
        ]
        starts.append(starts[-1] + query_len)
    width = max(needed) + 2
    padded = [t + [-1] * (width + 3 - len(t)) for t in tables]
    block_table = torch.tensor(padded, dtype=torch.int32, device=device)[:, :width]
    seq_lens = torch.tensor([c + q for c, q in chunks], dtype=torch.int32)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_seqs=len(chunks),
        num_tokens=starts[-1],
        max_query_len=max(q for _, q in chunks),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return meta, tables, num_blocks


def poisoned_cache(
    chunks, tables, num_blocks, block_size, head_dim, dtype, device: str = "cpu"
) -> torch.Tensor:
    """Random keys where sequences have tokens, NaN everywhere else: a stray read shows.
    Poisoned in fp32, then rounded to `dtype` (FP8 tensors take no masked writes)."""
    cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for (context_len, query_len), table in zip(chunks, tables, strict=True):
        for p in range(context_len + query_len):
            used[table[p // block_size], p % block_size] = True
    cache[~used] = float("nan")
    return cache.to(dtype).to(device)


def reference_attention(query, k_cache, v_cache, chunks, tables, scale, window=None, cap=None):
    """Per sequence: dense fp32 scores over gathered keys with an explicit causal mask; with
    `cap`, each scaled score s is cap * tanh(s / cap) first (Gemma 2's soft cap)."""
    query, k_cache, v_cache = query.cpu(), k_cache.cpu(), v_cache.cpu()
    block_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    out, start = [], 0
    for (context_len, query_len), table in zip(chunks, tables, strict=True):
        seq_len = context_len + query_len
        positions = torch.arange(seq_len)
        blocks = torch.tensor(table)[positions // block_size]
        keys = k_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        q = query[start : start + query_len].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", q, keys) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        query_pos = context_len + torch.arange(query_len)
        allowed = positions[None, :] <= query_pos[:, None]
        if window is not None:
            # The last `window` keys, the token itself included.
            allowed &= positions[None, :] > query_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hls,shd->lhd", scores.softmax(-1), values))
        start += query_len
    return torch.cat(out)


def mixed_chunks(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """Decodes, prefix-cache hits, chunks after mid-block context and fresh prompts."""
    chunks = [(rng.randint(1, 90), 1) for _ in range(3)]  # decodes, mostly mid-block
    chunks.append((0, 1))  # a one-token prompt: a "decode" without context
    chunks.append((2 * block_size, rng.randint(2, 12)))  # prefix-cache hit on whole blocks
    chunks.append((rng.randint(1, 70), rng.randint(2, 30)))  # chunk after mid-block context
    chunks.append((0, rng.randint(2, 40)))  # fresh prefill
    rng.shuffle(chunks)
    return chunks
