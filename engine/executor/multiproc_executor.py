"""Worker processes driven through a shared-memory broadcast queue."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import socket
from concurrent.futures import Future
from multiprocessing.connection import Connection

import msgspec

from tidegate.engine.config import EngineArgs
from tidegate.engine.distributed.shm_broadcast import ShmBroadcastQueue
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.executor.abstract import Executor
from tidegate.engine.messages import (
    ExecuteModel,
    InitializeKVCache,
    KVPins,
    KVWorkerConfig,
    ModelRunnerOutput,
    SchedulerOutput,
    ShutdownWorker,
    WorkerCommand,
    WorkerFailure,
    WorkerReady,
    WorkerReply,
    WorkerResult,
    WorkerWarmedUp,
)
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.worker.worker_proc import run_worker

logger = logging.getLogger(__name__)

# A worker that does not stop within this many seconds of being told is killed.
_SHUTDOWN_GRACE_S = 5.0


def free_init_method() -> str:
    """A tcp:// rendezvous address for torch.distributed on a port that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class MultiprocExecutor(Executor):
    """Starts one worker process per tensor-parallel rank and steps them together."""

    title_prefix = "tidegate::"

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        kv_config: KVWorkerConfig | None = None,
    ) -> None:
        super().__init__(args, model_config, max_model_len, kv_config)
        self.world_size = args.tensor_parallel_size
        # Where the ranks meet to form their torch.distributed group (unused for one rank).
        init_method = free_init_method() if self.world_size > 1 else ""
        ctx = multiprocessing.get_context("spawn")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._queue = ShmBroadcastQueue.create(num_readers=self.world_size, ctx=ctx)
        self._replies: list[Connection] = []
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self._stopping = False
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=run_worker,
                args=(
                    args,
                    max_model_len,
                    rank,
                    self._queue.handle,
                    theirs,
                    self.title_prefix,
                    init_method,
                    kv_config,
                ),
                name=f"{self.title_prefix}worker_tp{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._replies.append(ours)
            self.workers.append(process)
        try:
            ready = [self._receive(rank) for rank in range(self.world_size)]
        except BaseException:
            self.shutdown()
            raise
        # Every reader has attached: drop the name so nothing outlives us in /dev/shm.
        self._queue.unlink()
        readies = [r for r in ready if isinstance(r, WorkerReady)]
        self._num_kv_blocks = min(r.num_kv_blocks for r in readies)
        self._kv_data_ports = [r.kv_data_port for r in sorted(readies, key=lambda r: r.rank)]

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker exits."""
        return [process.sentinel for process in self.workers]

    def check_alive(self) -> None:
        """Raise EngineDeadError if any worker has exited."""
        for rank, process in enumerate(self.workers):
            if process.exitcode is not None:
                raise EngineDeadError(
                    f"worker tp{rank} (pid {process.pid}) exited with code {process.exitcode}"
                )

    def _receive(self, rank: int) -> WorkerReady | WorkerWarmedUp | WorkerResult:
        """The next reply of one worker; a failure or a death raises instead."""
        conn = self._replies[rank]
        while True:
            ready = multiprocessing.connection.wait([conn, *self.sentinels])
            if conn in ready:
                try:
                    reply = self._decoder.decode(conn.recv_bytes())
                except EOFError:
                    self.workers[rank].join(timeout=1.0)
                    self.check_alive()
                    raise EngineDeadError(f"worker tp{rank} closed its reply pipe") from None
                if isinstance(reply, WorkerFailure):
                    raise EngineDeadError(f"worker tp{reply.rank} failed:\n{reply.error}")
                return reply
            self.check_alive()

    def _broadcast(self, command: WorkerCommand) -> None:
        self._queue.enqueue(self._encoder.encode(command), check=self.check_alive)

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
        # The workers read the queue in order: this step waits there until the one before
        # it is done. Rank 0 answers steps in order, so the earliest pending reply is next.
        self._broadcast(ExecuteModel(scheduler_output=scheduler_output))
        return _PendingReply(self)

    def _next_result(self) -> ModelRunnerOutput:
        reply = self._receive(0)
        assert isinstance(reply, WorkerResult), reply
        return reply.output

    def kv_data_ports(self) -> list[int]:
        return self._kv_data_ports

    def update_kv_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        self._broadcast(KVPins(pin=pin, unpin=unpin))

    def describe(self) -> str:
        pids = ", ".join(str(process.pid) for process in self.workers)
        return f"{self.world_size} worker process(es) (pid {pids})"

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if all(process.exitcode is None for process in self.workers):
            with contextlib.suppress(EngineDeadError, OSError):
                self._broadcast(ShutdownWorker())
        else:
            # A rank died: the others may be blocked in a collective that will never finish.
            for process in self.workers:
                if process.exitcode is None:
                    process.kill()
        for process in self.workers:
            process.join(timeout=_SHUTDOWN_GRACE_S)
            if process.exitcode is None:
                logger.warning("worker pid %d did not stop; killing it", process.pid)
                process.kill()
                process.join(timeout=_SHUTDOWN_GRACE_S)
        for conn in self._replies:
            conn.close()
        self._queue.close()


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
