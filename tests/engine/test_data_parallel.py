"""The data-parallel router: least-loaded placement, prefix affinity, and its bounds."""

from __future__ import annotations

import os
from collections import deque

import pytest

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.config import EngineArgs
from tidegate.engine.core.block_hash import extend_block_hashes
from tidegate.engine.core.request import Request
from tidegate.engine.data_parallel import DataParallelRouter
from tidegate.engine.device import devices_of_core, use_own_devices
from tidegate.engine.messages import SchedulerStats

BLOCK_SIZE = 4


def block_hashes(token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
    """A prompt's block hashes, computed as the KV cache manager computes them."""
    request = Request("r", token_ids, SamplingParams(), cache_salt=cache_salt)
    extend_block_hashes(request, BLOCK_SIZE)
    return request.block_hashes


def stats(running: int = 0, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=waiting,
        num_total_blocks=100,
        num_free_blocks=100,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )


def test_requests_go_to_the_least_loaded_core_counting_those_sent_since_its_stats():
    router = DataParallelRouter(2, max_hashes_per_core=100)
    assert [router.choose() for _ in range(4)] == [0, 1, 0, 1]
    assert router.loads() == [8, 8]  # two sent to each, counted as waiting
    router.record_stats(0, stats(running=2))  # core 0 admitted both
    assert router.loads() == [2, 8]
    assert router.choose() == 0
    router.record_stats(1, stats(waiting=0, running=0))
    assert router.choose() == 1


def test_a_shared_prefix_follows_its_core_until_that_core_is_overloaded():
    router = DataParallelRouter(2, max_hashes_per_core=100, affinity_margin=4)
    prefix = list(range(10, 26))  # four full blocks
    first = router.choose(block_hashes([*prefix, 1, 2, 3, 4]))
    other = router.choose(block_hashes([99] * 16))
    assert other != first
    # Same leading blocks, different tail: back to the core that served them.
    assert router.choose(block_hashes([*prefix, 5, 6, 7, 8])) == first
    # Overloaded: more than 4 above the least-loaded core; least loaded wins.
    router.record_stats(first, stats(waiting=3))
    router.record_stats(other, stats())
    assert router.choose(block_hashes([*prefix, 9, 9, 9, 9])) == other


def test_the_cache_salt_separates_tenants_that_share_a_prompt():
    prompt = list(range(10, 26))
    assert block_hashes(prompt, "a")[0] != block_hashes(prompt, "b")[0]
    assert block_hashes(prompt, "a")[1:] != block_hashes(prompt)[1:]
    router = DataParallelRouter(2, max_hashes_per_core=100)
    first = router.choose(block_hashes(prompt, "a"))
    # Another tenant's identical prompt has nothing cached anywhere: least loaded.
    assert router.choose(block_hashes(prompt, "b")) != first


def test_remembered_hashes_are_bounded_least_recently_used_first_out():
    router = DataParallelRouter(2, max_hashes_per_core=4, affinity_margin=100)
    old = block_hashes(list(range(10, 26)))  # four blocks fill core 0's memory
    assert router.choose(old) == 0
    assert router.choose(block_hashes(list(range(50, 66)))) == 1
    router.record_stats(0, stats())
    router.record_stats(1, stats())
    assert router.choose(block_hashes(list(range(100, 108)))) == 0  # evicts two of `old`
    router.record_stats(0, stats(running=1))
    # `old`'s first block is forgotten: no affinity, least loaded (core 1) wins.
    assert router.choose(old) == 1


def simulated_prefix_hits(prefix_affinity: bool) -> tuple[int, set[int]]:
    """Prompt tokens found cached by a fixed workload of shared-prefix requests.

    Seven system prompts of eight blocks, each asked six times with a one-block question,
    interleaved; a request runs while the next three arrive. Each core's prefix cache is
    modelled as never evicting, so only placement decides the hits.
    """
    router = DataParallelRouter(2, max_hashes_per_core=10_000, prefix_affinity=prefix_affinity)
    cached: list[set[bytes]] = [set(), set()]
    running: deque[int] = deque(maxlen=3)
    hits = 0
    used = set()
    for round_ in range(6):
        for group in range(7):
            prefix = [1000 * (group + 1) + i for i in range(8 * BLOCK_SIZE)]
            hashes = block_hashes(prefix + [7 + round_] * BLOCK_SIZE)
            for core in range(2):
                router.record_stats(core, stats(running=running.count(core)))
            core = router.choose(hashes)
            used.add(core)
            for block_hash in hashes:
                if block_hash not in cached[core]:
                    break
                hits += BLOCK_SIZE
            cached[core].update(hashes)
            running.append(core)
    return hits, used


def test_prefix_affinity_finds_more_cached_tokens_than_least_loaded_routing():
    affinity_hits, affinity_cores = simulated_prefix_hits(prefix_affinity=True)
    plain_hits, plain_cores = simulated_prefix_hits(prefix_affinity=False)
    assert affinity_cores == plain_cores == {0, 1}  # both spread the work
    # With affinity only the first of six requests per prefix misses: 7 * 5 * 32 tokens.
    assert affinity_hits == 7 * 5 * 8 * BLOCK_SIZE
    # Least-loaded routing scatters each prefix over both cores and misses on each.
    assert plain_hits == 7 * 4 * 8 * BLOCK_SIZE < affinity_hits


def test_the_offline_llm_refuses_data_parallelism_and_says_where_it_lives(tiny_llama_dir):
    with pytest.raises(ValueError, match="serving feature"):
        LLM(str(tiny_llama_dir), data_parallel_size_local=2)


def test_each_engine_core_gets_its_own_slice_of_the_gpus():
    visible = ["0", "1", "2", "3", "4"]
    assert devices_of_core(0, 2, 2, visible) == "0,1"
    assert devices_of_core(1, 2, 2, visible) == "2,3"
    with pytest.raises(ValueError, match="needs 6 CUDA devices; 5 are visible"):
        devices_of_core(0, 3, 2, visible)


def test_an_engine_core_takes_its_gpus_without_starting_cuda(monkeypatch):
    # An in-process worker (uni) reads CUDA_VISIBLE_DEVICES when CUDA starts in the engine
    # core: setting it after is_available() (which starts CUDA) would give every core GPU 0.
    import torch

    def starts_cuda() -> bool:
        raise AssertionError("is_available() starts CUDA before the devices are chosen")

    monkeypatch.setattr(torch.cuda, "is_available", starts_cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # NVML's count
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # unset; restored after the test
    args = EngineArgs(model="m", data_parallel_size_local=4)
    use_own_devices(args, engine_index=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    use_own_devices(args.model_copy(update={"data_parallel_size_local": 2}), engine_index=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"


def test_without_gpus_the_devices_are_left_alone(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    use_own_devices(EngineArgs(model="m", data_parallel_size_local=2), engine_index=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
