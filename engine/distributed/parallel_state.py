"""Tensor-parallel state of this process: its rank, the group size, and the collectives.

Each worker process holds one shard of the model. With one worker nothing here touches
torch.distributed: the accessors answer rank 0 of 1 and the collectives return their input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TPGroup:
    rank: int = 0
    size: int = 1


_tp = _TPGroup()


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device
) -> None:
    """Join the tensor-parallel group: gloo on CPU, NCCL on CUDA; nothing for one rank."""
    global _tp
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _tp = _TPGroup(rank=rank, size=world_size)


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent)."""
    global _tp
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _tp = _TPGroup()


def get_tp_rank() -> int:
    """This worker's rank in the tensor-parallel group."""
    return _tp.rank


def get_tp_size() -> int:
    """How many workers share the model."""
    return _tp.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; returns x."""
    if _tp.size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along `dim`, in rank order."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite x with rank `src`'s x, in place; returns x."""
    if _tp.size > 1:
        dist.broadcast(x, src=src)
    return x


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """(start, length) of this rank's even share of `total` rows (size must divide total)."""
    rank = _tp.rank if rank is None else rank
    size = _tp.size if size is None else size
    per_rank = total // size
    return rank * per_rank, per_rank


def kv_head_shard(num_kv_heads: int) -> tuple[int, int]:
    """(first head, count) of the KV heads this rank keeps; replicated when ranks > heads."""
    if _tp.size <= num_kv_heads:
        return shard_range(num_kv_heads)
    replicas = _tp.size // num_kv_heads
    return _tp.rank // replicas, 1
