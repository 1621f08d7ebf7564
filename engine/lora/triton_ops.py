"""Triton kernels for the batched LoRA delta: `y += (x @ A_s^T) @ B_s^T` per token's adapter.

A step's flat batch of T tokens may use up to S adapters at once, loaded in stacked buffers
`a_stack` [S, R, K] and `b_stack` [S, N, R] (R the largest rank: a smaller adapter is zero
padded; the LoRA scaling is already folded into B). Which token uses which slot is given by a
*segment mapping*:

- `sorted_token_ids` int32 [T]: token rows grouped by slot, slot 0's first. Tokens that use
  the base model appear in no segment; entries past `slot_starts[S]` are padding, never read.
- `slot_starts` int32 [S + 1]: slot s owns `sorted_token_ids[slot_starts[s]:slot_starts[s + 1]]`
  (equal starts for an empty slot).

The delta is two skinny matmuls. `lora_shrink` writes `h = x @ A_s^T` ([T, R], fp32) and
`lora_expand` adds `h @ B_s^T` into y in place. Both launch a grid of (token tile, output
column tile, slot) that depends only on tensor shapes, never on the mapping's values, so the
launches can be captured in CUDA graphs: each program reads its slot's segment bounds on the
device and returns at once when its token tile lies past the segment's end. A program loads
its slot's A (or B) tile once per K (or R) step and reuses it for BLOCK_M tokens through
`tl.dot`, gathering the token rows through `sorted_token_ids` (the punica "segment" idea).

Rows of tokens in no segment are never written, neither in h nor in y. On CPU the kernels run
under `TRITON_INTERPRET=1`, which is how the tests exercise them; the interpreter cannot do
bf16 arithmetic, so there 16-bit tiles are widened to fp32 on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Token tiles: decode steps spread few tokens over the slots, so a small tile wastes less of
# each program; prefill steps reuse every A/B tile over more rows. 16 is tl.dot's minimum.
_SMALL_BATCH = 128
# Reduction step over the hidden size K (shrink), and output columns per program (expand).
BLOCK_K = 64
BLOCK_N = 64
# Rank tile cap: R up to 64 is one tile, larger ranks are split over programs (shrink) or
# looped over (expand).
_MAX_BLOCK_R = 64


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """For every slot s and token t in its segment: `out[t] = x[t] @ a_stack[s].T` (fp32).

    x: [T, K]; a_stack: [S, R, K] of x's dtype; out: float32 [T, R]. Rows of tokens in no
    segment are left as they are.
    """
    num_tokens, hidden = x.shape
    num_slots, rank, a_hidden = a_stack.shape
    _check_mapping(sorted_token_ids, slot_starts, num_tokens, num_slots, x.device)
    if a_hidden != hidden:
        raise ValueError(f"a_stack is [S, R, {a_hidden}] but x has {hidden} features")
    if a_stack.dtype != x.dtype or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x and a_stack must share a float dtype, got {x.dtype}, {a_stack.dtype}")
    if out.shape != (num_tokens, rank) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{num_tokens}, {rank}], got {out.dtype} {out.shape}")
    _check_device(x.device, a_stack, out)
    if num_tokens == 0 or num_slots == 0 or rank == 0:
        return

    block_m = _block_m(num_tokens)
    block_r = _block_r(rank)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(rank, block_r), num_slots)
    _shrink_kernel[grid](
        x,
        a_stack,
        out,
        sorted_token_ids,
        slot_starts,
        hidden,
        rank,
        x.stride(0),
        x.stride(1),
        a_stack.stride(0),
        a_stack.stride(1),
        a_stack.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
        UPCAST=_interpreted() and x.dtype != torch.float32,
        # fp32 adapters keep full precision; 16-bit tiles are exact in any mode.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )


def lora_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """For every slot s and token t in its segment: `y[t] += h[t] @ b_stack[s].T`, in place.

    h: float32 [T, R]; b_stack: [S, N, R] of y's dtype; y: [T, N]. The product is accumulated
    in fp32, added to y in fp32 and rounded once to y's dtype. Rows of tokens in no segment
    are left as they are (and their rows of h are never read).
    """
    num_tokens, out_features = y.shape
    num_slots, b_out, rank = b_stack.shape
    _check_mapping(sorted_token_ids, slot_starts, num_tokens, num_slots, y.device)
    if b_out != out_features:
        raise ValueError(f"b_stack is [S, {b_out}, R] but y has {out_features} features")
    if b_stack.dtype != y.dtype or y.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"y and b_stack must share a float dtype, got {y.dtype}, {b_stack.dtype}")
    if h.shape != (num_tokens, rank) or h.dtype != torch.float32:
        raise ValueError(f"h must be float32 [{num_tokens}, {rank}], got {h.dtype} {h.shape}")
    _check_device(y.device, b_stack, h)
    if num_tokens == 0 or num_slots == 0 or rank == 0 or out_features == 0:
        return

    block_m = _block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, BLOCK_N), num_slots)
    _expand_kernel[grid](
        h,
        b_stack,
        y,
        sorted_token_ids,
        slot_starts,
        out_features,
        rank,
        h.stride(0),
        h.stride(1),
        b_stack.stride(0),
        b_stack.stride(1),
        b_stack.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_R=_block_r(rank),
        # h stays fp32. A 16-bit B is exact in tf32 and h loses less there than it would
        # rounded to y's dtype; tf32 keeps the tensor cores, so expand stays memory-bound.
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
    )


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    buffer: torch.Tensor | None = None,
) -> None:
    """Add each token's LoRA delta `(x[t] @ A_s^T) @ B_s^T` to y[t] in place.

    `buffer` (float32 [T_max >= T, >= R]) holds the shrink output in its first T rows and R
    columns; pass a preallocated one to keep CUDA-graph captures free of allocations. Without
    it one is allocated.
    """
    num_tokens = x.shape[0]
    rank = a_stack.shape[1]
    if buffer is None:
        buffer = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    elif buffer.dim() != 2 or buffer.shape[0] < num_tokens or buffer.shape[1] < rank:
        raise ValueError(f"buffer must be [>= {num_tokens}, >= {rank}], got {tuple(buffer.shape)}")
    h = buffer[:num_tokens, :rank]
    lora_shrink(x, a_stack, sorted_token_ids, slot_starts, h)
    lora_expand(h, b_stack, sorted_token_ids, slot_starts, y)


@triton.jit
def _segment_rows(token_ids_ptr, seg_start, seg_len, tile_m, BLOCK_M: tl.constexpr):
    """This tile's token rows of a segment (int64) and which of them are real.

    Offsets past the segment's end are masked, so padding in `sorted_token_ids` is never read.
    """
    offs = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs < seg_len
    rows = tl.load(token_ids_ptr + seg_start + offs, mask=row_ok, other=0)
    # int64 before multiplying by a row stride: T * N can pass 2**31 for merged projections.
    return rows.to(tl.int64), row_ok


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    token_ids_ptr,
    slot_starts_ptr,
    K,
    R,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_om,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # 16-bit under the interpreter, which cannot do bf16 arithmetic
    DOT_PRECISION: tl.constexpr,
):
    """One (token tile, rank tile, slot): out[rows, r] = x[rows] @ A[slot, r]^T."""
    tile_m = tl.program_id(0)
    tile_r = tl.program_id(1)
    slot = tl.program_id(2)
    seg_start = tl.load(slot_starts_ptr + slot)
    seg_len = tl.load(slot_starts_ptr + slot + 1) - seg_start
    # The grid covers every tile T tokens could need; most (tile, slot) pairs have no rows.
    if tile_m * BLOCK_M >= seg_len:
        return
    rows, row_ok = _segment_rows(token_ids_ptr, seg_start, seg_len, tile_m, BLOCK_M)

    offs_r = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # A[slot] read transposed, [BLOCK_K, BLOCK_R], so the dot needs no tl.trans.
    a_ptrs = (
        a_ptr
        + slot.to(tl.int64) * stride_as
        + offs_r[None, :] * stride_ar
        + offs_k[:, None] * stride_ak
    )
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_r[None, :] * stride_or
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    token_ids_ptr,
    slot_starts_ptr,
    N,
    R,
    stride_hm,
    stride_hr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (token tile, column tile, slot): y[rows, n] += h[rows] @ B[slot, n]^T."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    slot = tl.program_id(2)
    seg_start = tl.load(slot_starts_ptr + slot)
    seg_len = tl.load(slot_starts_ptr + slot + 1) - seg_start
    if tile_m * BLOCK_M >= seg_len:
        return
    rows, row_ok = _segment_rows(token_ids_ptr, seg_start, seg_len, tile_m, BLOCK_M)

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_r[None, :] * stride_hr
    # B[slot] read transposed, [BLOCK_R, BLOCK_N].
    b_ptrs = (
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + offs_n[None, :] * stride_bn
        + offs_r[:, None] * stride_br
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One step for R <= 64, the usual case.
    for r0 in range(0, R, BLOCK_R):
        r_ok = offs_r < R - r0
        h = tl.load(h_ptrs, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        # h is fp32, so B is widened to match (exactly) rather than h rounded to 16 bits.
        b = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(h, b, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_R * stride_hr
        b_ptrs += BLOCK_R * stride_br

    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    # Add in fp32, round once to y's dtype.
    y_new = (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y_new, mask=y_mask)


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= _SMALL_BATCH else 64


def _block_r(rank: int) -> int:
    return min(max(16, triton.next_power_of_2(rank)), _MAX_BLOCK_R)


def _interpreted() -> bool:
    return isinstance(_shrink_kernel, InterpretedFunction)


def _check_mapping(
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    num_tokens: int,
    num_slots: int,
    device: torch.device,
) -> None:
    """Shapes, dtypes and device only: the values stay on the device (no sync)."""
    if sorted_token_ids.dtype != torch.int32 or slot_starts.dtype != torch.int32:
        raise ValueError(
            "sorted_token_ids and slot_starts must be int32, got "
            f"{sorted_token_ids.dtype}, {slot_starts.dtype}"
        )
    if sorted_token_ids.shape != (num_tokens,):
        raise ValueError(
            f"sorted_token_ids must be [{num_tokens}], got {tuple(sorted_token_ids.shape)}"
        )
    if slot_starts.shape != (num_slots + 1,):
        raise ValueError(f"slot_starts must be [{num_slots + 1}], got {tuple(slot_starts.shape)}")
    if not (sorted_token_ids.is_contiguous() and slot_starts.is_contiguous()):
        raise ValueError("sorted_token_ids and slot_starts must be contiguous")
    _check_device(device, sorted_token_ids, slot_starts)


def _check_device(device: torch.device, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}, got one on {t.device}")
