"""A pool with no ready instance (scaled to zero): requests wait for one, within bounds."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from tests.router.conftest import Router, wait_until
from tests.router.fake_engine import DECODE_CHUNKS

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8}
# Far apart: a held request must be routed through the holding rounds, not the usual ones.
SLOW_CHECKS_S = 60.0


def pending(router: Router, pool: str) -> float:
    """tidegate:router_pending_requests{pool} as the router exports it now."""
    pattern = rf'^tidegate:router_pending_requests{{pool="{pool}"}} (\S+)$'
    found = re.search(pattern, router.metrics(), re.MULTILINE)
    assert found, f"no pending gauge for pool {pool}"
    return float(found.group(1))


def held(router: Router, pool: str, count: int) -> None:
    wait_until(lambda: pending(router, pool) == count, what=f"{count} held for {pool}")


async def post(router: Router, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=router.server.url, timeout=30.0) as client:
        response = await client.post("/v1/completions", json=body)
        await response.aread()
        return response


def assert_refused(response: httpx.Response, message: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "60"
    error = response.json()["error"]
    assert error == {
        "message": error["message"],
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert message in error["message"], error["message"]


def test_requests_at_zero_wait_and_all_succeed_once_an_instance_is_ready(backend, router):
    decode = backend("decode", healthy=False)  # loading its weights, say
    proxy = router([], [decode.url], health_interval=SLOW_CHECKS_S)
    assert proxy.client.get("/health").status_code == 200  # in its Service, to hold them

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        plain = [asyncio.ensure_future(post(proxy, {**BODY, "prompt": f"p{i}"})) for i in range(4)]
        stream = asyncio.ensure_future(post(proxy, {**BODY, "stream": True}))
        await asyncio.to_thread(held, proxy, "unified", 5)
        assert decode.engine.received == []
        decode.engine.healthy = True
        started = time.monotonic()
        answers = await asyncio.gather(*plain), await stream
        # Routed within the holding rounds (0.25 s), not the minute between usual checks.
        assert time.monotonic() - started < 5.0
        return answers

    plain, stream = asyncio.run(scenario())
    assert [r.status_code for r in plain] == [200] * 4
    assert all(r.json()["choices"][0]["text"] == "one two 3" for r in plain)
    assert stream.status_code == 200 and stream.content == b"".join(DECODE_CHUNKS)
    assert len(decode.engine.received) == 5  # none lost, none sent twice
    assert pending(proxy, "unified") == 0


def test_a_request_waits_for_decode_before_its_prefill_leg(backend, router):
    prefill, decode = backend("prefill"), backend("decode", healthy=False)
    proxy = router([prefill.url], [decode.url], health_interval=SLOW_CHECKS_S)

    async def scenario() -> httpx.Response:
        waiting = asyncio.ensure_future(post(proxy, BODY))
        await asyncio.to_thread(held, proxy, "decode", 1)
        assert pending(proxy, "prefill") == 0
        # No KV blocks are produced for a decode that may never come.
        assert prefill.engine.received == []
        decode.engine.healthy = True
        return await waiting

    response = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert len(prefill.engine.received) == 1
    assert decode.engine.received[0].body["kv_transfer_params"]["remote_engine"] == "prefill0"
    assert pending(proxy, "decode") == 0


def test_beyond_max_pending_or_pending_timeout_a_503_and_a_leaving_client_leaves(backend, router):
    decode = backend("decode", healthy=False)
    proxy = router(
        [], [decode.url], health_interval=SLOW_CHECKS_S, max_pending=2, pending_timeout=1.0
    )

    async def scenario() -> None:
        first = asyncio.ensure_future(post(proxy, {**BODY, "prompt": "first"}))
        second = asyncio.ensure_future(post(proxy, {**BODY, "prompt": "second"}))
        await asyncio.to_thread(held, proxy, "unified", 2)
        # The queue is full: the router is not ready for more, and the next is refused at once.
        assert proxy.client.get("/health").status_code == 503
        assert_refused(await post(proxy, BODY), "2 requests already wait for one (--max-pending 2)")
        second.cancel()  # its client disconnects
        await asyncio.to_thread(held, proxy, "unified", 1)
        assert proxy.client.get("/health").status_code == 200
        assert_refused(await first, "no decode instance became healthy within 1 s")

    asyncio.run(scenario())
    assert pending(proxy, "unified") == 0
    assert decode.engine.received == []


def test_max_pending_0_refuses_at_once_as_before(backend, router):
    decode = backend("decode", healthy=False)
    proxy = router([], [decode.url], health_interval=SLOW_CHECKS_S, max_pending=0)
    started = time.monotonic()
    assert_refused(proxy.client.post("/v1/completions", json=BODY), "no healthy decode instance")
    assert time.monotonic() - started < 3.0
    assert proxy.client.get("/health").status_code == 503


def test_a_request_refused_by_the_last_draining_instance_waits_for_its_replacement(backend, router):
    # A scale-down or a restart: the router has not yet seen the old instance go.
    old, new = backend("decode"), backend("decode", healthy=False)
    proxy = router([], [old.url, new.url], health_interval=SLOW_CHECKS_S)
    old.engine.draining = True

    async def scenario() -> httpx.Response:
        waiting = asyncio.ensure_future(post(proxy, BODY))
        await asyncio.to_thread(held, proxy, "unified", 1)
        assert len(old.engine.received) == 1  # refused there, before anything ran
        new.engine.healthy = True
        return await waiting

    response = asyncio.run(scenario())
    assert response.status_code == 200 and response.json()["engine"] == new.engine.name
    assert pending(proxy, "unified") == 0


def test_a_request_whose_last_instance_died_unseen_waits_for_its_replacement(backend, router):
    # A rollout: the old instance has exited, the router has not yet seen it go, and it still
    # holds its replacement for down (its last check ran while it restarted). The request
    # finds nobody listening there; the pool is then empty, so it is held, as a request that
    # came to an empty pool is, not refused.
    old, new = backend("decode"), backend("decode", healthy=False)
    proxy = router([], [old.url, new.url], health_interval=SLOW_CHECKS_S)
    old.kill()

    async def scenario() -> httpx.Response:
        waiting = asyncio.ensure_future(post(proxy, BODY))
        await asyncio.to_thread(held, proxy, "unified", 1)
        new.engine.healthy = True
        return await waiting

    response = asyncio.run(scenario())
    assert response.status_code == 200 and response.json()["engine"] == new.engine.name
    assert len(new.engine.received) == 1
    assert pending(proxy, "unified") == 0
