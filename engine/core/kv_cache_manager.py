"""Which KV blocks each request owns, and reuse of cached prefixes across requests.

The scheduler drives it in three calls: `get_computed_blocks` when a request is first
scheduled (prefix-cache lookup, no side effects but statistics), `allocate_slots` before
every step of the request (all or nothing), and `free` when it finishes, aborts or is
preempted.

Blocks are registered in the prefix cache as soon as they are allocated for the tokens that
fill them, before the step that writes their KV runs. That is safe as long as the scheduler does not
free a request between allocating its slots and executing that step; a request that hits
such a block in the same step reads it in the same forward pass, in which every layer writes
its KV before attending.
"""

from __future__ import annotations

from collections import Counter

from tidegate.engine.core.block_hash import extend_block_hashes
from tidegate.engine.core.block_pool import BlockPool, CacheEventLog, KVCacheBlock
from tidegate.engine.core.request import Request


class KVCacheManager:
    """Allocates KV blocks to requests and finds their longest cached prefix."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size is {block_size}; it must be at least 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        events = CacheEventLog(block_size) if record_events else None
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Blocks of finished requests kept for a KV transfer (producer pins), by transfer id.
        self.detached: dict[str, list[KVCacheBlock]] = {}
        # Token units, as vLLM counts them: hits / queries is the token hit rate.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """All blocks of the pool."""
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, from 0.0 to 1.0."""
        return self.block_pool.usage

    @property
    def peak_usage(self) -> float:
        """The highest usage since the cache was made, from 0.0 to 1.0."""
        return self.block_pool.peak_usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached leading blocks of a new request, and the tokens they cover."""
        if not self.enable_caching:
            return [], 0
        extend_block_hashes(request, self.block_size)
        params = request.sampling_params
        if params.prompt_logprobs is not None or params.pooling == "mean":
            # Its prompt's logprobs, or the mean of its hidden states, come from computing every
            # prompt token: a hit would skip some.
            return [], 0
        # Stop one token short of the whole prompt: the last token must be computed so the
        # step yields logits to sample from.
        max_blocks = max(request.num_tokens - 1, 0) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_computed_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for its next tokens; None (and no change) if none are left.

        An empty list is success: the request already owns enough blocks. `cache=False` leaves
        the new blocks out of the prefix cache until `cache_blocks` (their KV comes from a
        producer and is not there yet).
        """
        rid = request.request_id
        computed = new_computed_blocks or []
        held = self.req_to_blocks.get(rid, [])
        if computed and held:
            raise ValueError(f"request {rid} already holds blocks; prefix hits are for new ones")
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if not computed and num_tokens <= len(held) * self.block_size:
            # The common decode step: room in the last block and, unless it just filled up,
            # nothing new to hash. Kept cheap because it runs once per request per step.
            num_full = self._num_full_blocks(request, num_tokens)
            if not self.enable_caching or num_full <= self.num_cached_blocks.get(rid, 0):
                return []
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(num_required - len(held) - len(computed), 0)
        # A hit block with ref_cnt 0 sits in the free queue; touching it takes it out, so it
        # cannot also be handed out as a new block.
        num_revived = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_revived:
            return None

        self.block_pool.touch(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(rid, [])
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if not cache:
            self.num_cached_blocks[rid] = self.num_cached_blocks.get(rid, len(computed))
        elif self.enable_caching:
            self._cache_blocks(request, blocks, num_tokens, len(computed))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once num_tokens have KV."""
        if self.enable_caching:
            blocks = self.req_to_blocks[request.request_id]
            self._cache_blocks(request, blocks, num_tokens, 0)

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def detach(self, request: Request, key: str) -> list[int]:
        """Keep a finishing request's blocks under `key` (a KV transfer); their ids."""
        if key in self.detached:
            raise ValueError(f"blocks are already kept under {key!r}")
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.detached[key] = blocks
        return [block.block_id for block in blocks]

    def free_detached(self, key: str) -> int:
        """Release blocks kept by `detach`; how many (0 if nothing is kept under key)."""
        blocks = self.detached.pop(key, [])
        self.block_pool.free_blocks(reversed(blocks))
        return len(blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and forget it; unknown requests are a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a prefix chain is evicted before its start, which more
            # requests share.
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Ids of the blocks the request owns, in token order."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def _num_full_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks full once num_tokens are computed; only known tokens count (they get hashed)."""
        return min(num_tokens, request.num_tokens) // self.block_size

    def _cache_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int, num_hit: int
    ) -> None:
        """Register every block that is full once the request's first num_tokens are computed."""
        extend_block_hashes(request, self.block_size)
        num_full = self._num_full_blocks(request, num_tokens)
        # Prefix hits came from the cache, so they are registered already.
        num_cached = self.num_cached_blocks.get(request.request_id, num_hit)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
            num_cached = num_full
        self.num_cached_blocks[request.request_id] = num_cached

    def check_invariants(self) -> None:
        """Raise AssertionError if reference counts, the free queue or the hash map disagree."""
        pool = self.block_pool
        holders: Counter[int] = Counter()
        for blocks in self.detached.values():
            holders.update(block.block_id for block in blocks)
        for rid, blocks in self.req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
            num_cached = self.num_cached_blocks.get(rid, 0)
            assert num_cached <= len(blocks), f"request {rid}: {num_cached} cached > held"
            holders.update(ids)
            for i, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert i < num_cached, f"request {rid} block {i} hashed but not full"

        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = [block.block_id for block in free]
        assert len(set(free_ids)) == len(free_ids), f"free queue repeats a block: {free_ids}"
        assert len(free) == pool.num_free_blocks, "free queue length disagrees with its count"
        for block in pool.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative reference count"
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} requests"
            )
            in_queue = block.prev_free is not None
            assert in_queue == (block.ref_cnt == 0), f"{block} free-queue membership is wrong"
            if block.ref_cnt > 1:
                # Shared blocks are read-only: only full, cached blocks may be shared.
                assert block.block_hash is not None, f"{block} is shared but not cached"
            if block.block_hash is not None:
                assert pool.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{block} has a hash the cache does not map to it"
                )
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"cache maps a hash to {block}"
        assert self.enable_caching or not pool.cached_block_hash_to_block
