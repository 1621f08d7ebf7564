"""The `triton` attention backend: paged attention for mixed prefill/decode batches in Triton.

`unified_attention` serves a whole batch — prefill chunks, prefix-cache hits and decodes mixed
— in one kernel launch, reading K/V straight from the paged cache through the block table.
Each program owns a tile of up to BLOCK_Q consecutive new tokens of one sequence and *all*
the query heads that share one KV head, so every K/V tile is loaded once per KV head (GQA,
MQA) and fed to the tensor cores as a `[BLOCK_M, TILE_N]` matrix product, with BLOCK_M =
BLOCK_Q * query heads per KV head (rounded up to a power of two). The softmax is online
(running max and sum in fp32, exp2 with the scale folded in).

Decode batches of a few long sequences leave most SMs idle with one program per (sequence,
KV head); for them the keys are split into NUM_SEGMENTS segments, each program writes a
partial (max, sum, accumulator) and a second kernel merges them (split-KV, "flash-decoding").

`reshape_and_cache` writes the new tokens' K/V into their cache slots. On CPU the kernels
run under `TRITON_INTERPRET=1`, which is how the tests exercise them; the interpreter cannot
do bf16 arithmetic, so there bf16 tiles are widened to fp32 on load (P still rounded to bf16).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from tidegate.engine.attention.backend import (
    KV_CACHE_DTYPES,
    STANDARD_KV_LAYOUT,
    AttentionMetadata,
    to_cache_dtype,
)

# Split-KV: segments per sequence, and the SM count assumed when no GPU says otherwise.
NUM_SEGMENTS = 16
_DEFAULT_NUM_SMS = 132  # H100/H200


class TritonAttentionBackend:
    """Paged attention with Triton kernels: one launch per layer for any mix of sequences."""

    name = "triton"
    # Launch shapes come from host ints fixed at capture (num_seqs, max_query_len,
    # max_seq_len); everything per-sequence is read on the device.
    cuda_graph_safe = True
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
        n = meta.num_tokens
        reshape_and_cache(key[:n], value[:n], k_cache, v_cache, meta.slot_mapping[:n])

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
        unified_attention(
            query[: meta.num_tokens],
            k_cache,
            v_cache,
            out[: meta.num_tokens],
            meta.query_start_loc[: meta.num_seqs + 1],
            meta.seq_lens[: meta.num_seqs],
            meta.block_table[: meta.num_seqs],
            softmax_scale,
            # A host int fixed per layer, as the kernel's SLIDING switch: a captured CUDA
            # graph replays each layer with its own window.
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )
        return out


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float = 0.0,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    split_kv: bool | None = None,
) -> None:
    """Write into `out` the causal paged attention of every new token in the batch.

    q, out: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; query_start_loc int32 [num_seqs + 1]; seq_lens int32 [num_seqs] (context plus
    new tokens); block_table int32 [num_seqs, max_blocks_per_seq], entries past a sequence's
    blocks may be -1 and are never read. The token at query offset j of sequence i sees key
    positions p < seq_lens[i] - query_len_i + j + 1; with `sliding_window=W` only the last W
    of those (itself included), as Mistral's and Hugging Face's masks define it. With
    `logits_soft_cap=C` > 0 each scaled score s becomes C * tanh(s / C) (Gemma 2).

    max_query_len/max_seq_len are host ints used only to pick tile sizes and the split-KV
    path (read from the tensors, one sync, when not given); `split_kv` forces that path on
    or off. Rows of `out` past query_start_loc[-1] are not written.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check_inputs(q, k_cache, v_cache, out, block_table, num_heads, num_kv_heads, head_dim)
    if num_tokens == 0 or num_seqs == 0:
        return
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if split_kv is None:
        split_kv = use_split_kv(max_query_len, max_seq_len, num_seqs, num_kv_heads, q.device)

    group = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    block_m, tile_n, num_warps = _tiles(max_query_len, head_pad, group_pad, q.dtype)
    block_q = block_m // group_pad
    # Sequence i owns q blocks [qsl[i] // BLOCK_Q + i, ...): an upper bound needing no sync.
    num_q_blocks = num_tokens // block_q + num_seqs
    num_segments = NUM_SEGMENTS if split_kv else 1
    interpreted = isinstance(_attention_kernel, InterpretedFunction)

    if split_kv:
        partial_shape = (num_tokens, num_heads, num_segments)
        part_max = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
        part_acc = torch.empty((*partial_shape, head_pad), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # unused placeholders

    _attention_kernel[(num_q_blocks, num_kv_heads, num_segments)](
        q,
        k_cache,
        v_cache,
        out,
        part_max,
        part_sum,
        part_acc,
        query_start_loc,
        seq_lens,
        block_table,
        softmax_scale * math.log2(math.e),
        # The cap in the kernel's base-2 units: scores come scaled by log2(e).
        logits_soft_cap * math.log2(math.e),
        num_seqs,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        SLIDING=bool(sliding_window),
        SOFT_CAP=logits_soft_cap > 0,
        UPCAST=interpreted and q.dtype == torch.bfloat16,
        FP8_KV=k_cache.dtype != q.dtype,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    if split_kv:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out,
            part_max,
            part_sum,
            part_acc,
            query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_segments,
        )


def _tiles(
    max_query_len: int, head_pad: int, group_pad: int, dtype: torch.dtype
) -> tuple[int, int, int]:
    """(BLOCK_M query rows, TILE_N keys, warps) of one attention program.

    tl.dot needs at least 16 rows; decodes need no more, prefill chunks amortize each K/V tile
    over more rows. Chosen by compiling for sm_90 and reading register use, not yet by timing:
    64-key tiles spill registers, as do 64 rows on 4 warps; with these, bf16/fp16 builds spill
    at most a few bytes. fp32 (exact "ieee" dots) is correct but untuned and spills.
    """
    rows = 16 if max_query_len == 1 else (64 if head_pad <= 128 else 32)
    block_m = max(rows, group_pad)
    num_warps = 8 if block_m >= 64 or dtype == torch.float32 else 4
    return block_m, 32, num_warps


def use_split_kv(
    max_query_len: int,
    max_seq_len: int,
    num_seqs: int,
    num_kv_heads: int,
    device: torch.device,
) -> bool:
    """Whether a batch should take the split-KV path.

    Only decode-only batches (every query length 1) whose one-program-per-(sequence, KV head)
    grid would not even give each SM one program, and whose longest sequence gives each of
    the NUM_SEGMENTS segments at least 64 keys, so that the partial results and the reduce
    launch are small next to the key reads they parallelize. The thresholds are a starting
    guess; benchmarks/attention.py times both paths on few long decodes.
    """
    if max_query_len != 1:
        return False
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = _DEFAULT_NUM_SMS
    return num_seqs * num_kv_heads < num_sms and max_seq_len >= NUM_SEGMENTS * 64


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots.

    Slot s is row s % block_size of block s // block_size; tokens whose slot is negative
    (padding) are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    narrowed = k_cache.dtype in KV_CACHE_DTYPES.values()
    if (key.dtype != k_cache.dtype and not narrowed) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"key/value are {key.dtype}/{value.dtype} but the caches hold "
            f"{k_cache.dtype}/{v_cache.dtype}; they must hold the keys' dtype or "
            f"{', '.join(map(str, KV_CACHE_DTYPES.values()))}"
        )
    if narrowed:
        # Rounded to FP8 by torch, one elementwise op before the copy: Triton's interpreter
        # rounds some values that carry into the next power of two wrongly (-7.84 to -4, not
        # -8), so the kernel only moves bytes, and the tests see what a GPU stores.
        key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head dimension of key, value and the caches must be contiguous")
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def _check_inputs(q, k_cache, v_cache, out, block_table, num_heads, num_kv_heads, head_dim) -> None:
    """Shapes and layouts the kernels rely on, with what was given."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly; "
            "the query head count must be a multiple of the KV head count"
        )
    if k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match a query "
            f"head size of {head_dim}; both must be [num_blocks, block_size, num_kv_heads, "
            f"{head_dim}]"
        )
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; it must match q {q.dtype}")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head dimension of q, out and the caches must be contiguous")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous (stride 1 along a row)")
    if k_cache.dtype not in (q.dtype, *KV_CACHE_DTYPES.values()) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q is {q.dtype} but the caches hold {k_cache.dtype}/{v_cache.dtype}; they must "
            f"hold q's dtype or {', '.join(map(str, KV_CACHE_DTYPES.values()))}"
        )


@triton.jit
def _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose q blocks contain q_block (block starts: qsl[i] // BLOCK_Q + i)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    query_start_loc,
    seq_lens,
    block_table,
    scale_log2,  # softmax_scale * log2(e): scores go through exp2
    soft_cap_log2,  # logits_soft_cap * log2(e), read when SOFT_CAP
    num_seqs,
    window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_blk,
    stride_k_slot,
    stride_k_head,
    stride_v_blk,
    stride_v_slot,
    stride_v_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr,  # bf16 under the interpreter, which cannot do bf16 arithmetic
    FP8_KV: tl.constexpr,  # the cache holds FP8 keys and values, widened to q's dtype on load
    DOT_PRECISION: tl.constexpr,
):
    """One (q tile of one sequence, KV head, key segment): online softmax over its keys."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - query_len

    # Row m is query token local_block * BLOCK_Q + m // GROUP_PAD, head m % GROUP_PAD of the
    # KV head's group: the group's heads share every K/V tile this program loads.
    rows = tl.arange(0, BLOCK_M)
    q_off = local_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_off < query_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q_ptrs = q_ptr + (q_start + q_off)[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(q_ptrs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    query_pos = context_len + q_off  # absolute position of each row's token

    # Keys this tile needs: up to its last token (causal), from its first token's window.
    tile_last = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, query_len) - 1
    key_end = context_len + tile_last + 1
    key_begin = 0
    if SLIDING:
        key_begin = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)
    if NUM_SEGMENTS > 1:
        seg_len = tl.cdiv(tl.cdiv(seq_len, NUM_SEGMENTS), TILE_N) * TILE_N
        key_begin = tl.maximum(key_begin, segment * seg_len)
        key_end = tl.minimum(key_end, (segment + 1) * seg_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    tile_begin = (key_begin // TILE_N) * TILE_N
    for start in range(tile_begin, key_end, TILE_N):
        key_pos = start + tl.arange(0, TILE_N)
        key_ok = key_pos < key_end
        # Per-key block lookup lets a tile span several cache blocks; masked keys never
        # touch the block table, so its -1 padding is never dereferenced.
        blocks = tl.load(block_table + seq * stride_bt + key_pos // BLOCK_SIZE, mask=key_ok)
        blocks = blocks.to(tl.int64)
        slot_in_block = key_pos % BLOCK_SIZE
        k_rows = blocks * stride_k_blk + slot_in_block * stride_k_slot + kv_head * stride_k_head
        v_rows = blocks * stride_v_blk + slot_in_block * stride_v_slot + kv_head * stride_v_head
        kv_mask = key_ok[None, :] & dim_ok[:, None]
        k = tl.load(k_cache_ptr + k_rows[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask.T, other=0.0)
        if FP8_KV:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if SOFT_CAP:
            # C * tanh(s / C) in base-2 units (both sides scaled by log2(e)); tanh(x) as
            # 1 - 2 / (e^(2x) + 1), which saturates to +-1 without overflow trouble.
            e2x = tl.math.exp2((2.0 * 1.4426950408889634 / soft_cap_log2) * s)
            s = soft_cap_log2 * (1.0 - 2.0 / (e2x + 1.0))
        allowed = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if SLIDING:
            allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no allowed key yet keeps max -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P enters the second matmul in the cache dtype; the interpreter rounds it to bf16
        # as the GPU would, then multiplies in fp32.
        p = p.to(tl.bfloat16).to(tl.float32) if UPCAST else p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    token = q_start + q_off
    if NUM_SEGMENTS == 1:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
        result = result.to(out_ptr.dtype.element_ty)
        tl.store(o_ptrs + dims[None, :], result, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    query_start_loc,
    num_seqs,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Merge one (token, head)'s segment partials: rescale each to the global max, sum."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    if token >= tl.load(query_start_loc + num_seqs):
        return
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_PAD)
    part = (token * num_heads + head) * NUM_SEGMENTS + segs
    seg_max = tl.load(part_max_ptr + part)
    seg_sum = tl.load(part_sum_ptr + part)
    seg_acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :])
    overall = tl.max(seg_max, axis=0)
    # Empty segments have max -inf and weigh exp2(-inf) = 0.
    weight = tl.math.exp2(seg_max - tl.where(overall == float("-inf"), 0.0, overall))
    total = tl.sum(seg_sum * weight, axis=0)
    result = tl.sum(seg_acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + token * stride_o_tok + head * stride_o_head + dims
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Copy one token's [num_kv_heads, head_dim] key and value rows into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    src_k = key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst_k = block * stride_kc_blk + offset * stride_kc_slot + heads[:, None] * stride_kc_head
    dst_v = block * stride_vc_blk + offset * stride_vc_slot + heads[:, None] * stride_vc_head
    tl.store(k_cache_ptr + dst_k + dims[None, :], tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst_v + dims[None, :], tl.load(src_v, mask=mask), mask=mask)
