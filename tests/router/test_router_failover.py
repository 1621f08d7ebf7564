"""Instances die and come back; clients get an answer or a clean error, never a hang."""

from __future__ import annotations

import time

import httpx

from tests.router.conftest import wait_until
from tests.router.fake_engine import DECODE_CHUNKS
from tidegate.engine.router.selection import affinity_key, rendezvous_order

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8}
QUICK_S = 3.0  # far below any timeout that a hang would run into


def prompt_preferring(url: str, urls: list[str]) -> dict:
    """A request body whose affinity puts `url` first among `urls`."""
    for i in range(1000):
        body = {**BODY, "prompt": f"prompt {i}"}
        if rendezvous_order(affinity_key(body) or "", urls)[0] == url:
            return body
    raise AssertionError("no prompt prefers " + url)


def timed_post(client: httpx.Client, body: dict) -> httpx.Response:
    started = time.monotonic()
    response = client.post("/v1/completions", json=body)
    assert time.monotonic() - started < QUICK_S
    return response


def test_a_dead_prefill_instance_is_skipped_and_then_avoided(backend, router):
    p0, p1, decode = backend("prefill"), backend("prefill"), backend("decode")
    # Health checks far apart: only the request path can notice the death.
    proxy = router([p0.url, p1.url], [decode.url], health_interval=60)
    p0.kill()
    first = prompt_preferring(p0.url, [p0.url, p1.url])
    assert timed_post(proxy.client, first).status_code == 200
    for i in range(4):
        assert timed_post(proxy.client, {**BODY, "prompt": f"next {i}"}).status_code == 200
    assert len(p1.engine.received) == 5
    text = proxy.metrics()
    # The dead instance was tried once, by the first request, and never again.
    assert 'tidegate:router_requests_total{code="error",leg="prefill"} 1.0' in text
    assert f'tidegate:router_backend_up{{role="prefill",url="{p0.url}"}} 0.0' in text


def test_no_prefill_instance_left_is_a_quick_503_with_retry_after(backend, router):
    p0, p1, decode = backend("prefill"), backend("prefill"), backend("decode")
    # Without holding: a pool with no healthy instance left is refused at once (held: see
    # test_router_pending.py).
    proxy = router([p0.url, p1.url], [decode.url], health_interval=60, max_pending=0)
    p0.kill()
    p1.kill()
    for _ in range(2):  # the first finds them dead, the second knows
        response = timed_post(proxy.client, BODY)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "60"
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert error["param"] is None and error["code"] is None
        assert "no healthy prefill instance" in error["message"]
    assert decode.engine.received == []


def test_a_decode_instance_answering_5xx_is_left_for_another(backend, router):
    prefill = backend("prefill")
    d0, d1 = backend("decode", error_status=500), backend("decode")
    proxy = router([prefill.url], [d0.url, d1.url], health_interval=60)
    body = prompt_preferring(d0.url, [d0.url, d1.url])
    response = timed_post(proxy.client, body)
    assert response.status_code == 200
    assert response.json()["engine"] == d1.engine.name
    assert len(prefill.engine.received) == 1  # the prefill leg is not repeated
    assert d1.engine.received[0].body["kv_transfer_params"]["remote_engine"] == "prefill0"


def test_health_follows_backends_that_die_and_come_back(backend, router):
    prefill, decode = backend("prefill"), backend("decode")
    client = router([prefill.url], [decode.url], health_interval=0.05, max_pending=0).client
    assert client.get("/health").status_code == 200
    decode.kill()
    wait_until(lambda: client.get("/health").status_code == 503, what="health 503")
    error = client.get("/health").json()["error"]
    assert "no healthy decode instance" in error["message"]
    # No decode to take the KV blocks: the prefill leg is not even tried.
    assert client.post("/v1/completions", json=BODY).status_code == 503
    assert prefill.engine.received == []
    decode.revive()
    wait_until(lambda: client.get("/health").status_code == 200, what="health 200 again")
    prefill.engine.healthy = False  # alive, but its own /health says it cannot serve
    wait_until(lambda: client.get("/health").status_code == 503, what="prefill unhealthy")
    assert client.post("/v1/completions", json=BODY).status_code == 503
    assert client.get("/live").status_code == 200


def test_a_decode_dying_mid_stream_ends_the_clients_stream_with_an_error(backend, router):
    prefill, decode = backend("prefill"), backend("decode", die_after=2)
    client = router([prefill.url], [decode.url], health_interval=60).client
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
        received = b"".join(response.iter_raw())
    assert received.startswith(DECODE_CHUNKS[0] + DECODE_CHUNKS[1])
    assert b'data: {"error": {"message": "the decode instance failed mid-stream' in received
    assert received.endswith(b"}\n\ndata: [DONE]\n\n")  # as an engine ends a failed stream


def test_a_client_leaving_mid_stream_closes_the_decode_stream(backend, router):
    prefill, decode = backend("prefill"), backend("decode", hold=True)
    proxy = router([prefill.url], [decode.url], health_interval=60)
    with proxy.client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as reply:
        assert next(reply.iter_raw()) == DECODE_CHUNKS[0]
    assert decode.engine.disconnected.wait(5.0), "the decode engine never saw the client leave"
    in_flight = f'tidegate:router_backend_in_flight{{role="decode",url="{decode.url}"}} 0.0'
    wait_until(lambda: in_flight in proxy.metrics(), what="in-flight back to 0")


def test_a_draining_instance_is_left_at_its_first_503_and_at_its_next_health_check(backend, router):
    # An engine told to stop answers /health and new requests 503 while it drains.
    d0, d1 = backend("decode", error_status=503), backend("decode")
    proxy = router([], [d0.url, d1.url], health_interval=60)
    body = prompt_preferring(d0.url, [d0.url, d1.url])
    response = timed_post(proxy.client, body)
    assert response.status_code == 200 and response.json()["engine"] == d1.engine.name
    # Out of rotation at once, without waiting a minute for the next health round.
    assert f'tidegate:router_backend_up{{role="decode",url="{d0.url}"}} 0.0' in proxy.metrics()
    # With nothing sent to it, the health check alone takes it out within a round.
    d2, d3 = backend("decode"), backend("decode")
    checked = router([], [d2.url, d3.url], health_interval=0.05)
    d2.engine.healthy = False
    up = f'tidegate:router_backend_up{{role="decode",url="{d2.url}"}} 0.0'
    wait_until(lambda: up in checked.metrics(), timeout_s=2.0, what="a 503 /health to count")
