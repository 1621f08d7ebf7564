"""The mixture-of-experts feed-forward of Mixtral and Qwen3-MoE.

A router (a linear over the hidden state) scores every expert; each token goes to its top-k,
each expert is a SwiGLU MLP, and the token's output is the sum of its experts' outputs
weighted by their routing probabilities (renormalised over the k picked, or not, as the model
says).

Weights: every expert's gate and up projections are stacked in one [E, 2 * I, H] tensor and
its down projection in [E, H, I], so that one matmul per expert runs all the tokens routed to
it. Under tensor parallelism each rank keeps its share of every expert's intermediate
features (a dense MLP's Megatron split, expert by expert) and one all-reduce sums the ranks'
parts. Checkpoints name each expert's projections apart (`experts.<e>.gate_proj`, or
Mixtral's `w1`/`w3`/`w2`); the loader hands each one to `weight_loader` with a shard id such
as "gate.3".

How many tokens each expert gets is known only on the host, once the router has run, so the
routed part is one opaque op (`tidegate::moe_experts`) that torch.compile leaves out of its
graph, as it does paged attention. For the same reason a model with experts captures no CUDA
graphs (the model runner runs it at compilation level 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidegate.engine.distributed.parallel_state import all_reduce, get_tp_size, shard_range
from tidegate.engine.model.config import Fp8Checkpoint, MoEConfig
from tidegate.engine.model.layers import (
    Linear,
    _copy_loader,
    _narrow,
    _parameter,
    _whole,
    current_fp8_layout,
    fp8_linears,
)
from tidegate.engine.model.quantization import FP8_DTYPE, expand_scale, fp8_linear, quantize_rows

# Checkpoint projection of one expert -> the kind of shard it is in our stacked weights.
EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",  # Mixtral's names
    "w3": "up",
    "w2": "down",
}


class FusedExperts(nn.Module):
    """The experts' weights, stacked: `gate_up_proj` [E, 2 * I, H], `down_proj` [E, H, I]
    (I is this rank's share of the intermediate size).

    Built under `fp8_linears(layout)`, the weights are FP8 and each has a float32 scale per row
    and K-group beside it (`gate_up_scale` [E, 2 * I, G], `down_scale` [E, H, G']), as an FP8
    linear's (quantization.py); each expert's products are then FP8 products."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.start, self.local = shard_range(intermediate_size)
        self.dtype = torch.get_default_dtype()
        layout = current_fp8_layout()
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        self.triton = layout is not None and layout.triton
        # K-group of each projection's scales: the block's width, or the whole input row.
        self.gate_up_group = (layout.group if layout else None) or hidden_size
        self.down_group = (layout.group if layout else None) or self.local
        if layout is not None and layout.group and self.start % layout.group:
            raise ValueError(
                f"tensor parallelism splits the experts' {intermediate_size:,} intermediate "
                f"features at {self.start:,}, inside one of their {layout.group}-column FP8 "
                "scale blocks; choose a tensor_parallel_size that splits on a block boundary"
            )
        dtype = FP8_DTYPE if layout is not None else None
        self.gate_up_proj = _parameter(num_experts, 2 * self.local, hidden_size, dtype=dtype)
        self.down_proj = _parameter(num_experts, hidden_size, self.local, dtype=dtype)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader
        if layout is not None:
            groups = -(-hidden_size // self.gate_up_group), -(-self.local // self.down_group)
            self.gate_up_scale = _parameter(
                num_experts, 2 * self.local, groups[0], dtype=torch.float32
            )
            self.down_scale = _parameter(num_experts, hidden_size, groups[1], dtype=torch.float32)
            for param in (self.gate_up_proj, self.down_proj):
                param.scale_loader = self.scale_loader

    def hold_full_precision(self) -> None:
        """Hold the weights in the module's dtype after all: the checkpoint left them
        unquantized."""
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(self, name)
            new = nn.Parameter(
                torch.empty(old.shape, dtype=self.dtype, device=old.device), requires_grad=False
            )
            new.weight_loader = self.weight_loader
            setattr(self, name, new)
        self.gate_up_scale = self.down_scale = None

    def checkpoint_shards(self, param_name: str) -> list[str]:
        """The shard ids a checkpoint fills `param_name` with: one per expert and projection."""
        kinds = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return [f"{kind}.{e}" for e in range(self.num_experts) for kind in kinds]

    def _shard(self, shard_id: str | None) -> tuple[str, int]:
        kind, _, expert = (shard_id or "").partition(".")
        if (
            not expert.isdigit()
            or int(expert) >= self.num_experts
            or kind not in EXPERT_PROJECTIONS.values()
        ):
            raise ValueError(
                f"unknown expert shard {shard_id!r}; expected gate, up or down of an expert "
                f"below {self.num_experts}, as 'gate.0'"
            )
        return kind, int(expert)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's share of one expert's projection ("gate.3", "up.3", "down.3")."""
        kind, e = self._shard(shard_id)
        if kind == "down":
            rows, part = param[e], _whole(_narrow(loaded, 1, self.start, self.local))
            scale = self.down_scale[e] if self.down_scale is not None else None
        else:
            offset = 0 if kind == "gate" else self.local
            rows = param[e].narrow(0, offset, self.local)
            part = _whole(_narrow(loaded, 0, self.start, self.local))
            scale = None
            if self.gate_up_scale is not None:
                scale = self.gate_up_scale[e].narrow(0, offset, self.local)
        if scale is not None and part.dtype != FP8_DTYPE:  # a 16/32-bit checkpoint
            part, row_scale = quantize_rows(part)
            scale.copy_(row_scale)
        _copy_loader(rows, part)

    def scale_loader(
        self, scale: torch.Tensor, checkpoint: Fp8Checkpoint, shard_id: str | None = None
    ) -> None:
        """Copy this rank's part of one expert projection's checkpoint scale."""
        kind, e = self._shard(shard_id)
        expanded = expand_scale(scale, checkpoint)
        if kind == "down":
            target = self.down_scale[e]
            if expanded.numel() > 1:  # every row (a block's may run past the last), our columns
                expanded = expanded[: target.shape[0]]
                if expanded.shape[1] > 1:
                    start = self.start // self.down_group
                    expanded = expanded.narrow(1, start, target.shape[1])
        else:
            offset = 0 if kind == "gate" else self.local
            target = self.gate_up_scale[e].narrow(0, offset, self.local)
            if expanded.numel() > 1:
                expanded = expanded.narrow(0, self.start, self.local)
        if expanded.numel() == 1:
            target.fill_(expanded.item())
        elif expanded.shape != target.shape:
            raise ValueError(
                f"expert scale of shape {tuple(scale.shape)} does not fit {shard_id} "
                f"with scales {tuple(target.shape)}"
            )
        else:
            target.copy_(expanded)


class SparseMoE(nn.Module):
    """Router and experts: a drop-in for a decoder layer's MLP."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        with fp8_linears(None):  # the router stays in the model's dtype, as quantizers leave it
            self.gate = Linear(hidden_size, moe.num_experts)  # whole on every rank
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token of x [T, H] through its top-k experts, weighted and summed."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        experts = self.experts
        out = moe_experts(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            ids,
            experts.gate_up_scale,
            experts.down_scale,
            (experts.gate_up_group, experts.down_group),
            experts.triton,
        )
        return all_reduce(out) if get_tp_size() > 1 else out


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in float32, expert ids [T, k]): the softmax over all experts, in float32
    as transformers computes it, at the k most likely; rescaled to sum to 1 if `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    groups: tuple[int, int] = (0, 0),
    triton: bool = False,
) -> torch.Tensor:
    """Sum over each token's experts of weight * expert(x): [T, H], x's dtype. With scales,
    the weights are FP8 and each product an FP8 product (K-groups of `groups` columns)."""
    args = (x, gate_up, down, weights, ids, gate_up_scale, down_scale, list(groups), triton)
    if torch.compiler.is_compiling():
        return torch.ops.tidegate.moe_experts(*args)
    return _moe_experts(*args)


@torch.library.custom_op("tidegate::moe_experts", mutates_args=())
def _moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    groups: list[int],
    triton: bool,
) -> torch.Tensor:
    num_tokens, top_k = ids.shape
    # The (token, choice) pairs sorted by expert: each expert's rows are then one slice.
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    inputs = x.index_select(0, tokens)
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = slice(start, start + count)
        if gate_up_scale is None:
            gate, up = F.linear(inputs[rows], gate_up[expert]).chunk(2, dim=-1)
            outputs[rows] = F.linear(F.silu(gate) * up, down[expert])
        else:
            product = fp8_linear(
                inputs[rows], gate_up[expert], gate_up_scale[expert], groups[0], triton
            )
            gate, up = product.chunk(2, dim=-1)
            outputs[rows] = fp8_linear(
                F.silu(gate) * up, down[expert], down_scale[expert], groups[1], triton
            )
        start += count
    # Weighted and summed in float32, then rounded once to the model's dtype.
    scaled = outputs.float() * weights.flatten()[order].unsqueeze(1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, scaled).to(x.dtype)


@_moe_experts.register_fake
def _(x, gate_up, down, weights, ids, gate_up_scale, down_scale, groups, triton) -> torch.Tensor:
    return torch.empty_like(x)
