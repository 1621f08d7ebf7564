"""The torch attention backend equals dense causal attention, for any mix of sequences."""

from __future__ import annotations

import random

import pytest
import torch

from tidegate.engine.attention import TorchAttentionBackend, get_attention_backend
from tidegate.engine.attention.backend import AttentionMetadata

NUM_KV_HEADS = 2
HEAD_DIM = 32
NUM_BLOCKS = 64


def paged_batch(
    chunks: list[tuple[int, int]], block_size: int, rng: random.Random
) -> tuple[AttentionMetadata, list[list[int]]]:
    """Metadata for sequences given as (context_len, query_len), on shuffled block ids."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables, slots, starts = [], [], [0]
    for context_len, query_len in chunks:
        seq_len = context_len + query_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(context_len, seq_len)
        ]
        starts.append(starts[-1] + query_len)
    width = max(len(t) for t in tables) + 1
    # Padding entries are -1: the backend must never read through them.
    block_table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in chunks], dtype=torch.int32)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_seqs=len(chunks),
        num_tokens=starts[-1],
        max_query_len=max(q for _, q in chunks),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens.clone(),
    )
    return meta, tables


def reference_attention(query, k_cache, v_cache, chunks, tables, scale):
    """Per sequence, per head: dense scores over gathered keys, explicit causal mask, fp32."""
    block_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    out, start = [], 0
    for (context_len, query_len), table in zip(chunks, tables, strict=True):
        seq_len = context_len + query_len
        slots = [(table[p // block_size], p % block_size) for p in range(seq_len)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).float()  # [S, Hkv, D]
        values = torch.stack([v_cache[b, o] for b, o in slots]).float()
        q = query[start : start + query_len].float()  # [L, H, D]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q, keys) * scale
        allowed = (
            torch.arange(seq_len)[None, :] < (context_len + torch.arange(query_len) + 1)[:, None]
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hls,shd->lhd", scores.softmax(-1), values))
        start += query_len
    return torch.cat(out)


def mixed_chunks(rng: random.Random) -> list[tuple[int, int]]:
    """Decodes, prefill chunks after cached context and fresh prompts, in random order."""
    chunks = [(rng.randint(1, 90), 1) for _ in range(4)]  # decodes
    chunks.append((0, 1))  # a one-token prompt: a "decode" without context
    chunks += [(rng.randint(1, 70), rng.randint(2, 40)) for _ in range(2)]  # chunks with context
    chunks += [(0, rng.randint(2, 50)) for _ in range(2)]  # fresh prefills
    rng.shuffle(chunks)
    return chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attend_matches_dense_reference(group, block_size, dtype):
    rng = random.Random(group * 100 + block_size)
    torch.manual_seed(rng.randrange(1 << 30))
    chunks = mixed_chunks(rng)
    meta, tables = paged_batch(chunks, block_size, rng)
    num_heads = NUM_KV_HEADS * group
    cache_shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    # Random cache contents stand in for context; unused slots hold garbage that must be masked.
    k_cache = torch.randn(cache_shape).to(dtype)
    v_cache = torch.randn(cache_shape).to(dtype)
    query = torch.randn(meta.num_tokens, num_heads, HEAD_DIM).to(dtype)
    key = torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    value = torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    backend = TorchAttentionBackend()
    scale = HEAD_DIM**-0.5

    backend.write_kv(key, value, k_cache, v_cache, meta)
    out = backend.attend(query, k_cache, v_cache, meta, scale)

    expected = reference_attention(query, k_cache, v_cache, chunks, tables, scale)
    assert out.dtype == dtype and out.shape == query.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_decodes_of_very_different_lengths_are_padded_per_group_and_stay_exact():
    from tidegate.engine.attention.torch_attention import _length_groups

    rng = random.Random(7)
    chunks = [(3, 1), (400, 1), (10, 1), (150, 1), (380, 1)]
    meta, tables = paged_batch(chunks, 16, rng)
    groups = _length_groups(torch.arange(5), meta.seq_lens_cpu.long())
    # Short ones together, long ones together: nobody pads a 4-token sequence to 401.
    assert [g.tolist() for g in groups] == [[0, 2], [3], [4, 1]]
    cache_shape = (NUM_BLOCKS, 16, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * 2, HEAD_DIM)
    out = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    expected = reference_attention(query, k_cache, v_cache, chunks, tables, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_padding_rows_after_the_batch_are_ignored():
    rng = random.Random(3)
    chunks = [(5, 1), (0, 9), (20, 1)]
    meta, _ = paged_batch(chunks, 16, rng)
    cache_shape = (NUM_BLOCKS, 16, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    query = torch.randn(meta.num_tokens + 3, NUM_KV_HEADS * 2, HEAD_DIM)
    backend = TorchAttentionBackend()

    padded = backend.attend(query, k_cache, v_cache, meta, 0.1)
    exact = backend.attend(query[: meta.num_tokens], k_cache, v_cache, meta, 0.1)

    torch.testing.assert_close(padded[: meta.num_tokens], exact, atol=0, rtol=0)
    assert padded[meta.num_tokens :].abs().sum() == 0


def test_write_kv_stores_rows_and_skips_negative_slots():
    block_size = 16
    rng = random.Random(7)
    meta, _ = paged_batch([(3, 5), (0, 20), (10, 1)], block_size, rng)
    slots = meta.slot_mapping.clone()
    skipped = torch.tensor([1, 9, 25])
    slots[skipped] = -1
    meta.slot_mapping = slots
    k_cache = torch.zeros(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM)

    TorchAttentionBackend().write_kv(key, value, k_cache, v_cache, meta)

    flat_k = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    kept = slots >= 0
    torch.testing.assert_close(flat_k[slots[kept]], key[kept], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots[kept]], value[kept], atol=0, rtol=0)
    # Nothing else was written: every other slot is still zero.
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[kept]] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_backend_names(monkeypatch):
    cpu = torch.device("cpu")
    # auto keeps the reference on CPU where the C++ kernel does not fit (head size 48).
    assert isinstance(get_attention_backend("auto", cpu, head_dim=48), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", cpu), TorchAttentionBackend)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", cpu)
    with pytest.raises(ValueError, match="auto, torch, triton"):
        get_attention_backend("flash", cpu)
