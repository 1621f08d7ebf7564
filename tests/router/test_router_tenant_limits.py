"""The router's per-tenant limit: a tenant's requests in flight, counted until their response
or stream ends, are refused past (running + waiting limit) per healthy instance."""

from __future__ import annotations

import contextlib
import threading

import pytest
from pydantic import ValidationError

from tests.router.conftest import wait_until
from tests.router.test_router_proxy import COMPLETION
from tidegate.engine.config import RouterArgs

STREAM = dict(COMPLETION, stream=True)
LIMITS = dict(cache_salt_header="x-tenant-id", max_running_per_tenant=1, max_waiting_per_tenant=1)


def tenant(name: str) -> dict[str, str]:
    return {"x-tenant-id": name}


def test_a_tenant_past_its_limit_gets_a_429_and_no_instance_sees_the_request(backend, router):
    gate = threading.Event()
    decode = backend("decode", gate=gate)
    limited = router([], [decode.url], **LIMITS)
    with contextlib.ExitStack() as streams:
        opened = []
        for name in ("A", "A", "B"):
            response = streams.enter_context(
                limited.client.stream("POST", "/v1/completions", json=STREAM, headers=tenant(name))
            )
            assert response.status_code == 200
            chunks = response.iter_bytes()  # kept: a dropped iterator closes the stream
            next(chunks)  # the first chunk: the stream is in flight
            opened.append(chunks)
        refused = limited.client.post("/v1/completions", json=STREAM, headers=tenant("A"))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "this tenant has 2 requests in flight, at its limit of 2" in error["message"]
        assert len(decode.engine.received) == 3
        gate.set()
        for chunks in opened:
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    # Their streams ended: A may send two at once again.
    gate.clear()
    with contextlib.ExitStack() as streams:
        for _ in range(2):
            response = streams.enter_context(
                limited.client.stream("POST", "/v1/completions", json=STREAM, headers=tenant("A"))
            )
            assert response.status_code == 200
        gate.set()


def test_clients_that_leave_free_their_places(backend, router):
    decode = backend("decode", hold=True)  # a stream waits after its first chunk
    limited = router([], [decode.url], **LIMITS)

    def two_at_once() -> bool:
        """Whether two streams of A are admitted together (and left at once)."""
        with contextlib.ExitStack() as streams:
            codes = [
                streams.enter_context(
                    limited.client.stream(
                        "POST", "/v1/completions", json=STREAM, headers=tenant("A")
                    )
                ).status_code
                for _ in range(2)
            ]
        return codes == [200, 200]

    assert two_at_once()
    # Their clients left mid-stream: once the router has closed both, A has both places back.
    wait_until(two_at_once, what="the places of streams whose clients left")


def test_the_limit_grows_with_the_healthy_instances(backend, router):
    gate = threading.Event()
    decodes = [backend("decode", gate=gate) for _ in range(2)]
    limited = router([], [d.url for d in decodes], **LIMITS)
    with contextlib.ExitStack() as streams:
        for _ in range(4):
            response = streams.enter_context(
                limited.client.stream("POST", "/v1/completions", json=STREAM, headers=tenant("A"))
            )
            assert response.status_code == 200
        refused = limited.client.post("/v1/completions", json=STREAM, headers=tenant("A"))
        assert refused.status_code == 429
        assert "at its limit of 4 (2 per healthy instance" in refused.json()["error"]["message"]
        gate.set()


def test_without_the_limits_nothing_is_counted(backend, router):
    gate = threading.Event()
    decode = backend("decode", gate=gate)
    plain = router([], [decode.url], cache_salt_header="x-tenant-id")
    with contextlib.ExitStack() as streams:
        for _ in range(5):
            response = streams.enter_context(
                plain.client.stream("POST", "/v1/completions", json=STREAM, headers=tenant("A"))
            )
            assert response.status_code == 200
        gate.set()


def test_the_router_takes_both_limits_or_neither():
    with pytest.raises(ValidationError, match="together"):
        RouterArgs(decode=["http://d"], max_running_per_tenant=2)
    args = RouterArgs(decode=["http://d"], max_running_per_tenant=2, max_waiting_per_tenant=3)
    assert args.max_in_flight_per_tenant == 5
    assert RouterArgs(decode=["http://d"]).max_in_flight_per_tenant is None
