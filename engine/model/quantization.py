"""FP8 weights: checkpoints quantized to float8_e4m3fn, and 16/32-bit ones quantized at load.

An FP8 checkpoint stores each quantized linear as `X.weight` in float8_e4m3fn beside a scale
in float32 (or bf16), and the real weight is their product. config.json's
`quantization_config` says how the scales are laid out:

- `quant_method: fp8` (transformers' fine-grained FP8: DeepSeek-V3, Qwen3-*-FP8): one scale
  per block of `weight_block_size` [rows, columns], usually 128 x 128, in
  `X.weight_scale_inv` (multiplied in, despite its name); activations are quantized per
  token in groups of the block's width at run time.
- `quant_method: compressed-tensors` with 8-bit float weights (llm-compressor's FP8 and
  FP8_DYNAMIC): `X.weight_scale` per tensor, per output channel or per block
  (`strategy`), and activations per token or with a calibrated `X.input_scale`.
- `quant_method: fbgemm_fp8`: `X.weight_scale` per output channel.

Modules the quantizer left alone (the LM head, a MoE router, whatever the config's ignore
list names) have no scale; the loader goes by the scales it finds, not by the lists.

In memory every FP8 linear holds its weight [out, in] in FP8 and `weight_scale` [out, G] in
float32: one scale per output row and K-group of `scale_group` columns (G = 1 for per-tensor
and per-channel scales; a 128 x 128 block's scale is repeated on its 128 rows). Repeating
block scales over rows costs 1/32 of the FP8 weight's bytes and makes the merged q/k/v and
gate/up linears, and tensor-parallel row splits, slice scales exactly as they slice weights;
a per-tensor scale of each merged shard becomes those rows' scale, with no requantization.

Execution (`resolve_weight_format`, the engine's `--quantization`):
- `fp8`: the product runs on FP8 inputs. Activations are quantized per token (and K-group)
  at run time; calibrated input scales are not used, as a per-token scale is at least as
  precise. On CUDA (and in Triton's interpreter) through `fp8_triton.fp8_group_matmul`; on
  CPU through torch's `_scaled_mm` (per-row scales) or a dequantizing product (K-groups),
  which emulate FP8 and are many times slower than a float32 linear: on CPU this is for
  checking the arithmetic, not for serving.
- `dequantize`: each weight is multiplied out to the model's dtype while it is read, and
  the linear is an ordinary one (packed for oneDNN like any other): the checkpoint's exact
  values, at the memory of an unquantized model. What `auto` picks where FP8 products are
  emulated.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Literal

import torch

from tidegate.engine.model.config import Fp8Checkpoint

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Names of a weight's scale in the formats above, in the order they are looked for.
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# Calibrated scales an FP8 checkpoint may carry and the engine does not use: activations'
# (static quantization; per-token scales instead, see above) and attention's queries and
# outputs (FP8 attention arithmetic, which no backend does).
UNUSED_SCALE_SUFFIXES = (".input_scale", ".q_scale", ".output_scale")
# Calibrated KV-cache scales (a kv_cache_scheme): one k_scale and one v_scale per layer under
# self_attn (llm-compressor), under its k_proj and v_proj (ModelOpt), or one kv_scale for
# both (AutoFP8, older checkpoints). Under --kv-cache-dtype fp8 the cache holds k / k_scale
# and v / v_scale, which spends FP8's range on the values a layer really has.
KV_SCALE_NAME = re.compile(
    r"^(?P<attention>.+\.self_attn)(?:\.(?:k|v|qkv)_proj)?\.(?P<kind>kv|k|v)_scale$"
)
WeightFormat = Literal["fp8", "dequantize"]


def fp8_matmuls_native(device: torch.device) -> bool:
    """Whether the device multiplies FP8 in hardware: CUDA compute capability 8.9 or later
    (Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_weight_format(
    choice: str, checkpoint: Fp8Checkpoint | None, device: torch.device
) -> WeightFormat | None:
    """How the linears hold their weights for --quantization `choice`: "fp8", "dequantize"
    (an FP8 checkpoint multiplied out at load) or None (as the checkpoint stores them)."""
    if choice == "fp8":
        if not fp8_matmuls_native(device):
            logger.warning(
                "--quantization fp8 on %s: FP8 products are emulated here, many times slower "
                "than %s weights (auto dequantizes an FP8 checkpoint at load instead)",
                device.type,
                "16-bit" if device.type == "cuda" else "float32",
            )
        return "fp8"
    if checkpoint is None:
        return None
    if choice == "none":
        return "dequantize"
    if choice != "auto":
        raise ValueError(f"quantization {choice!r} is not one of auto, fp8, none")
    if fp8_matmuls_native(device):
        return "fp8"
    logger.info(
        "FP8 checkpoint (%s) on %s, which has no FP8 products: weights dequantized at load",
        checkpoint.method,
        device.type if device.type != "cuda" else "a GPU before compute capability 8.9",
    )
    return "dequantize"


# --- quantizing ------------------------------------------------------------------------------


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale [rows, 1]): each row scaled so that its largest magnitude is
    FP8's largest, how a 16/32-bit checkpoint is quantized at load."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x [M, K], float32 scale [M, ceil(K / group)]): dynamic quantization of each row's
    K-groups (one group per row when group >= K)."""
    rows, width = x.shape
    groups = -(-width // group)
    x = x.float()
    if groups == 1:
        scale = x.abs().amax(dim=1, keepdim=True)
    else:
        padded = torch.nn.functional.pad(x, (0, groups * group - width))
        scale = padded.view(rows, groups, group).abs().amax(dim=2)
    scale = scale.clamp(min=1e-12) / FP8_MAX
    expanded = scale if groups == 1 else scale.repeat_interleave(group, dim=1)[:, :width]
    return (x / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# --- reading a checkpoint's scales -----------------------------------------------------------


def expand_scale(scale: torch.Tensor, checkpoint: Fp8Checkpoint) -> torch.Tensor:
    """A checkpoint scale as [rows, G] float32 (see the module docstring); a per-tensor scale
    stays [1, 1], for the caller to broadcast over the rows it fills."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if checkpoint.block is None:
        return scale.reshape(-1, 1)  # per output channel: [out] or [out, 1]
    if scale.dim() != 2:
        raise ValueError(f"block scale of shape {tuple(scale.shape)} is not 2-D")
    return scale.repeat_interleave(checkpoint.block[0], dim=0)


class DequantizedSlice:
    """An FP8 checkpoint weight (tensor or lazy safetensors slice) read as float32 products
    with its scale: the rows and columns a layer's loader slices out, and only those."""

    def __init__(self, weight: Any, scale: torch.Tensor, checkpoint: Fp8Checkpoint) -> None:
        self.weight = weight
        self.scale = scale.float()
        self.checkpoint = checkpoint
        rows, cols = self.get_shape()
        if checkpoint.block is not None:
            expected: tuple[int, ...] = (
                -(-rows // checkpoint.block[0]),
                -(-cols // checkpoint.block[1]),
            )
            fits = tuple(self.scale.shape) == expected
        else:
            expected = (rows, 1)
            fits = self.scale.numel() in (1, rows)
        if not fits:
            raise ValueError(
                f"an FP8 weight of shape {(rows, cols)} has a scale of shape "
                f"{tuple(self.scale.shape)}; its layout ({checkpoint.method}, block "
                f"{checkpoint.block}) needs {expected}"
            )

    def get_shape(self) -> list[int]:
        """The weight's shape, as a safetensors slice answers."""
        if isinstance(self.weight, torch.Tensor):
            return list(self.weight.shape)
        return list(self.weight.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = self.get_shape()
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 2 or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise TypeError(f"a dequantized weight is sliced by ranges only, not {index!r}")
        row_range = range(*index[0].indices(rows))
        col_range = range(*(index[1] if len(index) > 1 else slice(None)).indices(cols))
        part = self.weight[index].float()
        scale = self.scale
        if scale.numel() == 1:
            return part * scale.reshape(())
        row_ids = torch.arange(row_range.start, row_range.stop)
        if self.checkpoint.block is None:
            return part * scale.reshape(-1)[row_ids].unsqueeze(1)
        block_rows, block_cols = self.checkpoint.block
        col_ids = torch.arange(col_range.start, col_range.stop)
        return part * scale[row_ids // block_rows][:, col_ids // block_cols]


def is_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a weight's scale (see SCALE_SUFFIXES)."""
    return name.endswith(SCALE_SUFFIXES)


def scaled_weight(scale_name: str) -> str:
    """The weight a scale belongs to: `X.weight_scale_inv` -> `X.weight`."""
    for suffix in SCALE_SUFFIXES:
        if scale_name.endswith(suffix):
            return scale_name[: -len(suffix)] + ".weight"
    raise ValueError(f"{scale_name} is not a weight scale")


# --- the product -----------------------------------------------------------------------------


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int, use_triton: bool
) -> torch.Tensor:
    """x @ (weight * scale).T with x quantized per token and K-group at run time: [..., N] in
    x's dtype. Under torch.compile an opaque op (`tidegate::fp8_linear`), as the Triton
    launch and the emulated CPU products are not for inductor to trace."""
    if torch.compiler.is_compiling():
        return torch.ops.tidegate.fp8_linear(x, weight, scale, group, use_triton)
    return _fp8_linear(x, weight, scale, group, use_triton)


@torch.library.custom_op("tidegate::fp8_linear", mutates_args=())
def _fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int, use_triton: bool
) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    x8, x_scale = quantize_activations(flat, group)
    if use_triton:
        from tidegate.engine.model.fp8_triton import fp8_group_matmul

        out = fp8_group_matmul(x8, x_scale, weight, scale, group, x.dtype)
    elif scale.shape[1] == 1:  # per-row scales: torch's scaled product takes them as they are
        out = torch._scaled_mm(
            x8, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype
        )
    else:
        out = fp8_group_matmul_reference(x8, x_scale, weight, scale, group, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_group_matmul_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_triton.fp8_group_matmul in plain torch: both operands dequantized to float32 by
    their [rows, K-groups] scales, multiplied, cast to out_dtype."""
    k = a.shape[1]
    a_full = a.float() * a_scale.repeat_interleave(group, dim=1)[:, :k]
    b_full = b.float() * b_scale.repeat_interleave(group, dim=1)[:, :k]
    return (a_full @ b_full.T).to(out_dtype)


@_fp8_linear.register_fake
def _(x, weight, scale, group, use_triton) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def kv_cache_scale(name: str, tensor: Any) -> float:
    """A checkpoint's calibrated KV-cache scale (tensor or lazy slice) as a number; a
    ValueError for a scale per head or channel, or one that is not positive and finite."""
    value = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
    if value.numel() != 1:
        raise ValueError(
            f"{name} holds {value.numel()} KV-cache scales (shape {tuple(value.shape)}); only "
            "one per layer is supported (a kv_cache_scheme of strategy tensor)"
        )
    scale = float(value.float())
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} is {scale}; a KV-cache scale must be positive and finite")
    return scale


def kv_cache_scales(found: dict[str, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """(k_scale, v_scale) of each attention module from the scales its checkpoint names hold
    (`found`: module -> {"k", "v", "kv"} -> scale): a kv_scale stands for whichever of the
    two is missing, and a layer with neither scales by 1."""
    scales = {}
    for attention, kinds in found.items():
        k_scale = kinds.get("k", kinds.get("kv", 1.0))
        v_scale = kinds.get("v", kinds.get("kv", 1.0))
        if ("k" in kinds) != ("v" in kinds) and "kv" not in kinds:
            given, missing = ("k", "v") if "k" in kinds else ("v", "k")
            logger.warning("%s has a %s_scale and no %s_scale (1)", attention, given, missing)
        scales[attention] = (k_scale, v_scale)
    return scales
