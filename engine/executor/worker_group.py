"""The worker processes of one node: spawned together, fed through one shared-memory ring.

The leader's executor drives its node's ranks through a group, and so does the node agent of
every other node (engine/executor/node_agent.py), which relays the leader's commands.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from tidegate.engine.config import EngineArgs
from tidegate.engine.distributed.shm_broadcast import ShmBroadcastQueue
from tidegate.engine.errors import EngineDeadError, worker_failed
from tidegate.engine.messages import KVWorkerConfig, WorkerFailure, WorkerReply
from tidegate.engine.worker.worker_proc import run_worker

logger = logging.getLogger(__name__)

# A worker that does not stop within this many seconds of being told is killed.
SHUTDOWN_GRACE_S = 5.0


def worker_title(rank: int, args: EngineArgs) -> str:
    """A rank's process name: worker_tp<r> without pipeline stages, else worker_pp<s>_tp<r>."""
    tp = args.tensor_parallel_size
    if args.pipeline_parallel_size == 1:
        return f"worker_tp{rank}"
    return f"worker_pp{rank // tp}_tp{rank % tp}"


class WorkerGroup:
    """Spawns global ranks [first_rank, first_rank + count) and reads their replies."""

    def __init__(
        self,
        args: EngineArgs,
        max_model_len: int,
        first_rank: int,
        count: int,
        init_method: str,
        title_prefix: str,
        kv_config: KVWorkerConfig | None = None,
    ) -> None:
        self.first_rank = first_rank
        self.ranks = range(first_rank, first_rank + count)
        ctx = multiprocessing.get_context("spawn")
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        self.queue = ShmBroadcastQueue.create(num_readers=count, ctx=ctx)
        self.replies: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.titles = [worker_title(rank, args) for rank in self.ranks]
        for local_rank, rank in enumerate(self.ranks):
            ours, theirs = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=run_worker,
                args=(
                    args,
                    max_model_len,
                    rank,
                    local_rank,
                    self.queue.handle,
                    theirs,
                    title_prefix + self.titles[local_rank],
                    init_method,
                    kv_config,
                ),
                name=title_prefix + self.titles[local_rank],
                daemon=True,
            )
            process.start()
            theirs.close()
            self.replies.append(ours)
            self.processes.append(process)

    def attached(self) -> None:
        """Every reader has attached: drop the ring's name so nothing outlives us in /dev/shm."""
        self.queue.unlink()

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker exits."""
        return [process.sentinel for process in self.processes]

    def check_alive(self) -> None:
        """Raise EngineDeadError if any worker has exited."""
        for title, process in zip(self.titles, self.processes, strict=True):
            if process.exitcode is not None:
                raise EngineDeadError(
                    f"worker {title} (pid {process.pid}) exited with code {process.exitcode}"
                )

    def enqueue(self, data: bytes, check: Callable[[], None] | None = None) -> None:
        """Write one encoded command for every rank of the group (`check` raises when a peer
        it waits for died: by default, one of the group's workers)."""
        self.queue.enqueue(data, check=check or self.check_alive)

    def receive_bytes(self, rank: int, check: Callable[[], None] | None = None) -> bytes:
        """The next encoded reply of one rank; a death raises instead."""
        check = check or self.check_alive
        index = rank - self.first_rank
        conn = self.replies[index]
        while True:
            ready = multiprocessing.connection.wait([conn, *self.sentinels], timeout=0.5)
            if conn in ready:
                try:
                    return conn.recv_bytes()
                except EOFError:
                    self.processes[index].join(timeout=1.0)
                    check()
                    raise EngineDeadError(
                        f"worker {self.titles[index]} closed its reply pipe"
                    ) from None
            check()

    def receive(self, rank: int, check: Callable[[], None] | None = None) -> WorkerReply:
        """The next reply of one rank, decoded; a failure or a death raises instead."""
        reply = self._decoder.decode(self.receive_bytes(rank, check))
        if isinstance(reply, WorkerFailure):
            raise EngineDeadError(worker_failed(reply.rank, reply.error))
        return reply

    def describe(self) -> str:
        return ", ".join(str(process.pid) for process in self.processes)

    def all_alive(self) -> bool:
        return all(process.exitcode is None for process in self.processes)

    def stop(self, told: bool) -> None:
        """Wait for the workers to stop (`told`: a shutdown command was sent), else kill them:
        a rank died, and the others may be blocked in a collective that will never finish."""
        if not told:
            for process in self.processes:
                if process.exitcode is None:
                    process.kill()
        for process in self.processes:
            process.join(timeout=SHUTDOWN_GRACE_S)
            if process.exitcode is None:
                logger.warning("worker pid %d did not stop; killing it", process.pid)
                process.kill()
                process.join(timeout=SHUTDOWN_GRACE_S)
        for conn in self.replies:
            with contextlib.suppress(OSError):
                conn.close()
        self.queue.close()
