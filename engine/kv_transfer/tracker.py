"""Bookkeeping of KV transfers by id: pinned transfers and their deadlines (producer), pulls
and their per-rank reports (consumer).

Pure data structures, no requests, no I/O: the engine core's KV-transfer coordinator
(engine/core/kv_coordinator.py) drives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Pin:
    """A finished producer request's blocks, held until a consumer has read them."""

    transfer_id: str
    request_id: str
    num_blocks: int
    deadline: float


class PinTable:
    """Pinned transfers in deadline order (every pin gets the same timeout)."""

    def __init__(self) -> None:
        self._pins: dict[str, Pin] = {}
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, pin: Pin) -> None:
        if pin.transfer_id in self._pins:
            raise ValueError(f"transfer {pin.transfer_id!r} is already pinned")
        self._pins[pin.transfer_id] = pin
        self.num_blocks += pin.num_blocks

    def pop(self, transfer_id: str) -> Pin | None:
        """Remove and return a pin; None if it is not (or no longer) pinned."""
        pin = self._pins.pop(transfer_id, None)
        if pin is not None:
            self.num_blocks -= pin.num_blocks
        return pin

    def expired(self, now: float) -> list[str]:
        """Transfer ids whose deadline has passed (still pinned)."""
        expired = []
        for transfer_id, pin in self._pins.items():
            if pin.deadline > now:
                break  # insertion order is deadline order
            expired.append(transfer_id)
        return expired

    def next_deadline(self) -> float | None:
        return next(iter(self._pins.values())).deadline if self._pins else None


@dataclass
class _Pull:
    world_size: int
    deadline: float
    ok_ranks: set[int] = field(default_factory=set)
    failed: bool = False
    num_bytes: int = 0
    seconds: float = 0.0


PullState = Literal["pending", "done", "failed"]


class PullTracker:
    """Consumer pulls in flight, each complete once every worker rank has reported."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._pulls: dict[str, _Pull] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pulls

    def __len__(self) -> int:
        return len(self._pulls)

    def start(self, req_id: str, deadline: float) -> None:
        self._pulls[req_id] = _Pull(self.world_size, deadline)

    def report(
        self, req_id: str, rank: int, ok: bool, num_bytes: int, seconds: float
    ) -> PullState | None:
        """Fold in one rank's report; the pull's state once all ranks spoke, None if unknown."""
        pull = self._pulls.get(req_id)
        if pull is None:
            return None  # cancelled or expired; a late report
        if ok:
            pull.ok_ranks.add(rank)
            pull.num_bytes += num_bytes
            pull.seconds = max(pull.seconds, seconds)
        else:
            pull.failed = True
        if pull.failed:
            del self._pulls[req_id]
            return "failed"
        if len(pull.ok_ranks) == pull.world_size:
            return "done"
        return "pending"

    def finish(self, req_id: str) -> tuple[int, float]:
        """Forget a completed pull; its (bytes, seconds)."""
        pull = self._pulls.pop(req_id)
        return pull.num_bytes, pull.seconds

    def cancel(self, req_id: str) -> None:
        self._pulls.pop(req_id, None)

    def pop_expired(self, now: float) -> list[str]:
        expired = [rid for rid, pull in self._pulls.items() if pull.deadline <= now]
        for rid in expired:
            del self._pulls[rid]
        return expired

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._pulls.values()), default=None)
