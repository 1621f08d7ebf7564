"""The KV connector interface: an engine-core side and a worker side per transport.

The scheduler decides *what* moves (which blocks stay pinned, which are pulled into which
local blocks) and keeps that bookkeeping itself; a connector only moves bytes and messages.
`zmq` (TCP through ZMQ, bulk per request) is the transport that works everywhere; RDMA
(NIXL) or NCCL transports implement the same two classes.

Engine-core side: advertises where its workers serve pinned blocks (producer), tells a
producer when its blocks may go (consumer), and delivers events from workers and peers to
the engine core's loop through `sink`, from its own thread.

Worker side: serves pinned blocks to consumers (producer); pulls blocks in the background and
writes them into the paged cache between steps, never during one (consumer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tidegate.engine.messages import KVConnectorMetadata, KVEvent, KVWorkerConfig

if TYPE_CHECKING:
    import torch

    from tidegate.engine.attention.backend import KVLayout
    from tidegate.engine.config import EngineArgs
    from tidegate.engine.kv_transfer.params import RemotePrefill


class KVConnectorScheduler(ABC):
    """A transport's engine-core side."""

    @abstractmethod
    def worker_config(self) -> KVWorkerConfig:
        """What every worker of this engine core needs to build its side."""

    @abstractmethod
    def start(self, data_ports: list[int], sink: Callable[[KVEvent], None]) -> None:
        """Begin delivering events; `data_ports` are where rank r serves blocks."""

    @abstractmethod
    def transfer_params(
        self, transfer_id: str, block_ids: list[int], digest: str
    ) -> dict[str, Any]:
        """Producer: the `kv_transfer_params` a consumer needs to pull these blocks."""

    @abstractmethod
    def release_remote(self, params: RemotePrefill) -> None:
        """Consumer: tell the producer its pinned blocks may be freed (never blocks)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the thread and close the sockets; idempotent."""


class KVConnectorWorker(ABC):
    """A transport's worker side (one per tensor-parallel rank)."""

    @property
    @abstractmethod
    def data_port(self) -> int:
        """Where this rank serves blocks (0 for a consumer)."""

    @abstractmethod
    def register_kv_caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        """The paged caches, per layer (keys, values), once allocated, in the attention
        backend's `layout`; blocks travel in the standard layout, converted on each side."""

    @abstractmethod
    def update_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        """Producer: start or stop serving transfers; an unpin waits for a read in progress."""

    @abstractmethod
    def handle(self, meta: KVConnectorMetadata) -> None:
        """Consumer, before a step's forward pass: drop, start and write pulls."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop threads and close sockets; idempotent."""


def create_scheduler_connector(args: EngineArgs, engine_index: int) -> KVConnectorScheduler:
    """The engine-core side of --kv-connector for this engine core."""
    if args.kv_connector == "zmq":
        from tidegate.engine.kv_transfer.zmq_scheduler import ZmqConnectorScheduler

        return ZmqConnectorScheduler(args, engine_index)
    raise ValueError(f"kv_connector {args.kv_connector!r} is not known; allowed: 'zmq'")


def create_worker_connector(
    config: KVWorkerConfig,
    rank: int,
    tp_size: int,
    num_kv_heads: int,
    device: torch.device,
) -> KVConnectorWorker:
    """The worker side of the engine core's connector, for one rank."""
    if config.connector == "zmq":
        from tidegate.engine.kv_transfer.zmq_worker import ZmqConnectorWorker

        return ZmqConnectorWorker(config, rank, tp_size, num_kv_heads, device)
    raise ValueError(f"kv_connector {config.connector!r} is not known; allowed: 'zmq'")
