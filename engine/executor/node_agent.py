"""`tidegate serve --node-rank N` (N > 0): run this node's share of a model's ranks.

The agent connects to the leader's control channel (engine/distributed/node_link.py), gets
the engine's arguments in the handshake, starts its worker ranks (engine/executor/
worker_group.py) and relays: the leader's commands into the node's shared-memory ring, the
workers' replies back. It serves no HTTP.

Exit codes: 0 when the leader shut the engine down, 1 when the leader went away or a worker
of this node died (the group is restarted as a unit).
"""

from __future__ import annotations

import logging
import os
import socket
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tidegate.engine.config import EngineArgs
from tidegate.engine.distributed.node_link import (
    CMD,
    HELLO,
    NODE_TIMEOUT_S,
    PING,
    PING_S,
    REPLY,
    START,
    STOP,
    control_port,
)
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.executor.worker_group import WorkerGroup
from tidegate.engine.messages import NodeHello, NodeStart, WorkerFailure
from tidegate.engine.process import LOG_FORMAT, name_process

logger = logging.getLogger("tidegate.node")

# A node says hello this often until the leader answers (the leader may restart meanwhile).
_HELLO_S = 2.0


def run_node(
    nnodes: int, node_rank: int, master_addr: str, master_port: int, log_level: str
) -> int:
    """Run until the leader stops the engine or goes away; returns the exit code."""
    name_process(f"tidegate::node{node_rank}")
    os.environ.setdefault("TIDEGATE_LOG_LEVEL", log_level.upper())
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    if not 0 < node_rank < nnodes:
        logger.error("node_rank %d must be between 1 and nnodes - 1 (%d)", node_rank, nnodes - 1)
        return 1
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    address = f"tcp://{master_addr}:{control_port(master_port)}"
    dealer.connect(address)
    monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        start = _handshake(dealer, nnodes, node_rank, address)
        if start is None:
            return 0
        return _relay(dealer, monitor, start, node_rank)
    finally:
        ctx.destroy(linger=0)


def _handshake(dealer: zmq.Socket, nnodes: int, node_rank: int, address: str) -> NodeStart | None:
    """Say hello until the leader answers with this node's start; None when stopped."""
    hello = msgspec.msgpack.encode(NodeHello(node_rank, nnodes, socket.gethostname(), os.getpid()))
    logger.info("node %d of %d: waiting for the leader at %s", node_rank, nnodes, address)
    decoder = msgspec.msgpack.Decoder(NodeStart)
    while True:
        dealer.send_multipart([HELLO, hello])
        deadline = time.monotonic() + _HELLO_S
        while (left := deadline - time.monotonic()) > 0:
            if dealer.poll(int(left * 1000)):
                kind, payload = dealer.recv_multipart()
                if kind == START:
                    return decoder.decode(payload)


def _relay(dealer: zmq.Socket, monitor: zmq.Socket, start: NodeStart, node_rank: int) -> int:
    args = EngineArgs.model_validate_json(start.engine_args)
    args.node_rank = node_rank
    first = node_rank * args.local_world_size
    logger.info(
        "node %d: starting ranks %d-%d of %d",
        node_rank,
        first,
        first + args.local_world_size - 1,
        args.world_size,
    )
    group = WorkerGroup(
        args,
        start.max_model_len,
        first,
        args.local_world_size,
        start.init_method,
        title_prefix="tidegate::",
    )
    told = False
    try:
        code = _serve(dealer, monitor, group)
        told = code == 0
        return code
    finally:
        group.stop(told=told)


def _serve(dealer: zmq.Socket, monitor: zmq.Socket, group: WorkerGroup) -> int:
    """Relay until told to stop (0), or until the leader or a worker is gone (1)."""
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    for conn in group.replies:
        poller.register(conn.fileno(), zmq.POLLIN)
    for sentinel in group.sentinels:
        poller.register(sentinel, zmq.POLLIN)
    by_fd = {conn.fileno(): conn for conn in group.replies}
    last_heard = time.monotonic()
    next_ping = 0.0
    not_attached = set(by_fd)  # workers that have not replied yet (so may not have attached)
    while True:
        events = dict(poller.poll(int(PING_S * 250)))
        now = time.monotonic()
        if dealer in events:
            kind, payload = dealer.recv_multipart()
            last_heard = now
            if kind in (CMD, STOP):
                try:
                    group.enqueue(payload)
                except EngineDeadError as error:
                    return _worker_died(dealer, encoder, group, str(error))
                if kind == STOP:
                    logger.info("the leader stopped the engine")
                    return 0
        for fd, conn in by_fd.items():
            if fd in events:
                try:
                    data = conn.recv_bytes()
                except EOFError:
                    continue  # its process exited: the sentinel says so
                dealer.send_multipart([REPLY, data])
                if fd in not_attached:
                    not_attached.discard(fd)
                    if not not_attached:
                        group.attached()  # a worker attaches to the ring before its first reply
        try:
            group.check_alive()
        except EngineDeadError as error:
            return _worker_died(dealer, encoder, group, str(error))
        if monitor in events:
            recv_monitor_message(monitor)
            logger.error("the leader closed the connection; stopping this node's workers")
            return 1
        if now - last_heard > NODE_TIMEOUT_S:
            logger.error(
                "the leader was silent for %.0f s; stopping this node's workers", now - last_heard
            )
            return 1
        if now >= next_ping:
            dealer.send_multipart([PING, b""])
            next_ping = now + PING_S


def _worker_died(
    dealer: zmq.Socket, encoder: msgspec.msgpack.Encoder, group: WorkerGroup, why: str
) -> int:
    """Tell the leader (a worker killed by a signal sent nothing itself), then exit 1."""
    logger.error("%s", why)
    failure = WorkerFailure(rank=group.first_rank, error=why)
    dealer.send_multipart([REPLY, encoder.encode(failure)])
    return 1
