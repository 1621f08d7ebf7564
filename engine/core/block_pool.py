"""The pool of KV cache blocks: reference counts, an LRU free queue and the prefix-cache map.

Every block id in `range(num_blocks)` is usable; none is reserved as a null block, because
the model runner pads with slot -1. A block with ref_cnt 0 sits in the free queue but keeps
its hash (and its KV) until it is handed out again, so a later request can revive it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tidegate.engine.messages import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

if TYPE_CHECKING:
    from tidegate.engine.core.request import Request


class KVCacheBlock:
    """One block of KV slots: its id, how many requests hold it, its hash once full."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first; every operation O(1)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Sentinels spare every operation the empty-list and end-of-list special cases.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV cache block left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the n least recently freed blocks, oldest first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free KV cache blocks; {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (it is being revived or handed out)."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail: it becomes the most recently freed, the last to evict."""
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks from the front (next to evict) to the tail; O(n), for tests."""
        blocks = []
        block = self._head.next_free
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class CacheEventLog:
    """The prefix cache's changes since they were last taken (for --kv-events-port).

    A block is held, for a router, from the moment its hash enters the cache map until it is
    evicted or the cache is reset: a free block with ref_cnt 0 can still be revived.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[CacheEvent] = []

    def stored(self, hashes: list[bytes], parent: bytes | None, request: Request) -> None:
        lora = request.lora_request
        self._events.append(
            BlockStored(
                hashes,
                parent,
                self.block_size,
                lora.name if lora is not None else None,
                lora.digest if lora is not None else None,
            )
        )

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)  # one event per run of evictions
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before no longer matters

    def take(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events


class BlockPool:
    """All KV blocks, which are free (LRU order) and which hold a known prefix."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: CacheEventLog | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks is {num_blocks}; the KV cache needs at least 1 block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One block per hash. Only full blocks are hashed, so every block found here is
        # complete and read-only; a block with ref_cnt 0 stays here until it is evicted.
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.events = events
        # The most blocks requests held at once since the pool was made. A gauge scraped
        # every few seconds misses a short burst; this high-water mark does not.
        self.peak_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including cached ones that may still be revived."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, from 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def peak_usage(self) -> float:
        """The highest usage since the pool was made, from 0.0 to 1.0."""
        return self.peak_used_blocks / self.num_blocks

    def _note_used(self) -> None:
        used = self.num_blocks - self.free_block_queue.num_free_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding this hash's content, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Hand out n free blocks with ref_cnt 1, evicting the least recently freed content."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        self._note_used()
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, reviving those that were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
        self._note_used()

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under the request's hashes."""
        if not self.enable_caching:
            return
        stored: list[bytes] = []
        first = -1
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], request.block_hashes[i]
            if block.block_hash is not None:
                # Already registered, e.g. a revived prefix block; its hash is this one.
                continue
            # Two requests may compute the same content at once (both missed the cache).
            # The first copy keeps the mapping; this one stays unhashed and private to its
            # request, so the map stays one-to-one and the duplicate is reused on free.
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                stored.append(block_hash)
                first = i if first < 0 else first
        if stored and self.events is not None:
            parent = request.block_hashes[first - 1] if first > 0 else None
            self.events.stored(stored, parent, request)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each; blocks reaching 0 join the free queue in this order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a reused block's old content from the prefix cache."""
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
