"""A headless Service's name stands for every pod behind it, as DNS says at each round."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.router.conftest import wait_until
from tidegate.common.local_server import free_port
from tidegate.engine.router.discovery import discover, expand_url

_real_getaddrinfo = socket.getaddrinfo


@pytest.fixture
def dns(monkeypatch) -> dict[str, list[str]]:
    """Names the test resolves itself (name -> IPv4 addresses; none: the name is unknown)."""
    records: dict[str, list[str]] = {}

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in records:
            return _real_getaddrinfo(host, port, family, type, proto, flags)
        if not records[host]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))
            for address in records[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return records


def test_a_name_with_several_addresses_is_one_instance_per_address(dns):
    dns["decode.ns.svc"] = ["10.0.0.12", "10.0.0.3", "10.0.0.12"]
    urls = asyncio.run(expand_url("http://decode.ns.svc:8000/base"))
    assert urls == ["http://10.0.0.3:8000/base", "http://10.0.0.12:8000/base"]


def test_a_name_with_one_address_and_an_ip_stay_as_written(dns):
    dns["single.svc"] = ["10.0.0.7"]
    assert asyncio.run(expand_url("http://single.svc:8000")) == ["http://single.svc:8000"]
    dns["10.0.0.9"] = []  # would fail, were an IP literal ever resolved
    assert asyncio.run(expand_url("http://10.0.0.9:8000")) == ["http://10.0.0.9:8000"]


def test_an_endpoint_picker_gets_the_address_of_a_one_pod_service(dns):
    # The gateway is handed ip:port endpoints; a name would not do for Envoy.
    dns["single.svc"] = ["10.0.0.7"]
    expanded = asyncio.run(expand_url("http://single.svc:8000", keep_single_name=False))
    assert expanded == ["http://10.0.0.7:8000"]


def test_a_name_that_stops_resolving_keeps_its_last_instances(dns):
    dns["pods.svc"] = ["10.0.0.1", "10.0.0.2"]
    seeds = ["http://pods.svc:80", "http://gone.svc:80"]
    dns["gone.svc"] = []
    first = asyncio.run(discover(seeds, {}))
    assert first["http://pods.svc:80"] == ["http://10.0.0.1:80", "http://10.0.0.2:80"]
    assert first["http://gone.svc:80"] == ["http://gone.svc:80"]  # checked, and found down
    dns["pods.svc"] = []
    assert asyncio.run(discover(seeds, first)) == first


def test_the_router_follows_the_pods_behind_a_headless_service(dns, backend, router):
    port = free_port()
    d2 = backend("decode", host="127.0.0.2", port=port)
    d3 = backend("decode", host="127.0.0.3", port=port)
    prefill = backend("prefill")
    dns["decode-headless"] = ["127.0.0.2", "127.0.0.3"]
    proxy = router([prefill.url], [f"http://decode-headless:{port}"], health_interval=0.05)

    def up(url: str) -> str:
        return f'tidegate:router_backend_up{{role="decode",url="{url}"}} 1.0'

    wait_until(lambda: up(d2.url) in (t := proxy.metrics()) and up(d3.url) in t, what="both up")
    for i in range(20):
        body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": 4}
        assert proxy.client.post("/v1/completions", json=body).status_code == 200
    assert d2.engine.received and d3.engine.received  # affinity spreads distinct prompts
    dns["decode-headless"] = ["127.0.0.3"]  # a pod went away
    wait_until(lambda: d2.url not in proxy.metrics(), what="the pod dropped")
    dns["decode-headless"] = ["127.0.0.2", "127.0.0.3"]  # it is back
    wait_until(lambda: up(d2.url) in proxy.metrics(), what="the pod back in rotation")
