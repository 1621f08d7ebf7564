"""A client's request goes through prefill, then decode, and comes back as decode sent it."""

from __future__ import annotations

import threading
import time

import pytest

from tests.router.conftest import wait_until
from tests.router.fake_engine import DECODE_CHUNKS

COMPLETION = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "min_tokens": 4}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello"}],
    "max_completion_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_a_completion_is_prefilled_then_decoded_with_the_prefills_kv_params(pd):
    prefill, decode, router = pd
    headers = {"Authorization": "Bearer k", "X-Request-Id": "req-1"}
    response = router.client.post("/v1/completions", json=COMPLETION, headers=headers)
    assert response.status_code == 200
    assert response.json()["choices"] == [{"text": "one two 3"}]
    assert response.headers["content-type"] == "application/json"
    [first] = prefill.engine.received
    # One token is all a prefill computes: a min_tokens above it would only be refused.
    unbounded = {key: value for key, value in COMPLETION.items() if key != "min_tokens"}
    assert first.body == {
        **unbounded,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    [second] = decode.engine.received
    assert second.body == {**COMPLETION, "kv_transfer_params": prefill.engine.kv_params("req-1")}
    for leg in (first, second):
        assert leg.headers["x-request-id"] == "req-1"
        assert leg.headers["authorization"] == "Bearer k"


def test_a_chat_prefill_is_capped_at_one_token_and_not_streamed(pd):
    prefill, decode, router = pd
    with router.client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert b"".join(response.iter_raw()) == b"".join(DECODE_CHUNKS)
    [first] = prefill.engine.received
    assert first.body["max_tokens"] == first.body["max_completion_tokens"] == 1
    assert first.body["stream"] is False
    assert "stream_options" not in first.body
    [second] = decode.engine.received
    assert second.body["stream_options"] == {"include_usage": True}
    # One id per client request when the client gives none, the same on both legs.
    request_id = first.headers["x-request-id"]
    assert len(request_id) >= 16
    assert second.headers["x-request-id"] == request_id
    assert second.body["kv_transfer_params"] == prefill.engine.kv_params(request_id)


def test_a_stream_reaches_the_client_chunk_by_chunk(backend, router):
    gate = threading.Event()
    prefill, decode = backend("prefill"), backend("decode", gate=gate)
    client = router([prefill.url], [decode.url]).client
    started = time.monotonic()
    with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as reply:
        chunks = reply.iter_raw()
        first = next(chunks)
        # The decode engine holds the rest until the client has its first chunk.
        assert time.monotonic() - started < 5.0
        assert first == DECODE_CHUNKS[0]
        gate.set()
        assert first + b"".join(chunks) == b"".join(DECODE_CHUNKS)


def test_n_above_one_and_batches_skip_the_prefill_leg(pd):
    prefill, decode, router = pd
    bodies = [
        {**COMPLETION, "n": 2},
        {**COMPLETION, "prompt": ["a", "b"]},
        {**COMPLETION, "prompt": [[1, 2], [3]]},
        {**CHAT, "stream": False, "n": 3, "kv_transfer_params": {"forged": True}},
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert router.client.post(path, json=body).status_code == 200
    assert prefill.engine.received == []
    sent = [r.body for r in decode.engine.received]
    assert sent[:3] == bodies[:3]
    assert "kv_transfer_params" not in sent[3]  # only the router sets those
    assert "tidegate:router_prefill_skipped_total 4.0" in router.metrics()


def test_embeddings_go_to_a_decode_instance_in_one_leg(pd):
    """An embedding comes from computing the input, which a pull of its KV would skip."""
    prefill, decode, router = pd
    body = {"model": "tiny", "input": "Once upon a time", "dimensions": 8}
    headers = {"Authorization": "Bearer k", "X-Request-Id": "emb-1"}
    assert router.client.post("/v1/embeddings", json=body, headers=headers).status_code == 200
    assert prefill.engine.received == []
    [sent] = decode.engine.received
    assert (sent.path, sent.body) == ("/v1/embeddings", body)
    assert sent.headers["x-request-id"] == "emb-1"
    assert "tidegate:router_prefill_skipped_total 1.0" in router.metrics()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/classify", {"input": ["Once upon a time", "the end"]}),
        ("/v1/score", {"text_1": "Once upon a time", "text_2": ["a", "b"]}),
        ("/rerank", {"query": "Once upon a time", "documents": ["a", "b"]}),
        ("/v2/rerank", {"query": "Once upon a time", "documents": ["a"], "top_n": 1}),
    ],
)
def test_classification_and_scores_go_to_a_decode_instance_in_one_leg(pd, path, body):
    """Like embeddings, they pool what the instance computes itself."""
    prefill, decode, router = pd
    body = {"model": "tiny", **body}
    headers = {"Authorization": "Bearer k"}
    assert router.client.post(path, json=body, headers=headers).status_code == 200
    assert prefill.engine.received == []
    [sent] = decode.engine.received
    assert (sent.path, sent.body) == (path, body)


def test_a_single_prompt_of_token_ids_is_prefilled(pd):
    prefill, _, router = pd
    body = {**COMPLETION, "prompt": [5, 6, 7]}
    assert router.client.post("/v1/completions", json=body).status_code == 200
    assert prefill.engine.received[0].body["prompt"] == [5, 6, 7]


def test_a_prefill_4xx_is_the_clients_answer_and_decode_never_runs(backend, router):
    prefill, decode = backend("prefill", error_status=400), backend("decode")
    client = router([prefill.url], [decode.url]).client
    response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prefill0 refuses"
    assert decode.engine.received == []
    assert client.get("/health").status_code == 200  # a client error is no instance fault


def test_a_decode_4xx_is_passed_through(backend, router):
    prefill, decode = backend("prefill"), backend("decode", error_status=404)
    response = router([prefill.url], [decode.url]).client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "decode1 refuses"


def test_models_come_from_a_decode_instance(pd):
    _, decode, router = pd
    response = router.client.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "tiny"
    assert decode.engine.received[0].headers["authorization"] == "Bearer k"


def test_unknown_paths_and_bad_bodies_get_openai_errors(pd):
    _, _, router = pd
    missing = router.client.get("/v1/audio/speech")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"].startswith("no route GET /v1/audio/speech")
    assert router.client.get("/v1/embeddings").status_code == 405
    assert router.client.get("/v1/completions").status_code == 405
    bad = router.client.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_requests_per_leg_and_show_backends(pd):
    prefill, decode, router = pd
    router.client.post("/v1/completions", json=COMPLETION)
    text = router.metrics()
    assert 'tidegate:router_requests_total{code="200",leg="prefill"} 1.0' in text
    assert 'tidegate:router_requests_total{code="200",leg="decode"} 1.0' in text
    assert f'tidegate:router_backend_up{{role="decode",url="{decode.url}"}} 1.0' in text
    assert f'tidegate:router_backend_in_flight{{role="prefill",url="{prefill.url}"}} 0.0' in text
    assert 'tidegate:router_request_latency_seconds_count{leg="decode"} 1.0' in text


def test_without_prefill_instances_the_router_balances_whole_requests(backend, router):
    """A unified pool behind the router (`tidegate up` with several unified replicas)."""
    first, second = backend("decode"), backend("decode")
    balancer = router([], [first.url, second.url])
    # The router is healthy with one backend up; the spread needs both to be seen up.
    wait_until(
        lambda: all(
            f'tidegate:router_backend_up{{role="decode",url="{b.url}"}} 1.0' in balancer.metrics()
            for b in (first, second)
        ),
        what="both backends up",
    )
    # Rendezvous hashing over the two (randomly ported) URLs sends all of n distinct prefixes
    # to one of them with probability 2^(1-n): 1 in 128 for 8, which did happen; 24 makes it
    # 1 in 8 million.
    for i in range(24):
        body = {**COMPLETION, "prompt": f"prompt {i} " * 40}
        assert balancer.client.post("/v1/completions", json=body).status_code == 200
    received = first.engine.received + second.engine.received
    assert len(received) == 24
    assert all("kv_transfer_params" not in leg.body for leg in received)
    assert first.engine.received and second.engine.received  # different prefixes spread
    assert "tidegate:router_prefill_skipped_total 0.0" in balancer.metrics()
