"""Attention backends behind one interface; pick one by name with `get_attention_backend`."""

from __future__ import annotations

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
    if name == "triton":
        raise ValueError("attention backend 'triton' is not available yet; use 'torch' (or 'auto')")
    # "auto" will pick triton on CUDA once it exists; until then torch runs everywhere.
    return TorchAttentionBackend()
