"""Building blocks of the decoder: norms, activation, linears, embedding and LM head.

Every parameter carries a `weight_loader(param, tensor, shard_id)` so that the loader never
needs to know how a layer stores its weights; a tensor-parallel version of a layer only has
to slice in its own loader. Parameters are created uninitialised (the loader fills them) in
the current default dtype and device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}"
        )
    param.copy_(loaded)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(hidden_size)
        self.weight.weight_loader = _copy_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of x."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SiluAndMul(nn.Module):
    """SwiGLU gate: silu(first half) * second half of the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gate to a [..., 2 * intermediate] tensor."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class Linear(nn.Module):
    """y = x @ W.T + b with W of shape [output_size, input_size] (o_proj, down_proj)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _parameter(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _parameter(output_size)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        """Copy a checkpoint tensor into `param` (weight or bias)."""
        _copy_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project the last dimension of x."""
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears over the same input stacked along the output, run as one matmul."""

    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias)
        self.output_sizes = dict(output_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in output_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        """Copy the checkpoint tensor of one shard (e.g. "gate" or "k") into its rows."""
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.output_sizes)}"
            )
        rows = param.narrow(0, self.shard_offsets[shard_id], self.output_sizes[shard_id])
        _copy_loader(rows, loaded)


class QKVLinear(MergedLinear):
    """The fused q/k/v projection; shards "q", "k", "v"."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        sizes = {
            "q": num_heads * head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * head_dim,
        }
        super().__init__(hidden_size, sizes, bias)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _parameter(vocab_size, hidden_size)
        self.weight.weight_loader = _copy_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up the embeddings of input_ids."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _parameter(vocab_size, hidden_size)
        self.weight.weight_loader = _copy_loader

    def tie(self, embedding: VocabEmbedding) -> None:
        """Use the embedding table as the output projection (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, computed in the model's dtype as transformers does."""
        return F.linear(hidden, self.weight).float()
