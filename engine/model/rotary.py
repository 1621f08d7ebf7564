"""Rotary position embedding (neox style, as Hugging Face Llama), with a per-position cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by angles looked up from `positions`."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        # Phi-4-mini rotates the first 3/4 of each head and passes the rest through.
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention_factor = _inv_freq(self.rotary_dim, base, scaling, max_position)
        # Computed in float32 and then cast to the model's dtype, exactly as transformers does,
        # so that bf16 models round the same way. Shapes: [max_position, head_dim // 2].
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", (freqs.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, Hq, D] and key [T, Hkv, D] for tokens at `positions` [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim == query.shape[-1]:
            return _rotate(query, cos, sin), _rotate(key, cos, sin)
        dim = self.rotary_dim
        return tuple(
            torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1) for x in (query, key)
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as HF's x * cos + rotate_half(x) * sin, on half the dims at a time.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _inv_freq(
    dim: int, base: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier, as transformers' ROPE_INIT_FUNCTIONS."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(dim, base, scaling, max_position_embeddings)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    dim: int, base: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention by mscale."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as transformers does
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(
    dim: int, base: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, the long list's when the
    engine serves beyond the pretraining length (`long_context`, ModelConfig.at_context_length),
    else the short one's; cos and sin scaled by sqrt(1 + ln(s) / ln(original length)), s the
    extension's ratio."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        )
    factors = scaling["long_factor" if scaling.get("long_context") else "short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for {dim // 2} frequencies")
    ext = torch.tensor(factors, dtype=torch.float32)
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)
