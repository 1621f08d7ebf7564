"""The Triton FP8 group-scaled matmul equals a dequantize-then-matmul torch reference.

`fp8_group_matmul(a, a_scale, b, b_scale, group, out_dtype)` multiplies float8_e4m3fn
activations [M, K] by a float8_e4m3fn weight [N, K], each with one float32 scale per row and
K-group. Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`, set
here before triton is imported); with one, natively. Shapes stay small so the interpreter gets
through the file quickly.
"""

from __future__ import annotations

import os

import pytest
import torch

# Before anything imports triton: without a GPU, its kernels must run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton FP8 kernel needs the triton package")

from tidegate.engine.model.fp8_triton import fp8_group_matmul
from tidegate.engine.model.quantization import fp8_group_matmul_reference

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# A dot product's rounding error scales with the sum of its terms' magnitudes, not with its
# result (which can cancel), so outputs are compared within FP32_ERROR of sum |a_s b_s a b|;
# kernel and reference differ only in the order of their fp32 sums (scaled per group, versus
# scaled per element). A 16-bit output is one rounding of two nearly equal fp32 values, which
# may land one ulp apart: ULP of the result on top.
FP32_ERROR = 1e-5
ULP = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] fp32 to (float8_e4m3fn [R, K], float32 scales [R, ceil(K / group)]).

    Per row and K-group: scale = amax / 448, as FP8 checkpoints and activation quantizers do
    (a partial last group gets its own amax).
    """
    rows, k = x.shape
    num_groups = -(-k // group)
    padded = torch.zeros(rows, num_groups * group)
    padded[:, :k] = x
    grouped = padded.view(rows, num_groups, group)
    scale = (grouped.abs().amax(dim=2) / FP8_MAX).clamp(min=1e-12)
    q = (grouped / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows, num_groups * group)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


def make_operand(rows: int, k: int, group: int, gen: torch.Generator):
    """A quantized random [rows, k] operand whose groups span magnitudes 1e-2 to 1e2, so a
    scale taken from the wrong row or group shows up as a large error."""
    x = torch.randn(rows, k, generator=gen)
    num_groups = -(-k // group)
    magnitude = 10 ** (4 * torch.rand(rows, num_groups, generator=gen) - 2)
    x *= magnitude.repeat_interleave(group, dim=1)[:, :k]
    q, scale = quantize(x, group)
    return q.to(DEVICE), scale.to(DEVICE)


def make_case(m: int, n: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = make_operand(m, k, group, gen)
    b, b_scale = make_operand(n, k, group, gen)
    return a, a_scale, b, b_scale


def assert_matches_reference(a, a_scale, b, b_scale, group, out_dtype):
    out = fp8_group_matmul(a, a_scale, b, b_scale, group, out_dtype)
    expected = fp8_group_matmul_reference(a, a_scale, b, b_scale, group, out_dtype)
    assert out.dtype == out_dtype
    assert out.shape == (a.shape[0], b.shape[0])
    k = a.shape[1]
    abs_a = a.float().abs() * a_scale.repeat_interleave(group, dim=1)[:, :k]
    abs_b = b.float().abs() * b_scale.repeat_interleave(group, dim=1)[:, :k]
    bound = FP32_ERROR * (abs_a @ abs_b.T) + ULP[out_dtype] * expected.float().abs()
    excess = (out.float() - expected.float()).abs() - bound
    worst = divmod(int(excess.argmax()), out.shape[1])
    assert excess.max() <= 0, (
        f"out{list(worst)} = {out[worst].item()}, reference {expected[worst].item()}, "
        f"allowed error {bound[worst].item():.3g}"
    )


# ---------------------------------------------------------------------------------------------


def test_reference_is_the_grouped_sum_of_scaled_products():
    """The oracle itself: out[m, n] = sum_g a_s[m, g] b_s[n, g] sum_{k in g} a[m, k] b[n, k],
    computed here group by group in float64, K=40 with a partial last group of 8."""
    a, a_scale, b, b_scale = (t.cpu() for t in make_case(3, 5, 40, 16))
    expected = torch.zeros(3, 5, dtype=torch.float64)
    for g in range(3):
        ks = slice(16 * g, 16 * (g + 1))
        dot = a[:, ks].double() @ b[:, ks].double().T
        expected += a_scale[:, g, None].double() * b_scale[None, :, g].double() * dot
    out = fp8_group_matmul_reference(a, a_scale, b, b_scale, 16, torch.float32)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [
        (1, 40, 64, 16),  # one decode token; N not a multiple of the column tile
        (3, 24, 50, 16),  # partial last group (50 = 3 * 16 + 2)
        (37, 72, 96, 32),  # M and N not multiples of the tiles; whole groups
        (37, 33, 80, 32),  # ... and a partial last group (80 = 2 * 32 + 16)
        (5, 16, 32, 32),  # K == group: one group, i.e. per-row scales
        (4, 20, 20, 32),  # K < group: a single partial group
        (3, 20, 40, 40),  # one group of any width (per-row scales): K step 64, masked
        (2, 16, 300, 300),  # ... over several K steps, all with scale column 0
        (17, 24, 96, 48),  # a group that is no power of two (K step 16, three per group)
        (6, 24, 80, 48),  # ... partial, ending on a K step: its last step lies wholly past K
        (2, 16, 300, 256),  # two K steps per group, the last group partial past its first
    ],
)
def test_fp32_matches_reference(m, n, k, group):
    assert_matches_reference(*make_case(m, n, k, group), group, torch.float32)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "out_dtype"),
    [
        (1, 40, 64, 16, torch.bfloat16),
        (37, 33, 80, 32, torch.bfloat16),
        (9, 24, 50, 16, torch.float16),
    ],
)
def test_16_bit_output_matches_reference(m, n, k, group, out_dtype):
    assert_matches_reference(*make_case(m, n, k, group), group, out_dtype)


def test_strided_inputs():
    """Row slices of wider tensors (a merged projection's columns), a column-major a_scale and
    a transposed view of a (K not innermost, copied): the same result as contiguous inputs."""
    a, a_scale, b, b_scale = make_case(6, 20, 64, 16)
    wide_b = torch.zeros(20, 96, dtype=torch.float8_e4m3fn, device=DEVICE)
    wide_b[:, 16:80] = b
    a_scale_cm = a_scale.T.contiguous().T  # [M, G] with stride (1, M)
    a_t = a.T.contiguous().T  # [M, K] with stride (1, M)
    assert not a_t.is_contiguous() and not a_scale_cm.is_contiguous()
    out = fp8_group_matmul(a_t, a_scale_cm, wide_b[:, 16:80], b_scale, 16, torch.float32)
    expected = fp8_group_matmul(a, a_scale, b, b_scale, 16, torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_empty_shapes():
    """No rows, no columns: an empty result; K == 0: the empty sum, zeros."""
    a, a_scale, b, b_scale = make_case(0, 8, 32, 16)
    assert fp8_group_matmul(a, a_scale, b, b_scale, 16, torch.float32).shape == (0, 8)
    a, a_scale, b, b_scale = make_case(4, 0, 32, 16)
    assert fp8_group_matmul(a, a_scale, b, b_scale, 16, torch.bfloat16).shape == (4, 0)
    a, a_scale, b, b_scale = make_case(4, 8, 0, 16)
    out = fp8_group_matmul(a, a_scale, b, b_scale, 16, torch.float32)
    assert torch.equal(out, torch.zeros(4, 8, device=DEVICE))


def test_rejects_bad_inputs():
    a, a_scale, b, b_scale = make_case(4, 8, 48, 16)

    def call(**changes):
        args = dict(a=a, a_scale=a_scale, b=b, b_scale=b_scale, group=16)
        args["out_dtype"] = torch.float32
        args.update(changes)
        return fp8_group_matmul(**args)

    with pytest.raises(ValueError, match=r"a and b must be torch\.float8_e4m3fn"):
        call(a=a.to(torch.bfloat16))
    with pytest.raises(ValueError, match="a and b must be 2-D"):
        call(b=b[None])
    with pytest.raises(ValueError, match=r"a is \[M, 48\] but b is \[N, 32\]"):
        call(b=b[:, :32].contiguous())
    with pytest.raises(ValueError, match="a_scale must be float32"):
        call(a_scale=a_scale.half())
    with pytest.raises(ValueError, match=r"b_scale must be \[8, 3\].*got \(8, 2\)"):
        call(b_scale=b_scale[:, :2])
    with pytest.raises(ValueError, match=r"a_scale must be \[4, 3\].*got \(3, 3\)"):
        call(a_scale=a_scale[:3])
    for group in (0, -16, 8, 24):
        with pytest.raises(ValueError, match=f"multiple of 16 .* cover all of K=48, got {group}$"):
            call(group=group)
    with pytest.raises(ValueError, match="group must be an int"):
        call(group=16.0)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        call(out_dtype=torch.int8)
    with pytest.raises(ValueError, match="all tensors must be on"):
        call(b_scale=b_scale.to("meta"))
