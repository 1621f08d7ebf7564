"""The engine-core side of the ZMQ transport: worker events in, release notices between peers.

One thread owns every socket (ZMQ sockets are not thread-safe):
- a PULL socket where this engine core's workers report finished pulls;
- producer: a ROUTER socket (the side channel, `--kv-port`) where consumers say "done";
- consumer: a DEALER per producer it has pulled from, to send those notices;
- an inproc PAIR that wakes the thread when the engine core queues a notice or stops;
- with --kv-encryption curve, a producer's ZAP handler, which admits to the side channel only
  consumers holding the deployment's key pair (`zmq_curve.py`).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tidegate.engine.config import EngineArgs, KVPorts, kv_port_layout
from tidegate.engine.kv_transfer.base import KVConnectorScheduler
from tidegate.engine.kv_transfer.params import RemotePrefill
from tidegate.engine.kv_transfer.zmq_curve import (
    ZapHandler,
    curve_client,
    curve_server,
    load_curve_keys,
)
from tidegate.engine.kv_transfer.zmq_sockets import STOP, Waker, bind_tcp, tcp_address
from tidegate.engine.messages import KVEvent, KVRelease, KVWorkerConfig

logger = logging.getLogger(__name__)

# Producers a consumer keeps a socket open to; the least recently used one is closed beyond.
_MAX_PEERS = 64


def advertised_host(configured: str | None) -> str:
    """The address consumers reach this pod at: the flag, else this host name's address."""
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ZmqConnectorScheduler(KVConnectorScheduler):
    """Side channel and worker events of one engine core."""

    def __init__(self, args: EngineArgs, engine_index: int) -> None:
        self.role = args.kv_role
        self.timeout_s = args.kv_transfer_timeout
        self.block_size = args.block_size
        self.tp_size = args.tensor_parallel_size
        self.host = advertised_host(args.kv_host)
        self.engine_id = f"{socket.gethostname()}-{os.getpid()}-{engine_index}"
        # kv_port 0 lets every socket pick a free port.
        ports = KVPorts(side_channel=0, ranks=(0,) * self.tp_size)
        if args.kv_port:
            layout = kv_port_layout(args.kv_port, args.data_parallel_size_local, self.tp_size)
            ports = layout[engine_index]
        # --kv-encryption curve: every TCP socket of this side and the workers' speaks CURVE.
        self._curve_key_dir = args.kv_curve_key_dir if args.kv_encryption == "curve" else None
        self._keys = load_curve_keys(self._curve_key_dir) if self._curve_key_dir else None
        self._ctx = zmq.Context()
        self.events_address = f"ipc://@tidegate-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._events = self._ctx.socket(zmq.PULL)
        self._events.bind(self.events_address)
        self._side: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self.side_port = 0
        if self.role == "producer":
            self._side = self._ctx.socket(zmq.ROUTER)
            if self._keys is not None:
                self._zap = ZapHandler(self._ctx, self._keys)  # before the first handshake
                curve_server(self._side, self._keys)
            self.side_port = bind_tcp(self._side, ports.side_channel)
        # Rank r of this engine core binds the first rank's port + r (KVWorkerConfig.data_port).
        self._data_port_base = ports.ranks[0]
        self.data_ports: list[int] = []
        # The engine core's threads wake the connector's through it.
        self._waker = Waker(self._ctx, "kv-wake")
        self._outbox: queue.SimpleQueue[tuple[str, int, bytes]] = queue.SimpleQueue()
        self._peers: collections.OrderedDict[tuple[str, int], zmq.Socket] = (
            collections.OrderedDict()
        )
        self._thread: threading.Thread | None = None
        self._stopped = False

    def worker_config(self) -> KVWorkerConfig:
        return KVWorkerConfig(
            connector="zmq",
            role=self.role,
            data_port=self._data_port_base,
            events_address=self.events_address,
            timeout_s=self.timeout_s,
            curve_key_dir=self._curve_key_dir or "",
        )

    def start(self, data_ports: list[int], sink: Callable[[KVEvent], None]) -> None:
        self.data_ports = list(data_ports)
        self._thread = threading.Thread(
            target=self._run, args=(sink,), name="kv-connector", daemon=True
        )
        self._thread.start()
        if self.role == "producer":
            logger.info(
                "KV producer %s: side channel %s:%d, blocks served on ports %s",
                self.engine_id,
                self.host,
                self.side_port,
                self.data_ports,
            )

    def transfer_params(
        self, transfer_id: str, block_ids: list[int], digest: str
    ) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": transfer_id,
            "remote_host": self.host,
            "remote_port": self.side_port,
            "remote_data_ports": self.data_ports,
            "remote_block_ids": block_ids,
            "remote_block_size": self.block_size,
            "remote_tp_size": self.tp_size,
            "prompt_digest": digest,
        }

    def release_remote(self, params: RemotePrefill) -> None:
        payload = msgspec.msgpack.encode(KVRelease(params.remote_request_id))
        self._outbox.put((params.remote_host, params.remote_port, payload))
        self._waker.wake()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._waker.wake(STOP)
            self._thread.join(timeout=5.0)
        else:
            self._close_sockets()
        self._waker.close()
        if self._thread is None or not self._thread.is_alive():
            self._ctx.term()  # would wait forever on a thread that still holds sockets

    # -- the thread -----------------------------------------------------------------------

    def _run(self, sink: Callable[[KVEvent], None]) -> None:
        decoder = msgspec.msgpack.Decoder(KVEvent)
        poller = zmq.Poller()
        zap = self._zap.socket if self._zap is not None else None
        for sock in (self._events, self._waker.receiver, self._side, zap):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._waker.receiver:
                        if self._waker.receiver.recv() == STOP:
                            return
                        self._send_outbox()
                    elif sock is self._events:
                        sink(decoder.decode(self._events.recv()))
                    elif self._zap is not None and sock is zap:
                        self._zap.answer()
                    else:
                        self._receive_side(sink, decoder)
        except Exception:
            logger.exception("the KV connector thread failed")
        finally:
            self._close_sockets()

    def _receive_side(self, sink: Callable[[KVEvent], None], decoder: msgspec.msgpack.Decoder):
        assert self._side is not None
        frames = self._side.recv_multipart()
        try:
            event = decoder.decode(frames[-1])
        except msgspec.DecodeError:
            logger.warning("ignored a malformed KV side-channel message")
            return
        if isinstance(event, KVRelease):
            sink(event)

    def _send_outbox(self) -> None:
        while True:
            try:
                host, port, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            peer = self._peer(host, port)
            try:
                peer.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                # The producer is unreachable; its pins expire by its own timeout.
                logger.warning("KV release to %s:%d dropped: peer not reachable", host, port)

    def _peer(self, host: str, port: int) -> zmq.Socket:
        key = (host, port)
        peer = self._peers.pop(key, None)
        if peer is None:
            peer = self._ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 1000)
            peer.setsockopt(zmq.SNDHWM, 1000)
            if self._keys is not None:
                curve_client(peer, self._keys)
            peer.connect(tcp_address(host, port))
            if len(self._peers) >= _MAX_PEERS:
                _, oldest = self._peers.popitem(last=False)
                oldest.close()
        self._peers[key] = peer
        return peer

    def _close_sockets(self) -> None:
        for sock in (self._events, self._waker.receiver, self._side, *self._peers.values()):
            if sock is not None:
                sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._peers.clear()
