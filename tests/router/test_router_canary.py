"""Canary instances: a share of a pool's requests by weight, the ranking within each track."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import wait_until
from tidegate.engine.config import DEFAULT_CANARY_WEIGHT
from tidegate.engine.router.adapters import Adapters
from tidegate.engine.router.exposition import parse_exposition
from tidegate.engine.router.health import READ_METRICS, revision
from tidegate.engine.router.instances import Instance, InstancePool
from tidegate.engine.router.metrics import RouterMetrics
from tidegate.engine.router.routing import Route
from tidegate.engine.router.selection import Selector

STABLE_URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 4)]
CANARY_URL = "http://10.0.1.1:8000"
REQUESTS = 4000


class NoDraws(random.Random):
    """A generator that fails the test if a draw is taken from it."""

    def random(self) -> float:
        raise AssertionError("no draw was expected")


def canary_pool(
    weight: float | None = 0.1,
    role: str = "decode",
    seed: int = 1,
    canaries: tuple[str, ...] = (CANARY_URL,),
    rng: random.Random | None = None,
) -> InstancePool:
    """Three stable instances and the canaries, all healthy and idle."""
    pool = InstancePool(role, rng=rng or random.Random(seed))
    pool.set_urls([*STABLE_URLS, *canaries])
    for instance in pool:
        if instance.url in canaries:
            instance.track, instance.traffic_weight = "canary", weight
        pool.mark_healthy(instance)
    return pool


def by_url(pool: InstancePool) -> dict[str, Instance]:
    return {i.url: i for i in pool}


def firsts(pool: InstancePool, count: int = REQUESTS) -> Counter[str]:
    """Where each of `count` requests with distinct prompts goes first."""
    chosen: Counter[str] = Counter()
    for i in range(count):
        instance = pool.pick(Route(f"prompt {i}"))
        assert instance is not None
        chosen[instance.url] += 1
    return chosen


def routed_requests(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    body, _ = metrics.render()
    return {
        (s.labels["role"], s.labels["track"]): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == "tidegate:router_routed_requests_total"
    }


# -- the track and weight, from an instance's /metrics ------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('tidegate:revision_info{model_name="m",track="canary",traffic_weight="0.3"} 1\n', 0.3),
        ('tidegate:revision_info{track="canary",traffic_weight=""} 1\n', DEFAULT_CANARY_WEIGHT),
        ('tidegate:revision_info{track="canary"} 1\n', DEFAULT_CANARY_WEIGHT),
        ('tidegate:revision_info{track="canary",traffic_weight="1.5"} 1\n', DEFAULT_CANARY_WEIGHT),
        ('tidegate:revision_info{track="canary",traffic_weight="NaN"} 1\n', DEFAULT_CANARY_WEIGHT),
        ('tidegate:revision_info{track="canary",traffic_weight="x"} 1\n', DEFAULT_CANARY_WEIGHT),
    ],
    ids=["weight", "empty", "missing", "above-one", "nan", "not-a-number"],
)
def test_a_canary_page_gives_its_weight_or_the_engines_default(line, expected):
    page = parse_exposition("tidegate:num_requests_running 0\n" + line, READ_METRICS)
    assert revision(page) == ("canary", expected)


@pytest.mark.parametrize(
    "text",
    [
        'tidegate:revision_info{model_name="m",track="stable",traffic_weight=""} 1\n',
        'tidegate:revision_info{track="beta",traffic_weight="0.5"} 1\n',
        "tidegate:num_requests_running 0\n",  # a vLLM server, an older engine
    ],
    ids=["stable", "unknown-track", "absent"],
)
def test_anything_but_a_canary_page_is_stable(text):
    assert revision(parse_exposition(text, READ_METRICS)) == ("stable", None)


# -- the share, drawn per request ---------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("weight", [0.1, 0.3])
def test_a_canary_takes_its_weights_share_of_the_requests(weight, role):
    pool = canary_pool(weight, role=role)
    chosen = firsts(pool)
    # Within 4 standard deviations of the binomial count (a seeded draw: the same every run).
    tolerance = 4 * math.sqrt(REQUESTS * weight * (1 - weight))
    assert abs(chosen[CANARY_URL] - REQUESTS * weight) <= tolerance, chosen
    # The stable instances share the rest by the ranking, each about a third.
    stable = REQUESTS * (1 - weight)
    for url in STABLE_URLS:
        assert abs(chosen[url] - stable / 3) <= 0.15 * stable / 3, chosen
    assert pool.routed_requests == {
        "canary": chosen[CANARY_URL],
        "stable": REQUESTS - chosen[CANARY_URL],
    }


def test_the_other_track_follows_as_fallbacks_each_ranked_as_alone():
    pool = canary_pool(0.5)
    instances = by_url(pool)
    instances[STABLE_URLS[0]].in_flight = 5  # beyond the stable group's load bound
    stable_order = Selector().order("k", {u: instances[u].load for u in STABLE_URLS})
    assert stable_order[-1] == STABLE_URLS[0]
    seen = set()
    for _ in range(50):
        order = [i.url for i in pool.rank(Route("k"))]
        if order[0] == CANARY_URL:
            assert order[1:] == stable_order
        else:
            assert order == [*stable_order, CANARY_URL]
        seen.add(order[0])
    assert seen == {CANARY_URL, stable_order[0]}


def test_the_canary_share_is_the_largest_weight_spread_over_the_canaries_by_ranking():
    canaries = (CANARY_URL, "http://10.0.1.2:8000")
    pool = canary_pool(0.1, canaries=canaries)
    by_url(pool)[canaries[1]].traffic_weight = 0.3
    chosen = firsts(pool)
    together = chosen[canaries[0]] + chosen[canaries[1]]
    assert abs(together - REQUESTS * 0.3) <= 4 * math.sqrt(REQUESTS * 0.3 * 0.7), chosen
    # Rendezvous order spreads the prompts over both.
    assert min(chosen[c] for c in canaries) > together / 3, chosen


def test_only_canaries_healthy_take_every_request_without_a_draw():
    pool = canary_pool(0.1, rng=NoDraws())
    for url in STABLE_URLS:
        pool.mark_down(by_url(pool)[url], "gone")
    assert firsts(pool, 200) == Counter({CANARY_URL: 200})
    assert pool.routed_requests == {"canary": 200, "stable": 0}


def test_a_canary_that_is_down_gets_nothing():
    pool = canary_pool(0.3, rng=NoDraws())
    pool.mark_down(by_url(pool)[CANARY_URL], "refused")
    chosen = firsts(pool, 300)
    assert CANARY_URL not in chosen
    assert set(chosen) == set(STABLE_URLS)
    # A retry that excludes the stable instances still finds the canary, once it is back.
    pool.mark_healthy(by_url(pool)[CANARY_URL])
    pool.rng = random.Random(0)
    assert pool.pick(Route("k"), exclude=set(STABLE_URLS)).url == CANARY_URL


def test_without_a_canary_the_order_is_the_selectors_and_nothing_is_drawn():
    pool = InstancePool("decode", rng=NoDraws())
    pool.set_urls([*STABLE_URLS, CANARY_URL])
    for instance, load in zip(pool, (0, 3, 1, 7), strict=True):
        instance.in_flight = load
        pool.mark_healthy(instance)
    loads = {i.url: i.load for i in pool}
    for n in range(200):
        key = f"prompt {n}"
        assert [i.url for i in pool.rank(Route(key))] == Selector().order(key, loads)
    assert pool.routed_requests == {"canary": 0, "stable": 200}


def test_an_adapter_only_stable_instances_serve_never_goes_to_the_canary():
    pool = canary_pool(0.5, rng=NoDraws())
    for url in STABLE_URLS:
        by_url(pool)[url].adapters = Adapters(served=frozenset({"sql"}), hot=frozenset())
    by_url(pool)[CANARY_URL].adapters = Adapters(served=frozenset(), hot=frozenset())
    for i in range(100):
        assert pool.pick(Route(f"p{i}", model="sql")).url in STABLE_URLS


def test_the_router_counts_routed_requests_by_role_and_track():
    decode, prefill = canary_pool(0.3, seed=4), canary_pool(0.3, role="prefill", seed=5)
    metrics = RouterMetrics([prefill, decode])
    assert routed_requests(metrics) == {
        (role, track): 0.0 for role in ("prefill", "decode") for track in ("stable", "canary")
    }
    chosen = firsts(decode, 1000)
    # Retries (an excluded instance) are not counted again.
    decode.pick(Route("again"), exclude={CANARY_URL})
    counted = routed_requests(metrics)
    assert counted[("decode", "canary")] == chosen[CANARY_URL] > 0
    assert counted[("decode", "stable")] == 1000 - chosen[CANARY_URL]
    assert counted[("prefill", "canary")] == counted[("prefill", "stable")] == 0


# -- through a running router: the health checks read the track, HTTP and the picker use it -----


def test_the_balancer_reads_the_track_and_sends_the_canary_its_share(backend, router):
    stable = backend("decode", track="stable")
    canary = backend("decode", track="canary", traffic_weight="0.5")
    proxy = router([], [stable.url, canary.url])
    for i in range(60):
        answer = proxy.client.post("/v1/completions", json={"model": "tiny", "prompt": f"p{i}"})
        assert answer.status_code == 200
    received = {"stable": len(stable.engine.received), "canary": len(canary.engine.received)}
    assert sum(received.values()) == 60 and min(received.values()) > 0, received
    text = proxy.metrics()
    for track, count in received.items():
        pattern = rf'^tidegate:router_routed_requests_total{{role="decode",track="{track}"}} (\S+)$'
        found = re.search(pattern, text, re.MULTILINE)
        assert found and float(found.group(1)) == count, text
    # The canary goes: everything to the stable instance.
    canary.kill()
    wait_until(lambda: 'backend_up{role="decode",url="' + canary.url + '"} 0.0' in proxy.metrics())
    before = len(stable.engine.received)
    for i in range(20):
        proxy.client.post("/v1/completions", json={"model": "tiny", "prompt": f"q{i}"})
    assert len(stable.engine.received) == before + 20
