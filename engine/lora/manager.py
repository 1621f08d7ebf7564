"""The worker's LoRA state: adapter slots on the model's linears, and adapters in host memory.

Each adapted linear (fused q/k/v, o, fused gate/up, down) gets a `LoRAStack`: `max_loras`
slots of A [n x R, in] and B [out, n x R], n being the projections fused in that linear (3 for
q/k/v) and R `max_lora_rank`. A fused linear's B is block-diagonal, so one shrink and one
expand serve q, k and v at once; a smaller rank is zero padded; the scaling is folded into B.
Under tensor parallelism a slot holds this rank's share, sliced as the base weights are:
column-parallel linears (q/k/v, gate/up) keep their rows of B, row-parallel ones (o, down)
their columns of A, and the delta joins the base output before the all-reduce, which sums it
over the ranks like the rest.

Before each step `prepare` puts the step's adapters into slots (loading a missing one from its
folder, through an LRU of `max_cpu_loras` adapters in host memory) and writes the step's
segment mapping (`ops.py`). The scheduler never puts more than `max_loras` adapters in a step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from tidegate.engine.lora.adapter import (
    _TENSOR_NAME,
    WEIGHTS_FILE,
    LoRAError,
    read_adapter,
    split_fused,
)
from tidegate.engine.lora.ops import (
    LoRAMapping,
    LoRAWeights,
    lora_delta,
    register_weights,
    set_mapping,
)
from tidegate.engine.messages import LoRARequest
from tidegate.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

# Our fused linear -> (shard id, checkpoint projection) in the order its output is laid out.
_FUSED_SHARDS = {
    "qkv_proj": (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")),
    "gate_up_proj": (("gate", "gate_proj"), ("up", "up_proj")),
}
_ROW_PARALLEL = {"o_proj": "o_proj", "down_proj": "down_proj"}


class LoRAStack(nn.Module):
    """The adapter slots of one linear (ops.LoRAWeights: A [S, W, K], B [N, S x W])."""

    def __init__(self, linear: nn.Module, name: str, layer: int, slots: int, rank: int) -> None:
        super().__init__()
        self.layer = layer  # the decoder layer (checkpoint numbering) of the linear
        self.rank = rank
        self.row_parallel = name in _ROW_PARALLEL
        self.shards = _FUSED_SHARDS.get(name, ((None, _ROW_PARALLEL.get(name)),))
        weight = linear.packed if linear.packed is not None else linear.weight
        out_features, in_features = weight.shape
        width = len(self.shards) * rank
        kwargs = {"dtype": linear.dtype, "device": weight.device}  # not an FP8 weight's
        self.weights = LoRAWeights(
            a_stack=torch.zeros(slots, width, in_features, **kwargs),
            b_all=torch.zeros(out_features, slots * width, **kwargs),
        )
        self.weights.repack()
        # The compiled graph passes this number, never the weights (ops.py).
        self.index = register_weights(self.weights)
        self.linear = [linear]  # a list: not a submodule, so its weights are not ours

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to the linear's output y the delta of each row's adapter (ops.py)."""
        lora_delta(x, y, self.index)

    def write(self, slot: int, arranged: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one adapter's (A, B) for this linear in a slot (None: it adapts none of ours)."""
        width = self.weights.width
        a_slot = self.weights.a_stack[slot]
        b_slot = self.weights.b_all[:, slot * width : (slot + 1) * width]
        if arranged is None:
            a_slot.zero_()
            b_slot.zero_()
        else:
            a_slot.copy_(arranged[0])
            b_slot.copy_(arranged[1])

    def arrange(
        self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's (A [W, K], B [N, W]) of one adapter, or None when it adapts none of
        ours."""
        if not any(proj in tensors for _, proj in self.shards):
            return None
        linear = self.linear[0]
        a_slot = torch.zeros_like(self.weights.a_stack[0])
        b_slot = torch.zeros(self.weights.b_all.shape[0], self.weights.width, dtype=a_slot.dtype)
        for j, (shard, proj) in enumerate(self.shards):
            if proj not in tensors:
                continue
            a, b = tensors[proj]
            r = a.shape[0]
            cols = slice(j * self.rank, j * self.rank + r)
            b = b.float() * scaling
            if self.row_parallel:
                a = a.narrow(1, linear.input_start, a_slot.shape[1])
                b_slot[:, cols] = b
            else:
                start, length = linear.source_rows[shard]
                offset = linear.shard_offsets[shard]
                b_slot[offset : offset + length, cols] = b.narrow(0, start, length)
            a_slot[cols] = a
        return a_slot, b_slot


def attach_lora_stacks(model: nn.Module, slots: int, rank: int) -> list[LoRAStack]:
    """Give every adaptable linear of the decoder a LoRAStack (its `lora` attribute): the
    layers of this pipeline stage, in order."""
    stacks = []
    for index in model.model.stage_layers:
        layer = model.model.layers[index]
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in parent.named_children():
                if name in _FUSED_SHARDS or name in _ROW_PARALLEL:
                    linear.lora = LoRAStack(linear, name, index, slots, rank)
                    stacks.append(linear.lora)
    return stacks


class LoRAManager:
    """Slots and the host-memory LRU of one worker; `prepare` readies a step's adapters."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        max_num_tokens: int,
        use_triton: bool = False,
    ) -> None:
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.stacks = attach_lora_stacks(model, max_loras, max_lora_rank)
        # A loaded adapter is a list of (A, B) in the order of the stacks.
        self.slot_ids: list[int | None] = [None] * max_loras
        self._slot_used = [0] * max_loras
        self._clock = 0
        self.cached: OrderedDict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = (
            OrderedDict()
        )
        device = self.stacks[0].weights.a_stack.device
        widest = max(stack.weights.width for stack in self.stacks)
        self.mapping = LoRAMapping(
            sorted_token_ids=torch.zeros(max_num_tokens, dtype=torch.int32, device=device),
            slot_starts=torch.zeros(max_loras + 1, dtype=torch.int32, device=device),
            buffer=torch.zeros(max_num_tokens, widest, dtype=torch.float32, device=device),
            use_triton=use_triton or device.type == "cuda",
        )
        set_mapping(self.mapping)

    @property
    def max_loras(self) -> int:
        return len(self.slot_ids)

    def prepare(self, loras: Sequence[LoRARequest | None], num_scheduled: Sequence[int]) -> None:
        """Put the step's adapters in slots and write which rows use which slot."""
        needed = {lora.lora_id: lora for lora in loras if lora is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(
                f"a step uses {len(needed)} adapters; this worker has {self.max_loras} slots"
            )
        self._clock += 1
        slot_of = {}
        for lora_id in needed:
            if lora_id in self.slot_ids:
                slot_of[lora_id] = self.slot_ids.index(lora_id)
        written = set()
        for lora_id, lora in needed.items():
            if lora_id not in slot_of:
                slot_of[lora_id] = self._activate(lora, busy=set(slot_of.values()))
                written.add(slot_of[lora_id])
        if written:
            for stack in self.stacks:
                stack.weights.repack(written)
        for slot in slot_of.values():
            self._slot_used[slot] = self._clock
        set_mapping(self.mapping)  # another engine in this process may have set its own
        self._write_mapping(
            [slot_of[lora.lora_id] if lora is not None else -1 for lora in loras], num_scheduled
        )

    def _write_mapping(self, request_slots: list[int], num_scheduled: Sequence[int]) -> None:
        mapping = self.mapping
        mapping.segments = []
        mapping.masks = {}
        starts = np.zeros(self.max_loras + 1, dtype=np.int32)
        if any(slot >= 0 for slot in request_slots):
            token_slots = np.repeat(np.asarray(request_slots, dtype=np.int64), num_scheduled)
            mapping.token_slots = torch.from_numpy(token_slots)
            mapping.num_tokens = len(token_slots)
            order = np.argsort(token_slots, kind="stable")
            order = order[token_slots[order] >= 0]
            counts = np.bincount(token_slots[token_slots >= 0], minlength=self.max_loras)
            np.cumsum(counts, out=starts[1:])
            mapping.sorted_token_ids[: len(order)].copy_(torch.from_numpy(order.astype(np.int32)))
            rows = torch.from_numpy(order)
            mapping.segments = [
                (slot, rows[starts[slot] : starts[slot + 1]])
                for slot in range(self.max_loras)
                if counts[slot]
            ]
        mapping.slot_starts.copy_(torch.from_numpy(starts))

    def _activate(self, lora: LoRARequest, busy: set[int]) -> int:
        """Load `lora` into a slot no adapter of this step uses: an empty one, else the least
        recently used."""
        free = [s for s in range(self.max_loras) if s not in busy]
        slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self._slot_used[s]))
        weights = self._host_copy(lora)
        for stack, arranged in zip(self.stacks, weights, strict=True):
            stack.write(slot, arranged)
        self.slot_ids[slot] = lora.lora_id
        return slot

    def _host_copy(self, lora: LoRARequest) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The adapter arranged for every stack, from the LRU or read from its folder."""
        if lora.lora_id in self.cached:
            self.cached.move_to_end(lora.lora_id)
            return self.cached[lora.lora_id]
        weights = self.read(lora)
        self.cached[lora.lora_id] = weights
        while len(self.cached) > self.max_cpu_loras:
            self.cached.popitem(last=False)
        return weights

    def read(self, lora: LoRARequest) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Read and arrange an adapter's weights (this rank's share) for every stack."""
        info = read_adapter(lora.path, self.config, self.max_lora_rank)
        if info.digest != lora.digest:
            raise LoRAError(
                f"adapter {lora.name!r}: the files at {lora.path} changed after it was loaded; "
                "unload and load it again"
            )
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in load_file(str(Path(lora.path) / WEIGHTS_FILE)).items():
            match = _TENSOR_NAME.search(name)
            assert match is not None  # read_adapter checked every name
            raw.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
        for (layer, proj), pair in raw.items():
            for part, a, b in split_fused(self.config, proj, pair["A"], pair["B"]):
                by_layer.setdefault(layer, {})[part] = (a, b)
        weights = [
            stack.arrange(by_layer.get(stack.layer, {}), info.scaling) for stack in self.stacks
        ]
        logger.info("read LoRA adapter %r (rank %d) from %s", lora.name, info.rank, lora.path)
        return weights
