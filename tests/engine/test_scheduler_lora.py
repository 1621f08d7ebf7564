"""The scheduler's LoRA rules: at most max_loras adapters run at once, first come first served
among adapters, base-model requests unaffected."""

from __future__ import annotations

from tests.engine.test_scheduler import make_request, run_to_completion, step
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.scheduler import Scheduler
from tidegate.engine.core.step_budget import StepLimits
from tidegate.engine.messages import LoRARequest


def lora(name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name=name, lora_id=lora_id, path=f"/adapters/{name}", digest=name * 8)


A, B, C = lora("a", 1), lora("b", 2), lora("c", 3)


def make_scheduler(max_loras: int) -> Scheduler:
    limits = StepLimits(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        long_prefill_token_threshold=0,
        max_num_partial_prefills=1,
        max_long_partial_prefills=1,
        max_model_len=4096,
        max_loras=max_loras,
    )
    return Scheduler(limits, KVCacheManager(1000, 16))


def add(scheduler: Scheduler, req_id: str, adapter: LoRARequest | None, max_tokens: int = 4):
    request = make_request(req_id, 20, max_tokens=max_tokens)
    request.lora_request = adapter
    scheduler.add_request(request)
    return request


def running_adapters(scheduler: Scheduler) -> set[str]:
    return {r.lora_name for r in scheduler.running if r.lora_name is not None}


def test_a_step_never_holds_more_adapters_than_max_loras():
    scheduler = make_scheduler(max_loras=2)
    for i, adapter in enumerate([A, B, C, A, B, C, None, C]):
        add(scheduler, f"r{i}", adapter, max_tokens=3 + i)
    seen = []
    while scheduler.has_unfinished_requests():
        out = step(scheduler)
        adapters = {
            scheduler.requests[r].lora_name
            for r in out.num_scheduled_tokens
            if r in scheduler.requests and scheduler.requests[r].lora_name
        }
        assert len(running_adapters(scheduler)) <= 2
        seen.append(adapters)
    assert any("c" in step_adapters for step_adapters in seen)  # c got its turn


def test_first_come_first_served_among_adapters_a_busy_adapter_does_not_starve_another():
    """With one slot held by a, b's request waits; a's requests that came after b's wait too,
    so a drains and b gets the slot before them. A base-model request passes meanwhile."""
    scheduler = make_scheduler(max_loras=1)
    add(scheduler, "a1", A, max_tokens=5)
    step(scheduler)
    add(scheduler, "b1", B)
    add(scheduler, "a2", A)
    add(scheduler, "base", None)
    step(scheduler)
    assert {r.request_id for r in scheduler.running} == {"a1", "base"}
    assert [r.request_id for r in scheduler.waiting] == ["b1", "a2"]
    order = []
    while scheduler.has_unfinished_requests():
        before = {r.request_id for r in scheduler.running}
        step(scheduler)
        order += [r.request_id for r in scheduler.running if r.request_id not in before]
    assert order.index("b1") < order.index("a2")


def test_requests_of_a_running_adapter_join_while_nobody_waits_for_a_slot():
    scheduler = make_scheduler(max_loras=1)
    for i in range(4):
        add(scheduler, f"a{i}", A)
    step(scheduler)
    assert len(scheduler.running) == 4
    run_to_completion(scheduler)


def test_stats_count_running_and_waiting_requests_per_adapter():
    scheduler = make_scheduler(max_loras=1)
    add(scheduler, "a1", A)
    add(scheduler, "a2", A)
    add(scheduler, "b1", B)
    step(scheduler)
    stats = scheduler.make_stats()
    assert stats.running_lora_adapters == {"a": 2}
    assert stats.waiting_lora_adapters == {"b": 1}
