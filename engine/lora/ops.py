"""The batched LoRA delta of one linear: `y += (x @ A_s^T) @ B_s^T` for each row's adapter.

A step mixes requests of several adapters (and of none). Each adapted linear's weights are a
`LoRAWeights`: S slots of A, stacked as `a_stack` [S, W, K], and of B, side by side as
`b_all` [N, S x W] (slot s owns columns s*W..(s+1)*W; W is the rank, times 3 for a fused q/k/v
linear). The worker's LoRAManager writes the step's mapping before the forward pass:

- `sorted_token_ids` [max tokens] and `slot_starts` [S + 1], static buffers: the rows of the
  flat batch grouped by slot (slot s owns `sorted_token_ids[slot_starts[s]:slot_starts[s+1]]`),
  rows of base-model requests in no segment;
- on the host, `segments` (each used slot's rows) and `token_slots` (each row's slot, -1 for
  none).

On a GPU the delta is two Triton launches (`triton_ops.py`) whose grid depends on shapes only,
so CUDA graphs capture them and replay them with whatever the buffers hold. On CPU it takes
one of three forms, by batch size (micro-benchmarks on 2 AVX-512 cores, bf16, 4 slots):

- up to FUSED_MAX_TOKENS rows (decode steps), one call of the fused C++ kernel
  (`lora_delta.cpp`): shrink and expand for every row under its own slot, near the speed of
  reading the slots' weights. Through oneDNN each tiny product costs a fixed 20-30 us, more
  than the bytes: for a q/k/v linear at 16 rows, 50 us fused against 112 us;
- up to DENSE_MAX_TOKENS rows, where the kernel is not built or serves no more, one oneDNN
  product for all slots at once: h = x A_all^T ([T, S x W]), each row's columns of other
  slots zeroed by a mask, then y += h B_all^T, on weights packed in oneDNN's layout (bf16):
  S times the FLOPs, but two calls instead of 2 x S;
- above it (long prefill chunks), one shrink and one expand per slot on that slot's rows,
  where the FLOPs saved matter more than the calls.

Linear layers call `lora_delta(x, y, index)`, `index` naming their LoRAWeights in a registry
here. Under torch.compile it is the custom op `tidegate::lora_delta`, a black box to the
compiler (as paged attention is): the compiled graph holds neither the weights nor the mix of
adapters, so no mix recompiles and slots can be rewritten (and repacked) freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

# Rows up to which the CPU delta is one masked product over every slot (see above).
DENSE_MAX_TOKENS = 1024
# Rows up to which the fused C++ kernel (lora_delta.cpp) serves, where it is built.
FUSED_MAX_TOKENS = 256
FUSED_SOURCE = Path(__file__).with_name("lora_delta.cpp")


@dataclass
class LoRAMapping:
    """Which rows of the current step use which adapter slot."""

    sorted_token_ids: torch.Tensor  # int32 [max tokens], static
    slot_starts: torch.Tensor  # int32 [S + 1], static
    # Host side, for the CPU path: (slot, row indices) of each slot the step uses, each row's
    # slot (-1: no adapter) and the number of rows.
    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    token_slots: torch.Tensor | None = None
    num_tokens: int = 0
    # fp32 [max tokens, widest W] scratch for the shrink output (Triton path).
    buffer: torch.Tensor | None = None
    # The Triton kernels, reading only the static buffers: always on CUDA; on CPU with the
    # triton attention backend, whose tests run them in Triton's interpreter.
    use_triton: bool = False
    # Per (slot width W, dtype): the [T, S x W] 0/1 mask of this step, made on first use.
    masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, width: int, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """Row t keeps only its own slot's W columns of h (all zero for a base-model row)."""
        key = (width, dtype)
        mask = self.masks.get(key)
        if mask is None:
            assert self.token_slots is not None
            slots = self.token_slots[: self.num_tokens]
            onehot = torch.zeros(self.num_tokens, num_slots + 1, dtype=dtype)
            onehot[torch.arange(self.num_tokens), slots.clamp(min=-1) + 1] = 1
            mask = onehot[:, 1:].repeat_interleave(width, dim=1)
            self.masks[key] = mask
        return mask


@dataclass
class LoRAWeights:
    """One linear's adapter slots, and their packed copies for the CPU's dense product."""

    a_stack: torch.Tensor  # [S, W, K]
    b_all: torch.Tensor  # [N, S * W]
    a_packed: torch.Tensor | None = None  # a_stack as [S * W, K], in oneDNN's layout
    b_packed: torch.Tensor | None = None
    # Each slot's (A [W, K], B [N, W]) packed alone, for steps of one adapter and long chunks.
    slot_packed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # B transposed per slot, [S, W, N], for the fused kernel (CPU, where it is built).
    bt_stack: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.a_stack.shape[0]

    @property
    def width(self) -> int:
        return self.a_stack.shape[1]

    @property
    def a_all(self) -> torch.Tensor:
        return self.a_stack.view(self.num_slots * self.width, -1)

    @property
    def b_stack(self) -> torch.Tensor:
        """B as [S, N, W] (a strided view), as the Triton kernels read it."""
        return self.b_all.view(self.b_all.shape[0], self.num_slots, self.width).permute(1, 0, 2)

    def repack(self, slots: set[int] | None = None) -> None:
        """Refresh the packed copies after these slots (None: all) were written (bf16 on CPU
        only)."""
        from tidegate.engine.model.packed_linear import can_pack, pack

        if self.a_stack.device.type == "cpu" and fused_kernel_available():
            n = self.b_all.shape[0]
            bt = self.b_all.T.reshape(self.num_slots, self.width, n)
            self.bt_stack = bt.contiguous()
        if not can_pack(self.a_all):
            return
        self.a_packed = pack(self.a_all)
        self.b_packed = pack(self.b_all)
        if not self.slot_packed:
            slots = None
        packed = dict(enumerate(self.slot_packed))
        for slot in range(self.num_slots) if slots is None else slots:
            columns = self.b_all[:, slot * self.width : (slot + 1) * self.width]
            packed[slot] = (pack(self.a_stack[slot]), pack(columns.contiguous()))
        self.slot_packed = [packed[slot] for slot in range(self.num_slots)]


_mapping: LoRAMapping | None = None
_weights: list[LoRAWeights] = []


def set_mapping(mapping: LoRAMapping | None) -> None:
    """Make a step's mapping the one every LoRA linear reads (the manager calls this)."""
    global _mapping
    _mapping = mapping


def register_weights(weights: LoRAWeights) -> int:
    """Add a linear's slots to the registry; the index its layer passes to lora_delta."""
    _weights.append(weights)
    return len(_weights) - 1


def clear_weights() -> None:
    """Forget every registered linear (a new model in this process registers its own)."""
    _weights.clear()


def lora_delta(x: torch.Tensor, y: torch.Tensor, index: int) -> None:
    """Add each row's adapter delta to y in place (rows of no adapter are left as they are)."""
    if torch.compiler.is_compiling():
        torch.ops.tidegate.lora_delta(x, y, index)
        return
    _lora_delta(x, y, index)


@torch.library.custom_op("tidegate::lora_delta", mutates_args=("y",))
def _lora_delta_op(x: torch.Tensor, y: torch.Tensor, index: int) -> None:
    _lora_delta(x, y, index)


@_lora_delta_op.register_fake
def _(x: torch.Tensor, y: torch.Tensor, index: int) -> None:
    return None


def _lora_delta(x: torch.Tensor, y: torch.Tensor, index: int) -> None:
    mapping = _mapping
    if mapping is None:
        return
    weights = _weights[index]
    if mapping.use_triton or x.device.type == "cuda":
        from tidegate.engine.lora.triton_ops import lora_apply

        num_tokens = x.shape[0]
        lora_apply(
            x,
            y,
            weights.a_stack,
            weights.b_stack,
            mapping.sorted_token_ids[:num_tokens],
            mapping.slot_starts,
            mapping.buffer,
        )
        return
    if not mapping.segments:
        return
    num_tokens = x.shape[0]
    width = weights.width
    if (
        num_tokens <= FUSED_MAX_TOKENS
        and weights.bt_stack is not None
        and x.stride(-1) == 1
        and y.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16)
    ):
        torch.ops.tidegate_lora.lora_delta(
            x, y, weights.a_stack, weights.bt_stack, mapping.token_slots
        )
        return
    dense = num_tokens <= DENSE_MAX_TOKENS and len(mapping.segments) > 1
    if weights.a_packed is not None:
        if dense:
            # Several adapters in a small batch: one product over every slot, masked.
            mask = mapping.mask(width, weights.num_slots, x.dtype)
            h = _packed_product(x, weights.a_packed)
            h.mul_(mask)
            y.add_(_packed_product(h, weights.b_packed))
            return
        for slot, rows in mapping.segments:
            a, b = weights.slot_packed[slot]
            if len(rows) == num_tokens:  # every row under this adapter: no gather
                y.add_(_packed_product(_packed_product(x, a), b))
            else:
                h = _packed_product(x.index_select(0, rows), a)
                y.index_add_(0, rows, _packed_product(h, b))
        return
    if dense:
        h = x @ weights.a_all.T
        h.mul_(mapping.mask(width, weights.num_slots, x.dtype))
        y.addmm_(h, weights.b_all.T)
        return
    for slot, rows in mapping.segments:
        columns = slice(slot * width, (slot + 1) * width)
        if len(rows) == num_tokens:
            y.addmm_(x @ weights.a_stack[slot].T, weights.b_all[:, columns].T)
        else:
            h = x.index_select(0, rows) @ weights.a_stack[slot].T
            y.index_add_(0, rows, h @ weights.b_all[:, columns].T)


@cache
def fused_kernel_available() -> bool:
    """Whether the fused C++ kernel builds (once, cached on disk) and loads here."""
    from tidegate.engine.attention.cpu_attention import (
        CpuKernelUnavailable,
        build_cpu_extension,
        cpu_kernel_isa,
    )

    try:
        build_cpu_extension(FUSED_SOURCE, "tidegate_lora", cpu_kernel_isa())
    except CpuKernelUnavailable:
        return False  # the products of ops.py serve instead
    return True


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ W.T with W in oneDNN's layout (engine/model/packed_linear.py)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


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
