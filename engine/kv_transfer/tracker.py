"""The scheduler's bookkeeping of KV transfers: pinned blocks (producer), pulls (consumer).

Pure: the scheduler feeds it times and worker reports; sockets stay elsewhere.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tidegate.engine.messages import KVConnectorMetadata

if TYPE_CHECKING:
    from tidegate.engine.core.request import Request
    from tidegate.engine.kv_transfer.base import KVConnectorScheduler
    from tidegate.engine.kv_transfer.params import RemotePrefill


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


@dataclass
class KVTransferState:
    """Everything the scheduler tracks about KV transfers, and what it owes others.

    `pin`/`unpin` go to the workers and `releases` to producers; the engine core takes them
    after every step and every event, so a worker stops serving blocks before they are reused.
    """

    connector: KVConnectorScheduler | None
    timeout_s: float
    world_size: int
    pins: PinTable = field(default_factory=PinTable)
    pulls: PullTracker = field(init=False)
    # Consumer requests whose blocks are allocated and whose KV is on its way.
    parked: dict[str, Request] = field(default_factory=dict)
    # Pulled and not yet run: the step that first runs them writes their KV (`load`).
    to_load: set[str] = field(default_factory=set)
    meta: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    pin: dict[str, list[int]] = field(default_factory=dict)
    unpin: list[str] = field(default_factory=list)
    releases: list[RemotePrefill] = field(default_factory=list)
    # Producer request id -> transfer id of its pin, for aborts.
    pin_of_request: dict[str, str] = field(default_factory=dict)
    sequence: itertools.count = field(default_factory=itertools.count)
    pins_expired: int = 0
    received_bytes: int = 0
    fallbacks: int = 0
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pulls = PullTracker(self.world_size)

    @property
    def enabled(self) -> bool:
        return self.connector is not None

    def take_meta(self) -> KVConnectorMetadata | None:
        """The workers' part of the next step, if it has any."""
        meta = self.meta
        if not (meta.recv or meta.load or meta.discard):
            return None
        self.meta = KVConnectorMetadata()
        return meta

    def take_pin_updates(self) -> tuple[dict[str, list[int]], list[str]]:
        pin, unpin = self.pin, self.unpin
        self.pin, self.unpin = {}, []
        return pin, unpin

    def take_releases(self) -> list[RemotePrefill]:
        releases, self.releases = self.releases, []
        return releases

    def take_latencies(self) -> list[float]:
        latencies, self.latencies = self.latencies, []
        return latencies

    def next_deadline(self) -> float | None:
        deadlines = [d for d in (self.pins.next_deadline(), self.pulls.next_deadline()) if d]
        return min(deadlines, default=None)
