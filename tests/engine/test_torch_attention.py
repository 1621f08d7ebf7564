"""The torch attention backend equals dense causal attention, for any mix of sequences."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine import paged_attention_cases as cases
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


# -- Sliding windows: the calling layer's, per call --------------------------------------


def windowed_case(chunks, block_size, group, dtype, seed):
    """Metadata, caches and a query for `chunks` on the shared paged-cache cases.

    The caches are poisoned where no sequence has a token, with a large finite value rather
    than the shared cases' NaN: SDPA multiplies masked-out values by a zero weight, and
    NaN * 0 is NaN even where nothing was read wrongly. A stray read of 1e3 still shows.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    meta, tables, num_blocks = cases.paged_batch(chunks, block_size, rng)
    args = (chunks, tables, num_blocks, block_size, HEAD_DIM, dtype)
    k_cache, v_cache = (cases.poisoned_cache(*args).nan_to_num(nan=1e3) for _ in range(2))
    query = torch.randn(meta.num_tokens, cases.NUM_KV_HEADS * group, HEAD_DIM).to(dtype)
    return meta, tables, k_cache, v_cache, query


# Decodes deep into long contexts and right at the window's edge, chunks after mid-block
# context (some longer than the window), fresh prompts longer and shorter than it.
WINDOW_CHUNKS = [(70, 1), (5, 1), (40, 30), (0, 33), (23, 1), (24, 1), (100, 17), (0, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize(
    ("window", "block_size"),
    [(1, 16), (5, 16), (16, 16), (24, 16), (37, 32), (64, 16)],
    ids=["itself-only", "inside-a-block", "one-block", "not-a-block-multiple", "b32", "4-blocks"],
)
def test_sliding_window_sees_only_the_last_keys(window, block_size, group, dtype):
    seed = window * 100 + block_size + group
    chunks = WINDOW_CHUNKS + cases.mixed_chunks(random.Random(seed), block_size)
    meta, tables, k_cache, v_cache, query = windowed_case(chunks, block_size, group, dtype, seed)
    scale = HEAD_DIM**-0.5

    out = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, scale, window)

    expected = cases.reference_attention(query, k_cache, v_cache, chunks, tables, scale, window)
    assert out.dtype == dtype and out.isfinite().all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_a_window_longer_than_every_sequence_is_no_window():
    chunks = [(30, 1), (0, 20), (17, 9), (63, 1)]  # at most 64 tokens
    meta, tables, k_cache, v_cache, query = windowed_case(chunks, 16, 2, torch.float32, 5)
    backend = TorchAttentionBackend()

    full = backend.attend(query, k_cache, v_cache, meta, 0.1)
    for window in (64, 65, 4096):
        out = backend.attend(query, k_cache, v_cache, meta, 0.1, window)
        torch.testing.assert_close(out, full, atol=0, rtol=0)
    expected = cases.reference_attention(query, k_cache, v_cache, chunks, tables, 0.1)
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)


def test_one_backend_serves_a_windowed_and_a_full_layer_in_one_step():
    # Gemma 3: windowed and full layers share one step's metadata and one backend; each
    # call gets its own layer's window and nothing of the other's.
    window = 24
    meta, tables, k_cache, v_cache, query = windowed_case(WINDOW_CHUNKS, 16, 2, torch.float32, 8)
    backend = TorchAttentionBackend()
    scale = HEAD_DIM**-0.5
    reference = cases.reference_attention

    windowed = backend.attend(query, k_cache, v_cache, meta, scale, window)
    full = backend.attend(query, k_cache, v_cache, meta, scale)

    expected_windowed = reference(query, k_cache, v_cache, WINDOW_CHUNKS, tables, scale, window)
    expected_full = reference(query, k_cache, v_cache, WINDOW_CHUNKS, tables, scale)
    torch.testing.assert_close(windowed, expected_windowed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full, expected_full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected_windowed, expected_full)  # the windows do differ


def test_windowed_chunk_functions_take_the_window_too():
    # attend_chunk/attend_gathered are public (the cpu and KV-transfer code may call them):
    # the window reaches a fresh prompt (no context) as well as a chunk after context.
    from tidegate.engine.attention.torch_attention import attend_chunk, attend_gathered

    window = 10
    chunks = [(0, 40), (45, 20)]
    meta, tables, k_cache, v_cache, query = windowed_case(chunks, 16, 2, torch.float32, 3)
    expected = cases.reference_attention(query, k_cache, v_cache, chunks, tables, 0.1, window)
    fresh, after = query[:40], query[40:]

    out_fresh = attend_chunk(fresh, k_cache, v_cache, meta.block_table[0], 40, 0.1, window)
    out_after = attend_chunk(after, k_cache, v_cache, meta.block_table[1], 65, 0.1, window)
    gathered_k = k_cache[tables[1]].flatten(0, 1)
    gathered_v = v_cache[tables[1]].flatten(0, 1)
    out_gathered = attend_gathered(after, gathered_k, gathered_v, 65, 0.1, window)

    torch.testing.assert_close(out_fresh, expected[:40], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_after, expected[40:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_gathered, expected[40:], atol=1e-5, rtol=1e-5)


# -- Soft-capped scores (Gemma 2's attn_logit_softcapping), per call ----------------------


@pytest.mark.parametrize("window", [0, 24], ids=["full", "windowed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_capped_scores_equal_the_reference(window, dtype):
    # A cap of 2 on scores up to about 10 (query x 3): most scores bend, so a cap that was
    # skipped, applied after the mask or before the scale would show.
    chunks = WINDOW_CHUNKS + cases.mixed_chunks(random.Random(31), 16)
    meta, tables, k_cache, v_cache, query = windowed_case(chunks, 16, 4, dtype, 31)
    query = (query.float() * 3).to(dtype)
    scale, cap = HEAD_DIM**-0.5, 2.0
    backend = TorchAttentionBackend()

    out = backend.attend(query, k_cache, v_cache, meta, scale, window, cap)

    reference = cases.reference_attention
    expected = reference(query, k_cache, v_cache, chunks, tables, scale, window or None, cap)
    uncapped = reference(query, k_cache, v_cache, chunks, tables, scale, window or None)
    assert out.dtype == dtype and out.isfinite().all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert (expected - uncapped).abs().max() > 0.1  # the cap does change the output
