"""The C++ CPU paged-attention kernel equals dense attention and the torch backend.

Each case runs the kernel on a NaN-poisoned paged cache (a stray read shows) and compares it
with dense fp32 attention per sequence: tight in fp32; in bf16/fp16 within the error of
rounding the inputs' products and the output. The caches are built in the standard layout,
which the reference reads, and packed (`pack_kv`) for the backend and the ops, which read and
write the cpu backend's packed layout. The first test in a fresh cache compiles the kernel
(about 20 s); later runs load it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from tests.engine.paged_attention_cases import (
    NUM_KV_HEADS,
    mixed_chunks,
    paged_batch,
    poisoned_cache,
    reference_attention,
)
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.attention import TorchAttentionBackend, cpu_attention, get_attention_backend
from tidegate.engine.attention.backend import to_cache_dtype
from tidegate.engine.attention.cpu_attention import (
    PACKED_KV_LAYOUT,
    CpuAttentionBackend,
    cpu_kernels_available,
    pack_kv,
    unpack_kv,
)
from tidegate.engine.attention.custom_op import attention_context

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the CPU kernels need x86-64, a C++ compiler and ninja"
)
# fp32: accumulation order and the exp2 polynomial only. 16-bit: the query, keys and output
# are rounded; products and sums are fp32 in the kernel and the reference alike.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def run_case(
    chunks,
    head_dim,
    block_size,
    group,
    dtype,
    seed,
    window=None,
    kernel_max=0,
    cap=None,
    cache_dtype=None,
):
    """The backend on a poisoned paged cache (packed), and the dense reference for it.

    kernel_max=0: the kernel takes every sequence, long chunks included. window: the call's
    sliding window (None: none). cap: its soft cap (None: none). cache_dtype: the caches'
    dtype when it is not the query's (FP8); the reference reads the same rounded values.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    meta, tables, num_blocks = paged_batch(chunks, block_size, rng)
    args = (chunks, tables, num_blocks, block_size, head_dim, cache_dtype or dtype)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    num_heads = NUM_KV_HEADS * group
    # q as the model makes it: a strided view of a fused qkv projection.
    qkv = torch.randn(meta.num_tokens, num_heads + 2 * NUM_KV_HEADS, head_dim).to(dtype)
    query = qkv[:, :num_heads]
    scale = head_dim**-0.5
    backend = CpuAttentionBackend(max_kernel_query_len=kernel_max)
    out = backend.attend(query, *pack_kv(k_cache, v_cache), meta, scale, window or 0, cap or 0.0)
    expected = reference_attention(
        query, k_cache.float(), v_cache.float(), chunks, tables, scale, window, cap
    )
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("block_size", [16, 32], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("head_dim", [64, 80, 128], ids=lambda d: f"d{d}")
def test_mixed_batch_matches_dense_reference(head_dim, block_size, group, dtype):
    # Decodes mid-block, a one-token prompt, a prefix hit on whole blocks, a chunk after
    # mid-block context and a fresh prompt, in one flat batch.
    seed = head_dim * 1000 + block_size * 10 + group
    chunks = mixed_chunks(random.Random(seed), block_size)

    out, expected = run_case(chunks, head_dim, block_size, group, dtype, seed)

    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_randomized_batches_match_dense_reference(seed):
    rng = random.Random(seed)
    head_dim = rng.choice([32, 64, 80, 96, 128, 256])
    block_size = rng.choice([16, 32, 64])
    group = rng.choice([1, 2, 3, 4, 8])
    dtype = rng.choice(list(TOLERANCE))
    # Long chunks span several 16-token query tiles; contexts cross many blocks.
    chunks = [(rng.randint(0, 300), rng.choice([1, 1, rng.randint(1, 70)])) for _ in range(7)]

    out, expected = run_case(chunks, head_dim, block_size, group, dtype, seed)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "window"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 300), (torch.bfloat16, 300)],
)
def test_tiles_deep_in_long_contexts_split_by_kv_head_and_match_dense(dtype, window, threads):
    # A tile that attends to 8,192 (token, key) pairs or more runs as one work item per KV
    # head when there are threads to share it: a chunk deep into a long prompt (its tiles
    # cross the threshold one by one), a decode of a long context, beside short sequences
    # that stay whole. With one thread nothing is split; the results are the same.
    chunks = [(1500, 40), (9000, 1), (37, 1), (0, 20), (511, 16), (8000, 3)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, expected = run_case(chunks, 64, 16, 4, dtype, 21, window=window)
    finally:
        torch.set_num_threads(before)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 37], ids=["causal", "window"])
@pytest.mark.parametrize(
    ("head_dim", "block_size", "group"),
    [(64, 16, 3), (80, 32, 1), (128, 16, 8), (32, 64, 5), (256, 16, 2), (96, 32, 32)],
    ids=lambda x: str(x),
)
def test_bf16_tiles_match_dense_reference(head_dim, block_size, group, window):
    # Where the CPU has AVX512_BF16, a bf16 tile of 16 rows or more (tokens times the GQA
    # group) runs on vdpbf16ps with rows in the vector lanes, up to 64 rows at a time: full
    # and partial row vectors, several row blocks (group 8 and 32), tiles whose first rows
    # see none of a chunk, contexts that start mid-block, and a decode beside them on the
    # other path. Elsewhere the same cases check the portable path.
    chunks = [(0, 40), (19, 16), (130, 7), (3, 1), (250, 33), (0, 5)]
    seed = head_dim + block_size + group

    out, expected = run_case(chunks, head_dim, block_size, group, torch.bfloat16, seed, window)

    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_nan_query_gives_nan_rows_not_a_silent_average():
    # A NaN that reaches attention (an overflowing model) must show in that row's output,
    # on the bf16 tile path as on the others; the other rows stay finite.
    chunks = [(20, 32)]
    rng = random.Random(5)
    meta, tables, num_blocks = paged_batch(chunks, 16, rng)
    args = (chunks, tables, num_blocks, 16, 64, torch.bfloat16)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * 4, 64).to(torch.bfloat16)
    query[3, 1] = float("nan")
    k_packed, v_packed = pack_kv(k_cache, v_cache)

    out = CpuAttentionBackend(max_kernel_query_len=0).attend(query, k_packed, v_packed, meta, 0.125)

    assert out[3, 1].isnan().all()
    out[3, 1] = 0
    assert out.isfinite().all()


def test_long_chunks_go_to_sdpa_and_the_rest_to_the_kernel_in_one_batch():
    # Two chunks past the threshold (one after cached context), beside decodes and a chunk
    # the kernel keeps; every row must be written once, by the right path.
    chunks = [(100, 70), (0, 200), (37, 1), (5, 64), (300, 1)]

    out, expected = run_case(chunks, 64, 16, 3, torch.bfloat16, 12, kernel_max=64)

    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (80, 32), (128, 16)])
def test_long_chunks_match_dense_reference(head_dim, block_size, group, dtype):
    # Past the threshold: bf16 where oneDNN's brgemm runs (AMX) takes the flash path on the
    # packed tiles, the rest SDPA. Fresh prompts, chunks after mid-block context, one longer
    # than a 128-token work item, two past a 512-key softmax step, NaN past each end.
    chunks = [(0, 20), (37, 150), (600, 9), (5, 700), (0, 1)]

    out, expected = run_case(chunks, head_dim, block_size, group, dtype, 5, kernel_max=8)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("fpu avx512f avx512_bf16 amx_bf16 amx_tile", 64), ("fpu avx2 avx512f avx512_bf16", 0)],
    ids=["amx", "no-amx"],
)
def test_long_chunks_go_to_sdpa_by_default_only_where_the_cpu_has_amx(monkeypatch, flags, expected):
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: f"flags\t\t: {flags}")

    assert CpuAttentionBackend().max_kernel_query_len == expected
    assert CpuAttentionBackend(max_kernel_query_len=32).max_kernel_query_len == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_windowed_call_sees_its_window_in_long_chunks_too(dtype):
    # The long-chunk paths (oneDNN, SDPA) have no window: a windowed call on a backend that
    # sends long chunks there must still give every chunk its window (the kernel takes them).
    chunks = [(0, 100), (150, 70), (37, 9), (300, 1), (0, 1)]

    out, expected = run_case(chunks, 64, 16, 4, dtype, 17, window=37, kernel_max=8)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_sliding_window_sees_only_the_last_keys():
    window = 24
    chunks = [(70, 1), (5, 1), (40, 30), (0, 33), (window - 1, 1), (100, 17)]

    out, expected = run_case(chunks, 64, 16, 2, torch.float32, 9, window=window)

    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("compiled_path", [False, True], ids=["attend", "layer_op"])
def test_one_backend_serves_a_windowed_and_a_full_layer_in_one_step(compiled_path):
    # Gemma 3: windowed and full layers share one step's metadata and one backend. Each call
    # (attend, or the C++ layer op after begin_step) gets its own layer's window, long chunks
    # included, where this backend would otherwise hand them to the windowless SDPA path.
    block_size, head_dim, group, window = 16, 64, 2, 24
    chunks = [(70, 1), (5, 1), (40, 30), (0, 100), (window - 1, 1), (100, 17)]
    rng = random.Random(19)
    torch.manual_seed(19)
    meta, tables, num_blocks = paged_batch(chunks, block_size, rng)
    args = (chunks, tables, num_blocks, block_size, head_dim, torch.float32)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * group, head_dim)
    scale = head_dim**-0.5
    backend = CpuAttentionBackend(max_kernel_query_len=8)
    # Two layers with the same contents, one per window.
    layers = [pack_kv(k_cache, v_cache) for _ in range(2)]

    if compiled_path:
        # The new tokens' keys and values as the layer op writes them: their own slots'.
        slots = meta.slot_mapping
        key = k_cache.flatten(0, 1)[slots]
        value = v_cache.flatten(0, 1)[slots]
        with attention_context(backend, layers, meta):
            windowed = backend.layer_op(query, key, value, 0, scale, window)
            full = backend.layer_op(query, key, value, 1, scale, 0)
    else:
        windowed = backend.attend(query, *layers[0], meta, scale, window)
        full = backend.attend(query, *layers[1], meta, scale)

    expected_windowed = reference_attention(query, k_cache, v_cache, chunks, tables, scale, window)
    expected_full = reference_attention(query, k_cache, v_cache, chunks, tables, scale)
    torch.testing.assert_close(windowed, expected_windowed, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(full, expected_full, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected_windowed, expected_full)  # the windows do differ


@pytest.mark.parametrize("kernel_max", [0, 8], ids=["kernel", "long-chunk-backend"])
@pytest.mark.parametrize("window", [None, 37], ids=["causal", "window"])
@pytest.mark.parametrize(
    ("dtype", "head_dim", "group"),
    [
        (torch.float32, 64, 4),
        (torch.float32, 128, 1),
        (torch.bfloat16, 64, 8),
        (torch.float16, 80, 2),
    ],
    ids=lambda x: str(x).removeprefix("torch."),
)
def test_capped_scores_match_dense_reference(dtype, head_dim, group, window, kernel_max):
    # Gemma 2 caps every scaled score s at C * tanh(s / C). Scores of unit queries and keys
    # spread over [-4, 4], so a cap of 2 bends most of them; small ones take the series
    # branch. Long chunks stay with the kernel (the oneDNN and SDPA paths have no cap) even
    # on a backend that would send them there. Where the CPU has AVX512_BF16, bf16 decodes
    # (group 8: 8 rows) and tiles of 16 rows or more cap on the vdpbf16ps paths.
    chunks = [(0, 40), (19, 16), (130, 7), (3, 1), (250, 33), (0, 5), (600, 1), (70, 90)]
    cap = 2.0

    out, expected = run_case(
        chunks, head_dim, 16, group, dtype, head_dim + group, window, kernel_max, cap=cap
    )
    _, uncapped = run_case(chunks, head_dim, 16, group, dtype, head_dim + group, window)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert (expected - uncapped).abs().max() > 0.1  # the cap does change the output


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("kernel_max", [0, 8], ids=["kernel", "long-chunk-backend"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("head_dim", "block_size", "group"), [(64, 16, 4), (80, 32, 1), (128, 16, 8)], ids=str
)
def test_an_fp8_cache_matches_dense_attention_over_its_values(
    head_dim, block_size, group, dtype, kernel_max
):
    # --kv-cache-dtype fp8: the kernel widens each FP8 key and value as it reads it, and a
    # long chunk's context is gathered and widened for SDPA. Against dense attention over
    # the same FP8 values: as tight as a cache of the query's own dtype.
    chunks = [*mixed_chunks(random.Random(head_dim), block_size), (40, 70), (0, 130)]

    out, expected = run_case(
        chunks, head_dim, block_size, group, dtype, 7, kernel_max=kernel_max, cache_dtype=FP8
    )

    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel_max", [0, 8], ids=["kernel", "long-chunk-backend"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_an_fp8_cache_gives_exactly_the_output_of_its_values_in_the_querys_dtype(dtype, kernel_max):
    # FP8 values are exact in every wider dtype, so widening as the kernel reads (through a
    # table, or on AVX512_BF16 32 at a time through fp16) must give bit for bit what the
    # same kernel gives on a cache that holds them widened already: every FP8 code, the
    # subnormals and the largest included, in decodes and chunks of both bf16 paths, and in
    # long chunks (AMX's flash path in bf16, else SDPA over the gathered context).
    chunks = [(0, 40), (19, 16), (130, 7), (3, 1), (250, 1), (77, 1)]
    rng = random.Random(11)
    meta, _, num_blocks = paged_batch(chunks, 16, rng)
    gen = torch.Generator().manual_seed(11)
    shape = (num_blocks, 16, NUM_KV_HEADS, 64)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    codes[codes.bitwise_and(0x7F) == 0x7F] = 0x3C  # no NaN codes: they poison the rows
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    codes.view(-1)[:256][torch.arange(256).bitwise_and(0x7F) == 0x7F] = 0
    k_fp8 = codes.view(FP8)
    v_fp8 = codes.flip(0).contiguous().view(FP8)
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * 8, 64, generator=gen).to(dtype) / 16
    backend = CpuAttentionBackend(max_kernel_query_len=kernel_max)

    got = backend.attend(query, *pack_kv(k_fp8, v_fp8), meta, 0.125)
    wide = backend.attend(query, *pack_kv(k_fp8.to(dtype), v_fp8.to(dtype)), meta, 0.125)

    assert got.isfinite().all()
    assert torch.equal(got, wide)


def test_an_fp8_cache_with_a_window_and_a_cap_in_the_compiled_layer_op():
    # Gemma 2 with --kv-cache-dtype fp8 on the compiled path: the C++ layer op writes the
    # step's keys into the FP8 cache (clipped, rounded) and attends with the layer's window
    # and cap.
    block_size, head_dim, group, window, cap = 16, 64, 2, 24, 3.0
    chunks = [(70, 1), (5, 1), (40, 30), (0, 100), (window - 1, 1), (100, 17)]
    rng = random.Random(4)
    torch.manual_seed(4)
    meta, tables, num_blocks = paged_batch(chunks, block_size, rng)
    args = (chunks, tables, num_blocks, block_size, head_dim, FP8)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    slots = meta.slot_mapping  # each new token's slot, in the batch's order
    key = torch.randn(meta.num_tokens, NUM_KV_HEADS, head_dim) * 2
    value = torch.randn(meta.num_tokens, NUM_KV_HEADS, head_dim)
    key[0, 0, :3] = torch.tensor([1000.0, -1000.0, 0.3])  # clipped to +-448, rounded
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * group, head_dim)
    scale = head_dim**-0.5
    # The reference's cache: the new rows written as the torch backend writes FP8.
    ref_k, ref_v = k_cache.float(), v_cache.float()
    flat_k, flat_v = ref_k.view(-1, NUM_KV_HEADS, head_dim), ref_v.view(-1, NUM_KV_HEADS, head_dim)
    flat_k[slots] = to_cache_dtype(key, FP8).float()
    flat_v[slots] = to_cache_dtype(value, FP8).float()
    assert flat_k[slots[0], 0, :2].tolist() == [448.0, -448.0]
    backend = CpuAttentionBackend(max_kernel_query_len=8)
    packed = pack_kv(k_cache, v_cache)

    with attention_context(backend, [packed], meta):
        out = backend.layer_op(query, key, value, 0, scale, window, cap)

    torch.testing.assert_close(unpack_kv(*packed)[0].float(), ref_k, equal_nan=True, atol=0, rtol=0)
    expected = reference_attention(query, ref_k, ref_v, chunks, tables, scale, window, cap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_many_query_heads_on_one_kv_head():
    chunks = [(20, 1), (0, 5), (9, 3)]

    out, expected = run_case(chunks, 64, 16, 32, torch.float16, 4)

    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_backend_matches_the_torch_backend_and_leaves_padding_rows_zero():
    block_size, head_dim, group = 16, 64, 4
    rng = random.Random(11)
    torch.manual_seed(11)
    chunks = [(13, 1), (0, 9), (32, 4), (50, 1), (0, 1)]
    meta, _, num_blocks = paged_batch(chunks, block_size, rng)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = (torch.randn(shape) for _ in range(2))
    caches = [*pack_kv(k_cache, v_cache), k_cache.clone(), v_cache.clone()]  # cpu: packed
    num_padded = meta.num_tokens + 3  # padding rows, and slots -1 past the batch
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((3,), -1)])
    query = torch.randn(num_padded, NUM_KV_HEADS * group, head_dim)
    qkv = torch.randn(num_padded, 2 * NUM_KV_HEADS, head_dim)  # strided key and value views
    key, value = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS:]
    cpu_backend, torch_backend = CpuAttentionBackend(), TorchAttentionBackend()

    cpu_backend.write_kv(key, value, caches[0], caches[1], meta)
    torch_backend.write_kv(key, value, caches[2], caches[3], meta)
    out = cpu_backend.attend(query, caches[0], caches[1], meta, 0.125)
    expected = torch_backend.attend(query, caches[2], caches[3], meta, 0.125)

    written_k, written_v = unpack_kv(caches[0], caches[1])
    torch.testing.assert_close(written_k, caches[2], atol=0, rtol=0)
    torch.testing.assert_close(written_v, caches[3], atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert out[meta.num_tokens :].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (32, 80), (16, 128)])
def test_gather_kv_gives_the_context_in_the_standard_order_heads_first(dtype, block_size, head_dim):
    """What the SDPA path reads: the first seq_len keys and values of a sequence's blocks."""
    gen = torch.Generator().manual_seed(block_size + head_dim)
    shape = (12, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_packed, v_packed = pack_kv(k_cache, v_cache)
    blocks = torch.randperm(12, generator=gen)[:7]
    for seq_len in (1, 15, 16, 17, 7 * block_size - 3, 7 * block_size):
        keys, values = torch.ops.tidegate_cpu.gather_kv(k_packed, v_packed, blocks, seq_len)
        for got, cache in ((keys, k_cache), (values, v_cache)):
            want = cache.index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
            assert got.is_contiguous() and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.tidegate_cpu.gather_kv(k_packed, v_packed, blocks, 7 * block_size + 1)


def test_write_kv_skips_negative_slots_and_refuses_slots_past_the_cache():
    shape = PACKED_KV_LAYOUT.shape(2, 16, NUM_KV_HEADS, 64)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    # Distinct values for every (token, head, dim), so a misplaced one shows.
    keys = torch.arange(1, 3 * NUM_KV_HEADS * 64 + 1, dtype=torch.float32)
    keys = keys.view(3, NUM_KV_HEADS, 64)
    values = -keys
    slots = torch.tensor([5, -1, 31])
    torch.ops.tidegate_cpu.reshape_and_cache(keys, values, k_cache, v_cache, slots)
    k_std, v_std = unpack_kv(k_cache, v_cache)
    for written, rows in ((k_std, keys), (v_std, values)):
        flat = written.reshape(-1, NUM_KV_HEADS, 64)
        assert torch.equal(flat[5], rows[0]) and torch.equal(flat[31], rows[2])
        others = torch.ones(32, dtype=torch.bool)
        others[[5, 31]] = False
        assert not flat[others].any()

    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.tidegate_cpu.reshape_and_cache(keys, values, k_cache, v_cache, torch.tensor([32]))


def test_inconsistent_metadata_is_refused_not_read_out_of_bounds():
    query = torch.zeros(2, 2, 64)
    cache = torch.zeros(PACKED_KV_LAYOUT.shape(1, 16, 2, 64))
    starts = torch.tensor([0, 2], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    for seq_lens in ([1], [17]):  # shorter than its query; more blocks than its table has
        with pytest.raises(RuntimeError, match="inconsistent metadata"):
            torch.ops.tidegate_cpu.paged_attention(
                query.clone(), query, cache, cache, starts,
                torch.tensor(seq_lens, dtype=torch.int32), table, 1.0, 0, 0.0, 0,
            )  # fmt: skip


def test_a_block_id_outside_the_cache_is_refused():
    query = torch.zeros(1, 2, 64)
    cache = torch.zeros(PACKED_KV_LAYOUT.shape(2, 16, 2, 64))
    starts = torch.tensor([0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([20], dtype=torch.int32)  # two blocks: the second is bad
    for bad in (2, -1):
        table = torch.tensor([[0, bad]], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=f"names block {bad} of a 2-block cache"):
            torch.ops.tidegate_cpu.paged_attention(
                query.clone(), query, cache, cache, starts, seq_lens, table, 1.0, 0, 0.0, 0
            )


def test_auto_picks_the_cpu_kernel_on_cpu_when_the_shapes_fit():
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "cpu"
    assert get_attention_backend("cpu", cpu).name == "cpu"
    # A head size the kernel was not built for: auto keeps the reference, cpu says why.
    shape = {"head_dim": 48, "block_size": 16, "dtype": torch.float32}
    assert get_attention_backend("auto", cpu, **shape).name == "torch"
    with pytest.raises(ValueError, match="head size 48"):
        get_attention_backend("cpu", cpu, **shape)


@pytest.mark.slow
def test_the_avx2_build_gives_the_same_results(tmp_path):
    """The kernel compiled for AVX2 only (no AVX-512) on a mixed fp32 and bf16 batch."""
    script = (
        "import random, torch\n"
        "from tests.engine.test_cpu_attention import run_case, TOLERANCE\n"
        "from tests.engine.paged_attention_cases import mixed_chunks\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    out, ref = run_case(mixed_chunks(random.Random(3), 16), 128, 16, 4, dtype, 3)\n"
        "    tol = TOLERANCE[dtype]\n"
        "    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)\n"
        "from tidegate.engine.attention.cpu_attention import cpu_kernel_isa\n"
        "print(cpu_kernel_isa())\n"
    )
    env = {**os.environ, "TIDEGATE_CPU_ISA": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "avx2"


def test_the_engine_gives_the_torch_backends_greedy_tokens(tiny_llama_dir):
    shared = "The tide gate opens at dawn and closes at dusk, every day of the year, " * 2
    prompts = [
        shared + "while the keeper sleeps",  # long: prefilled in chunks
        shared + "and the boats wait",  # the same prefix: cached blocks, context > 0
        "Hi",
        [5, 17, 99, 3, 250, 61, 7],
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    # A small step budget: prompts are chunked and decodes share steps with prefill chunks.
    common = dict(dtype="float32", max_num_batched_tokens=40, long_prefill_token_threshold=24)
    reference = LLM(model=str(tiny_llama_dir), attention_backend="torch", **common)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    llm = LLM(model=str(tiny_llama_dir), **common)  # auto
    runner = llm.engine.executor.worker.runner
    assert runner.attn_backend.name == "cpu"
    k_cache, head_dim = runner.kv_caches[0][0], runner.model_config.head_dim
    packed = PACKED_KV_LAYOUT.shape(len(k_cache), runner.block_size, runner.num_kv_heads, head_dim)
    assert k_cache.shape == packed

    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    assert got == expected
    assert llm.stats()["prefix_cache_hits"] > 0


def test_the_build_key_changes_with_the_compiler_flags(monkeypatch):
    """A cached build is reused only for the same source, flags, torch and CPU."""
    from tidegate.engine.attention import cpu_attention

    source = cpu_attention.SOURCE
    before = cpu_attention._build_key(source, "avx2")
    monkeypatch.setattr(cpu_attention, "_COMMON_FLAGS", [*cpu_attention._COMMON_FLAGS, "-O2"])
    assert cpu_attention._build_key(source, "avx2") != before
    monkeypatch.undo()
    assert cpu_attention._build_key(source, "avx2") == before
    assert cpu_attention._build_key(source, "avx512") != before


def test_the_source_is_copied_into_its_build_folder_once(tmp_path):
    """Checkouts of the same source build from one copy: ninja sees the same path, and a file
    no newer than the build."""
    from tidegate.engine.attention import cpu_attention

    build = tmp_path / "build"
    build.mkdir()
    first, second = tmp_path / "a" / "op.cpp", tmp_path / "b" / "op.cpp"
    for source in (first, second):
        source.parent.mkdir()
        source.write_text("// the same op\n")
    copy = cpu_attention._source_copy(first, build)
    assert copy == build / "op.cpp" and copy.read_text() == "// the same op\n"
    stamp = copy.stat().st_mtime_ns
    os.utime(second)  # a fresh checkout's file is newer than the build
    assert cpu_attention._source_copy(second, build) == copy
    assert copy.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in build.iterdir()) == ["op.cpp"]


@pytest.mark.slow
def test_a_second_checkout_of_the_same_source_loads_the_first_ones_build(tmp_path):
    """A one-op extension built from one folder, then loaded from a copy in another (as a
    fresh clone would): the library is not rebuilt, and the op runs."""
    op = (
        "#include <ATen/ATen.h>\n#include <torch/library.h>\n"
        "at::Tensor twice(const at::Tensor& x) { return x * 2; }\n"
        'TORCH_LIBRARY(tidegate_build_test, m) { m.def("twice(Tensor x) -> Tensor"); }\n'
        'TORCH_LIBRARY_IMPL(tidegate_build_test, CPU, m) { m.impl("twice", &twice); }\n'
    )
    script = (
        "import sys, torch\nfrom pathlib import Path\n"
        "from tidegate.engine.attention.cpu_attention import build_cpu_extension\n"
        "build_cpu_extension(Path(sys.argv[1]), 'tidegate_build_test', 'avx2')\n"
        "print(torch.ops.tidegate_build_test.twice(torch.ones(2)).tolist())\n"
    )
    env = {**os.environ, "TIDEGATE_CPU_KERNELS_DIR": str(tmp_path / "kernels")}
    libraries = []
    for checkout in ("a", "b"):
        source = tmp_path / checkout / "op.cpp"
        source.parent.mkdir()
        source.write_text(op)
        result = subprocess.run(
            [sys.executable, "-c", script, str(source)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\n")[-2] == "[2.0, 2.0]"
        (library,) = (tmp_path / "kernels").glob("*/*.so")
        libraries.append((library, library.stat().st_mtime_ns))
    assert libraries[0] == libraries[1]
