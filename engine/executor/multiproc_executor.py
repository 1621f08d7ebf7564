"""Worker processes driven through a shared-memory broadcast queue (and, on other nodes,
through their node agents)."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future

import msgspec

from tidegate.common.local_server import free_port
from tidegate.engine.config import EngineArgs
from tidegate.engine.distributed.node_link import NodeLinks
from tidegate.engine.distributed.node_link import init_method as node_init_method
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.executor.abstract import Executor
from tidegate.engine.executor.worker_group import WorkerGroup
from tidegate.engine.messages import (
    ExecuteModel,
    InitializeKVCache,
    KVPins,
    KVWorkerConfig,
    ModelRunnerOutput,
    SchedulerOutput,
    ShutdownWorker,
    WorkerCommand,
    WorkerReady,
    WorkerReply,
    WorkerResult,
    WorkerWarmedUp,
)
from tidegate.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)


def free_init_method() -> str:
    """A tcp:// rendezvous address for torch.distributed on a port that is free right now
    (and reserved against other starts on this machine: `free_port`)."""
    return f"tcp://127.0.0.1:{free_port()}"


class MultiprocExecutor(Executor):
    """Starts one worker process per rank on this node and steps every rank together.

    With nnodes > 1 this is the leader: the other nodes' ranks run under their node agents,
    which it reaches through `NodeLinks`; a command goes to them and into this node's ring.
    """

    title_prefix = "tidegate::"

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        kv_config: KVWorkerConfig | None = None,
    ) -> None:
        super().__init__(args, model_config, max_model_len, kv_config)
        self.world_size = args.world_size
        # TP rank 0 of the last pipeline stage samples and answers each step.
        self.output_rank = args.world_size - args.tensor_parallel_size
        self._encoder = msgspec.msgpack.Encoder()
        self._stopping = False
        self._nodes: NodeLinks | None = None
        self._group: WorkerGroup | None = None
        try:
            if args.nnodes > 1:
                init_method = node_init_method(args)
                # Every other node says hello before any rank starts to rendezvous.
                self._nodes = NodeLinks(args, max_model_len, init_method)
            else:
                # Where the ranks meet to form their group (unused for one rank).
                init_method = free_init_method() if self.world_size > 1 else ""
            self._group = WorkerGroup(
                args,
                max_model_len,
                0,
                args.local_world_size,
                init_method,
                self.title_prefix,
                kv_config,
            )
            ready = [self._receive(rank) for rank in range(self.world_size)]
        except BaseException:
            self.shutdown()
            raise
        self._group.attached()
        readies = [r for r in ready if isinstance(r, WorkerReady)]
        self._num_kv_blocks = min(r.num_kv_blocks for r in readies)
        self._kv_data_ports = [r.kv_data_port for r in sorted(readies, key=lambda r: r.rank)]

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker exits (or a node is gone)."""
        nodes = self._nodes.sentinels if self._nodes is not None else []
        return [*self._group.sentinels, *nodes] if self._group is not None else nodes

    def check_alive(self) -> None:
        """Raise EngineDeadError if any worker has exited or any node is gone."""
        if self._nodes is not None:
            self._nodes.check_alive()
        if self._group is not None:
            self._group.check_alive()

    def _receive(self, rank: int) -> WorkerReply:
        """The next reply of one rank; a failure or a death raises instead."""
        assert self._group is not None
        if rank in self._group.ranks:
            return self._group.receive(rank, check=self.check_alive)
        assert self._nodes is not None
        return self._nodes.receive(rank, check=self.check_alive)

    def _broadcast(self, command: WorkerCommand) -> None:
        assert self._group is not None
        data = self._encoder.encode(command)
        if self._nodes is not None:
            self._nodes.send(data, last=isinstance(command, ShutdownWorker))
        self._group.enqueue(data, check=self.check_alive)

    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitializeKVCache(num_blocks=num_blocks))
        # Warm-up (compilation) happens there too: the engine is ready only once all are done.
        for rank in range(self.world_size):
            reply = self._receive(rank)
            assert isinstance(reply, WorkerWarmedUp), reply

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(ExecuteModel(scheduler_output=scheduler_output))
        return self._next_result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        # The workers read the queue in order, and the output rank answers steps in order,
        # so the earliest pending reply is next. With pipeline stages, several steps run at
        # once, each in its own stage.
        self._broadcast(ExecuteModel(scheduler_output=scheduler_output))
        return _PendingReply(self)

    def _next_result(self) -> ModelRunnerOutput:
        reply = self._receive(self.output_rank)
        assert isinstance(reply, WorkerResult), reply
        return reply.output

    def kv_data_ports(self) -> list[int]:
        return self._kv_data_ports

    def update_kv_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        self._broadcast(KVPins(pin=pin, unpin=unpin))

    def describe(self) -> str:
        assert self._group is not None
        where = f"{self.world_size} worker process(es)"
        if self._nodes is not None:
            where += f" on {self.args.nnodes} nodes"
        return f"{where} (pid {self._group.describe()} here)"

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        group, nodes = self._group, self._nodes
        told = False
        if group is not None and group.all_alive():
            with contextlib.suppress(EngineDeadError, OSError):
                self._broadcast(ShutdownWorker())
                told = True
        if group is not None:
            group.stop(told=told)
        if nodes is not None:
            nodes.close()


class _PendingReply(Future):
    """A step's result that is read off rank 0's pipe when asked for (steps answer in order)."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            try:
                self.set_result(self._executor._next_result())
            except BaseException as error:
                self.set_exception(error)
        return super().result(timeout)
