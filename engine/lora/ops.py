"""The batched LoRA delta of one linear: `y += (x @ A_s^T) @ B_s^T` for each token's adapter.

A step mixes requests of several adapters (and of none). The worker's LoRAManager writes the
step's *segment mapping* into static buffers before the forward pass:

- `sorted_token_ids` [max tokens]: the rows of the flat batch grouped by adapter slot;
- `slot_starts` [S + 1]: slot s owns `sorted_token_ids[slot_starts[s]:slot_starts[s + 1]]`;
  rows of base-model requests are in no segment and get no delta.

On a GPU the delta is two Triton launches (`triton_ops.py`) whose grid depends on shapes only,
so CUDA graphs capture them and replay them with whatever the buffers hold. On CPU it is one
shrink and one expand matmul per adapter of the step, on the rows `segments` lists (host
indices, so no Python loop over tokens or requests).

Linear layers call `lora_delta(x, y, a_stack, b_stack)`. Under torch.compile it is the custom op
`tidegate::lora_delta`, a black box to the compiler (as paged attention is), so the compiled
graph never depends on which adapters a step mixes: no recompile per mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAMapping:
    """Which rows of the current step use which adapter slot."""

    sorted_token_ids: torch.Tensor  # int32 [max tokens], static
    slot_starts: torch.Tensor  # int32 [S + 1], static
    # Host copy for the CPU path: (slot, row indices) of each slot the step uses.
    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # fp32 [max tokens, R_max] scratch for the shrink output (GPU path).
    buffer: torch.Tensor | None = None


_mapping: LoRAMapping | None = None


def set_mapping(mapping: LoRAMapping | None) -> None:
    """Make a step's mapping the one every LoRA linear reads (the manager calls this)."""
    global _mapping
    _mapping = mapping


def lora_delta(
    x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor
) -> None:
    """Add each row's adapter delta to y in place (rows of no adapter are left as they are)."""
    if torch.compiler.is_compiling():
        torch.ops.tidegate.lora_delta(x, y, a_stack, b_stack)
        return
    _lora_delta(x, y, a_stack, b_stack)


@torch.library.custom_op("tidegate::lora_delta", mutates_args=("y",))
def _lora_delta_op(
    x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor
) -> None:
    _lora_delta(x, y, a_stack, b_stack)


def _lora_delta(
    x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor
) -> None:
    mapping = _mapping
    if mapping is None:
        return
    if x.device.type == "cuda":
        from tidegate.engine.lora.triton_ops import lora_apply

        num_tokens = x.shape[0]
        lora_apply(
            x,
            y,
            a_stack,
            b_stack,
            mapping.sorted_token_ids[:num_tokens],
            mapping.slot_starts,
            mapping.buffer,
        )
        return
    for slot, rows in mapping.segments:
        delta = (x.index_select(0, rows) @ a_stack[slot].T) @ b_stack[slot].T
        y.index_add_(0, rows, delta)


def reference_delta(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: list[int],
) -> torch.Tensor:
    """The delta row by row (-1: no adapter), in fp32: what tests compare the paths against."""
    out = torch.zeros(x.shape[0], b_stack.shape[1], dtype=torch.float32)
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            out[row] = (x[row].float() @ a_stack[slot].float().T) @ b_stack[slot].float().T
    return out


@_lora_delta_op.register_fake
def _(x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor) -> None:
    return None
