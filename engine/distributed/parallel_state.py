"""Parallel state of this process: its ranks, its groups, and the collectives.

Each worker process is one rank of tensor_parallel_size x pipeline_parallel_size. Global rank
r is tensor-parallel rank r % TP of pipeline stage r // TP: the TP ranks of a stage are
consecutive, so a node that holds whole stages keeps its all-reduces on the node. Stage s holds
the layers `stage_layers` gives it; it receives the hidden states of stage s - 1 from the rank
with its own TP rank there, and sends its own to stage s + 1 the same way.

With one worker nothing here touches torch.distributed: the accessors answer rank 0 of 1 and
the collectives return their input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Ranks:
    rank: int = 0  # global
    tp_size: int = 1
    pp_size: int = 1
    # The ProcessGroup of this rank's stage (None: the whole world, or a single rank).
    tp_group: object | None = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


_state = _Ranks()
# The send of this stage's last step, kept until the next send (or shutdown) so its buffer
# lives until the transport is done with it.
_pending_send: tuple[dist.Work, torch.Tensor] | None = None


def init_parallel(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    init_method: str,
    device: torch.device,
) -> None:
    """Join the world (gloo on CPU, NCCL on CUDA) and the TP group of this rank's stage."""
    global _state
    world_size = tensor_parallel_size * pipeline_parallel_size
    tp_group = None
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        if pipeline_parallel_size > 1 and tensor_parallel_size > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for stage in range(pipeline_parallel_size):
                first = stage * tensor_parallel_size
                group = dist.new_group(list(range(first, first + tensor_parallel_size)))
                if stage == rank // tensor_parallel_size:
                    tp_group = group
    _state = _Ranks(rank, tensor_parallel_size, pipeline_parallel_size, tp_group)


def destroy_parallel() -> None:
    """Leave the groups (idempotent)."""
    global _state, _pending_send
    if _pending_send is not None:
        _pending_send[0].wait()
        _pending_send = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state = _Ranks()


def get_tp_rank() -> int:
    """This worker's rank in its stage's tensor-parallel group."""
    return _state.tp_rank


def get_tp_size() -> int:
    """How many workers share each layer."""
    return _state.tp_size


def get_pp_rank() -> int:
    """This worker's pipeline stage."""
    return _state.pp_rank


def get_pp_size() -> int:
    """How many stages the layers are split into."""
    return _state.pp_size


def is_first_stage() -> bool:
    """True on the stage that embeds tokens."""
    return _state.pp_rank == 0


def is_last_stage() -> bool:
    """True on the stage that computes logits and samples."""
    return _state.pp_rank == _state.pp_size - 1


def stage_layers(
    num_layers: int,
    stage: int | None = None,
    stages: int | None = None,
    head_layers: float = 0.0,
) -> range:
    """The decoder layers of a stage.

    The last stage also runs the LM head, which costs `head_layers` decoder layers (in
    weights, and in compute per sampled token): it takes that many fewer layers, rounded, and
    at least one. The other stages share the rest evenly, the first ones taking one more each
    when the split is uneven.
    """
    stage = _state.pp_rank if stage is None else stage
    stages = _state.pp_size if stages is None else stages
    if num_layers < stages:
        raise ValueError(
            f"pipeline_parallel_size {stages} is more than this model's {num_layers} layers"
        )
    if stages == 1:
        return range(num_layers)
    fair = (num_layers + head_layers) / stages
    # The last stage: its fair share less the head, leaving each other stage at least one.
    last = min(max(1, round(fair - head_layers)), num_layers - (stages - 1))
    if stage == stages - 1:
        return range(num_layers - last, num_layers)
    per_stage, extra = divmod(num_layers - last, stages - 1)
    start = stage * per_stage + min(stage, extra)
    return range(start, start + per_stage + (stage < extra))


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the stage's TP ranks, in place; returns x."""
    if _state.tp_size > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's x along `dim`, in rank order."""
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite x with TP rank `src`'s x (of this stage), in place; returns x."""
    if _state.tp_size > 1:
        dist.broadcast(x, group_src=src, group=_state.tp_group)
    return x


def send_to_next_stage(hidden: torch.Tensor) -> None:
    """Start sending this stage's output to the same TP rank of the next stage; returns at once
    (the previous send is waited for first, so at most one is in flight)."""
    global _pending_send
    if _pending_send is not None:
        _pending_send[0].wait()
    hidden = hidden.contiguous()
    _pending_send = (dist.isend(hidden, dst=_state.rank + _state.tp_size), hidden)


def recv_from_previous_stage(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The previous stage's output for this step: [num_tokens, hidden_size]."""
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src=_state.rank - _state.tp_size)
    return hidden


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """(start, length) of this rank's even share of `total` rows (size must divide total)."""
    rank = _state.tp_rank if rank is None else rank
    size = _state.tp_size if size is None else size
    per_rank = total // size
    return rank * per_rank, per_rank


def kv_head_shard(num_kv_heads: int) -> tuple[int, int]:
    """(first head, count) of the KV heads this rank keeps; replicated when ranks > heads."""
    if _state.tp_size <= num_kv_heads:
        return shard_range(num_kv_heads)
    replicas = _state.tp_size // num_kv_heads
    return _state.tp_rank // replicas, 1
