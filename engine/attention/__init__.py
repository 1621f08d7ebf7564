"""Attention backends behind one interface; pick one by name with `get_attention_backend`."""

from __future__ import annotations

import importlib.util
import os

import torch

from tidegate.engine.attention.backend import (
    STANDARD_KV_LAYOUT,
    AttentionBackend,
    AttentionMetadata,
    KVLayout,
)
from tidegate.engine.attention.torch_attention import TorchAttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")

__all__ = [
    "ATTENTION_BACKENDS",
    "STANDARD_KV_LAYOUT",
    "AttentionBackend",
    "AttentionMetadata",
    "KVLayout",
    "TorchAttentionBackend",
    "get_attention_backend",
]


def get_attention_backend(
    name: str,
    device: torch.device,
    *,
    head_dim: int | None = None,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend called `name` ("auto", "torch", "triton", "cpu") for a model on `device`.

    auto: triton on CUDA; on CPU the C++ kernel when it builds here and fits the model's
    head size, block size and dtype (those given), else the torch reference. Every backend
    caps attention logits (`logits_soft_cap`, Gemma 2) and reads a `kv_cache_dtype` other
    than `dtype` (an FP8 cache).
    """
    fp8_cache = kv_cache_dtype is not None and dtype is not None and kv_cache_dtype != dtype
    if fp8_cache and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "an FP8 KV cache needs a GPU of compute capability 8.9 or later (Ada, Hopper) for "
            "the kernels' FP8 loads; use --kv-cache-dtype auto"
        )
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_importable() else "torch"
        else:
            name = "cpu" if _cpu_kernel_fits(head_dim, block_size, dtype) else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return _cpu_backend(device, head_dim, block_size, dtype)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device (the model is on {device.type}); "
            "use 'torch', or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"
        )
    if not _triton_importable():
        raise ValueError("attention backend 'triton' needs the triton package: pip install triton")
    from tidegate.engine.attention.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


def _cpu_kernel_fits(
    head_dim: int | None, block_size: int | None, dtype: torch.dtype | None
) -> bool:
    from tidegate.engine.attention import cpu_attention

    if _cpu_misfit(head_dim, block_size, dtype) is not None:
        return False
    return cpu_attention.cpu_kernels_available()


def _cpu_misfit(
    head_dim: int | None, block_size: int | None, dtype: torch.dtype | None
) -> str | None:
    """Why the CPU kernel cannot run this model, or None."""
    from tidegate.engine.attention import cpu_attention as cpu

    if head_dim is not None and head_dim not in cpu.HEAD_SIZES:
        sizes = ", ".join(map(str, cpu.HEAD_SIZES))
        return f"head size {head_dim} (it is built for {sizes})"
    if block_size is not None and block_size % cpu.KEY_CHUNK:
        return f"block size {block_size} (it needs a multiple of {cpu.KEY_CHUNK})"
    if dtype is not None and dtype not in cpu.DTYPES:
        return f"dtype {dtype}"
    return None


def _cpu_backend(
    device: torch.device, head_dim: int | None, block_size: int | None, dtype: torch.dtype | None
) -> AttentionBackend:
    from tidegate.engine.attention import cpu_attention

    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU, not {device.type}")
    misfit = _cpu_misfit(head_dim, block_size, dtype)
    if misfit is not None:
        raise ValueError(f"attention backend 'cpu' does not support {misfit}; use 'torch'")
    try:
        return cpu_attention.CpuAttentionBackend()
    except cpu_attention.CpuKernelUnavailable as error:
        raise ValueError(f"attention backend 'cpu': {error}; use 'torch'") from error


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None
