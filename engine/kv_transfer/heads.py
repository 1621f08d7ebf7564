"""Which producer ranks hold the KV heads a consumer rank caches, when TP sizes differ.

Ranks keep KV heads as `kv_head_shard` says: a contiguous share each when there are at least
as many heads as ranks, otherwise one head replicated over `ranks // heads` ranks.
"""

from __future__ import annotations

from typing import NamedTuple


class HeadSource(NamedTuple):
    """Read heads [src_start, src_end) of producer `rank` into local heads [dst_start, ...)."""

    rank: int
    src_start: int
    src_end: int
    dst_start: int


def heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first global head, count) that `rank` of a `tp_size` group keeps."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per_rank = num_kv_heads // tp_size
        return rank * per_rank, per_rank
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} ranks do not replicate {num_kv_heads} KV heads evenly")
    return rank // (tp_size // num_kv_heads), 1


def head_sources(
    num_kv_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> list[HeadSource]:
    """Where a consumer rank reads each of its heads from, in as few reads as possible."""
    first, count = heads_of_rank(num_kv_heads, consumer_tp, consumer_rank)
    sources: list[HeadSource] = []
    head = first
    while head < first + count:
        # Among the producer ranks keeping this head, spread readers by consumer rank.
        holders = [
            r
            for r in range(producer_tp)
            if heads_of_rank(num_kv_heads, producer_tp, r)[0]
            <= head
            < sum(heads_of_rank(num_kv_heads, producer_tp, r))
        ]
        rank = holders[consumer_rank % len(holders)]
        start, held = heads_of_rank(num_kv_heads, producer_tp, rank)
        end = min(start + held, first + count)
        sources.append(HeadSource(rank, head - start, end - start, head - first))
        head = end
    return sources
