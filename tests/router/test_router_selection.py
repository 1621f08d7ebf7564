"""Choosing an instance: prefix affinity that yields to load, and only healthy instances."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tidegate.engine.entrypoints.openai.pd_bodies import needs_prefill
from tidegate.engine.router.health import reported_load
from tidegate.engine.router.instances import InstancePool
from tidegate.engine.router.routing import Route
from tidegate.engine.router.selection import (
    AFFINITY_PREFIX_CHARS,
    Selector,
    affinity_key,
    rendezvous_order,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
IDLE = dict.fromkeys(URLS, 0.0)


def first(selector: Selector, *args: Any, **kwargs: Any) -> str:
    """The instance the selector puts first."""
    return selector.order(*args, **kwargs)[0]


def test_affinity_sends_a_key_to_the_same_instance_every_time():
    selector = Selector()
    chosen = {first(selector, "system prompt A", IDLE) for _ in range(10)}
    assert len(chosen) == 1
    assert chosen == {rendezvous_order("system prompt A", URLS)[0]}


def test_keys_spread_over_all_instances():
    counts = Counter(first(Selector(), f"prompt {i}", IDLE) for i in range(400))
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 50  # 100 each on average


def test_losing_an_instance_moves_only_the_keys_it_served():
    keys = [f"prompt {i}" for i in range(200)]
    before = {key: rendezvous_order(key, URLS)[0] for key in keys}
    after = {key: rendezvous_order(key, URLS[1:])[0] for key in keys}
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] == URLS[0]}


def test_affinity_holds_within_the_slack_and_yields_beyond_it():
    order = rendezvous_order("k", URLS)
    selector = Selector(slack=2, slack_ratio=0.25)
    assert first(selector, "k", {**IDLE, order[0]: 2}) == order[0]
    # Too loaded: the key's second choice, not just any idle instance.
    assert first(selector, "k", {**IDLE, order[0]: 3}) == order[1]
    assert first(selector, "k", {**IDLE, order[0]: 3, order[1]: 3}) == order[2]
    # The slack grows with the load: at least 8 everywhere, 12 is still within bounds.
    busy = dict.fromkeys(URLS, 8.0)
    assert first(selector, "k", {**busy, order[0]: 12}) == order[0]
    assert first(selector, "k", {**busy, order[0]: 13}) == order[1]


def test_no_candidates_means_no_choice():
    assert Selector().order("k", {}) == []


def test_a_pool_picks_only_healthy_instances_not_yet_tried():
    pool = InstancePool("decode")
    pool.set_urls(URLS)
    assert pool.pick(Route("k")) is None  # discovered, not yet checked
    for instance in pool:
        pool.mark_healthy(instance)
    first = pool.pick(Route("k"))
    assert first is not None and first.url == rendezvous_order("k", URLS)[0]
    pool.mark_down(first, "refused")
    second = pool.pick(Route("k"))
    assert second is not None and second.url == rendezvous_order("k", URLS)[1]
    assert pool.pick(Route("k"), exclude={second.url}).url == rendezvous_order("k", URLS)[2]
    assert pool.pick(Route("k"), exclude=set(URLS)) is None


def test_a_pool_keeps_the_state_of_instances_it_still_has():
    pool = InstancePool("prefill")
    pool.set_urls(URLS[:2])
    kept = next(iter(pool))
    pool.mark_healthy(kept)
    kept.in_flight = 3
    pool.set_urls([URLS[0], URLS[2]])
    assert [i.url for i in pool] == [URLS[0], URLS[2]]
    assert next(iter(pool)) is kept and kept.in_flight == 3
    assert pool.healthy() == [kept]


def test_load_counts_the_routers_requests_and_everyone_elses():
    pool = InstancePool("decode")
    pool.set_urls(URLS[:2])
    a, b = list(pool)
    for instance in (a, b):
        pool.mark_healthy(instance)
    key = next(f"k{i}" for i in range(100) if rendezvous_order(f"k{i}", URLS[:2])[0] == a.url)
    a.external_load = 5  # e.g. another router replica's requests
    assert pool.pick(Route(key)) is b
    a.external_load, a.in_flight = 0, 5
    assert pool.pick(Route(key)) is b


def test_the_affinity_key_is_the_prompts_head_in_a_canonical_form():
    chat = {"messages": [{"role": "system", "content": "be brief"}]}
    reordered = {"messages": [{"content": "be brief", "role": "system"}]}
    assert affinity_key(chat) == affinity_key(reordered)
    head = "x" * AFFINITY_PREFIX_CHARS
    assert affinity_key({"prompt": head + "one"}) == affinity_key({"prompt": head + "two"})
    assert affinity_key({"prompt": [1, 2, 3]}) == "\0[1,2,3]"
    assert affinity_key({"model": "m", "prompt": [1, 2, 3]}) == "m\0[1,2,3]"
    assert affinity_key({"model": "m"}) is None


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/completions", {"prompt": "a"}, True),
        ("/v1/completions", {"prompt": "a", "n": 1}, True),
        ("/v1/completions", {"prompt": [1, 2]}, True),
        ("/v1/completions", {"prompt": "a", "n": 2}, False),
        ("/v1/completions", {"prompt": ["a"]}, False),
        ("/v1/completions", {"prompt": [[1, 2]]}, False),
        ("/v1/completions", {"prompt": []}, False),
        ("/v1/completions", {}, False),
        ("/v1/chat/completions", {"messages": []}, True),
        ("/v1/chat/completions", {"messages": [], "n": 4}, False),
        # The prompt's logprobs come from computing it: the decode instance does it all.
        ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 1}, False),
        ("/v1/completions", {"prompt": "a", "echo": True}, True),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 0}, False),
    ],
)
def test_only_single_prompts_with_one_choice_are_prefilled(path, body, expected):
    assert needs_prefill(path, body) is expected


def test_reported_load_sums_running_and_waiting_over_engine_cores():
    text = (
        "# HELP tidegate:num_requests_running Requests in the batch.\n"
        "# TYPE tidegate:num_requests_running gauge\n"
        'tidegate:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'tidegate:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'tidegate:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        "tidegate:num_requests_waiting_other 7.0\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    )
    assert reported_load(text) == 6.0
    assert reported_load("") == 0.0
