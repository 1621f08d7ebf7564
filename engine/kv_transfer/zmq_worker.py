"""The worker side of the ZMQ transport: a block server (producer) or a puller (consumer).

Producer: a thread answers `KVReadRequest`s on a ROUTER socket with one K and one V frame
per layer, but only for blocks of a transfer that is pinned right now. Pins change only
through `update_pins`, which the worker runs before any later step, under the lock the
server holds while copying: a block is never read after the scheduler let it go. A read may
arrive before its pin does (the engine core tells its workers and, through the API, the
consumer at about the same time); it waits a few seconds for the pin, without holding up
other reads, unless the transfer is known to be released.

Consumer: a thread sends reads to the producers' ranks holding this rank's heads, waits with
a deadline, checks dtype and shapes, and keeps the result in host memory. The model's
thread writes it into the cache only when the scheduler says `load`, before the forward pass
of the step that first runs the request, so no write ever races a step.

With --kv-encryption curve the block server is a CURVE server whose ZAP handler admits only
the deployment's key pair, and the puller's sockets are CURVE clients (`zmq_curve.py`). A
refused handshake never reaches the socket itself, so the monitor that notices refused
connections notices it too: the pull fails at once, not at its deadline.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from tidegate.engine.attention.backend import STANDARD_KV_LAYOUT, KVLayout, index_copy_into
from tidegate.engine.kv_transfer.base import KVConnectorWorker
from tidegate.engine.kv_transfer.heads import HeadSource, head_sources, heads_of_rank
from tidegate.engine.kv_transfer.zmq_curve import (
    ZapHandler,
    curve_client,
    curve_server,
    load_curve_keys,
)
from tidegate.engine.kv_transfer.zmq_sockets import STOP, Waker, bind_tcp, tcp_address
from tidegate.engine.messages import (
    KVConnectorMetadata,
    KVReadReply,
    KVReadRequest,
    KVRecvDone,
    KVRecvSpec,
    KVWorkerConfig,
)

logger = logging.getLogger(__name__)
# Received frames are read-only; they are copied into the assembled tensors at once.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_PINS = b"pins"
# How long a read waits for the pin of a transfer this rank has not heard of.
_EARLY_READ_WAIT_S = 5.0
# What a puller's monitor reports about a producer's connection: each fails the reads on it.
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_PEER_EVENTS = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Pull:
    """One request's reads on this rank: one per producer rank holding some of its heads."""

    spec: KVRecvSpec
    sources: list[HeadSource]
    started: float
    deadline: float
    replies: dict[int, list[zmq.Frame]] = field(default_factory=dict)  # source index -> frames


class ZmqConnectorWorker(KVConnectorWorker):
    """One rank's block server or puller."""

    def __init__(
        self,
        config: KVWorkerConfig,
        rank: int,
        tp_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.rank = rank
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.kv_caches: KVCaches = []
        self.kv_layout: KVLayout = STANDARD_KV_LAYOUT
        # A block's standard shape (block_size, heads, head_dim), as it goes on the wire.
        self._block_shape: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self._keys = load_curve_keys(config.curve_key_dir) if config.curve_key_dir else None
        self._ctx = zmq.Context()
        self._waker = Waker(self._ctx, "kv-worker")
        # Producer: transfer id -> the block ids it may serve.
        self._pins: dict[str, frozenset[int]] = {}
        # Recently unpinned transfers: a read of one fails at once instead of waiting.
        self._released: collections.deque[str] = collections.deque(maxlen=4096)
        self._server: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._data_port = 0
        # Consumer: pulls the thread is working on, finished ones, and ones to drop.
        self._new_pulls: queue.SimpleQueue[KVRecvSpec] = queue.SimpleQueue()
        self._in_flight: set[str] = set()
        self._cancelled: set[str] = set()
        self._ready: dict[str, tuple[list[int], KVCaches]] = {}
        self._events: zmq.Socket | None = None
        if config.role == "producer":
            self._server = self._ctx.socket(zmq.ROUTER)
            if self._keys is not None:
                self._zap = ZapHandler(self._ctx, self._keys)  # before the first handshake
                curve_server(self._server, self._keys)
            self._data_port = bind_tcp(
                self._server, config.data_port + rank if config.data_port else 0
            )
            target = self._serve
        else:
            self._events = self._ctx.socket(zmq.PUSH)
            self._events.connect(config.events_address)
            target = self._pull_loop
        self._thread = threading.Thread(target=target, name=f"kv-{config.role}", daemon=True)
        self._thread.start()
        self._stopped = False

    @property
    def data_port(self) -> int:
        return self._data_port

    @property
    def local_heads(self) -> int:
        return heads_of_rank(self.num_kv_heads, self.tp_size, self.rank)[1]

    def register_kv_caches(
        self, kv_caches: KVCaches, layout: KVLayout = STANDARD_KV_LAYOUT
    ) -> None:
        block_shape: tuple[int, ...] = ()
        if kv_caches:  # the standard shape of zero blocks converted
            k_cache, v_cache = kv_caches[0]
            block_shape = tuple(layout.to_standard(k_cache[:0], v_cache[:0])[0].shape[1:])
        with self._lock:
            self.kv_caches = kv_caches
            self.kv_layout = layout
            self._block_shape = block_shape

    # -- producer ---------------------------------------------------------------------------

    def update_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        with self._lock:  # waits for a read in progress to finish copying
            for transfer_id in unpin:
                self._pins.pop(transfer_id, None)
                self._released.append(transfer_id)
            for transfer_id, block_ids in pin.items():
                self._pins[transfer_id] = frozenset(block_ids)
        if pin:
            self._waker.wake(_PINS)  # reads that came before their pin can go on

    def _serve(self) -> None:
        assert self._server is not None
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        poller.register(self._waker.receiver, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.socket, zmq.POLLIN)
        decoder = msgspec.msgpack.Decoder(KVReadRequest)
        # A read can overtake its pin: the engine core tells this rank and the consumer at
        # about the same time. Such reads wait here (not blocking others) for a while.
        early: list[tuple[float, list[bytes], KVReadRequest]] = []
        try:
            while True:
                now = time.monotonic()
                timeout = min((e[0] for e in early), default=None)
                ready = dict(
                    poller.poll(None if timeout is None else max(0.0, timeout - now) * 1e3)
                )
                waker = self._waker.receiver
                if waker in ready and waker.recv() == STOP:
                    return
                if self._zap is not None and self._zap.socket in ready:
                    self._zap.answer()
                if self._server in ready:
                    *route, payload = self._server.recv_multipart()
                    try:
                        request = decoder.decode(payload)
                    except msgspec.DecodeError:
                        self._answer(route, KVReadReply(ok=False, error="malformed read"), [])
                    else:
                        early.append((now + _EARLY_READ_WAIT_S, route, request))
                waiting = []
                for deadline, route, request in early:
                    answer = self._read(request, give_up=time.monotonic() >= deadline)
                    if answer is None:
                        waiting.append((deadline, route, request))
                    else:
                        self._answer(route, *answer)
                early = waiting
        except Exception:
            logger.exception("the KV block server of rank %d failed", self.rank)
        finally:
            self._server.close(linger=0)
            self._waker.receiver.close(linger=0)
            if self._zap is not None:
                self._zap.close()

    def _answer(self, route: list[bytes], reply: KVReadReply, frames: list[memoryview]) -> None:
        assert self._server is not None
        header = msgspec.msgpack.encode(reply)
        self._server.send_multipart([*route, header, *frames], copy=False)

    def _read(
        self, request: KVReadRequest, give_up: bool
    ) -> tuple[KVReadReply, list[memoryview]] | None:
        """Copy the asked blocks and heads of every layer if the transfer is pinned; None to
        wait for a pin that may not have arrived yet."""
        with self._lock:
            allowed = self._pins.get(request.transfer_id)
            if allowed is None:
                if not give_up and request.transfer_id not in self._released:
                    return None
                return KVReadReply(ok=False, error="transfer not pinned (released or expired)"), []
            if not allowed.issuperset(request.block_ids):
                return KVReadReply(ok=False, error="blocks outside the pinned transfer"), []
            if not 0 <= request.head_start < request.head_end <= self.local_heads:
                return KVReadReply(ok=False, error="heads outside this rank's share"), []
            index = torch.tensor(request.block_ids, dtype=torch.long, device=self.device)
            frames: list[memoryview] = []
            dtype = shape = None
            heads = slice(request.head_start, request.head_end)
            for k_cache, v_cache in self.kv_caches:
                # On the wire: the standard layout, whatever the backend caches.
                blocks = self.kv_layout.to_standard(
                    k_cache.index_select(0, index), v_cache.index_select(0, index)
                )
                for cache in blocks:
                    part = cache[:, :, heads].contiguous().cpu()
                    dtype, shape = str(part.dtype), list(part.shape)
                    frames.append(memoryview(part.view(torch.uint8).numpy()))
        return KVReadReply(ok=True, dtype=dtype or "", shape=shape or []), frames

    # -- consumer ---------------------------------------------------------------------------

    def handle(self, meta: KVConnectorMetadata) -> None:
        with self._lock:
            for req_id in meta.discard:
                if self._ready.pop(req_id, None) is None and req_id in self._in_flight:
                    self._cancelled.add(req_id)
            for spec in meta.recv:
                self._in_flight.add(spec.req_id)
                self._cancelled.discard(spec.req_id)
        for spec in meta.recv:
            self._new_pulls.put(spec)
        if meta.recv:
            self._waker.wake()
        for req_id in meta.load:
            with self._lock:
                entry = self._ready.pop(req_id, None)
            if entry is None:
                raise RuntimeError(f"the scheduler loads KV for {req_id!r}, which was not pulled")
            self._write(*entry)

    def _write(self, block_ids: list[int], pulled: KVCaches) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for (k_cache, v_cache), (k, v) in zip(self.kv_caches, pulled, strict=True):
            k, v = self.kv_layout.from_standard(k.to(self.device), v.to(self.device))
            index_copy_into(k_cache, index, k)
            index_copy_into(v_cache, index, v)

    def _pull_loop(self) -> None:
        assert self._events is not None
        # Only this thread touches these.
        self._poller = zmq.Poller()
        self._poller.register(self._waker.receiver, zmq.POLLIN)
        self._peers: dict[tuple[str, int], zmq.Socket] = {}
        # A monitor per peer socket: a refused or dropped connection fails its reads at once.
        self._monitors: dict[zmq.Socket, tuple[str, int]] = {}
        self._pulls: dict[str, _Pull] = {}
        self._waiting: dict[bytes, tuple[str, int]] = {}  # tag -> (request, source index)
        self._tags = itertools.count()
        try:
            while True:
                now = time.monotonic()
                for req_id in [r for r, p in self._pulls.items() if p.deadline <= now]:
                    self._fail(self._pulls.pop(req_id), "timed out", drop_peers=True)
                next_deadline = min((p.deadline for p in self._pulls.values()), default=None)
                timeout = None if next_deadline is None else max(0.0, next_deadline - now) * 1000
                for sock, _ in self._poller.poll(timeout):
                    if sock is self._waker.receiver:
                        if self._waker.receiver.recv() == STOP:
                            return
                    elif sock in self._monitors:
                        self._peer_event(sock)
                    else:
                        self._receive(sock)
                while True:
                    try:
                        self._start(self._new_pulls.get_nowait())
                    except queue.Empty:
                        break
        except Exception:
            logger.exception("the KV puller of rank %d failed", self.rank)
        finally:
            for address in list(self._peers):
                self._drop_peer(address)
            self._events.close(linger=0)
            self._waker.receiver.close(linger=0)

    def _start(self, spec: KVRecvSpec) -> None:
        """Send this rank's reads of one request to the producer ranks holding its heads."""
        now = time.monotonic()
        pull = _Pull(spec, [], now, now + self.config.timeout_s)
        try:
            pull.sources = head_sources(
                self.num_kv_heads, len(spec.data_ports), self.tp_size, self.rank
            )
        except ValueError as error:
            self._fail(pull, str(error))
            return
        self._pulls[spec.req_id] = pull
        for index, source in enumerate(pull.sources):
            address = (spec.host, spec.data_ports[source.rank])
            sock = self._peers.get(address) or self._connect(address)
            tag = next(self._tags).to_bytes(8, "little")
            self._waiting[tag] = (spec.req_id, index)
            read = KVReadRequest(spec.transfer_id, spec.remote_block_ids, *source[1:3])
            try:
                sock.send_multipart([tag, msgspec.msgpack.encode(read)], zmq.NOBLOCK)
            except zmq.Again:  # thousands of reads queued: the producer is not reading them
                self._fail(self._pulls.pop(spec.req_id), "producer not reading", drop_peers=True)
                return

    def _connect(self, address: tuple[str, int]) -> zmq.Socket:
        sock = self._peers[address] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            curve_client(sock, self._keys)
        monitor = sock.get_monitor_socket(_PEER_EVENTS)
        self._monitors[monitor] = address
        sock.connect(tcp_address(*address))
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        return sock

    def _drop_peer(self, address: tuple[str, int]) -> None:
        """Close a peer's socket and its monitor; the next read connects afresh."""
        sock = self._peers.pop(address, None)
        if sock is None:
            return
        monitor = next(m for m, a in self._monitors.items() if a == address)
        del self._monitors[monitor]
        for closing in (sock, monitor):
            self._poller.unregister(closing)
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)

    def _peer_event(self, monitor: zmq.Socket) -> None:
        """A producer refused or dropped the connection, or the handshake failed: its reads
        will never be answered."""
        address = self._monitors[monitor]
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_CONNECT_RETRIED:
            reason = "refused the connection"
        elif event & _HANDSHAKE_FAILED:
            reason = (
                "refused the handshake (another CURVE key pair, or --kv-encryption differs "
                "between the pools)"
            )
        else:
            reason = "hung up"
        for rid in [rid for rid, pull in self._pulls.items() if address in _addresses(pull)]:
            self._fail(self._pulls.pop(rid), f"producer {address[0]}:{address[1]} {reason}")
        self._drop_peer(address)

    def _receive(self, sock: zmq.Socket) -> None:
        tag, *frames = sock.recv_multipart(copy=False)
        owner = self._waiting.pop(tag.bytes, None)
        if owner is None or owner[0] not in self._pulls:
            return  # a reply to a pull that already failed
        pull = self._pulls[owner[0]]
        pull.replies[owner[1]] = frames
        if len(pull.replies) == len(pull.sources):
            del self._pulls[owner[0]]
            self._complete(pull)

    def _complete(self, pull: _Pull) -> None:
        """Check and assemble the replies of a pull; keep it for `load`, or report why not."""
        spec = pull.spec
        try:
            pulled = self._assemble(pull)
        except ValueError as error:
            self._fail(pull, str(error))
            return
        num_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in pulled)
        with self._lock:
            self._in_flight.discard(spec.req_id)
            if spec.req_id in self._cancelled:
                self._cancelled.discard(spec.req_id)
                return
            self._ready[spec.req_id] = (spec.local_block_ids, pulled)
        self._report(pull, ok=True, num_bytes=num_bytes)

    def _assemble(self, pull: _Pull) -> KVCaches:
        k_local = self.kv_caches[0][0]
        n = len(pull.spec.local_block_ids)
        block_size, _, head_dim = self._block_shape
        shape = (n, block_size, self.local_heads, head_dim)  # standard, as on the wire
        out = [
            (torch.empty(shape, dtype=k_local.dtype), torch.empty(shape, dtype=k_local.dtype))
            for _ in self.kv_caches
        ]
        decoder = msgspec.msgpack.Decoder(KVReadReply)
        for index, source in enumerate(pull.sources):
            header, *frames = pull.replies[index]
            reply = decoder.decode(header.buffer)
            if not reply.ok:
                raise ValueError(f"producer rank {source.rank}: {reply.error}")
            heads = source.src_end - source.src_start
            want = [n, shape[1], heads, shape[3]]
            if reply.dtype != str(k_local.dtype) or reply.shape != want:
                raise ValueError(
                    f"producer sent {reply.dtype} {reply.shape}; this rank caches "
                    f"{k_local.dtype} {want} (different model, dtype or block size)"
                )
            if len(frames) != 2 * len(self.kv_caches):
                raise ValueError(f"producer sent {len(frames)} frames for {len(out)} layers")
            dst = slice(source.dst_start, source.dst_start + heads)
            for layer, (k, v) in enumerate(out):
                for target, frame in ((k, frames[2 * layer]), (v, frames[2 * layer + 1])):
                    part = torch.frombuffer(frame.buffer, dtype=torch.uint8)
                    target[:, :, dst] = part.view(k_local.dtype).view(want)
        return out

    def _fail(self, pull: _Pull, reason: str, drop_peers: bool = False) -> None:
        for tag in [t for t, (rid, _) in self._waiting.items() if rid == pull.spec.req_id]:
            del self._waiting[tag]
        if drop_peers:
            # Reads queued on a silent peer's socket would be answered late or never: the
            # next pull starts on a fresh connection.
            for address in _addresses(pull):
                self._drop_peer(address)
        with self._lock:
            self._in_flight.discard(pull.spec.req_id)
            self._cancelled.discard(pull.spec.req_id)
        self._report(pull, ok=False, error=reason)

    def _report(self, pull: _Pull, ok: bool, num_bytes: int = 0, error: str = "") -> None:
        if not ok:
            logger.warning(
                "KV pull of %s failed on rank %d: %s", pull.spec.req_id, self.rank, error
            )
        assert self._events is not None
        done = KVRecvDone(
            req_id=pull.spec.req_id,
            rank=self.rank,
            ok=ok,
            num_bytes=num_bytes,
            seconds=time.monotonic() - pull.started,
            error=error,
        )
        self._events.send(msgspec.msgpack.encode(done))

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._waker.wake(STOP)
        self._thread.join(timeout=5.0)
        self._waker.close()
        if not self._thread.is_alive():
            self._ctx.term()  # would wait forever on a thread that still holds sockets


def _addresses(pull: _Pull) -> set[tuple[str, int]]:
    """The producer ranks' addresses a pull reads from."""
    return {(pull.spec.host, pull.spec.data_ports[source.rank]) for source in pull.sources}
