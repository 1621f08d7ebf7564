"""The ZMQ transport's worker side on its own: a block server and a puller, real sockets."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from tidegate.engine.kv_transfer.zmq_worker import ZmqConnectorWorker
from tidegate.engine.messages import (
    KVConnectorMetadata,
    KVRecvDone,
    KVRecvSpec,
    KVWorkerConfig,
)

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 4, 2, 8


def caches(fill: bool, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (BLOCKS, BLOCK, HEADS, DIM)
    make = (
        (lambda: torch.randn(shape).to(dtype))
        if fill
        else (lambda: torch.zeros(shape, dtype=dtype))
    )
    return [(make(), make()) for _ in range(LAYERS)]


def worker(role: str, events_address: str, timeout_s: float = 5.0) -> ZmqConnectorWorker:
    config = KVWorkerConfig("zmq", role, 0, events_address, timeout_s)
    return ZmqConnectorWorker(
        config, rank=0, tp_size=1, num_kv_heads=HEADS, device=torch.device("cpu")
    )


def next_event(sock: zmq.Socket, timeout_s: float = 10.0) -> KVRecvDone:
    assert sock.poll(timeout_s * 1000), "no event from the puller"
    return msgspec.msgpack.decode(sock.recv(), type=KVRecvDone)


def spec(req_id: str, transfer_id: str, port: int, remote: list[int], local: list[int]):
    return KVRecvSpec(req_id, transfer_id, "127.0.0.1", [port], remote, local)


@pytest.fixture
def pair(events) -> Iterator[tuple[ZmqConnectorWorker, ZmqConnectorWorker, zmq.Socket]]:
    address, sock = events
    producer, consumer = worker("producer", address), worker("consumer", address)
    producer.register_kv_caches(caches(fill=True))
    consumer.register_kv_caches(caches(fill=False))
    yield producer, consumer, sock
    producer.shutdown()
    consumer.shutdown()


def test_a_read_that_overtakes_its_pin_waits_for_it(pair) -> None:
    producer, consumer, events = pair
    consumer.handle(KVConnectorMetadata(recv=[spec("r", "t", producer.data_port, [5, 2], [0, 7])]))
    assert not events.poll(200)  # no pin yet: the read waits instead of failing
    producer.update_pins({"t": [2, 5, 6]}, [])
    event = next_event(events)
    assert event.ok and event.req_id == "r"
    assert event.num_bytes == LAYERS * 2 * 2 * BLOCK * HEADS * DIM * 4
    consumer.handle(KVConnectorMetadata(load=["r"]))
    for (pk, pv), (ck, cv) in zip(producer.kv_caches, consumer.kv_caches, strict=True):
        assert torch.equal(ck[[0, 7]], pk[[5, 2]]) and torch.equal(cv[[0, 7]], pv[[5, 2]])
        assert not ck[1:7].any()  # nothing else was written


def test_released_transfers_and_foreign_blocks_are_refused(pair) -> None:
    producer, consumer, events = pair
    producer.update_pins({"t": [1, 2]}, [])
    producer.update_pins({}, ["t"])
    consumer.handle(KVConnectorMetadata(recv=[spec("a", "t", producer.data_port, [1], [1])]))
    event = next_event(events, timeout_s=2.0)  # refused at once, not after a wait
    assert not event.ok and "not pinned" in event.error
    producer.update_pins({"u": [1, 2]}, [])
    consumer.handle(KVConnectorMetadata(recv=[spec("b", "u", producer.data_port, [3], [1])]))
    event = next_event(events)
    assert not event.ok and "outside the pinned transfer" in event.error
    with pytest.raises(RuntimeError, match="not pulled"):
        consumer.handle(KVConnectorMetadata(load=["b"]))


def test_a_discarded_pull_leaves_nothing_behind(pair) -> None:
    producer, consumer, events = pair
    producer.update_pins({"t": [0, 1, 2, 3]}, [])
    consumer.handle(KVConnectorMetadata(recv=[spec("r", "t", producer.data_port, [0, 1], [4, 5])]))
    consumer.handle(KVConnectorMetadata(discard=["r"]))
    deadline = time.monotonic() + 10.0
    while consumer._in_flight:  # the read completes in the background and is dropped
        assert time.monotonic() < deadline, "the pull never completed"
        time.sleep(0.01)
    assert not consumer._ready and not consumer._cancelled
    assert not events.poll(100)  # the scheduler forgot it: nothing is reported
    assert not any(k.any() for k, _ in consumer.kv_caches)


def test_a_different_dtype_is_refused(events) -> None:
    address, sock = events
    producer, consumer = worker("producer", address), worker("consumer", address)
    try:
        producer.register_kv_caches(caches(fill=True, dtype=torch.bfloat16))
        consumer.register_kv_caches(caches(fill=False))
        producer.update_pins({"t": [0]}, [])
        consumer.handle(KVConnectorMetadata(recv=[spec("r", "t", producer.data_port, [0], [0])]))
        event = next_event(sock)
        assert not event.ok and "bfloat16" in event.error
    finally:
        producer.shutdown()
        consumer.shutdown()


@contextlib.contextmanager
def lone_consumer(events_address: str, timeout_s: float) -> Iterator[ZmqConnectorWorker]:
    """A consumer rank with an empty cache and no producer of its own."""
    consumer = worker("consumer", events_address, timeout_s=timeout_s)
    try:
        consumer.register_kv_caches(caches(fill=False))
        yield consumer
    finally:
        consumer.shutdown()


def test_a_silent_producer_times_out(events) -> None:
    address, sock = events
    with lone_consumer(address, timeout_s=0.3) as consumer:
        with socket_nobody_answers() as port:
            consumer.handle(KVConnectorMetadata(recv=[spec("r", "t", port, [0], [0])]))
            event = next_event(sock, timeout_s=3.0)
        assert not event.ok and "timed out" in event.error
        assert not consumer._in_flight


class socket_nobody_answers:
    """A TCP port that accepts connections (ZMQ's) and never replies."""

    def __enter__(self) -> int:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        return self.sock.bind_to_random_port("tcp://127.0.0.1")

    def __exit__(self, *exc: object) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_refused_connection_fails_the_pull_at_once(events) -> None:
    address, sock = events
    with lone_consumer(address, timeout_s=30.0) as consumer:
        with socket_nobody_answers() as port:
            pass  # closed again: nothing listens on the port now
        started = time.monotonic()
        consumer.handle(KVConnectorMetadata(recv=[spec("r", "t", port, [0], [0])]))
        event = next_event(sock, timeout_s=5.0)
        assert not event.ok and "refused" in event.error
        assert time.monotonic() - started < 5.0  # not the 30 s timeout
