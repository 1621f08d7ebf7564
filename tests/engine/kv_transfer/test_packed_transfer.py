"""KV transfer between caches in different layouts: blocks go on the wire in the standard
layout, so a producer that caches the cpu backend's packed layout serves consumers of either
layout, and a packed consumer takes blocks from a standard producer."""

from __future__ import annotations

import pytest
import torch

from tests.engine.kv_transfer.test_zmq_transport import next_event, spec
from tidegate.engine.attention.backend import STANDARD_KV_LAYOUT, KVLayout
from tidegate.engine.attention.cpu_attention import PACKED_KV_LAYOUT
from tidegate.engine.kv_transfer.zmq_worker import ZmqConnectorWorker
from tidegate.engine.messages import KVConnectorMetadata, KVWorkerConfig

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 6, 16, 4, 8
PACKED, STANDARD = PACKED_KV_LAYOUT, STANDARD_KV_LAYOUT
LAYOUTS = {"packed": PACKED, "standard": STANDARD}


def caches(
    layout: KVLayout, fill: bool, heads: int = HEADS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, random (or zero) keys and values, built standard and stored in `layout`."""
    shape = (BLOCKS, BLOCK, heads, DIM)
    make = torch.randn if fill else torch.zeros
    layers = [layout.from_standard(make(shape), make(shape)) for _ in range(LAYERS)]
    assert layers[0][0].shape == layout.shape(BLOCKS, BLOCK, heads, DIM)
    return layers


def worker(role: str, events_address: str, rank: int = 0, tp_size: int = 1):
    config = KVWorkerConfig("zmq", role, 0, events_address, 5.0)
    return ZmqConnectorWorker(
        config, rank=rank, tp_size=tp_size, num_kv_heads=HEADS, device=torch.device("cpu")
    )


def standard(layers, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [layout.to_standard(k, v) for k, v in layers]


@pytest.mark.parametrize(
    ("producer_layout", "consumer_layout"),
    [("packed", "standard"), ("packed", "packed"), ("standard", "packed")],
)
def test_blocks_arrive_whole_in_the_consumers_layout(
    events, producer_layout: str, consumer_layout: str
) -> None:
    address, sock = events
    p_layout, c_layout = LAYOUTS[producer_layout], LAYOUTS[consumer_layout]
    producer, consumer = worker("producer", address), worker("consumer", address)
    try:
        producer.register_kv_caches(caches(p_layout, fill=True), p_layout)
        consumer.register_kv_caches(caches(c_layout, fill=False), c_layout)
        producer.update_pins({"t": [1, 4, 5]}, [])
        read = spec("r", "t", producer.data_port, [5, 1], [0, 3])
        consumer.handle(KVConnectorMetadata(recv=[read]))
        event = next_event(sock)
        assert event.ok, event.error
        assert event.num_bytes == LAYERS * 2 * 2 * BLOCK * HEADS * DIM * 4
        consumer.handle(KVConnectorMetadata(load=["r"]))

        held = standard(producer.kv_caches, p_layout)
        got = standard(consumer.kv_caches, c_layout)
        for (pk, pv), (ck, cv) in zip(held, got, strict=True):
            assert torch.equal(ck[[0, 3]], pk[[5, 1]]) and torch.equal(cv[[0, 3]], pv[[5, 1]])
            assert not ck[[1, 2, 4, 5]].any() and not cv[[1, 2, 4, 5]].any()
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("consumer_layout", ["packed", "standard"])
def test_a_consumer_rank_takes_its_share_of_heads_from_packed_blocks(
    events, consumer_layout: str
) -> None:
    # One producer rank caches all 4 heads, packed; consumer rank 1 of 2 caches heads 2-3.
    address, sock = events
    c_layout = LAYOUTS[consumer_layout]
    producer = worker("producer", address)
    consumer = worker("consumer", address, rank=1, tp_size=2)
    try:
        producer.register_kv_caches(caches(PACKED, fill=True), PACKED)
        consumer.register_kv_caches(caches(c_layout, fill=False, heads=HEADS // 2), c_layout)
        producer.update_pins({"t": [2, 3]}, [])
        consumer.handle(KVConnectorMetadata(recv=[spec("r", "t", producer.data_port, [3], [4])]))
        event = next_event(sock)
        assert event.ok, event.error
        consumer.handle(KVConnectorMetadata(load=["r"]))

        held = standard(producer.kv_caches, PACKED)
        got = standard(consumer.kv_caches, c_layout)
        for (pk, pv), (ck, cv) in zip(held, got, strict=True):
            assert torch.equal(ck[4], pk[3, :, 2:]) and torch.equal(cv[4], pv[3, :, 2:])
            assert not ck[[0, 1, 2, 3, 5]].any() and not cv[[0, 1, 2, 3, 5]].any()
    finally:
        producer.shutdown()
        consumer.shutdown()
