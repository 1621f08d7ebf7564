"""Scheduling across tenants: fcfs, priority and fair (deficit round robin) orders, the
per-tenant running cap, and per-tenant bookkeeping that ends empty whatever happened."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from tests.engine.test_scheduler import fake_run, make_request, run_to_completion, step
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request
from tidegate.engine.core.request_queue import FairQueue, FCFSQueue
from tidegate.engine.core.scheduler import Scheduler
from tidegate.engine.core.step_budget import StepLimits

POLICIES = ["fcfs", "fair", "priority"]


def make_scheduler(
    policy: str = "fcfs",
    cap: int | None = None,
    num_blocks: int = 2000,
    block_size: int = 16,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 64,
    threshold: int = 0,
) -> Scheduler:
    limits = StepLimits(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=1,
        max_long_partial_prefills=1,
        max_model_len=4096,
        policy=policy,  # type: ignore[arg-type]
        max_running_per_tenant=cap,
    )
    # No prefix caching: every prompt costs its full length, whatever it shares with another.
    return Scheduler(limits, KVCacheManager(num_blocks, block_size, enable_caching=False))


def tenant_request(
    req_id: str, tenant: str | None, prompt: int, max_tokens: int = 1, priority: int = 0
) -> Request:
    request = make_request(req_id, prompt, max_tokens=max_tokens)
    request.tenant, request.priority = tenant, priority
    return request


def first_steps(scheduler: Scheduler, num_steps: int) -> Counter:
    """Tokens computed per tenant over the next steps."""
    tokens: Counter = Counter()
    for _ in range(num_steps):
        out = scheduler.schedule()
        for req_id, num in out.num_scheduled_tokens.items():
            tokens[scheduler.requests[req_id].tenant] += num
        scheduler.update_from_output(out, fake_run(scheduler, out))
    return tokens


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_fair_shares_step_tokens_equally_between_tenants_whatever_their_request_sizes(policy):
    scheduler = make_scheduler(policy)
    # A queued first, with prompts four times B's: under fair, B gets four requests per A's.
    for i in range(60):
        scheduler.add_request(tenant_request(f"a{i}", "A", 64))
    for i in range(200):
        scheduler.add_request(tenant_request(f"b{i}", "B", 16))
    tokens = first_steps(scheduler, 10)  # both stay backlogged throughout
    assert tokens["A"] + tokens["B"] == 10 * 256
    if policy == "fcfs":
        assert tokens["B"] == 0  # B waits behind all of A's queue
    else:
        # Equal shares, give or take one quantum and one request.
        assert abs(tokens["A"] - tokens["B"]) <= FairQueue().quantum + 64


@pytest.mark.parametrize(("policy", "most_steps"), [("fair", 2), ("fcfs", None)])
def test_a_flood_delays_another_tenant_by_no_more_than_its_share(policy, most_steps):
    scheduler = make_scheduler(policy)
    for i in range(100):
        scheduler.add_request(tenant_request(f"a{i}", "A", 64))
    step(scheduler)
    scheduler.add_request(tenant_request("b", "B", 64))
    steps = 0
    while "b" in scheduler.requests:
        step(scheduler)
        steps += 1
    if most_steps is not None:
        assert steps <= most_steps
    else:
        assert steps > 20  # behind the ~96 A requests still queued, four per step


def test_decodes_count_against_a_tenants_share():
    # A has 32 streams decoding, half of every step, and more requests waiting: B's requests
    # take the other half, since A's decodes already spend A's share.
    scheduler = make_scheduler("fair", max_num_batched_tokens=64)
    for i in range(32):
        scheduler.add_request(tenant_request(f"d{i}", "A", 2, max_tokens=500))
    step(scheduler)
    for i in range(200):
        scheduler.add_request(tenant_request(f"a{i}", "A", 8))
    for i in range(150):
        scheduler.add_request(tenant_request(f"b{i}", "B", 8))
    tokens = first_steps(scheduler, 30)
    # Counting only prompt tokens, B would get half of the other half: 480 against 1440.
    assert abs(tokens["A"] - tokens["B"]) <= FairQueue().quantum + 64


def test_fair_queue_alternates_turns_by_deficit():
    queue = FairQueue(quantum=100)
    for i in range(4):
        queue.add(tenant_request(f"a{i}", "A", 8))
    for i in range(8):
        queue.add(tenant_request(f"b{i}", "B", 8))
    costs = {"A": 200, "B": 100}
    order = []
    while queue:
        request = queue.peek()
        queue.pop(request)
        queue.charge(request.tenant, costs[request.tenant])
        order.append(request.request_id)
    # B's requests cost half of A's: two of B's for each of A's, each tenant in its own order.
    assert order[:6] == ["a0", "b0", "b1", "a1", "b2", "b3"]
    assert [r for r in order if r.startswith("a")] == ["a0", "a1", "a2", "a3"]
    assert queue.deficits == {} and queue.tenants == {}


def test_priority_admits_lowest_value_first_then_by_arrival():
    for policy, expected in [("priority", ["b", "d", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])]:
        scheduler = make_scheduler(policy, max_num_seqs=1)
        for req_id, priority in [("a", 3), ("b", 1), ("c", 2), ("d", 1)]:
            scheduler.add_request(tenant_request(req_id, None, 8, priority=priority))
        order = [next(iter(step(scheduler).num_scheduled_tokens)) for _ in range(4)]
        assert order == expected, policy


@pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "high")])
def test_preemption_takes_the_lowest_priority_first(policy, victim):
    # 16 blocks of 4 tokens: one request growing to 48 tokens fits, two do not.
    scheduler = make_scheduler(policy, num_blocks=16, block_size=4, max_num_batched_tokens=64)
    low = tenant_request("low", None, 8, max_tokens=40, priority=5)
    high = tenant_request("high", None, 8, max_tokens=40, priority=0)
    scheduler.add_request(low)
    step(scheduler)  # the low-priority request is the older one
    scheduler.add_request(high)
    preempted: set[str] = set()
    while not preempted:
        preempted = set(step(scheduler).preempted_req_ids)
    assert preempted == {victim}
    run_to_completion(scheduler)
    assert low.num_output_tokens == high.num_output_tokens == 40
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_fair_preempts_the_newest_request_of_the_tenant_running_most():
    scheduler = make_scheduler("fair", num_blocks=20, block_size=4, max_num_batched_tokens=64)
    requests = [
        tenant_request("b0", "B", 8, max_tokens=40),
        tenant_request("a0", "A", 8, max_tokens=40),
        tenant_request("a1", "A", 8, max_tokens=40),
    ]
    for request in requests:
        scheduler.add_request(request)
        step(scheduler)  # admitted one at a time: b0 oldest, a1 newest
    preempted: set[str] = set()
    while not preempted:
        preempted = set(step(scheduler).preempted_req_ids)
    assert preempted == {"a1"}
    run_to_completion(scheduler)
    assert all(r.num_output_tokens == 40 for r in requests)


def test_fair_takes_a_slot_back_from_a_flood_holding_every_slot():
    # A holds all 8 slots with long decodes and has more waiting; B's request arrives.
    scheduler = make_scheduler("fair", max_num_seqs=8)
    for i in range(20):
        scheduler.add_request(tenant_request(f"a{i}", "A", 8, max_tokens=200))
    step(scheduler)
    assert len(scheduler.running) == 8
    scheduler.add_request(tenant_request("b0", "B", 8, max_tokens=200))
    out = step(scheduler)
    # B starts at once; A's newest went back to WAITING, and no other prompt of A started in
    # the step that gives B its first token.
    assert out.num_scheduled_tokens["b0"] == 8
    assert set(out.preempted_req_ids) == {"a7"}
    assert [r.request_id for r in scheduler.waiting][:1] == ["a7"]
    assert not [d.req_id for d in out.scheduled_new_reqs if d.req_id != "b0"]
    # B below its share of four: each newcomer of B takes one of A's slots back, until B
    # holds its share and A the rest; then nobody is preempted to make room.
    for i in range(1, 6):
        scheduler.add_request(tenant_request(f"b{i}", "B", 8, max_tokens=200))
    preemptions = 0
    for _ in range(10):
        preemptions += len(step(scheduler).preempted_req_ids)
    running = Counter(r.tenant for r in scheduler.running)
    assert running == {"A": 4, "B": 4}
    assert preemptions == 3  # b1..b3 took slots back; b4, b5 wait for B's own
    assert scheduler.num_waiting_of("B") == 2


def test_fair_starts_no_prompt_above_its_share_while_a_tenant_below_it_waits():
    scheduler = make_scheduler("fair", max_num_seqs=8)
    for i in range(20):
        scheduler.add_request(tenant_request(f"a{i}", "A", 8, max_tokens=200))
    step(scheduler)
    scheduler.abort_requests(["a0", "a1"])  # two slots free
    scheduler.add_request(tenant_request("b0", "B", 8, max_tokens=200))
    out = step(scheduler)
    # B's first step holds B's prompt and A's decodes, none of A's waiting prompts, though
    # a slot is free and A's turn may come first.
    assert [d.req_id for d in out.scheduled_new_reqs] == ["b0"]
    assert not out.preempted_req_ids
    # Nothing of B waits now: A takes the free slot at the next step.
    assert [d.req_id for d in step(scheduler).scheduled_new_reqs] == ["a8"]


def test_fair_owes_no_slot_to_a_tenant_at_its_running_cap():
    scheduler = make_scheduler("fair", cap=1, max_num_seqs=8)
    scheduler.add_request(tenant_request("b0", "B", 8, max_tokens=200))
    step(scheduler)
    for i in range(1, 4):
        scheduler.add_request(tenant_request(f"b{i}", "B", 8, max_tokens=200))
    scheduler.add_request(tenant_request("a0", "A", 8, max_tokens=200))
    out = step(scheduler)
    # B is below its share of four but at its cap of one: A starts, nobody is preempted.
    assert [d.req_id for d in out.scheduled_new_reqs] == ["a0"]
    assert not out.preempted_req_ids


def test_fair_leaves_slots_alone_while_every_tenant_is_within_its_share():
    scheduler = make_scheduler("fair", max_num_seqs=8)
    for i in range(3):
        scheduler.add_request(tenant_request(f"a{i}", "A", 8, max_tokens=30))
    for i in range(2):
        scheduler.add_request(tenant_request(f"b{i}", "B", 8, max_tokens=30))
    outs = run_to_completion(scheduler)
    assert not any(out.preempted_req_ids for out in outs)


def test_fair_a_slot_taken_back_reuses_the_cached_prefix():
    # With prefix caching, A's preempted request finds its full blocks again when it resumes.
    limits = dataclasses.replace(make_scheduler("fair").limits, max_num_seqs=2)
    scheduler = Scheduler(limits, KVCacheManager(200, 16, enable_caching=True))
    a = [make_request(f"a{i}", 64 + i, max_tokens=40, base=1000 * (i + 1)) for i in range(2)]
    for request in a:
        request.tenant = "A"
        scheduler.add_request(request)
    step(scheduler)
    scheduler.add_request(tenant_request("b0", "B", 8, max_tokens=4))
    assert set(step(scheduler).preempted_req_ids) == {"a1"}
    run_to_completion(scheduler)
    assert a[1].num_output_tokens == 40 and a[1].num_preemptions == 1
    # Each prompt once, then at most a block's worth of a1's tokens recomputed.
    assert 64 + 65 + 8 < scheduler.num_computed_prompt_tokens <= 64 + 65 + 8 + 16
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tenant_at_its_running_cap_waits_while_others_start_and_keeps_its_order(policy):
    scheduler = make_scheduler(policy, cap=2)
    for i in range(5):
        scheduler.add_request(tenant_request(f"a{i}", "A", 8, max_tokens=50))
    for i in range(2):
        scheduler.add_request(tenant_request(f"b{i}", "B", 8, max_tokens=50))
    step(scheduler)
    assert sorted(r.request_id for r in scheduler.running) == ["a0", "a1", "b0", "b1"]
    assert [r.request_id for r in scheduler.waiting] == ["a2", "a3", "a4"]
    scheduler.abort_requests(["a0"])
    out = step(scheduler)
    assert "a2" in out.num_scheduled_tokens and "a3" not in out.num_scheduled_tokens
    assert [r.request_id for r in scheduler.waiting] == ["a3", "a4"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_nothing_is_left_behind_after_arrivals_aborts_and_preemptions(policy, seed):
    """Random tenants, priorities, arrivals and aborts on a tight pool; the per-tenant counts
    agree with the queue at every step, the cap holds, and everything ends empty."""
    rng = random.Random(seed)
    cap = rng.choice([None, 2])
    scheduler = make_scheduler(
        policy,
        cap=cap,
        num_blocks=24,
        max_num_batched_tokens=96,
        max_num_seqs=6,
        threshold=rng.choice([0, 13]),
    )
    pending = [
        tenant_request(
            f"r{i}",
            rng.choice(["A", "B", "C", None]),
            rng.randint(1, 200),
            rng.randint(1, 30),
            priority=rng.randint(-2, 2),
        )
        for i in range(50)
    ]
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop())
        if scheduler.requests and rng.random() < 0.1:
            scheduler.abort_requests([rng.choice(list(scheduler.requests))])
        step(scheduler)
        waiting = scheduler.waiting
        assert waiting.tenants == Counter(r.tenant for r in waiting)
        assert len(waiting) == len(list(waiting))
        if cap is not None:
            assert max(Counter(r.tenant for r in scheduler.running).values(), default=0) <= cap
        scheduler.kv_cache_manager.check_invariants()
        steps += 1
        assert steps < 5000
    waiting = scheduler.waiting
    assert len(waiting) == 0 and waiting.tenants == {}
    assert all(scheduler.num_waiting_of(t) == 0 for t in ("A", "B", "C", None))
    if isinstance(waiting, FairQueue):
        assert waiting.deficits == {}
    assert not scheduler.running and not scheduler.requests
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_a_pass_puts_back_what_it_set_aside_in_its_place():
    queue = FCFSQueue()
    requests = [tenant_request(f"{t}{i}", t, 8) for i in range(2) for t in "AB"]
    for request in requests:
        queue.add(request)
    queue.exclude("A")
    assert queue.peek().request_id == "B0"
    queue.set_aside()
    assert queue.peek().request_id == "B1"
    assert [r.request_id for r in queue] == ["A0", "B0", "A1", "B1"]
    queue.end_pass()
    assert [r.request_id for r in queue] == ["A0", "B0", "A1", "B1"]
    assert queue.tenants == {"A": 2, "B": 2}
