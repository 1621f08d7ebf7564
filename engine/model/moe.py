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
from tidegate.engine.model.config import MoEConfig
from tidegate.engine.model.layers import Linear, _copy_loader, _narrow, _parameter

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
    (I is this rank's share of the intermediate size)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.start, self.local = shard_range(intermediate_size)
        self.gate_up_proj = _parameter(num_experts, 2 * self.local, hidden_size)
        self.down_proj = _parameter(num_experts, hidden_size, self.local)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader

    def checkpoint_shards(self, param_name: str) -> list[str]:
        """The shard ids a checkpoint fills `param_name` with: one per expert and projection."""
        kinds = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return [f"{kind}.{e}" for e in range(self.num_experts) for kind in kinds]

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy this rank's share of one expert's projection ("gate.3", "up.3", "down.3")."""
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
        e = int(expert)
        if kind == "down":
            _copy_loader(param[e], _narrow(loaded, 1, self.start, self.local))
            return
        rows = param[e].narrow(0, 0 if kind == "gate" else self.local, self.local)
        _copy_loader(rows, _narrow(loaded, 0, self.start, self.local))


class SparseMoE(nn.Module):
    """Router and experts: a drop-in for a decoder layer's MLP."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(hidden_size, moe.num_experts)  # the router, whole on every rank
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token of x [T, H] through its top-k experts, weighted and summed."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
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
) -> torch.Tensor:
    """Sum over each token's experts of weight * expert(x): [T, H], x's dtype."""
    if torch.compiler.is_compiling():
        return torch.ops.tidegate.moe_experts(x, gate_up, down, weights, ids)
    return _moe_experts(x, gate_up, down, weights, ids)


@torch.library.custom_op("tidegate::moe_experts", mutates_args=())
def _moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
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
        gate, up = F.linear(inputs[rows], gate_up[expert]).chunk(2, dim=-1)
        outputs[rows] = F.linear(F.silu(gate) * up, down[expert])
        start += count
    # Weighted and summed in float32, then rounded once to the model's dtype.
    scaled = outputs.float() * weights.flatten()[order].unsqueeze(1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, scaled).to(x.dtype)


@_moe_experts.register_fake
def _(x, gate_up, down, weights, ids) -> torch.Tensor:
    return torch.empty_like(x)
