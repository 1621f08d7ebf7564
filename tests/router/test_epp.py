"""The endpoint picker (`tidegate router --epp-port`) against a client that plays Envoy.

Fake engines stand in for the InferencePool's model servers; tests/router/envoy_client.py
plays the gateway: the ext_proc filter in each body mode, the requests upstream, and the
failure modes of a gateway whose picker is down.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from tests.router.conftest import Router, wait_until
from tests.router.envoy_client import (
    EnvoyClient,
    ExtProcStream,
    Mode,
    PickerFailed,
    body_message,
    header_map,
)
from tests.router.fake_engine import DECODE_CHUNKS
from tidegate.common.local_server import free_port
from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.auth import APIKeys
from tidegate.engine.router import epp as epp_module
from tidegate.engine.router.epp import (
    ENDPOINTS_PER_PICK,
    Exchange,
    Picker,
    ProtocolViolation,
    endpoint_of,
)
from tidegate.engine.router.epp_messages import (
    BODY_CHUNK_BYTES,
    BUFFERED_PARTIAL,
    FULL_DUPLEX_STREAMED,
    PREFILL_HEADER,
    STREAMED,
)
from tidegate.engine.router.proxy import Proxy
from tidegate.engine.router.selection import affinity_key, rendezvous_order

COMPLETION = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "stream": True}
STREAMED_COMPLETION = {**COMPLETION, "stream": True}


def epp_port(router: Router) -> int:
    port = router.server.server.config.app.state.epp_port
    assert isinstance(port, int) and port > 0
    return port


@pytest.fixture
def envoy() -> Any:
    """A client playing Envoy against a router's picker: envoy(router, mode=..., ...)."""
    clients: list[EnvoyClient] = []

    def connect(router: Router | None, **options: Any) -> EnvoyClient:
        target = f"127.0.0.1:{epp_port(router) if router else free_port()}"
        clients.append(EnvoyClient(target, **options))
        return clients[-1]

    yield connect
    for client in clients:
        client.close()


@pytest.fixture
def pool(backend, router) -> Callable[..., tuple[list, Router]]:
    """`count` fake decode engines and a router that picks among them."""

    def start(count: int = 1, prefill: int = 0, **flags: Any) -> tuple[list, Router]:
        decodes = [backend("decode") for _ in range(count)]
        prefills = [backend("prefill") for _ in range(prefill)]
        flags.setdefault("epp_port", 0)
        proxy = router([p.url for p in prefills], [d.url for d in decodes], **flags)
        return decodes, proxy

    return start


def in_flight(router: Router, url: str) -> float:
    pattern = rf'^tidegate:router_backend_in_flight{{role="\w+",url="{re.escape(url)}"}} (\S+)$'
    found = re.search(pattern, router.metrics(), re.MULTILINE)
    assert found, f"no in-flight gauge for {url}"
    return float(found.group(1))


def picks(router: Router, outcome: str) -> float:
    pattern = rf'^tidegate:router_epp_picks_total{{outcome="{outcome}"}} (\S+)$'
    found = re.search(pattern, router.metrics(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    ("mode", "without_waiting", "chunk_size"),
    [
        ("FULL_DUPLEX_STREAMED", True, 7),
        ("FULL_DUPLEX_STREAMED", True, None),
        ("BUFFERED", False, None),
        ("STREAMED", True, 5),
    ],
    ids=["full-duplex-chunked", "full-duplex-whole", "buffered", "streamed"],
)
def test_a_request_is_routed_and_relayed_in_every_body_mode(
    pool, envoy, mode: Mode, without_waiting: bool, chunk_size: int | None
):
    [decode], router = pool()
    client = envoy(router, mode=mode, send_body_without_waiting=without_waiting)
    relayed = client.request(
        "/v1/completions", STREAMED_COMPLETION, {"x-request-id": "r1"}, chunk_size=chunk_size
    )
    assert relayed.status == 200
    assert relayed.body == b"".join(DECODE_CHUNKS)
    decision = relayed.decision
    assert decision is not None
    # The header and the metadata name the same endpoints, and the route is picked anew.
    assert decision.endpoints == decision.metadata_endpoints == [endpoint_of(decode.url)]
    assert decision.cleared_route_cache
    assert decision.headers["content-length"] == str(len(json.dumps(STREAMED_COMPLETION)))
    assert relayed.endpoint == endpoint_of(decode.url)
    # The body reaches the engine as the client sent it, whatever the mode.
    [received] = decode.engine.received
    assert received.body == STREAMED_COMPLETION
    assert received.headers["x-gateway-destination-endpoint"] == endpoint_of(decode.url)
    assert received.headers["x-request-id"] == "r1"
    assert picks(router, "picked") == 1.0
    wait_until(lambda: in_flight(router, decode.url) == 0.0, what="the pick released")


def test_a_large_body_comes_back_whole_in_chunks_under_envoys_limit(pool, envoy):
    _, router = pool()
    body = {**COMPLETION, "prompt": "word " * 30_000}
    decision, stream = envoy(router).pick("/v1/completions", body, chunk_size=50_000)
    assert decision.status is None
    assert decision.body == json.dumps(body).encode()
    assert len(decision.body) > 2 * BODY_CHUNK_BYTES
    stream.cancel()


def test_the_fallback_list_is_the_pools_ranking_best_first(pool, envoy):
    decodes, router = pool(5)
    client = envoy(router)
    urls = [d.url for d in decodes]
    for prompt in ("one", "two", "three"):
        body = {**COMPLETION, "prompt": prompt}
        decision, stream = client.pick("/v1/completions", body)
        # Equal loads: the prompt's rendezvous order (router/selection.py), as for HTTP.
        expected = rendezvous_order(affinity_key(body) or "", urls)[:ENDPOINTS_PER_PICK]
        assert decision.endpoints == [endpoint_of(u) for u in expected]
        assert decision.metadata_endpoints == decision.endpoints
        stream.cancel()


def test_a_canary_comes_first_by_its_weight_and_the_stable_ones_follow(backend, router, envoy):
    stables = [backend("decode", track="stable") for _ in range(2)]
    canary = backend("decode", track="canary", traffic_weight="0.5")
    proxy = router([], [s.url for s in stables] + [canary.url], epp_port=0)
    client = envoy(proxy)
    everyone = sorted(endpoint_of(b.url) for b in (*stables, canary))
    first = {"stable": 0, "canary": 0}
    for prompt in range(30):
        decision, stream = client.pick("/v1/completions", {**COMPLETION, "prompt": f"p{prompt}"})
        stream.cancel()
        assert sorted(decision.endpoints) == everyone
        # The drawn track first, ranked as for HTTP, the other one as fallbacks.
        track = "canary" if decision.endpoints[0] == endpoint_of(canary.url) else "stable"
        if track == "stable":
            assert decision.endpoints[-1] == endpoint_of(canary.url)
        first[track] += 1
    assert min(first.values()) > 0, first  # one track 30 times in a row: 2e-9
    for track, count in first.items():
        pattern = rf'^tidegate:router_routed_requests_total{{role="decode",track="{track}"}} (\S+)$'
        found = re.search(pattern, proxy.metrics(), re.MULTILINE)
        assert found and float(found.group(1)) == count


def test_a_request_without_body_is_routed_at_its_headers(pool, envoy):
    [decode], router = pool()
    relayed = envoy(router).request("/v1/models", None, method="GET")
    assert relayed.status == 200
    assert relayed.endpoint == endpoint_of(decode.url)
    assert json.loads(relayed.body)["data"][0]["id"] == "tiny"


def test_the_gateways_subset_hint_limits_the_candidates(pool, envoy):
    decodes, router = pool(4)
    client = envoy(router)
    allowed = [endpoint_of(decodes[1].url), endpoint_of(decodes[3].url)]
    for prompt in ("a", "b", "c", "d"):
        decision, stream = client.pick(
            "/v1/completions", {**COMPLETION, "prompt": prompt}, subset=allowed
        )
        assert sorted(decision.endpoints) == sorted(allowed)
        stream.cancel()
    # A comma-separated string, as some data planes copy a header into the metadata.
    decision, stream = client.pick("/v1/completions", COMPLETION, subset=",".join(allowed[:1]))
    assert decision.endpoints == allowed[:1]
    stream.cancel()


@pytest.mark.parametrize("subset", [[], ["10.255.255.1:8000"]], ids=["empty", "outside-the-pool"])
def test_a_subset_with_no_eligible_endpoint_is_a_503(pool, envoy, subset):
    [decode], router = pool()
    relayed = envoy(router).request("/v1/completions", COMPLETION, subset=subset)
    assert relayed.status == 503
    assert relayed.endpoint is None
    assert relayed.decision is not None
    assert relayed.decision.error()["type"] == "server_error"
    assert "subset" in relayed.decision.error()["message"]
    assert relayed.headers["retry-after"] == "1"
    assert relayed.headers["content-type"] == "application/json"
    assert decode.engine.received == []
    assert picks(router, "no_endpoint") == 1.0


def test_no_healthy_endpoint_is_a_503(router, envoy):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = router([], [dead], epp_port=0, max_pending=0)
    relayed = envoy(proxy).request("/v1/completions", COMPLETION)
    assert relayed.status == 503
    error = relayed.decision.error()
    assert error["message"].startswith("no healthy decode instance")
    assert int(relayed.headers["retry-after"]) >= 1


def test_an_overloaded_pool_sheds_with_a_429(backend, router, envoy):
    busy = [backend("decode", reported_load=5.0) for _ in range(2)]
    proxy = router([], [b.url for b in busy], epp_port=0, epp_shed_load=4.0)
    client = envoy(proxy)
    wait_until(lambda: "tidegate:router_backend_up" in proxy.metrics())
    relayed = client.request("/v1/completions", COMPLETION)
    assert relayed.status == 429
    assert relayed.decision.error()["code"] == "rate_limit_exceeded"
    assert int(relayed.headers["retry-after"]) >= 1
    assert picks(proxy, "shed") == 1.0
    # Below the limit it routes again.
    for each in busy:
        each.engine.reported_load = 1.0
    wait_until(
        lambda: client.request("/v1/completions", COMPLETION).status == 200,
        what="the load to fall below --epp-shed-load",
    )


def test_a_pick_counts_in_flight_until_the_response_ends_on_the_endpoint_that_served(pool, envoy):
    decodes, router = pool(3)
    client = envoy(router)
    decision, stream = client.pick("/v1/completions", COMPLETION)
    primary, fallback = decision.endpoints[0], decision.endpoints[1]
    url = {endpoint_of(d.url): d.url for d in decodes}
    assert in_flight(router, url[primary]) == 1.0
    # The gateway reports that a fallback served it: the count moves there.
    relayed = client.finish(
        stream, 200, {"content-type": "text/event-stream"}, [b"a", b"b"], fallback
    )
    assert next(relayed) == b"a"
    assert in_flight(router, url[primary]) == 0.0
    assert in_flight(router, url[fallback]) == 1.0
    assert b"".join(relayed) == b"b"  # then the end of the body releases it
    assert all(in_flight(router, u) == 0.0 for u in url.values())


def test_a_stream_the_gateway_resets_gives_its_count_back(pool, envoy):
    [decode], router = pool()
    _, stream = envoy(router).pick("/v1/completions", COMPLETION)
    assert in_flight(router, decode.url) == 1.0
    stream.cancel()
    wait_until(lambda: in_flight(router, decode.url) == 0.0, what="the reset stream's release")


def test_a_draining_engines_503_takes_it_out_of_rotation(pool, envoy):
    _, router = pool(2)
    client = envoy(router)
    decision, stream = client.pick("/v1/completions", COMPLETION)
    first = decision.endpoints[0]
    headers = {"content-type": "application/json", "x-tidegate-draining": "1"}
    b"".join(client.finish(stream, 503, headers, [b"{}"], first))
    decision, stream = client.pick("/v1/completions", COMPLETION)
    assert first not in decision.endpoints
    stream.cancel()


def test_a_prefill_leg_gets_the_best_prefill_instance_in_a_header(pool, envoy):
    [decode], router = pool(1, prefill=1)
    [prefill] = router.server.server.config.app.state.proxy.pools["prefill"]
    client = envoy(router)
    relayed = client.request("/v1/chat/completions", CHAT, {PREFILL_HEADER: "evil:1"})
    assert relayed.status == 200
    [received] = decode.engine.received
    assert received.headers[PREFILL_HEADER] == endpoint_of(prefill.url)
    # n > 1 takes no prefill leg, and a client's own header never reaches the engine.
    relayed = client.request("/v1/completions", {**COMPLETION, "n": 2}, {PREFILL_HEADER: "evil:1"})
    assert relayed.status == 200
    assert PREFILL_HEADER not in decode.engine.received[1].headers


def test_without_a_healthy_prefill_instance_decode_computes_the_prompt(backend, router, envoy):
    decode = backend("decode")
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = router([dead], [decode.url], epp_port=0)
    relayed = envoy(proxy).request("/v1/completions", COMPLETION, {PREFILL_HEADER: "evil:1"})
    assert relayed.status == 200
    assert PREFILL_HEADER not in decode.engine.received[0].headers
    assert envoy(proxy).health("readiness") == "SERVING"  # it still routes


def test_a_body_that_is_not_json_is_a_400_and_the_picker_goes_on(pool, envoy):
    _, router = pool()
    client = envoy(router)
    for raw in (b"{not json", b"[1, 2]"):
        relayed = client.request("/v1/completions", raw)
        assert relayed.status == 400
        assert relayed.decision.error()["type"] == "invalid_request_error"
    assert client.request("/v1/completions", COMPLETION).status == 200
    assert picks(router, "error") == 2.0


def test_a_protocol_violation_closes_that_stream_alone(pool, envoy):
    _, router = pool()
    client = envoy(router)
    stream = ExtProcStream(client.stub, 10.0)
    stream.send(body_message(b"{}", end_of_stream=True))  # a body before any headers
    with pytest.raises(PickerFailed, match="INVALID_ARGUMENT"):
        stream.receive()
    assert client.request("/v1/completions", COMPLETION).status == 200


def test_grpc_health_follows_the_decode_pool(backend, router, envoy):
    decode = backend("decode")
    proxy = router([], [decode.url], epp_port=0)
    client = envoy(proxy)
    services = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
    assert client.health("liveness") == "SERVING"
    assert [client.health(s) for s in services] == ["SERVING"] * 3
    decode.kill()
    wait_until(lambda: client.health("readiness") == "NOT_SERVING", what="NOT_SERVING")
    assert [client.health(s) for s in services] == ["NOT_SERVING"] * 3
    assert client.health("liveness") == "SERVING"
    decode.revive()
    wait_until(lambda: client.health("readiness") == "SERVING", what="SERVING again")


def test_a_picker_that_is_down_leaves_the_gateway_to_its_failure_mode(pool, envoy):
    decodes, _ = pool(2)
    endpoints = [endpoint_of(d.url) for d in decodes]
    open_ = envoy(None, failure_mode="FailOpen", pool=endpoints)
    relayed = open_.request("/v1/completions", COMPLETION)
    assert relayed.status == 200
    assert relayed.endpoint in endpoints
    closed = envoy(None, failure_mode="FailClose", pool=endpoints)
    assert closed.request("/v1/completions", COMPLETION).status == 503


def test_on_shutdown_open_streams_close_cleanly(pool, envoy):
    _, router = pool()
    decision, stream = envoy(router).pick("/v1/completions", COMPLETION)
    assert decision.status is None
    router.server.stop(force=False)
    # A clean close: Envoy relays the rest of the response without the picker.
    with pytest.raises(StopIteration):
        stream.receive()
    assert stream.code() == grpc.StatusCode.OK


# The message sequence of one stream, without a network: Exchange takes each message and
# returns the answers, as the gRPC service sends them.

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def exchange(keys: APIKeys | None = None, **flags: Any) -> Exchange:
    return Exchange(picker(keys, **flags))


def picker(keys: APIKeys | None = None, **flags: Any) -> Picker:
    args = RouterArgs(decode=URLS, **flags)
    proxy = Proxy(args, client=None)  # type: ignore[arg-type]  # nothing is sent
    pool = proxy.pools["decode"]
    pool.set_urls(URLS)
    for instance in pool:
        pool.mark_healthy(instance)
    return Picker(args, proxy, keys)


def handle(epp: Exchange, message: Any) -> list:
    """One message through the exchange, as the stream's loop passes it."""
    return asyncio.run(epp.handle(message))


def headers_message(mode: int, without_waiting: bool = False, **headers: str) -> Any:
    found = {":method": "POST", ":path": "/v1/completions", **headers}
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=header_map(found)),
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=mode,
            response_body_mode=mode,
            send_body_without_waiting_for_header_response=without_waiting,
        ),
    )


def kinds(answers: list) -> list[str]:
    return [a.WhichOneof("response") for a in answers]


def test_full_duplex_answers_the_headers_once_the_body_ends_then_echoes_it():
    epp = exchange()
    raw = json.dumps(COMPLETION).encode()
    assert handle(epp, headers_message(FULL_DUPLEX_STREAMED)) == []
    assert handle(epp, body_message(raw[:10], end_of_stream=False)) == []
    answers = handle(epp, body_message(raw[10:], end_of_stream=True))
    assert kinds(answers) == ["request_headers", "request_body"]
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (raw, True)
    assert answers[0].request_headers.response.clear_route_cache
    assert epp.lease is not None and epp.lease.instance.in_flight == 1
    # The response: headers unchanged, every chunk echoed, the count given back at its end.
    answers = handle(epp, ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders()))
    assert kinds(answers) == ["response_headers"]
    answers = handle(epp, body_message(b"data", end_of_stream=True, request=False))
    assert answers[0].response_body.response.body_mutation.streamed_response.body == b"data"
    assert epp.lease.instance.in_flight == 0


def test_a_body_past_the_limit_is_a_413_and_is_not_kept(monkeypatch):
    monkeypatch.setattr(epp_module, "MAX_BODY_BYTES", 1000)
    epp = exchange()
    assert handle(epp, headers_message(FULL_DUPLEX_STREAMED)) == []
    assert handle(epp, body_message(b"x" * 600, end_of_stream=False)) == []
    (answer,) = handle(epp, body_message(b"x" * 600, end_of_stream=False))
    assert answer.immediate_response.status.code == 413
    error = json.loads(answer.immediate_response.body)["error"]
    assert error["type"] == "invalid_request_error" and "1,000 bytes" in error["message"]
    assert epp.finished and not epp.body and epp.lease is None


def test_trailers_end_a_body_that_had_no_end_of_stream():
    epp = exchange()
    handle(epp, headers_message(FULL_DUPLEX_STREAMED))
    handle(epp, body_message(json.dumps(COMPLETION).encode(), end_of_stream=False))
    trailers = ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers())
    answers = handle(epp, trailers)
    assert kinds(answers) == ["request_headers", "request_body", "request_trailers"]
    # The trailers follow: the echoed body does not end the stream.
    assert not answers[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_streamed_with_body_first_answers_each_chunk_after_the_routing():
    epp = exchange()
    raw = json.dumps(COMPLETION).encode()
    assert handle(epp, headers_message(STREAMED, without_waiting=True)) == []
    assert handle(epp, body_message(raw[:5], end_of_stream=False)) == []
    answers = handle(epp, body_message(raw[5:], end_of_stream=True))
    assert kinds(answers) == ["request_headers", "request_body", "request_body"]
    assert not answers[1].request_body.response.HasField("body_mutation")


def test_streamed_waiting_for_the_headers_answer_routes_without_the_body():
    epp = exchange()
    answers = handle(epp, headers_message(STREAMED, without_waiting=False))
    assert kinds(answers) == ["request_headers"]
    assert answers[0].request_headers.response.header_mutation.set_headers
    answers = handle(epp, body_message(b"{not json", end_of_stream=True))
    assert kinds(answers) == ["request_body"]


def test_a_buffered_partial_body_cut_short_is_routed_without_it():
    epp = exchange()
    assert kinds(handle(epp, headers_message(BUFFERED_PARTIAL))) == ["request_headers"]
    answers = handle(epp, body_message(b'{"prompt": "cut he', end_of_stream=False))
    assert kinds(answers) == ["request_body"]
    assert answers[0].request_body.response.header_mutation.set_headers
    assert answers[0].dynamic_metadata.fields["envoy.lb"]


def test_the_tenant_header_salts_the_route_as_for_http(monkeypatch):
    epp = exchange(cache_salt_header="X-Tenant-Id")
    proxy = epp.picker.proxy
    routed = proxy.route
    seen: list[dict] = []

    async def route(path: str, body: dict, request_id: str) -> Any:
        seen.append(body)
        return await routed(path, body, request_id)

    monkeypatch.setattr(proxy, "route", route)
    handle(epp, headers_message(FULL_DUPLEX_STREAMED, **{"x-tenant-id": "acme"}))
    handle(epp, body_message(json.dumps({**COMPLETION, "cache_salt": "globex"}).encode(), True))
    # The header's tenant, never the body's: the engines derive the salt the same way.
    assert [body["cache_salt"] for body in seen] == ["acme"]


@pytest.mark.parametrize(
    "messages",
    [
        [body_message(b"{}", end_of_stream=True)],
        [headers_message(FULL_DUPLEX_STREAMED), headers_message(FULL_DUPLEX_STREAMED)],
        [ext_proc.ProcessingRequest()],
    ],
    ids=["body-first", "headers-twice", "empty"],
)
def test_protocol_violations_are_named(messages):
    epp = exchange()
    with pytest.raises(ProtocolViolation):
        for message in messages:
            handle(epp, message)


def routed_request(epp: Exchange, **headers: str) -> ext_proc.ProcessingResponse:
    """Headers and a whole body through the exchange; the answer that routes or refuses it."""
    handle(epp, headers_message(FULL_DUPLEX_STREAMED, **headers))
    return handle(epp, body_message(json.dumps(COMPLETION).encode(), True))[0]


def test_a_tenant_at_its_limit_is_refused_with_a_429_until_one_of_its_responses_ends():
    # Two instances, 1 running + 1 waiting each: four of a tenant's requests in flight.
    shared = picker(
        cache_salt_header="X-Tenant-Id", max_running_per_tenant=1, max_waiting_per_tenant=1
    )
    acme = [Exchange(shared) for _ in range(5)]
    answers = [routed_request(epp, **{"x-tenant-id": "acme"}) for epp in acme]
    assert [a.WhichOneof("response") for a in answers[:4]] == ["request_headers"] * 4
    refused = answers[4].immediate_response
    assert refused.status.code == 429 and refused.details == "tidegate_epp_tenant_limit"
    error = json.loads(refused.body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "limit of 4" in error["message"]
    # Another tenant is not held back by acme's flood.
    globex = Exchange(shared)
    assert routed_request(globex, **{"x-tenant-id": "globex"}).HasField("request_headers")
    assert shared.tenants is not None and shared.tenants.in_flight == {"acme": 4, "globex": 1}
    # The end of one of acme's responses gives its count back; a refusal held none.
    handle(acme[0], body_message(b"data", end_of_stream=True, request=False))
    assert routed_request(Exchange(shared), **{"x-tenant-id": "acme"}).HasField("request_headers")
    for epp in [*acme, globex]:
        epp.release()
        epp.release()  # once only
    assert shared.tenants.in_flight == {"acme": 1}


def test_with_api_keys_the_picker_refuses_a_missing_or_wrong_key_and_counts_by_key():
    keys = APIKeys(["k1", "k2"])
    shared = picker(keys, max_running_per_tenant=1, max_waiting_per_tenant=1)
    missing = routed_request(Exchange(shared)).immediate_response
    wrong = routed_request(Exchange(shared), authorization="Bearer nope").immediate_response
    assert missing.status.code == wrong.status.code == 401
    assert wrong.details == "tidegate_epp_unauthorized"
    assert json.loads(wrong.body)["error"]["code"] == "invalid_api_key"
    # Four requests in flight for each key (two per instance): two keys are two tenants.
    for key in ["k1"] * 4 + ["k2"] * 4:
        answer = routed_request(Exchange(shared), authorization=f"Bearer {key}")
        assert answer.HasField("request_headers"), key
    third = routed_request(Exchange(shared), authorization="Bearer k1").immediate_response
    assert third.status.code == 429
    assert shared.tenants is not None and len(shared.tenants.in_flight) == 2
