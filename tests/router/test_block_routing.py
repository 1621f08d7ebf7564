"""Routing by held blocks: the choice weighs cached tokens against load; two routers agree."""

from __future__ import annotations

import asyncio
import random
import time

from tests.router.test_router_selection import first
from tidegate.engine.config import RouterArgs
from tidegate.engine.core.block_hash import append_block_hashes
from tidegate.engine.kv_events import KVEventPublisher
from tidegate.engine.messages import BlockRemoved, BlockStored
from tidegate.engine.router.block_index import BlockIndex
from tidegate.engine.router.exposition import parse_exposition
from tidegate.engine.router.health import kv_events_port
from tidegate.engine.router.instances import InstancePool
from tidegate.engine.router.proxy import Proxy
from tidegate.engine.router.routing import Route
from tidegate.engine.router.selection import LOAD_COST_TOKENS, Selector, rendezvous_order

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
IDLE = dict.fromkeys(URLS, 0.0)


def test_the_instance_holding_the_prefix_wins_over_rendezvous_order():
    order = rendezvous_order("k", URLS)
    holder = order[2]
    assert first(Selector(), "k", IDLE, cached={holder: 512}) == holder
    # The longer cached prefix wins; nothing cached anywhere keeps rendezvous order.
    assert first(Selector(), "k", IDLE, cached={order[1]: 64, holder: 512}) == holder
    assert first(Selector(), "k", IDLE, cached={}) == order[0]


def test_a_cached_prefix_is_worth_its_tokens_in_load_and_never_past_the_bound():
    order = rendezvous_order("k", URLS)
    holder = order[1]
    selector = Selector(slack=4, slack_ratio=0.0)
    # One request busier: a prefix of more than LOAD_COST_TOKENS still wins...
    loads = {**IDLE, holder: 1.0}
    assert first(selector, "k", loads, cached={holder: LOAD_COST_TOKENS + 16}) == holder
    # ...a shorter one does not, and the rest keep rendezvous order.
    assert first(selector, "k", loads, cached={holder: LOAD_COST_TOKENS - 16}) == order[0]
    # Past the load bound no prefix holds a request there.
    assert first(selector, "k", {**IDLE, holder: 5.0}, cached={holder: 10_000}) == order[0]
    # Every candidate comes back, the bound's first, the overloaded last (fallbacks).
    ranked = selector.order("k", {**IDLE, holder: 5.0}, cached={holder: 10_000})
    assert ranked[-1] == holder and sorted(ranked) == sorted(URLS)


def test_the_events_port_is_read_from_the_instances_metrics():
    page = parse_exposition('tidegate:kv_events_info{model_name="m",port="5557"} 1.0\n')
    assert kv_events_port(page) == 5557
    assert kv_events_port(parse_exposition("tidegate:num_requests_running 0\n")) is None
    assert kv_events_port(parse_exposition('tidegate:kv_events_info{port="x"} 1\n')) is None


def hashes_of(tokens, block_size=16):
    out: list[bytes] = []
    append_block_hashes(out, tokens, block_size, None)
    return out


async def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_two_routers_fed_the_same_events_make_the_same_choices():
    """Three instances' events, two routers' indexes: at least 99% equal choices (here all)."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([32, 64, 128]))] for _ in range(12)]
    urls = [f"http://127.0.0.{i + 1}:8000" for i in range(3)]

    async def scenario():
        publishers = [KVEventPublisher(0, host="127.0.0.1") for _ in urls]
        indexes = [BlockIndex(), BlockIndex()]
        try:
            for index in indexes:
                # Every instance publishes on its own port of this host.
                index.endpoint = lambda url, port: f"tcp://127.0.0.1:{port}"  # type: ignore[method-assign]
                index.track({url: pub.port for url, pub in zip(urls, publishers, strict=True)})
            held: list[set[bytes]] = [set() for _ in urls]
            for _ in range(150):
                which = rng.randrange(len(urls))
                prefix = rng.choice(prefixes)
                hashes = hashes_of(prefix)[: rng.randrange(1, len(prefix) // 16 + 1)]
                if rng.random() < 0.25 and held[which]:
                    gone = rng.sample(sorted(held[which]), k=min(2, len(held[which])))
                    publishers[which].publish(0, [BlockRemoved(gone)])
                    held[which].difference_update(gone)
                else:
                    publishers[which].publish(0, [BlockStored(hashes, None, 16)])
                    held[which].update(hashes)

            def synced():
                return all(
                    {h for p in index.held[url].pools.values() for h in p.hashes} == held[i]
                    for index in indexes
                    for i, url in enumerate(urls)
                )

            await wait_for(synced)
            pools = []
            for index in indexes:
                pool = InstancePool("decode", index=index)
                pool.set_urls(urls)
                for instance in pool:
                    pool.mark_healthy(instance)
                    instance.external_load = float(urls.index(instance.url) % 2)
                pools.append(pool)
            routes = []
            for i in range(300):
                prefix = rng.choice(prefixes)
                routes.append(Route(f"key {i}", token_ids=prefix + [rng.randrange(1000)] * 20))
            choices = [[pool.pick(route).url for route in routes] for pool in pools]
            agree = sum(a == b for a, b in zip(*choices, strict=True)) / len(routes)
            assert agree >= 0.99
            # Held blocks decided many of them: not every choice is the rendezvous one.
            rendezvous = [rendezvous_order(r.key, urls)[0] for r in routes]
            assert sum(a != b for a, b in zip(choices[0], rendezvous, strict=True)) > 30
        finally:
            for index in indexes:
                await index.close()
            for publisher in publishers:
                publisher.close()

    asyncio.run(scenario())


def test_tokenizing_a_prompt_never_holds_up_the_event_loop(tiny_llama_dir) -> None:
    """The router relays every stream on one loop: a long chat's template and tokenizer run
    on a worker thread, while the loop keeps its pace."""
    proxy = Proxy(RouterArgs(decode=["http://x:1"], tokenizer=str(tiny_llama_dir)), client=None)  # type: ignore[arg-type]
    assert proxy.tokenizer is not None
    slow = proxy.tokenizer.token_ids

    def token_ids(path, body):  # as a 100,000-token chat would take
        time.sleep(0.3)
        return slow(path, body)

    proxy.tokenizer.token_ids = token_ids  # type: ignore[method-assign]
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}

    async def story() -> tuple[Route, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        route = await proxy.route("/v1/chat/completions", body, "r1")
        done.set()
        await ticker
        return route, max(gaps)

    route, longest = asyncio.run(story())
    assert route.token_ids and route.num_tokens > 3
    assert longest < 0.15  # the loop ran all along (0.3 s on the loop would show here)
