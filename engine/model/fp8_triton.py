"""Triton kernel for FP8 (float8_e4m3fn) matrix products with group-wise scales.

FP8 checkpoints of the DeepSeek-V3 / Qwen3 kind store each linear weight as float8_e4m3fn with
one float32 scale per 128 x 128 block, and quantize the activations on the fly per token in
groups of 128 along K. A product of such operands is

    out[m, n] = sum_g a_scale[m, g] * b_scale[n, g] * sum_{k in group g} a[m, k] * b[n, k]

so the scales cannot be pulled out of the whole K sum, only out of each K-group's. The caller
expands the weight's block scales to one per output row ([N, G]), which lets the kernel treat
both operands alike: per K-group it loads a vector of row scales for a and one for b.

`fp8_group_matmul` tiles the output in BLOCK_M x BLOCK_N and walks K in steps of BLOCK_K,
which divides the group, so every step lies inside one group g. A step's fp8 tiles go through
`tl.dot` (fp32 out) into a partial that starts from zero; the partial is then scaled by
`a_scale[:, g][:, None] * b_scale[:, g][None, :]` and added to the fp32 accumulator. For the
checkpoints' group of 128, BLOCK_K is 128: one step, one partial per group. The fresh partial
also bounds the tensor cores' own accumulation: Hopper's fp8 MMA adds in reduced precision,
and on sm_90 Triton promotes a chain of fp8 dots to full fp32 only if asked
(`max_num_imprecise_acc`), so this is what DeepSeek-V3's report (section 3.3.2) calls
promotion to CUDA cores every 128 elements, at no extra cost.

One group that covers all of K (`group >= K`: per-row scales, as per-channel checkpoints have)
takes any width: every step then uses scale column 0. Otherwise the group must be a multiple
of 16, tl.dot's smallest K. K need not be a multiple of the group: the last group is partial,
its loads masked past K.

On CPU the kernel runs under `TRITON_INTERPRET=1`, which is how the tests exercise it (the
interpreter does fp8 dots); `fp8_group_matmul_reference` is the plain torch version, the
tests' oracle and the CPU path (it lives in quantization.py, which needs no Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Reduction step cap: 128 is the checkpoints' group width and a full fp8 wgmma K on Hopper.
_MAX_BLOCK_K = 128
# tl.dot needs every tile dimension >= 16.
_MIN_BLOCK = 16
# Output tiles that share a column of B run next to each other in groups of this many row
# tiles, so B's tiles are still in L2 when the next row tile asks for them (large prefills).
_GROUP_M = 8


def fp8_group_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`a @ b.T` of two group-scaled fp8 operands, accumulated in fp32, as out_dtype [M, N].

    a: float8_e4m3fn [M, K]; a_scale: float32 [M, G]; b: float8_e4m3fn [N, K] (nn.Linear's
    out x in); b_scale: float32 [N, G]; G = ceil(K / group). group: a multiple of 16, or
    >= K (one group). Strided inputs are read in place when K is their innermost dimension,
    else copied.
    """
    block_k = _check_inputs(a, a_scale, b, b_scale, group, out_dtype)
    if a.device.type == "cpu" and not _interpreted():
        raise ValueError(
            "fp8_group_matmul runs CPU tensors only under TRITON_INTERPRET=1; "
            "use quantization.fp8_group_matmul_reference on CPU"
        )
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    # Coalesced fp8 loads need K contiguous; the scales are small and read at any stride.
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()

    block_m, block_n, num_warps, num_stages = _tiles(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_group_matmul_kernel[grid](
        a,
        b,
        out,
        a_scale,
        b_scale,
        m,
        n,
        k,
        group,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        a_scale.stride(0),
        a_scale.stride(1),
        b_scale.stride(0),
        b_scale.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=_GROUP_M,
        EVEN_K=k % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton.jit
def _fp8_group_matmul_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    group,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_om,
    stride_on,
    stride_asm,
    stride_asg,
    stride_bsn,
    stride_bsg,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no load needs a K mask
):
    """One BLOCK_M x BLOCK_N output tile: out = sum over K steps of (a_k @ b_k^T) times the
    scales of the step's group."""
    # Grouped launch order: GROUP_M row tiles sweep one column tile before the next.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % tiles_per_group) % group_rows
    tile_n = (pid % tiles_per_group) // group_rows

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past M / N wrap onto real ones: every load stays in bounds without an
    # M or N mask (so it can be vectorised), and only the store is masked.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    # B read transposed, [BLOCK_K, BLOCK_N], straight from its [N, K] rows (K-major, as the
    # fp8 tensor cores want it), so the dot needs no tl.trans.
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    a_scale_ptrs = a_scale_ptr + rows * stride_asm
    b_scale_ptrs = b_scale_ptr + cols * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        # A fresh partial per step, not tl.dot(a, b, acc): the scales differ between groups,
        # and the fp32 add below is the precise accumulation (see the module docstring).
        partial = tl.dot(a, b, out_dtype=tl.float32)
        # BLOCK_K divides the group (or one group covers K), so the step has one scale column.
        g = k0 // group
        a_s = tl.load(a_scale_ptrs + g * stride_asg)
        b_s = tl.load(b_scale_ptrs + g * stride_bsg)
        acc += partial * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows: untuned, sensible on H100/H200.

    Decode (M <= 16) is bound by reading the weight, so the idle rows of a 16-row tile (tl.dot's
    smallest) cost little, and 64-column tiles make more programs to spread the weight over
    the SMs.
    Larger M reuses each weight tile over more rows; 128 x 128 pays off once there are enough
    row tiles to fill the GPU. Under the interpreter, small tiles keep the tests quick.
    """
    if _interpreted():
        return 16, 32, 1, 1
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 256:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def _block_k(group: int, k: int) -> int | None:
    """The K step for a K-group: the largest power of two <= 128 that divides it, or for one
    group covering K, K's next power of two within [16, 128]; None where there is none."""
    if group >= max(k, 1):
        return min(max(_MIN_BLOCK, triton.next_power_of_2(k)), _MAX_BLOCK_K)
    step = min(group & -group, _MAX_BLOCK_K) if group > 0 else 0
    return step if step >= _MIN_BLOCK else None


def _interpreted() -> bool:
    return isinstance(_fp8_group_matmul_kernel, InterpretedFunction)


def _check_inputs(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
) -> int:
    """Dtypes, shapes, group width and devices; returns the reduction step BLOCK_K."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a and b must be {FP8_DTYPE}, got {a.dtype}, {b.dtype}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {tuple(a.shape)}, {tuple(b.shape)}")
    (m, k), (n, b_k) = a.shape, b.shape
    if b_k != k:
        raise ValueError(f"a is [M, {k}] but b is [N, {b_k}]: both need the same K")
    if isinstance(group, bool) or not isinstance(group, int):
        raise ValueError(f"group must be an int, got {type(group).__name__}")
    block_k = _block_k(group, k)
    if block_k is None:
        raise ValueError(
            f"group must be a positive multiple of {_MIN_BLOCK} (the K step of the kernel's "
            f"matrix products divides it) or cover all of K={k}, got {group}"
        )
    num_groups = -(-k // group)
    for name, scale, rows in (("a_scale", a_scale, m), ("b_scale", b_scale, n)):
        if scale.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {scale.dtype}")
        if tuple(scale.shape) != (rows, num_groups):
            raise ValueError(
                f"{name} must be [{rows}, {num_groups}] (one scale per row and K-group of "
                f"{group} over K={k}), got {tuple(scale.shape)}"
            )
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    for t in (a_scale, b, b_scale):
        if t.device != a.device:
            raise ValueError(f"all tensors must be on {a.device}, got one on {t.device}")
    return block_k
