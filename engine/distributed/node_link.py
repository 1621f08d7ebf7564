"""The leader's control channel to the other nodes of a model spread over nodes (nnodes > 1).

The leader (node_rank 0) binds a ZMQ ROUTER on master_port + 1. Each other node's agent
(engine/executor/node_agent.py) connects a DEALER and says `NodeHello` until the leader
answers `NodeStart`. From then on frames are [kind, payload]:

- leader -> node: `cmd` (an encoded WorkerCommand, which the agent writes into its node's
  shared-memory ring unread), `stop` (the same, for the last command), `ping`;
- node -> leader: `reply` (an encoded WorkerReply from one of its ranks), `ping`.

Liveness is explicit, both ways: each side pings every PING_S and gives the other up after
NODE_TIMEOUT_S of silence. A killed node is noticed sooner: the ROUTER is mandatory, so a send
to a peer whose connection closed fails, and a closed connection (a monitor event) makes the
leader ping every node at once. When a node is given up the leader's engine core ends like it
does for a dead local worker (in-flight requests get 503s, the server exits 1), and the whole
group is restarted: a LeaderWorkerSet recreates it, `tidegate up` restarts it.

The tensors themselves do not pass here: the ranks talk over torch.distributed (gloo on CPU,
NCCL on CUDA), which rendezvous at master_addr:master_port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tidegate.engine.config import EngineArgs
from tidegate.engine.errors import EngineDeadError, worker_failed
from tidegate.engine.messages import (
    NodeHello,
    NodeStart,
    WorkerFailure,
    WorkerReply,
    WorkerResult,
)

logger = logging.getLogger(__name__)

# Frame kinds (see the module docstring).
HELLO, START, CMD, STOP, REPLY, PING = b"hello", b"start", b"cmd", b"stop", b"reply", b"ping"
PING_S = 1.0
NODE_TIMEOUT_S = 10.0
# How long the leader waits for every node to say hello before it gives up starting.
JOIN_TIMEOUT_S = 600.0


def control_port(master_port: int) -> int:
    """Where the leader's control channel listens, beside the torch.distributed rendezvous."""
    return master_port + 1


def init_method(args: EngineArgs) -> str:
    """Where the ranks of every node meet for torch.distributed: rank 0, on the leader."""
    return f"tcp://{args.master_addr}:{args.master_port}"


class NodeLinks:
    """The leader's side: wait for every node, start them, then relay commands and replies.

    One thread owns the ROUTER after start-up; the engine core's thread hands it commands
    through an inproc socket (ZMQ sockets are not shared between threads).
    """

    def __init__(self, args: EngineArgs, max_model_len: int, init: str) -> None:
        self.nnodes = args.nnodes
        self.ranks_per_node = args.local_world_size
        self.output_rank = args.world_size - args.tensor_parallel_size
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://*:{control_port(args.master_port)}")
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        # The node_rank -> (ZMQ identity, host) of every node, once it said hello.
        self.nodes: dict[int, tuple[bytes, str]] = {}
        self._last_seen: dict[int, float] = {}
        self._replies: dict[int, queue.SimpleQueue[WorkerReply]] = {
            rank: queue.SimpleQueue() for rank in range(self.ranks_per_node, args.world_size)
        }
        self._dead: str | None = None
        # Readable once a node is given up: the engine core waits on it like on a process.
        self._dead_r, self._dead_w = os.pipe()
        self._cmd_address = f"inproc://tidegate-nodes-{id(self)}"
        self._cmd_pull = self._ctx.socket(zmq.PULL)
        self._cmd_pull.bind(self._cmd_address)
        self._cmd_push = self._ctx.socket(zmq.PUSH)
        self._cmd_push.connect(self._cmd_address)
        self._cmd_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._join(args, max_model_len, init)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._run, name="node-links", daemon=True)
        self._thread.start()

    # -- start-up ------------------------------------------------------------------------------

    def _join(self, args: EngineArgs, max_model_len: int, init: str) -> None:
        """Wait for every node's hello (their order does not matter), then start them all."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        next_log = 0.0
        decoder = msgspec.msgpack.Decoder(NodeHello)
        while len(self.nodes) < self.nnodes - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(1, self.nnodes)) - set(self.nodes))
                raise RuntimeError(
                    f"node(s) {missing} did not connect to {args.master_addr}:"
                    f"{control_port(args.master_port)} within {JOIN_TIMEOUT_S:.0f} s; start them with "
                    f"--nnodes {self.nnodes} --node-rank N --master-addr {args.master_addr} "
                    f"--master-port {args.master_port}"
                )
            if now >= next_log:
                logger.info(
                    "waiting for %d of %d node(s) on port %d",
                    self.nnodes - 1 - len(self.nodes),
                    self.nnodes - 1,
                    control_port(args.master_port),
                )
                next_log = now + 10.0
            if not self._router.poll(500):
                continue
            identity, kind, payload = self._router.recv_multipart()
            if kind != HELLO:
                continue  # a node of an earlier group still talking: not ours
            hello = decoder.decode(payload)
            if hello.nnodes != self.nnodes or not 0 < hello.node_rank < self.nnodes:
                logger.warning(
                    "ignoring node %s (pid %d): node_rank %d of nnodes %d, but this group has "
                    "%d nodes",
                    hello.host,
                    hello.pid,
                    hello.node_rank,
                    hello.nnodes,
                    self.nnodes,
                )
                continue
            if hello.node_rank not in self.nodes:
                logger.info(
                    "node %d joined from %s (pid %d)", hello.node_rank, hello.host, hello.pid
                )
            self.nodes[hello.node_rank] = (identity, hello.host)
        start = msgspec.msgpack.encode(
            NodeStart(
                engine_args=args.model_dump_json().encode(),
                max_model_len=max_model_len,
                init_method=init,
            )
        )
        now = time.monotonic()
        for node_rank, (identity, _) in self.nodes.items():
            self._router.send_multipart([identity, START, start])
            self._last_seen[node_rank] = now

    # -- the engine core's side ------------------------------------------------------------------

    @property
    def sentinels(self) -> list[int]:
        """A file descriptor that becomes readable when a node is given up."""
        return [self._dead_r]

    def check_alive(self) -> None:
        """Raise EngineDeadError once a node is given up."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def send(self, data: bytes, last: bool = False) -> None:
        """Relay one encoded WorkerCommand to every node (`last`: the shutdown)."""
        self.check_alive()
        with self._cmd_lock:
            self._cmd_push.send_multipart([STOP if last else CMD, data])

    def receive(self, rank: int, check: Callable[[], None]) -> WorkerReply:
        """The next reply of a rank on another node; `check()` runs while waiting."""
        replies = self._replies[rank]
        while True:
            try:
                reply = replies.get(timeout=0.5)
            except queue.Empty:
                check()
                continue
            if isinstance(reply, WorkerFailure):
                raise EngineDeadError(worker_failed(reply.rank, reply.error))
            return reply

    def close(self) -> None:
        """Stop relaying and close the sockets (idempotent)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._ctx.destroy(linger=0)
        for fd in (self._dead_r, self._dead_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dead_r = self._dead_w = -1

    # -- the relay thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._cmd_pull, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_ping = 0.0
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(int(PING_S * 250)))
                now = time.monotonic()
                if self._router in events:
                    self._on_node_message(now)
                if self._cmd_pull in events:
                    kind, data = self._cmd_pull.recv_multipart()
                    self._to_all_nodes(kind, data)
                if self._monitor in events:
                    recv_monitor_message(self._monitor)
                    next_ping = 0.0  # a connection closed: find out whose, now
                if now >= next_ping:
                    self._to_all_nodes(PING, b"")
                    next_ping = now + PING_S
                for node_rank, seen in self._last_seen.items():
                    if now - seen > NODE_TIMEOUT_S:
                        self._give_up(node_rank, f"silent for {now - seen:.0f} s")
        except zmq.ContextTerminated:
            pass

    def _on_node_message(self, now: float) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            return
        identity, kind, payload = frames
        node_rank = next((r for r, (i, _) in self.nodes.items() if i == identity), None)
        if node_rank is None:
            return  # not a node of this group
        self._last_seen[node_rank] = now
        if kind != REPLY:
            return
        reply = self._decoder.decode(payload)
        if isinstance(reply, WorkerFailure):
            self._give_up(node_rank, worker_failed(reply.rank, reply.error))
        rank = self.output_rank if isinstance(reply, WorkerResult) else reply.rank
        self._replies[rank].put(reply)

    def _to_all_nodes(self, kind: bytes, data: bytes) -> None:
        for node_rank, (identity, _) in self.nodes.items():
            try:
                self._router.send_multipart([identity, kind, data])
            except zmq.ZMQError as error:
                if error.errno != zmq.EHOSTUNREACH:
                    raise
                self._give_up(node_rank, "its connection closed")

    def _give_up(self, node_rank: int, why: str) -> None:
        if self._dead is not None:
            return
        host = self.nodes[node_rank][1]
        self._dead = f"node {node_rank} ({host}) is gone: {why}"
        logger.error("%s", self._dead)
        if self._dead_w >= 0:
            os.write(self._dead_w, b"x")
