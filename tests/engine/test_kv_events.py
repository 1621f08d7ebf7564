"""KV-cache events: the block pool's log, the publisher's replay, the router's index follows.

The property that matters: after any sequence of allocations, frees, evictions and resets,
a subscriber's view (replay plus live messages) equals the pool's prefix-cache map exactly.
"""

from __future__ import annotations

import asyncio
import random
import time

from tests.engine.test_kv_cache_manager import make_request, prefill
from tidegate.engine.core.block_hash import append_block_hashes
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request
from tidegate.engine.kv_events import KVEventPublisher, replay_topic_of
from tidegate.engine.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HeldBlocks,
    KVEventsMessage,
    KVEventsSnapshot,
    LoRARequest,
)
from tidegate.engine.router.block_index import BlockIndex, HeldByInstance, _Follower
from tidegate.engine.router.routing import Route
from tidegate.engine.sampling_params import SamplingParams

URL = "http://127.0.0.1:8000"


def replay_events(events):
    """What a subscriber holds after these events, from nothing."""
    held: dict[bytes, None] = {}
    for event in events:
        if isinstance(event, BlockStored):
            held.update(dict.fromkeys(event.block_hashes))
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                del held[block_hash]  # only what was stored is ever removed
        elif isinstance(event, AllBlocksCleared):
            held.clear()
    return set(held)


def test_events_track_the_prefix_cache_map_through_evictions_and_resets():
    rng = random.Random(7)
    manager = KVCacheManager(num_blocks=12, block_size=4, record_events=True)
    events = []
    live = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    for step in range(300):
        if live and (rng.random() < 0.5 or manager.num_free_blocks < 5):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(9))]
            request = make_request(tokens, rid=f"r{step}")
            prefill(manager, request)
            live.append(request)
        if step % 97 == 96:
            for request in live:
                manager.free(request)
            live.clear()
            assert manager.reset_prefix_cache()
        events.extend(manager.block_pool.events.take())
        assert replay_events(events) == set(manager.block_pool.cached_block_hash_to_block)
    assert any(isinstance(e, BlockRemoved) for e in events), "the test must evict"


def test_stored_events_chain_and_name_the_adapter():
    manager = KVCacheManager(num_blocks=8, block_size=4, record_events=True)
    lora = LoRARequest(name="sql", lora_id=1, path="/a", digest="d" * 64)
    request = Request("a", list(range(10)), SamplingParams(), lora_request=lora)
    prefill(manager, request)
    (stored,) = manager.block_pool.events.take()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == request.block_hashes[:2]
    assert stored.parent_hash is None
    assert (stored.block_size, stored.lora_name, stored.lora_digest) == (4, "sql", "d" * 64)


def test_no_log_without_the_flag():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prefill(manager, make_request(range(10)))
    assert manager.block_pool.events is None


def test_replay_topic_is_read_from_subscription_messages_only():
    assert replay_topic_of(b"\x01replay.abc") == b"replay.abc"
    assert replay_topic_of(b"\x00replay.abc") is None  # an unsubscription
    assert replay_topic_of(b"\x01kv") is None


def hashes_of(tokens, block_size=4, salt=None, digest=None):
    out: list[bytes] = []
    append_block_hashes(out, tokens, block_size, salt, digest)
    return out


def test_cached_tokens_follow_the_engines_hashing_salt_and_adapter():
    held = HeldByInstance()
    tokens = list(range(20))
    held.replace(
        KVEventsSnapshot(
            "e",
            0,
            {
                0: HeldBlocks(4, hashes_of(tokens)[:3]),
                1: HeldBlocks(4, hashes_of(tokens, digest="x" * 64), {"sql": "x" * 64}),
            },
        )
    )
    assert held.cached_tokens(Route("k", token_ids=tokens)) == 12
    # Another tenant's salt shares nothing; the adapter's digest is learnt from the events.
    assert held.cached_tokens(Route("k", token_ids=tokens, cache_salt="t")) == 0
    assert held.cached_tokens(Route("k", model="sql", token_ids=tokens)) == 19  # never the last
    assert held.cached_tokens(Route("k", token_ids=None)) == 0


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


def test_subscriber_syncs_by_replay_follows_live_and_forgets_a_restarted_instance():
    tokens = list(range(64))
    hashes = hashes_of(tokens, block_size=16)
    route = Route("k", token_ids=tokens)

    async def scenario():
        publisher = KVEventPublisher(0, host="127.0.0.1")
        index = BlockIndex(publisher.port)  # the instance names no port: the default
        try:
            publisher.publish(0, [BlockStored(hashes[:2], None, 16)])
            await asyncio.sleep(0.1)  # published before anyone listens: only a replay has it
            index.track({URL: None})
            await wait_for(lambda: index.cached_tokens(URL, route) == 32)
            publisher.publish(0, [BlockStored(hashes[2:], hashes[1], 16)])
            await wait_for(lambda: index.cached_tokens(URL, route) == 63)
            publisher.publish(0, [BlockRemoved([hashes[1]])])
            await wait_for(lambda: index.cached_tokens(URL, route) == 16)
            # A second core of the same server holds more of it.
            publisher.publish(1, [BlockStored(hashes[:3], None, 16)])
            await wait_for(lambda: index.cached_tokens(URL, route) == 48)
            port = publisher.port
            publisher.close()
            # The instance restarts on the same port with an empty cache: its first
            # heartbeat carries a new epoch, and the replay empties the index.
            publisher = KVEventPublisher(port, host="127.0.0.1")
            await wait_for(lambda: index.cached_tokens(URL, route) == 0)
            publisher.publish(0, [BlockStored(hashes[:1], None, 16)])
            await wait_for(lambda: index.cached_tokens(URL, route) == 16)
            # Forgetting an instance stops its subscription and drops what it held.
            index.track({})
            assert index.cached_tokens(URL, route) == 0
        finally:
            await index.close()
            publisher.close()

    asyncio.run(scenario())


class FakeSocket:
    def __init__(self):
        self.topics: set[bytes] = set()

    def subscribe(self, topic):
        self.topics.add(topic)

    def unsubscribe(self, topic):
        self.topics.discard(topic)


def test_follower_buffers_until_the_replay_and_asks_again_on_a_gap_or_a_new_epoch():
    hashes = hashes_of(list(range(32)), block_size=16)
    route = Route("k", token_ids=list(range(32)))
    held = HeldByInstance()
    socket = FakeSocket()
    follower = _Follower(held, socket, URL)  # type: ignore[arg-type]
    follower.ask_replay()
    first_topic = follower.replay_topic
    assert first_topic in socket.topics

    # Live messages before the replay wait for it; those it covers are dropped.
    follower.on_live(KVEventsMessage("e1", 1, 0, [BlockStored(hashes[:1], None, 16)]))
    follower.on_live(KVEventsMessage("e1", 2, 0, [BlockStored(hashes[1:], hashes[0], 16)]))
    assert not held.synced
    follower.on_snapshot(KVEventsSnapshot("e1", 1, {0: HeldBlocks(16, hashes[:1])}))
    assert held.synced and first_topic not in socket.topics
    assert held.cached_tokens(route) == 31 and follower.seq == 2

    # A skipped number: the view may be wrong, so a new replay is asked for.
    follower.on_live(KVEventsMessage("e1", 4, 0, [BlockRemoved(hashes[1:])]))
    assert follower.replay_topic is not None and follower.replay_topic != first_topic
    follower.on_snapshot(KVEventsSnapshot("e1", 4, {0: HeldBlocks(16, hashes[:1])}))
    assert held.cached_tokens(route) == 16 and follower.replay_topic is None

    # Heartbeats: the same place is fine; another epoch (a restart) asks for a replay.
    follower.on_live(KVEventsMessage("e1", 4, -1, []))
    assert follower.replay_topic is None
    follower.on_live(KVEventsMessage("e2", 0, -1, []))
    assert follower.replay_topic is not None
    follower.on_snapshot(KVEventsSnapshot("e2", 0, {}))
    assert held.cached_tokens(route) == 0 and follower.epoch == "e2"
