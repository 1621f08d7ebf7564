"""The API server's KV-cache event publisher (`--kv-events-port`): a ZMQ XPUB socket.

Every engine core records how its prefix cache changes (engine/core/block_pool.py) and sends
the changes with each step's outputs. This publisher numbers them, sends each batch on the
live topic as a `KVEventsMessage`, and keeps a mirror of what every core holds.

A subscriber that subscribes to a topic of its own under REPLAY_TOPIC_PREFIX gets, on that
topic only, a `KVEventsSnapshot` of the mirror: every held block and the number of the last
message it includes (router/block_index.py has the subscriber's side). The XPUB socket is
what makes that possible: it hands the publisher every subscription message.

Heartbeats (a message with no events, repeating the last number) go out every HEARTBEAT_S
and whenever a subscriber (re)subscribes to the live topic. A subscriber that followed the
previous server on this port sees the new epoch in the first one and asks for a replay, so
a restarted instance's old blocks leave the index even if it never stores a block again.

The socket lives on a thread of its own; the event loop only puts batches on a queue, so
publishing never delays a token.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq

from tidegate.engine.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    HeldBlocks,
    KVEventsMessage,
    KVEventsSnapshot,
)

logger = logging.getLogger("tidegate.kv_events")

LIVE_TOPIC = b"kv"
REPLAY_TOPIC_PREFIX = b"replay."
# How often the publishing thread looks for new subscriptions while no event comes.
_POLL_S = 0.05
# An idle publisher still says where it stands this often (a message with no events and the
# last number): a subscriber learns of a restart, or of a lost last message, within this.
HEARTBEAT_S = 1.0
_STOP = object()


def replay_topic_of(subscription: bytes) -> bytes | None:
    """The private topic of an XPUB subscription message asking for a replay, if it is one."""
    if len(subscription) > 1 and subscription[0] == 1:
        topic = subscription[1:]
        if topic.startswith(REPLAY_TOPIC_PREFIX):
            return topic
    return None


@dataclass
class CoreCache:
    """What one engine core's prefix cache holds, as its events tell it.

    The publisher keeps one per core to answer replays; a router keeps one per core of every
    instance it follows (router/block_index.py). Both apply the same events the same way.
    """

    block_size: int = 0
    hashes: set[bytes] = field(default_factory=set)
    # The adapters blocks were stored under, name -> digest.
    loras: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_held(cls, held: HeldBlocks) -> CoreCache:
        return cls(held.block_size, set(held.block_hashes), dict(held.loras))

    def held(self) -> HeldBlocks:
        return HeldBlocks(self.block_size, list(self.hashes), dict(self.loras))

    def apply(self, events: list[CacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    # Hashes of another block size: none of the held ones can match anymore.
                    self.hashes.clear()
                    self.block_size = event.block_size
                self.hashes.update(event.block_hashes)
                if event.lora_name is not None and event.lora_digest is not None:
                    self.loras[event.lora_name] = event.lora_digest
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()


class KVEventPublisher:
    """Publishes every engine core's cache events on tcp://host:port, with replays."""

    def __init__(self, port: int, host: str = "*") -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Every subscription message, repeated ones too: a subscriber that asks again for a
        # replay on the same topic (after a reconnection) must get one.
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as error:
            self._socket.close()
            self._context.term()
            raise OSError(f"cannot publish KV events on port {port}: {error}") from None
        endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._queue: queue.SimpleQueue[tuple[int, list[CacheEvent]] | object] = queue.SimpleQueue()
        self._mirrors: dict[int, CoreCache] = {}
        self._seq = 0
        self._last_sent = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on port %d (epoch %s)", self.port, self.epoch)

    def publish(self, pool: int, events: list[CacheEvent]) -> None:
        """Queue one engine core's events; safe from any thread."""
        if events:
            self._queue.put((pool, events))

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5.0)
        self._context.term()

    # -- the publishing thread ----------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                with contextlib.suppress(queue.Empty):
                    item = self._queue.get(timeout=_POLL_S)
                    while True:
                        if item is _STOP:
                            return
                        pool, events = item  # type: ignore[misc]
                        self._send_live(encoder, pool, events)
                        item = self._queue.get_nowait()
                self._answer_subscriptions(encoder)
                if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._send_heartbeat(encoder)
        except Exception:
            logger.exception("the KV event publisher stopped")
        finally:
            self._socket.close(linger=0)

    def _send_live(self, encoder: msgspec.msgpack.Encoder, pool: int, events: list) -> None:
        self._mirrors.setdefault(pool, CoreCache()).apply(events)
        self._seq += 1
        message = KVEventsMessage(epoch=self.epoch, seq=self._seq, pool=pool, events=events)
        self._socket.send_multipart([LIVE_TOPIC, encoder.encode(message)], copy=False)
        self._last_sent = time.monotonic()
        # Subscriptions are answered between messages, so a snapshot's number is exact.
        self._answer_subscriptions(encoder)

    def _send_heartbeat(self, encoder: msgspec.msgpack.Encoder) -> None:
        message = KVEventsMessage(epoch=self.epoch, seq=self._seq, pool=-1, events=[])
        self._socket.send_multipart([LIVE_TOPIC, encoder.encode(message)], copy=False)
        self._last_sent = time.monotonic()

    def _answer_subscriptions(self, encoder: msgspec.msgpack.Encoder) -> None:
        while self._socket.poll(0, zmq.POLLIN):
            subscription = self._socket.recv()
            if subscription == b"\x01" + LIVE_TOPIC:
                self._send_heartbeat(encoder)  # tells a returning subscriber who we are
                continue
            topic = replay_topic_of(subscription)
            if topic is None:
                continue
            snapshot = KVEventsSnapshot(
                epoch=self.epoch,
                seq=self._seq,
                pools={index: mirror.held() for index, mirror in self._mirrors.items()},
            )
            self._socket.send_multipart([topic, encoder.encode(snapshot)], copy=False)
