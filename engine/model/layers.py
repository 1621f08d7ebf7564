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

from collections.abc import Iterator
from contextlib import contextmanager
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
from tidegate.engine.model.quantization import (
    FP8_DTYPE,
    Fp8Checkpoint,
    expand_scale,
    fp8_linear,
    quantize_rows,
)


def _parameter(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a tensor or safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (
        (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    )
    return loaded[index]


class _RowWindow:
    """Rows [first, first + size) of a lazy tensor (a safetensors slice, a dequantized one):
    sliced as the tensor itself would be, reading only the rows asked for."""

    def __init__(self, loaded: Any, first: int, size: int) -> None:
        self.loaded, self.first, self.size = loaded, first, size

    def get_shape(self) -> list[int]:
        return [self.size, *list(self.loaded.get_shape())[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        start, stop, _ = index[0].indices(self.size)
        return self.loaded[(slice(self.first + start, self.first + stop), *index[1:])]


def _rows(loaded: Any, first: int, size: int) -> Any:
    """Rows [first, first + size) of a tensor or a lazy one."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(0, first, size)
    return _RowWindow(loaded, first, size)


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


def _project(
    module: Linear | LMHead, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T + bias with the module's weight, FP8 (quantization.py), packed
    (packed_linear.py) or plain, plus the LoRA delta of each row's adapter when the engine
    serves adapters (engine/lora/)."""
    if module.weight_scale is not None:
        out = fp8_linear(x, module.weight, module.weight_scale, module.scale_group, module.triton)
        if bias is not None:
            out = out + bias
    elif module.packed is not None:
        out = packed_linear(x, module.packed, bias)
    else:
        out = F.linear(x, module.weight, bias)
    if module.lora is not None:
        module.lora(x, out)  # adds each row's adapter delta to out in place
    return out


# The FP8 layout of the linears built inside `fp8_linears(...)`: None builds them with weights
# in the default dtype.
_fp8_layout: Fp8Layout | None = None


class Fp8Layout:
    """How the linears built under `fp8_linears` hold FP8 weights: the checkpoint's scale
    layout (None: per row, as quantizing at load gives), and whether products run in Triton."""

    def __init__(self, checkpoint: Fp8Checkpoint | None, triton: bool) -> None:
        self.checkpoint = checkpoint
        self.triton = triton

    @property
    def group(self) -> int | None:
        """Columns per scale: the block's width, or None for one scale per row."""
        return self.checkpoint.block[1] if self.checkpoint and self.checkpoint.block else None


def current_fp8_layout() -> Fp8Layout | None:
    """The layout `fp8_linears` set for the modules being built, None outside it."""
    return _fp8_layout


@contextmanager
def fp8_linears(layout: Fp8Layout | None) -> Iterator[None]:
    """Build the linears created inside with FP8 weights laid out as `layout` (None: not)."""
    global _fp8_layout
    previous, _fp8_layout = _fp8_layout, layout
    try:
        yield
    finally:
        _fp8_layout = previous


class Linear(nn.Module):
    """y = x @ W.T + b with W of shape [output_size, input_size], whole on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        # The weight in oneDNN's layout once pack_linear_weights has run (CPU, bf16).
        self.packed: torch.Tensor | None = None
        # The adapter slots (engine/lora/manager.py), when the engine serves LoRA adapters:
        # set from above, so that models need not import the LoRA layer.
        self.lora: nn.Module | None = None
        self.dtype = torch.get_default_dtype()  # of inputs and outputs, whatever the weight's
        self.weight = _parameter(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        # FP8 weights (quantization.py): the weight in FP8 and its scale per row and K-group.
        self.weight_scale: nn.Parameter | None = None
        self.scale_group = input_size
        self.triton = False
        if _fp8_layout is not None:
            self._hold_fp8(_fp8_layout)
        self.bias = None
        if bias:
            self.bias = _parameter(output_size)
            self.bias.weight_loader = self.weight_loader

    def _hold_fp8(self, layout: Fp8Layout) -> None:
        output_size, input_size = self.weight.shape
        group = layout.group or input_size
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.weight.scale_loader = self.scale_loader
        self.weight_scale = nn.Parameter(
            torch.empty(output_size, -(-input_size // group), dtype=torch.float32),
            requires_grad=False,
        )
        self.scale_group = group
        self.triton = layout.triton

    def hold_full_precision(self) -> None:
        """Hold the weight in the module's dtype after all: the checkpoint left it unquantized."""
        self.weight = nn.Parameter(
            torch.empty(self.weight.shape, dtype=self.dtype, device=self.weight.device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader
        self.weight_scale = None
        self.scale_group = self.weight.shape[1]

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor into `param` (weight or bias)."""
        if param is self.weight and self.weight_scale is not None:
            if shard_id is not None:
                raise ValueError(f"linear of shape {tuple(param.shape)} has no shard {shard_id!r}")
            self._store_rows(0, _whole(loaded))
            return
        _copy_loader(param, loaded, shard_id)

    def _store_rows(self, start: int, rows: torch.Tensor) -> None:
        """Put rows of the weight in place from [start]: FP8 as they are (their scale comes
        from the checkpoint, through scale_loader), others quantized here, with their scale."""
        weight = self.weight.narrow(0, start, rows.shape[0])
        if rows.dtype != FP8_DTYPE:
            rows, scale = quantize_rows(rows)
            if self.weight_scale.shape[1] != 1:
                raise ValueError("a 16/32-bit weight cannot fill a linear laid out for blocks")
            self.weight_scale.narrow(0, start, rows.shape[0]).copy_(scale)
        _copy_loader(weight, rows)

    def scale_loader(
        self, scale: torch.Tensor, checkpoint: Fp8Checkpoint, shard_id: str | None = None
    ) -> None:
        """Copy this rank's part of an FP8 checkpoint weight's scale (whichever layout) into
        weight_scale, as [rows, K-groups]."""
        self._store_scale(expand_scale(scale, checkpoint), shard_id, scale.shape)

    def _store_scale(
        self, expanded: torch.Tensor, shard_id: str | None, checkpoint_shape: torch.Size
    ) -> None:
        """This rank's rows and K-groups of a scale expanded to [rows, G] ([1, 1]: one for
        every row)."""
        start, length, dest = self._rows_of(shard_id)
        target = self.weight_scale.narrow(0, dest, length)
        if expanded.numel() == 1:
            target.fill_(expanded.item())
            return
        rows = expanded.narrow(0, start, length)
        cols = self._scale_columns(rows)
        if cols.shape != target.shape:
            raise ValueError(
                f"weight scale of shape {tuple(checkpoint_shape)} does not fit a linear of "
                f"{tuple(self.weight.shape)} with scales {tuple(self.weight_scale.shape)}"
            )
        target.copy_(cols)

    def _rows_of(self, shard_id: str | None) -> tuple[int, int, int]:
        """(first row of the checkpoint tensor this rank keeps, rows, their row here)."""
        if shard_id is not None:
            raise ValueError(
                f"linear of shape {tuple(self.weight.shape)} has no shard {shard_id!r}"
            )
        return 0, self.weight.shape[0], 0

    def _scale_columns(self, scale: torch.Tensor) -> torch.Tensor:
        """This rank's K-groups of a [rows, G] scale: all of them."""
        return scale

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
        group = _fp8_layout.group if _fp8_layout is not None else None
        if group and self.input_start % group:
            raise ValueError(
                f"tensor parallelism splits the {input_size:,} input features of a linear at "
                f"{self.input_start:,}, inside one of its {group}-column FP8 scale blocks; "
                "choose a tensor_parallel_size that splits on a block boundary"
            )
        super().__init__(local_input, output_size, bias)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's columns of the weight; the bias whole."""
        if param is self.weight:
            loaded = _narrow(loaded, 1, self.input_start, param.shape[1])
        super().weight_loader(param, loaded, shard_id)

    def _scale_columns(self, scale: torch.Tensor) -> torch.Tensor:
        """This rank's K-groups (its columns' scale blocks); a per-row scale is every rank's."""
        if scale.shape[1] == 1:
            return scale
        return scale.narrow(1, self.input_start // self.scale_group, self.weight_scale.shape[1])

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
        # Each shard's rows in the checkpoint: a fused tensor (Phi-3's qkv_proj, gate_up_proj)
        # stacks them in this order.
        self.checkpoint_sizes = dict(output_sizes)
        # This rank's rows per shard, in order: what the caller splits the output by.
        self.output_sizes = {name: length for name, (_, length) in source_rows.items()}
        super().__init__(input_size, sum(self.output_sizes.values()), bias)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.output_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's rows of one shard (e.g. "gate" or "k") into their place; without a
        shard, a fused checkpoint tensor's rows of every shard."""
        if shard_id is None:
            total = sum(self.checkpoint_sizes.values())
            rows = loaded.shape[0] if isinstance(loaded, torch.Tensor) else loaded.get_shape()[0]
            if rows != total:
                raise ValueError(
                    f"a fused checkpoint tensor of {rows} rows cannot hold this linear's "
                    f"{', '.join(f'{n} {s}' for n, s in self.checkpoint_sizes.items())} rows"
                )
            for name, first, size in self._fused_rows():
                self.weight_loader(param, _rows(loaded, first, size), name)
            return
        start, length, offset = self._rows_of(shard_id)
        rows = _whole(_narrow(loaded, 0, start, length))
        if param is self.weight and self.weight_scale is not None:
            self._store_rows(offset, rows)
        else:
            _copy_loader(param.narrow(0, offset, length), rows)

    def scale_loader(
        self, scale: torch.Tensor, checkpoint: Fp8Checkpoint, shard_id: str | None = None
    ) -> None:
        """A shard's scale, or without a shard a fused checkpoint tensor's (its rows repeated
        per block first, so a block across two shards gives each its rows' scale)."""
        if shard_id is not None:
            super().scale_loader(scale, checkpoint, shard_id)
            return
        expanded = expand_scale(scale, checkpoint)
        for name, first, size in self._fused_rows():
            part = expanded if expanded.numel() == 1 else expanded.narrow(0, first, size)
            self._store_scale(part, name, scale.shape)

    def _fused_rows(self) -> Iterator[tuple[str, int, int]]:
        """(shard, its first row, its rows) in a fused checkpoint tensor."""
        first = 0
        for name, size in self.checkpoint_sizes.items():
            yield name, first, size
            first += size

    def _rows_of(self, shard_id: str | None) -> tuple[int, int, int]:
        """A shard's rows: the ones this rank keeps of its checkpoint tensor, and their place."""
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.output_sizes)}"
            )
        start, length = self.source_rows[shard_id]
        return start, length, self.shard_offsets[shard_id]


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
        self.weight_scale = None  # never FP8: quantizers leave the LM head alone

    def tie(self, embedding: VocabEmbedding) -> None:
        """Use the embedding table as the output projection (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, computed in the model's dtype as transformers does."""
        logits = _project(self, hidden).float()
        if get_tp_size() == 1:
            return logits
        return all_gather(logits, dim=-1)[..., : self.vocab_size]
