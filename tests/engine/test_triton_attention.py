"""The Triton attention kernels equal dense causal attention, for any mix of sequences.

Without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set here
before triton is imported); with one, natively. Shapes stay small so that the interpreter
gets through the file in well under a minute.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

# Before anything imports triton: without a GPU, its kernels must run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from tests.engine.paged_attention_cases import (
    NUM_KV_HEADS,
    mixed_chunks,
    paged_batch,
    poisoned_cache,
    reference_attention,
)
from tidegate.engine.attention import TorchAttentionBackend
from tidegate.engine.attention.triton_attention import (
    NUM_SEGMENTS,
    TritonAttentionBackend,
    reshape_and_cache,
    unified_attention,
    use_split_kv,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# atol = rtol against an fp32 reference computed from the same (rounded) inputs. 16-bit
# error comes from rounding P before the P·V matmul and rounding the output.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def run_case(chunks, head_dim, block_size, group, dtype, seed, **kwargs):
    """unified_attention on a poisoned paged cache, and the dense reference for it."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    meta, tables, num_blocks = paged_batch(chunks, block_size, rng, DEVICE)
    args = (chunks, tables, num_blocks, block_size, head_dim, dtype, DEVICE)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    num_heads = NUM_KV_HEADS * group
    # q as the model makes it: a strided view of a fused qkv projection.
    qkv = torch.randn(meta.num_tokens, num_heads + 2 * NUM_KV_HEADS, head_dim).to(dtype)
    query = qkv.to(DEVICE)[:, :num_heads]
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    unified_attention(
        query,
        k_cache,
        v_cache,
        out,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        scale,
        **kwargs,
    )
    window, cap = kwargs.get("sliding_window"), kwargs.get("logits_soft_cap")
    expected = reference_attention(query, k_cache, v_cache, chunks, tables, scale, window, cap)
    return out, expected


# Each head size, block size, GQA ratio and dtype at least once, not their cross product.
CASES = [
    pytest.param(64, 16, 1, torch.float32, id="d64-b16-g1-fp32"),
    pytest.param(80, 32, 2, torch.bfloat16, id="d80-b32-g2-bf16"),
    pytest.param(96, 64, 4, torch.float16, id="d96-b64-g4-fp16"),
    pytest.param(128, 16, 8, torch.bfloat16, id="d128-b16-g8-bf16"),
    pytest.param(256, 32, 2, torch.float16, id="d256-b32-g2-fp16"),
]


@pytest.mark.parametrize("split_kv", [False, True], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize(("head_dim", "block_size", "group", "dtype"), CASES)
def test_mixed_batch_matches_dense_reference(head_dim, block_size, group, dtype, split_kv):
    seed = head_dim * 1000 + block_size * 10 + group
    chunks = mixed_chunks(random.Random(seed), block_size)

    out, expected = run_case(chunks, head_dim, block_size, group, dtype, seed, split_kv=split_kv)

    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_randomized_batches_match_dense_reference(seed):
    rng = random.Random(seed)
    head_dim = rng.choice([64, 80, 96, 128])
    block_size = rng.choice([16, 32, 64])
    group = rng.choice([1, 2, 4, 8])
    dtype = rng.choice(list(TOLERANCE))
    chunks = [(rng.randint(0, 100), rng.choice([1, 1, rng.randint(1, 24)])) for _ in range(6)]

    out, expected = run_case(chunks, head_dim, block_size, group, dtype, seed)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("split_kv", [False, True], ids=["one-pass", "split-kv"])
def test_long_decodes_match_with_and_without_split_kv(split_kv):
    chunks = [(1100, 1), (301, 1), (17, 1)]

    out, expected = run_case(chunks, 64, 16, 4, torch.bfloat16, 5, split_kv=split_kv)

    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-2, rtol=2e-2)


def test_split_kv_is_chosen_for_few_long_decodes_only():
    cpu = torch.device("cpu")
    long_enough = NUM_SEGMENTS * 64
    assert use_split_kv(1, long_enough, 4, 8, cpu)
    assert not use_split_kv(1, long_enough - 1, 4, 8, cpu)  # too short to split
    assert not use_split_kv(2, 8 * long_enough, 4, 8, cpu)  # a prefill chunk in the batch
    assert not use_split_kv(1, 8 * long_enough, 64, 8, cpu)  # enough programs already


@pytest.mark.parametrize("split_kv", [False, True], ids=["one-pass", "split-kv"])
def test_sliding_window_sees_only_the_last_keys(split_kv):
    window = 24
    chunks = [(70, 1), (5, 1), (40, 30), (0, 33), (window - 1, 1)]

    out, expected = run_case(
        chunks, 64, 16, 2, torch.float32, 9, sliding_window=window, split_kv=split_kv
    )

    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


def test_the_backend_gives_each_call_its_own_window():
    # Gemma 3: windowed and full layers share one step's metadata and one backend; each
    # layer's call passes its own window (a host int, fixed per layer in a CUDA graph).
    block_size, head_dim, group, window = 16, 64, 2, 24
    chunks = [(70, 1), (5, 1), (40, 30), (0, 33), (window - 1, 1)]
    rng = random.Random(13)
    torch.manual_seed(13)
    meta, tables, num_blocks = paged_batch(chunks, block_size, rng, DEVICE)
    args = (chunks, tables, num_blocks, block_size, head_dim, torch.float32, DEVICE)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * group, head_dim).to(DEVICE)
    backend, scale = TritonAttentionBackend(), head_dim**-0.5

    windowed = backend.attend(query, k_cache, v_cache, meta, scale, window)
    full = backend.attend(query, k_cache, v_cache, meta, scale)

    expected_windowed = reference_attention(query, k_cache, v_cache, chunks, tables, scale, window)
    expected_full = reference_attention(query, k_cache, v_cache, chunks, tables, scale)
    torch.testing.assert_close(windowed.cpu(), expected_windowed, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(full.cpu(), expected_full, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected_windowed, expected_full)  # the windows do differ


@pytest.mark.parametrize("window", [None, 24], ids=["full", "windowed"])
@pytest.mark.parametrize("split_kv", [False, True], ids=["one-pass", "split-kv"])
def test_capped_scores_equal_the_reference(split_kv, window):
    # Gemma 2's soft cap in the kernel's base-2 units, with and without a window; the
    # split-KV path (few long decodes) caps its segments' scores as well. A cap of 0.5 bends
    # most scores (about unit-sized here), so a skipped or misplaced cap shows.
    mixed = [(70, 1), (5, 1), (40, 30), (0, 33), (23, 1)]
    chunks = [(300, 1), (150, 1)] if split_kv else mixed
    kwargs = dict(sliding_window=window, logits_soft_cap=0.5, split_kv=split_kv)

    out, expected = run_case(chunks, 64, 16, 2, torch.float32, 17, **kwargs)

    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    _, uncapped = run_case(chunks, 64, 16, 2, torch.float32, 17, sliding_window=window)
    assert (expected - uncapped).abs().max() > 0.05  # the cap does change the output


def test_many_query_heads_on_one_kv_head():
    # 32 query heads per KV head: more than one 16-row tile, so one token per program.
    chunks = [(20, 1), (0, 5), (9, 3)]

    out, expected = run_case(chunks, 64, 16, 32, torch.float16, 4)

    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_stores_rows_and_skips_negative_slots(dtype):
    block_size, head_dim, num_blocks, num_tokens = 16, 80, 6, 21
    rng = random.Random(7)
    slots = torch.tensor(rng.sample(range(num_blocks * block_size), num_tokens))
    slots[torch.tensor([1, 9, 20])] = -1
    # key/value as the model makes them: strided views of a fused qkv projection.
    qkv = torch.randn(num_tokens, 4 + 2 * NUM_KV_HEADS, head_dim).to(dtype).to(DEVICE)
    key, value = qkv[:, 4 : 4 + NUM_KV_HEADS], qkv[:, 4 + NUM_KV_HEADS :]
    k_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=dtype)
    k_cache, v_cache = k_cache.to(DEVICE), k_cache.clone().to(DEVICE)

    reshape_and_cache(key, value, k_cache, v_cache, slots.to(DEVICE))

    flat_k = k_cache.cpu().view(-1, NUM_KV_HEADS, head_dim)
    flat_v = v_cache.cpu().view(-1, NUM_KV_HEADS, head_dim)
    kept = slots >= 0
    torch.testing.assert_close(flat_k[slots[kept]], key.cpu()[kept], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots[kept]], value.cpu()[kept], atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[kept]] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_backend_matches_the_torch_backend_and_leaves_padding_rows_zero():
    block_size, head_dim, group = 16, 64, 4
    rng = random.Random(11)
    torch.manual_seed(11)
    chunks = [(13, 1), (0, 9), (32, 4), (50, 1)]
    meta, _, num_blocks = paged_batch(chunks, block_size, rng, DEVICE)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = (torch.randn(shape).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
    num_padded = meta.num_tokens + 3  # a padded (e.g. CUDA-graph) batch
    query = torch.randn(num_padded, NUM_KV_HEADS * group, head_dim).to(torch.bfloat16)
    key = torch.randn(num_padded, NUM_KV_HEADS, head_dim).to(torch.bfloat16)
    value = torch.randn(num_padded, NUM_KV_HEADS, head_dim).to(torch.bfloat16)
    query, key, value = query.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert triton_backend.name == "triton"

    triton_backend.write_kv(key, value, caches[0], caches[1], meta)
    torch_backend.write_kv(key, value, caches[2], caches[3], meta)
    out = triton_backend.attend(query, caches[0], caches[1], meta, 0.125)
    expected = torch_backend.attend(query, caches[2], caches[3], meta, 0.125)

    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert out[meta.num_tokens :].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_caches_hold_and_give_what_the_torch_backend_does(dtype):
    """--kv-cache-dtype fp8: the same FP8 bytes stored (clipped, then rounded), and the same
    attention over them, in one pass and split over key segments."""
    block_size, head_dim, group = 16, 64, 2
    rng = random.Random(5)
    torch.manual_seed(5)
    chunks = [(13, 1), (0, 9), (40, 4), (70, 1)]
    meta, _, num_blocks = paged_batch(chunks, block_size, rng, DEVICE)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(4)]
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * group, head_dim).to(dtype).to(DEVICE)
    key = (torch.randn(meta.num_tokens, NUM_KV_HEADS, head_dim) * 4).to(dtype).to(DEVICE)
    value = (torch.randn(meta.num_tokens, NUM_KV_HEADS, head_dim) * 4).to(dtype).to(DEVICE)
    key[0, 0, 0] = 1000.0  # past FP8's 448: clipped, not NaN
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()

    triton_backend.write_kv(key, value, caches[0], caches[1], meta)
    torch_backend.write_kv(key, value, caches[2], caches[3], meta)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].float().abs().max() == 448
    expected = torch_backend.attend(query, caches[2], caches[3], meta, 0.125).float()
    tol = TOLERANCE[dtype]
    for split_kv in (False, True):
        out = torch.full_like(query, float("nan"))
        unified_attention(
            query,
            caches[0],
            caches[1],
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            0.125,
            split_kv=split_kv,
        )
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_mismatched_heads_are_refused_with_the_rule():
    query = torch.zeros(1, 3, 64, device=DEVICE)
    cache = torch.zeros(1, 16, 2, 64, device=DEVICE)
    one = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of the KV head count"):
        unified_attention(query, cache, cache, query.clone(), one, one[1:], one[None, :1], 1.0)
