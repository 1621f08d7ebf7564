"""Block hashes, the free queue and the block pool: the parts of prefix caching below requests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tidegate.engine.core.block_hash import extend_block_hashes, hash_block_tokens
from tidegate.engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tidegate.engine.core.request import Request
from tidegate.engine.sampling_params import SamplingParams

# Pinned so that a change of the byte layout is a deliberate, visible act: routers and
# prefill/decode peers of different builds compare these values.
GOLDEN_FIRST = "9e38294338979d6d4e9b30cf3497d4be4c028866c152baf40faeb7e632ab8486"
GOLDEN_SECOND = "ea56686642b68babb4939863b640a259c5c2cd1462176eb48c748b0b23ea6283"


def make_request(tokens, salt=None, rid="r"):
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def ids(blocks):
    return [block.block_id for block in blocks]


# --- block hashes -------------------------------------------------------------------------


def test_hash_is_pinned_and_chained():
    first = hash_block_tokens(None, [1, 2, 3, 4], ("tenant-a",))
    second = hash_block_tokens(first, [5, 6, 7, 8], None)
    assert (first.hex(), second.hex()) == (GOLDEN_FIRST, GOLDEN_SECOND)
    # The same tokens under another parent are another block.
    assert hash_block_tokens(None, [5, 6, 7, 8], None) != second
    assert hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]) != second


def test_hash_is_identical_in_another_process():
    code = (
        "from tidegate.engine.core.block_hash import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4], ('tenant-a',)), [5, 6, 7, 8], None).hex())"
    )
    # A different PYTHONHASHSEED would change any value derived from Python's hash().
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GOLDEN_SECOND


def test_hash_distinguishes_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    variants = [
        hash_block_tokens(None, [4, 3, 2, 1]),
        hash_block_tokens(None, [1, 2, 3, 4], ()),
        hash_block_tokens(None, [1, 2, 3, 4], ("",)),
        hash_block_tokens(None, [1, 2, 3, 4], ("a",)),
        hash_block_tokens(None, [1, 2, 3, 4], (1,)),
        hash_block_tokens(None, [1, 2, 3, 4], ("1",)),
        hash_block_tokens(None, [1, 2, 3, 4], ("a", "b")),
        hash_block_tokens(None, [1, 2, 3, 4], ("ab",)),
    ]
    assert len({base, *variants}) == len(variants) + 1
    with pytest.raises(TypeError, match="not supported"):
        hash_block_tokens(None, [1], (1.5,))


def test_extend_block_hashes_is_incremental_and_skips_partial_blocks():
    request = make_request(range(10))
    extend_block_hashes(request, block_size=4)
    assert len(request.block_hashes) == 2  # tokens 8 and 9 do not fill a block
    first_two = list(request.block_hashes)
    for token in (10, 11):
        request.append_output_token(token)
    extend_block_hashes(request, block_size=4)
    assert request.block_hashes[:2] == first_two
    fresh = make_request(range(12))
    extend_block_hashes(fresh, block_size=4)
    assert request.block_hashes == fresh.block_hashes


def test_cache_salt_isolates_every_block():
    chains = []
    for salt in (None, "tenant-a", "tenant-b"):
        request = make_request(range(12), salt=salt)
        extend_block_hashes(request, block_size=4)
        chains.append(request.block_hashes)
    for i in range(3):
        assert len({chain[i] for chain in chains}) == 3


# --- free queue ---------------------------------------------------------------------------


def test_free_queue_order_and_constant_time_edits():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    queue.remove(blocks[3])  # middle
    queue.remove(blocks[0])  # head
    queue.remove(blocks[5])  # tail
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4]
    assert queue.num_free_blocks == 3
    assert queue.popleft() is blocks[1]
    queue.append(blocks[0])
    queue.append_n([blocks[5], blocks[3]])
    assert ids(queue.get_all_free_blocks()) == [2, 4, 0, 5, 3]
    assert ids(queue.popleft_n(2)) == [2, 4]
    assert queue.num_free_blocks == 3
    with pytest.raises(ValueError, match="asked for 4"):
        queue.popleft_n(4)
    assert queue.num_free_blocks == 3
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    assert ids(queue.popleft_n(3)) == [0, 5, 3]
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()


# --- block pool ---------------------------------------------------------------------------


def cache_chain(pool, tokens, block_size=2):
    """Allocate and cache one request's full blocks; return the request and its blocks."""
    request = make_request(tokens)
    extend_block_hashes(request, block_size)
    blocks = pool.get_new_blocks(len(request.block_hashes))
    pool.cache_full_blocks(request, blocks, 0, len(blocks))
    return request, blocks


def test_get_new_blocks_refuses_more_than_free_and_changes_nothing():
    pool = BlockPool(4)
    taken = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in taken] == [1, 1, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_lru_eviction_least_recently_freed_first_and_drops_hash():
    pool = BlockPool(4)
    req_a, blocks_a = cache_chain(pool, [1, 2, 3, 4])  # blocks 0, 1
    req_b, blocks_b = cache_chain(pool, [5, 6, 7, 8])  # blocks 2, 3
    pool.free_blocks(reversed(blocks_b))  # B finishes first: 3 then 2
    pool.free_blocks(reversed(blocks_a))  # then A: 1 then 0
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 0]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 3 and evicted.block_hash is None
    assert pool.get_cached_block(req_b.block_hashes[1]) is None  # B's chain tail is gone
    assert pool.get_cached_block(req_b.block_hashes[0]) is blocks_b[0]
    assert pool.get_cached_block(req_a.block_hashes[1]) is blocks_a[1]


def test_touch_revives_a_freed_cached_block():
    pool = BlockPool(4)
    request, blocks = cache_chain(pool, [1, 2, 3, 4])
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(request.block_hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit not in pool.free_block_queue.get_all_free_blocks()
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    # Allocating every other block never hands out the revived one.
    assert hit not in pool.get_new_blocks(3)


def test_peak_usage_keeps_the_high_water_mark_through_frees_and_revivals():
    pool = BlockPool(8)
    assert pool.peak_usage == 0.0
    request, blocks = cache_chain(pool, [1, 2, 3, 4])  # 2 blocks
    other = pool.get_new_blocks(3)  # 5 held
    pool.free_blocks(other)
    pool.free_blocks(reversed(blocks))
    assert pool.usage == 0.0 and pool.peak_usage == pytest.approx(5 / 8)
    # A revived cached block counts as held again: 1 revived + 5 new = 6.
    pool.touch([pool.get_cached_block(request.block_hashes[0])])
    assert pool.peak_usage == pytest.approx(5 / 8)
    pool.get_new_blocks(5)
    assert pool.usage == pool.peak_usage == pytest.approx(6 / 8)
    # A refused allocation changes nothing, the mark included.
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.peak_usage == pytest.approx(6 / 8)


def test_duplicate_content_keeps_the_first_block_cached():
    pool = BlockPool(4)
    request, first = cache_chain(pool, [1, 2])
    second = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, second, 0, 1)
    assert second[0].block_hash is None
    assert pool.get_cached_block(request.block_hashes[0]) is first[0]


def test_free_below_zero_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([block])


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(4)
    request, blocks = cache_chain(pool, [1, 2, 3, 4])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert all(block.block_hash is None for block in pool.blocks)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    _, blocks = cache_chain(pool, [1, 2, 3, 4])
    assert pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in blocks)
