"""Attention backends behind one interface; pick one by name with `get_attention_backend`."""

from __future__ import annotations

import importlib.util
import os

import torch

from tidegate.engine.attention.backend import AttentionBackend, AttentionMetadata
from tidegate.engine.attention.torch_attention import TorchAttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "triton")

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name` ("auto", "torch", "triton") for a model on `device`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device (the model is on {device.type}); "
            "use 'torch', or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"
        )
    if not _triton_importable():
        raise ValueError("attention backend 'triton' needs the triton package: pip install triton")
    from tidegate.engine.attention.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None
