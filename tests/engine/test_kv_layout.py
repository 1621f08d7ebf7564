"""KV-cache layouts: the standard one (torch, triton, the KV-transfer wire) and the cpu
backend's packed one, whose element order is the contract with its C++ kernel."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.paged_attention_cases import (
    NUM_KV_HEADS,
    paged_batch,
    poisoned_cache,
    reference_attention,
)
from tidegate.engine.attention import STANDARD_KV_LAYOUT, TorchAttentionBackend
from tidegate.engine.attention.cpu_attention import (
    PACKED_KV_LAYOUT,
    CpuAttentionBackend,
    cpu_kernels_available,
    pack_kv,
    unpack_kv,
)


def standard_blocks(num_blocks, block_size, head_dim, dtype, heads=NUM_KV_HEADS):
    shape = (num_blocks, block_size, heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [16, 32], ids=lambda b: f"b{b}")
def test_pack_and_unpack_round_trip(block_size, head_dim, dtype):
    k, v = standard_blocks(5, block_size, head_dim, dtype, heads=3)

    kp, vp = pack_kv(k, v)

    assert kp.shape == vp.shape == (5, 3, block_size, head_dim)
    assert kp.shape == PACKED_KV_LAYOUT.shape(5, block_size, 3, head_dim)
    assert kp.is_contiguous() and vp.is_contiguous() and kp.dtype == vp.dtype == dtype
    k2, v2 = unpack_kv(kp, vp)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # And the other way: any packed blocks survive unpacking and packing again.
    rk, rv = (torch.randn(5, 3, block_size, head_dim).to(dtype) for _ in range(2))
    rk2, rv2 = pack_kv(*unpack_kv(rk, rv))
    assert torch.equal(rk2, rk) and torch.equal(rv2, rv)
    # The layout object converts the same way, also on blocks picked with index_select.
    ids = torch.tensor([4, 1])
    ks, vs = PACKED_KV_LAYOUT.to_standard(kp.index_select(0, ids), vp.index_select(0, ids))
    assert torch.equal(ks, k[[4, 1]]) and torch.equal(vs, v[[4, 1]])
    kp4, vp4 = PACKED_KV_LAYOUT.from_standard(k, v)
    assert torch.equal(kp4, kp) and torch.equal(vp4, vp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 32), (32, 80), (48, 128)])
def test_each_element_sits_at_the_documented_offset(block_size, head_dim, dtype):
    n, heads = 3, 2
    k, v = standard_blocks(n, block_size, head_dim, dtype, heads=heads)
    kp, vp = pack_kv(k, v)
    kp_flat, vp_flat = kp.view(n, heads, -1), vp.view(n, heads, -1)
    rng = random.Random(block_size + head_dim)
    for _ in range(50):
        b, h = rng.randrange(n), rng.randrange(heads)
        t, d = rng.randrange(block_size), rng.randrange(head_dim)
        k_at = ((t // 16) * (head_dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
        v_at = ((t // 16) * 8 + (t % 16) // 2) * (2 * head_dim) + d * 2 + t % 2
        assert kp_flat[b, h, k_at] == k[b, t, h, d]
        assert vp_flat[b, h, v_at] == v[b, t, h, d]
    # Every position, at once: the offsets are a permutation of each (block, head)'s slots.
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    k_at = ((t // 16) * (head_dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
    v_at = ((t // 16) * 8 + (t % 16) // 2) * (2 * head_dim) + d * 2 + t % 2
    for at in (k_at, v_at):
        assert torch.equal(at.flatten().sort().values, torch.arange(block_size * head_dim))
    assert torch.equal(kp_flat[:, :, k_at], k.permute(0, 2, 1, 3))
    assert torch.equal(vp_flat[:, :, v_at], v.permute(0, 2, 1, 3))


def test_poisoned_slots_stay_poisoned_after_packing():
    chunks = [(20, 1), (0, 7), (33, 12)]
    _, tables, num_blocks = paged_batch(chunks, 16, random.Random(1))
    args = (chunks, tables, num_blocks, 16, 64, torch.bfloat16)
    k, v = poisoned_cache(*args), poisoned_cache(*args)

    kp, vp = pack_kv(k, v)

    assert kp.isnan().sum() == k.isnan().sum() > 0
    assert vp.isnan().sum() == v.isnan().sum() > 0
    k2, v2 = unpack_kv(kp, vp)
    torch.testing.assert_close(k2, k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v2, v, atol=0, rtol=0, equal_nan=True)


def test_the_standard_layout_is_the_identity_and_the_backends_name_theirs():
    k, v = standard_blocks(2, 16, 64, torch.float32)
    assert STANDARD_KV_LAYOUT.name == "standard"
    assert STANDARD_KV_LAYOUT.shape(7, 16, 2, 64) == (7, 16, 2, 64)
    for convert in (STANDARD_KV_LAYOUT.to_standard, STANDARD_KV_LAYOUT.from_standard):
        keys, values = convert(k, v)
        assert keys is k and values is v
    assert TorchAttentionBackend.kv_layout is STANDARD_KV_LAYOUT
    assert CpuAttentionBackend.kv_layout is PACKED_KV_LAYOUT
    assert PACKED_KV_LAYOUT.name == "cpu-packed"
    assert PACKED_KV_LAYOUT.shape(7, 16, 2, 64) == (7, 2, 16, 64)


@pytest.mark.parametrize(("block_size", "head_dim"), [(8, 64), (24, 64), (16, 63)])
def test_the_packed_layout_refuses_blocks_it_cannot_tile(block_size, head_dim):
    with pytest.raises(ValueError, match="packed KV layout"):
        PACKED_KV_LAYOUT.shape(4, block_size, 2, head_dim)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels cannot build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_chunks_read_the_packed_blocks_poisoned_past_each_end(dtype):
    # Every chunk is longer than max_kernel_query_len, so the kernel leaves them all to the
    # long-chunk path (flash on brgemm in bf16 with AMX, else SDPA over gathered blocks),
    # which reads the packed caches, NaN-poisoned past each sequence's tokens.
    chunks = [(100, 70), (0, 80), (37, 65)]
    block_size, head_dim, group = 16, 64, 3
    meta, tables, num_blocks = paged_batch(chunks, block_size, random.Random(7))
    args = (chunks, tables, num_blocks, block_size, head_dim, dtype)
    k_cache, v_cache = poisoned_cache(*args), poisoned_cache(*args)
    query = torch.randn(meta.num_tokens, NUM_KV_HEADS * group, head_dim).to(dtype)
    backend = CpuAttentionBackend(max_kernel_query_len=64)

    out = backend.attend(query, *pack_kv(k_cache, v_cache), meta, head_dim**-0.5)

    expected = reference_attention(query, k_cache, v_cache, chunks, tables, head_dim**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
