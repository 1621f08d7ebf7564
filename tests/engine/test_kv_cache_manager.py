"""KV cache manager: prefix hits, revival, eviction order, all-or-nothing allocation, no leaks."""

from __future__ import annotations

import random

import pytest

from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request
from tidegate.engine.sampling_params import SamplingParams


def make_request(tokens, rid="r", salt=None):
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def prefill(manager, request):
    """Schedule a new request's whole prompt in one step, as the scheduler would."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return hits, num_hit


def snapshot(manager):
    """Everything allocation may change, as comparable plain values."""
    pool = manager.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks},
        dict(manager.num_cached_blocks),
    )


def test_second_request_revives_the_freed_prefix_with_the_same_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request(range(14), rid="a")
    prefill(manager, first)
    first_ids = manager.get_block_ids("a")
    manager.free(first)
    assert manager.num_free_blocks == 16

    second = make_request(range(14), rid="b")
    hits, num_hit = prefill(manager, second)
    assert num_hit == 12
    assert [b.block_id for b in hits] == first_ids[:3]
    assert manager.get_block_ids("b")[:3] == first_ids[:3]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (28, 12)


def test_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    prefill(manager, make_request(range(16), rid="a"))  # exactly 4 full blocks, all cached
    second = make_request(range(16), rid="b")
    hits, num_hit = manager.get_computed_blocks(second)
    assert (len(hits), num_hit) == (3, 12)
    new = manager.allocate_slots(second, 4, hits, num_hit)
    assert len(new) == 1 and new[0].block_id not in manager.get_block_ids("a")
    manager.check_invariants()
    # A one-token prompt can never hit.
    assert manager.get_computed_blocks(make_request([0], rid="c")) == ([], 0)


def test_live_requests_share_prefix_blocks_read_only():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first, second = make_request(range(10), rid="a"), make_request(range(10), rid="b")
    prefill(manager, first)
    prefill(manager, second)
    shared = manager.req_to_blocks["a"][:2]
    assert manager.req_to_blocks["b"][:2] == shared
    assert [b.ref_cnt for b in shared] == [2, 2]
    # The partial third block is private to each request.
    assert manager.get_block_ids("a")[2] != manager.get_block_ids("b")[2]
    manager.free(first)
    assert [b.ref_cnt for b in shared] == [1, 1]
    manager.check_invariants()


def test_chain_tail_is_evicted_before_its_head():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    first = make_request(range(8), rid="a")
    prefill(manager, first)
    chain = manager.get_block_ids("a")
    manager.free(first)
    other = make_request([100, 101], rid="x")
    prefill(manager, other)
    assert manager.get_block_ids("x") == [chain[-1]]

    again = make_request([*range(8), 8], rid="b")
    hits, num_hit = manager.get_computed_blocks(again)
    assert [b.block_id for b in hits] == chain[:3] and num_hit == 6


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    first = make_request(range(16), rid="a")
    prefill(manager, first)
    manager.free(first)  # 4 cached blocks now sit in the free queue with ref_cnt 0

    # Needs 7 blocks: 4 hits, 3 new; of 6 free blocks only 2 remain once the hits are taken.
    second = make_request(range(28), rid="b")
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 16
    before = snapshot(manager)
    assert manager.allocate_slots(second, 12, hits, num_hit) is None
    assert snapshot(manager) == before
    manager.check_invariants()

    # A running request that cannot grow keeps exactly what it had.
    third = make_request(range(20), rid="c")
    prefill(manager, third)
    before = snapshot(manager)
    assert manager.allocate_slots(third, 8) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(third, 0) == []


def test_generated_tokens_are_cached_once_their_block_is_full():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = make_request(range(6), rid="a")
    prefill(manager, request)
    for token in (6, 7):  # decode: sample a token, then compute it
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    manager.check_invariants()
    follower = make_request(range(9), rid="b")
    assert manager.get_computed_blocks(follower)[1] == 8


def test_slots_beyond_known_tokens_are_allocated_but_not_cached():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = make_request(range(6), rid="a")
    assert len(manager.allocate_slots(request, 14)) == 4  # room for 8 tokens not sampled yet
    assert manager.num_cached_blocks["a"] == 1
    cached = [b.block_hash is not None for b in manager.req_to_blocks["a"]]
    assert cached == [True, False, False, False]
    manager.check_invariants()


def test_preempted_request_recomputes_from_its_own_cached_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = make_request(range(7), rid="a")
    prefill(manager, request)
    request.append_output_token(7)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    request.append_output_token(8)
    ids_before = manager.get_block_ids("a")

    manager.free(request)  # preemption by recompute
    request.num_computed_tokens = 0
    manager.check_invariants()
    hits, num_hit = prefill(manager, request)
    assert num_hit == 8 and [b.block_id for b in hits] == ids_before[:2]


def test_cache_salt_isolates_tenants():
    manager = KVCacheManager(num_blocks=32, block_size=4)
    prefill(manager, make_request(range(12), rid="a1", salt="tenant-a"))
    assert prefill(manager, make_request(range(12), rid="b", salt="tenant-b"))[1] == 0
    assert prefill(manager, make_request(range(12), rid="n"))[1] == 0
    assert prefill(manager, make_request(range(12), rid="a2", salt="tenant-a"))[1] == 8


def test_caching_disabled_never_hits_and_counts_nothing():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    request = make_request(range(12), rid="a")
    prefill(manager, request)
    manager.free(request)
    assert prefill(manager, make_request(range(12), rid="b")) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


def test_accounting_and_unknown_requests():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request(range(9), rid="a")
    prefill(manager, request)
    assert (manager.num_total_blocks, manager.num_free_blocks) == (8, 5)
    assert manager.usage == pytest.approx(3 / 8)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    manager.free(request)  # idempotent
    manager.free(make_request([1], rid="never-seen"))
    assert manager.get_block_ids("never-seen") == []
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request(range(9), rid="b")) == ([], 0)
    manager.check_invariants()


def test_check_invariants_catches_corruption():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prefill(manager, make_request(range(9), rid="a"))
    block = manager.req_to_blocks["a"][2]
    block.ref_cnt += 1  # a reference nobody holds: a leak
    with pytest.raises(AssertionError, match="held by 1 requests"):
        manager.check_invariants()
    block.ref_cnt -= 1
    manager.req_to_blocks["b"] = [block]  # two requests writing one partial block
    block.ref_cnt += 1
    with pytest.raises(AssertionError, match="shared but not cached"):
        manager.check_invariants()


# --- random workload ----------------------------------------------------------------------


class Workload:
    """A seeded random scheduler driving the manager, with a fake KV store to check content.

    Each slot of the fake store records the salt and the whole token prefix that produced
    it, so a prefix hit on wrong or stale content fails the test.
    """

    def __init__(self, seed: int, num_blocks: int = 16, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.manager = KVCacheManager(num_blocks, block_size)
        self.kv: dict[int, list] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.prefixes = [[self.rng.randrange(50) for _ in range(16)] for _ in range(3)]
        self.num_requests = self.num_failed = self.num_evicted = 0

    def add(self) -> None:
        prefix = self.rng.choice(self.prefixes)[: self.rng.randint(0, 16)]
        suffix = [self.rng.randrange(50) for _ in range(self.rng.randint(1, 10))]
        salt = self.rng.choice([None, None, "a", "b"])
        self.num_requests += 1
        request = make_request(prefix + suffix, rid=f"r{self.num_requests}", salt=salt)
        request.sampling_params.max_tokens = self.rng.randint(1, 8)
        self.waiting.append(request)

    def schedule_waiting(self) -> None:
        request = self.waiting[0]
        hits, num_hit = self.manager.get_computed_blocks(request)
        for i, block in enumerate(hits):
            for j in range(self.bs):
                assert self.kv[block.block_id][j] == self.expected(request, i * self.bs + j)
        num_new = self.rng.randint(1, request.num_tokens - num_hit)
        if self.advance(request, num_new, hits, num_hit):
            self.running.append(self.waiting.pop(0))
            self.sample(request)

    def step_running(self) -> None:
        request = self.rng.choice(self.running)
        num_new = self.rng.randint(1, request.num_tokens - request.num_computed_tokens)
        if self.advance(request, num_new):
            self.sample(request)
        else:
            self.preempt(request)

    def sample(self, request) -> None:
        if request.num_computed_tokens < request.num_tokens:
            return  # mid-prefill: no logits yet
        if request.num_output_tokens >= request.max_tokens:
            self.running.remove(request)
            self.manager.free(request)
        else:  # deterministic "sampling", so equal prompts generate equal tokens
            request.append_output_token(sum(request.all_token_ids[-3:]) % 50)

    def advance(self, request, num_new, hits=None, num_hit=0) -> bool:
        before = snapshot(self.manager)
        new = self.manager.allocate_slots(request, num_new, hits, num_hit)
        if new is None:
            self.num_failed += 1
            assert snapshot(self.manager) == before
            return False
        self.num_evicted += len({b.block_id for b in new} & set(before[2].values()))
        for block in new:
            self.kv[block.block_id] = [None] * self.bs  # fresh memory: old content is gone
        blocks = self.manager.req_to_blocks[request.request_id]
        start = request.num_computed_tokens + num_hit
        for pos in range(start, start + num_new):
            block = blocks[pos // self.bs]
            assert block.ref_cnt == 1, f"writing into shared {block}"
            self.kv[block.block_id][pos % self.bs] = self.expected(request, pos)
        request.num_computed_tokens = start + num_new
        return True

    def expected(self, request, pos):
        return request.cache_salt, tuple(request.all_token_ids[: pos + 1])

    def preempt(self, request) -> None:
        self.running.remove(request)
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting.insert(0, request)

    def abort(self) -> None:
        queue = self.rng.choice([q for q in (self.waiting, self.running) if q])
        request = queue.pop(self.rng.randrange(len(queue)))
        self.manager.free(request)

    def step(self) -> None:
        ops = {self.add: 3 if len(self.waiting) + len(self.running) < 8 else 0}
        ops[self.schedule_waiting] = 3 if self.waiting else 0
        ops[self.step_running] = 6 if self.running else 0
        ops[lambda: self.preempt(self.rng.choice(self.running))] = 1 if self.running else 0
        ops[self.abort] = 1 if self.waiting or self.running else 0
        self.rng.choices(list(ops), weights=list(ops.values()))[0]()


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_invariants_and_leaks_nothing(seed):
    workload = Workload(seed)
    manager = workload.manager
    for _ in range(1000):
        workload.step()
        manager.check_invariants()
        for request in workload.running:
            held = len(manager.get_block_ids(request.request_id)) * workload.bs
            assert held >= request.num_computed_tokens
    for request in workload.waiting + workload.running:
        manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    # The workload must actually exercise hits and memory pressure.
    assert manager.prefix_cache_hits > 0
    assert workload.num_failed > 0 and workload.num_evicted > 0
