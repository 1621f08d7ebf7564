"""Building blocks of the decoder: norms, activation, linears, embedding and LM head.

Every parameter carries a `weight_loader(param, tensor, shard_id)` so that the loader never
needs to know how a layer stores its weights. Under tensor parallelism each layer keeps its
rank's share and slices it out in its own loader: `loaded` may be a tensor or a lazy
safetensors slice, so a rank reads only its shard's bytes. Parameters are created
uninitialised (the loader fills them) in the current default dtype and device.

The split is Megatron's: q/k/v and gate/up are column-parallel (each rank computes some
heads, some of the intermediate features), o_proj and down_proj are row-parallel (each rank
adds its part of the sum, then an all-reduce), embedding and LM head split the vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidegate.engine.distributed.parallel_state import (
    all_gather,
    all_reduce,
    get_tp_rank,
    get_tp_size,
    kv_head_shard,
    shard_range,
)
from tidegate.engine.model.packed_linear import packed_linear


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a tensor or safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (
        (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    )
    return loaded[index]


def _whole(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def _copy_loader(param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    loaded = _whole(loaded)
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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as w - 1, and applied in float32 before the cast
    back (Llama's casts first), exactly as transformers computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of x."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def rms_norm(size: int, eps: float, gemma: bool = False) -> RMSNorm:
    """An RMSNorm over `size` features: Gemma's (`gemma`), or Llama's."""
    return GemmaRMSNorm(size, eps) if gemma else RMSNorm(size, eps)


class SiluAndMul(nn.Module):
    """SwiGLU gate: silu(first half) * second half of the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gate to a [..., 2 * intermediate] tensor."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU gate (Gemma): the tanh-approximated gelu of the first half * the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gate to a [..., 2 * intermediate] tensor."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATES = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}


def _project(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias with the module's weight, packed (packed_linear.py) or plain, plus the
    LoRA delta of each row's adapter when the engine serves adapters (engine/lora/)."""
    if module.packed is not None:
        out = packed_linear(x, module.packed, bias)
    else:
        out = F.linear(x, module.weight, bias)
    if module.lora is not None:
        module.lora(x, out)  # adds each row's adapter delta to out in place
    return out


class Linear(nn.Module):
    """y = x @ W.T + b with W of shape [output_size, input_size], whole on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        # The weight in oneDNN's layout once pack_linear_weights has run (CPU, bf16).
        self.packed: torch.Tensor | None = None
        # The adapter slots (engine/lora/manager.py), when the engine serves LoRA adapters:
        # set from above, so that models need not import the LoRA layer.
        self.lora: nn.Module | None = None
        self.weight = _parameter(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _parameter(output_size)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor into `param` (weight or bias)."""
        _copy_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project the last dimension of x."""
        return _project(self, x, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks (o_proj, down_proj).

    Each rank multiplies its slice of the input by its columns of W; the all-reduce sums
    the partial outputs, and the bias is added once, after it.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.input_start, local_input = shard_range(input_size)
        super().__init__(local_input, output_size, bias)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's columns of the weight; the bias whole."""
        if param is self.weight:
            loaded = _narrow(loaded, 1, self.input_start, param.shape[1])
        _copy_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project this rank's slice of x and sum over the ranks."""
        if get_tp_size() == 1:
            return _project(self, x, self.bias)
        out = all_reduce(_project(self, x))
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """Several linears over the same input stacked along the output, run as one matmul.

    Column-parallel: each rank keeps its rows of every shard. `source_rows` names, per
    shard, the rows (start, length) of the checkpoint tensor this rank keeps; by default an
    even split of `output_sizes`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: dict[str, int],
        bias: bool = False,
        source_rows: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        if source_rows is None:
            source_rows = {name: shard_range(size) for name, size in output_sizes.items()}
        self.source_rows = source_rows
        # This rank's rows per shard, in order: what the caller splits the output by.
        self.output_sizes = {name: length for name, (_, length) in source_rows.items()}
        super().__init__(input_size, sum(self.output_sizes.values()), bias)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.output_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's rows of one shard (e.g. "gate" or "k") into their place."""
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.output_sizes)}"
            )
        start, length = self.source_rows[shard_id]
        rows = param.narrow(0, self.shard_offsets[shard_id], length)
        _copy_loader(rows, _narrow(loaded, 0, start, length))


class QKVLinear(MergedLinear):
    """The fused q/k/v projection; shards "q", "k", "v".

    A rank keeps its share of the query heads and the key/value heads they read; when there
    are more ranks than key/value heads, each of those heads is replicated on several ranks.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_start, q_len = shard_range(num_heads * head_dim)
        kv_first, kv_count = kv_head_shard(num_kv_heads)
        kv_rows = (kv_first * head_dim, kv_count * head_dim)
        sizes = {
            "q": num_heads * head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * head_dim,
        }
        rows = {"q": (q_start, q_len), "k": kv_rows, "v": kv_rows}
        super().__init__(hidden_size, sizes, bias, source_rows=rows)
        self.num_heads = q_len // head_dim  # this rank's
        self.num_kv_heads = kv_count


def _vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first id, rows) of this rank's vocabulary slice; the last one is padded to size."""
    per_rank = -(-vocab_size // get_tp_size())
    return get_tp_rank() * per_rank, per_rank


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size], split by token id over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_start, rows = _vocab_shard(vocab_size)
        self.weight = _parameter(rows, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's rows of the table; padding rows past the vocabulary stay zero."""
        if get_tp_size() == 1:
            _copy_loader(param, loaded, shard_id)
            return
        length = max(0, min(param.shape[0], self.vocab_size - self.vocab_start))
        param.zero_()
        if length:
            _copy_loader(param[:length], _narrow(loaded, 0, self.vocab_start, length), shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up the embeddings of input_ids (each rank its own ids, summed)."""
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        # Exactly one rank holds each id, so the sum adds zeros and is exact.
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding.

    Each rank computes the logits of its vocabulary slice; they are gathered so that every
    rank (rank 0 samples) sees the whole row.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.packed: torch.Tensor | None = None  # as Linear's
        self.lora: nn.Module | None = None  # never adapted; _project reads it

    def tie(self, embedding: VocabEmbedding) -> None:
        """Use the embedding table as the output projection (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, computed in the model's dtype as transformers does."""
        logits = _project(self, hidden).float()
        if get_tp_size() == 1:
            return logits
        return all_gather(logits, dim=-1)[..., : self.vocab_size]
