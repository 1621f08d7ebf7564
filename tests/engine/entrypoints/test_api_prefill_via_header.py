"""--prefill-via-header: a consumer runs the prefill leg on the instance the header names.

The decode side is the real API app over the scripted engine, in its lifespan; the prefill
instance is a small app on a real socket that records what it gets and answers as scripted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from tests.engine.entrypoints.fake_engine import MODEL, FakeEngine, parse_sse
from tests.router.fake_engine import ServerThread
from tidegate.common.local_server import free_port
from tidegate.engine.config import EngineArgs, ServerArgs
from tidegate.engine.entrypoints.openai import prefill_via_header
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.entrypoints.openai.pd_bodies import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    prefill_body,
)
from tidegate.engine.entrypoints.openai.prefill_via_header import (
    PREFILLER_HEADER,
    prefiller_address,
)
from tidegate.engine.entrypoints.serve import _serve
from tidegate.engine.metrics import PREFILL_FALLBACK_REASONS, PrometheusMetrics

TIMEOUT_S = 10.0
LOGGER = "tidegate.engine.entrypoints.openai.prefill_via_header"


def remote_prefill(request_id: str) -> dict[str, Any]:
    """kv_transfer_params as a producer answers them."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_request_id": request_id or "transfer-1",
        "remote_host": "10.0.0.9",
        "remote_port": 14579,
        "remote_data_ports": [14580],
        "remote_block_ids": [3, 4],
        "remote_block_size": 16,
        "remote_tp_size": 1,
        "prompt_digest": "d1g35t",
    }


@dataclass
class Got:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakePrefill:
    """A prefill instance: records each request, answers as the test says."""

    received: list[Got] = field(default_factory=list)
    status: int = 200
    answer: Any = None  # the JSON to answer instead of a producer's
    retry_after: str | None = None
    redirect: bool = False
    hold: bool = False  # answer nothing until the caller hangs up
    held: threading.Event = field(default_factory=threading.Event)
    hung_up: threading.Event = field(default_factory=threading.Event)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(COMPLETIONS_PATH, self._serve, methods=["POST"]),
                Route(CHAT_PATH, self._serve, methods=["POST"]),
                Route("/elsewhere", self._serve, methods=["POST"]),
            ]
        )

    async def _serve(self, request: Request) -> Response:
        self.received.append(Got(request.url.path, await request.json(), dict(request.headers)))
        if self.hold:
            self.held.set()
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.hung_up.set()
                    break
                await asyncio.sleep(0.01)
            return JSONResponse({})
        if self.redirect:
            return RedirectResponse("/elsewhere", status_code=307)
        if self.status != 200:
            error = {"message": "the prefill refuses", "type": "invalid_request_error"}
            headers = {"Retry-After": self.retry_after} if self.retry_after else None
            return JSONResponse({"error": error}, status_code=self.status, headers=headers)
        if self.answer is not None:
            return JSONResponse(self.answer)
        params = remote_prefill(request.headers.get("x-request-id", ""))
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        return JSONResponse({"id": "cmpl-1", "choices": [choice], "kv_transfer_params": params})


@pytest.fixture
def fake_prefill() -> Iterator[tuple[FakePrefill, str]]:
    prefill = FakePrefill()
    server = ServerThread(prefill.app()).start()
    try:
        yield prefill, f"127.0.0.1:{server.port}"
    finally:
        server.stop()


@pytest.fixture
def consumer(engine: FakeEngine) -> FakeEngine:
    engine.kv_role = "consumer"
    return engine


def decode_app(engine: FakeEngine, tiny_llama_dir, **kwargs: Any):
    metrics = PrometheusMetrics(MODEL)
    flag = kwargs.pop("prefill_via_header", True)
    if flag:
        metrics.enable_prefill_via_header()
    app = build_app(
        engine,
        served_model_names=[MODEL],
        model_path=str(tiny_llama_dir),
        metrics=metrics,
        prefill_via_header=flag,
        on_prefill_fallback=metrics.record_prefill_header_fallback,
        **kwargs,
    )
    return app, metrics


def post(app: Any, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    """POST to the app inside its lifespan (which holds the prefill leg's client)."""

    async def run() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return await client.post(path, json=body, headers=headers)

    return asyncio.run(run())


def fallbacks(metrics: PrometheusMetrics) -> dict[str, float]:
    body, _ = metrics.render()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "tidegate:prefill_header_fallbacks_total"
    }


COMPLETION = {"model": MODEL, "prompt": "The tide", "max_tokens": 5, "temperature": 0}


def scripted(engine: FakeEngine) -> str:
    """What the scripted engine answers COMPLETION, wherever its prompt was computed."""
    return engine.tokenizer.decode(engine.script_ids[: COMPLETION["max_tokens"]])


def test_the_named_instance_prefills_and_the_decode_pulls_its_kv(
    consumer, tiny_llama_dir, fake_prefill
):
    prefill, address = fake_prefill
    app, metrics = decode_app(consumer, tiny_llama_dir)
    body = {**COMPLETION, "stream_options": None, "min_tokens": 2}
    headers = {
        PREFILLER_HEADER: address,
        "authorization": "Bearer client-key",
        "x-request-id": "req-7",
    }
    response = post(app, COMPLETIONS_PATH, body, headers)

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == scripted(consumer)
    assert response.json()["id"] == "cmpl-req-7"
    [got] = prefill.received
    assert got.path == COMPLETIONS_PATH
    assert got.body == prefill_body(COMPLETIONS_PATH, body)
    assert got.body["kv_transfer_params"] == {"do_remote_decode": True}
    assert got.headers["authorization"] == "Bearer client-key"
    assert got.headers["x-request-id"] == "req-7"
    assert PREFILLER_HEADER not in got.headers
    [submitted] = consumer.submitted
    assert submitted.kv_transfer_params is not None
    assert submitted.kv_transfer_params["remote_request_id"] == "req-7"
    assert submitted.kv_transfer_params["remote_block_ids"] == [3, 4]
    assert set(fallbacks(metrics).values()) == {0.0}


def test_a_streamed_chat_takes_the_prefill_leg_too(consumer, tiny_llama_dir, fake_prefill):
    prefill, address = fake_prefill
    app, _ = decode_app(consumer, tiny_llama_dir)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = post(app, CHAT_PATH, body, {PREFILLER_HEADER: address})

    assert response.status_code == 200
    events = parse_sse(response)
    assert events[-2]["usage"]["completion_tokens"] == 4
    [got] = prefill.received
    assert got.path == CHAT_PATH
    assert got.body["stream"] is False and "stream_options" not in got.body
    assert got.body["max_completion_tokens"] == 1 and got.body["max_tokens"] == 1
    [submitted] = consumer.submitted
    assert submitted.kv_transfer_params["do_remote_prefill"] is True


def test_the_prefill_leg_carries_the_tenants_salt_and_header(
    consumer, tiny_llama_dir, fake_prefill
):
    prefill, address = fake_prefill
    app, _ = decode_app(consumer, tiny_llama_dir, cache_salt_header="x-tenant")
    body = {**COMPLETION, "cache_salt": "another-tenants-salt"}
    response = post(app, COMPLETIONS_PATH, body, {PREFILLER_HEADER: address, "x-tenant": "t1"})

    assert response.status_code == 200
    [got] = prefill.received
    assert got.body["cache_salt"] == "t1"
    assert got.headers["x-tenant"] == "t1"
    assert consumer.submitted[0].cache_salt == "t1"


def test_without_the_flag_the_header_is_ignored_and_said_once(
    engine, tiny_llama_dir, fake_prefill, caplog
):
    prefill, address = fake_prefill
    engine.kv_role = "consumer"
    app, _ = decode_app(engine, tiny_llama_dir, prefill_via_header=False)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for _ in range(2):
        response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: address})
        assert response.status_code == 200
    assert prefill.received == []
    assert all(r.kv_transfer_params is None for r in engine.submitted)
    assert len([r for r in caplog.records if PREFILLER_HEADER in r.getMessage()]) == 1


@pytest.mark.parametrize(
    "value",
    [
        "10.0.0.1",
        "10.0.0.1:",
        ":8000",
        "10.0.0.1:0",
        "10.0.0.1:65536",
        "10.0.0.1:+80",
        "http://10.0.0.1:8000",
        "user@10.0.0.1:8000",
        "10.0.0.1:8000/v1",
        "10.0.0.1:8000,10.0.0.2:8000",
        "999.0.0.1:8000",
        "010.0.0.1:8000",
        "::1:8000",
        "[zz::1]:8000",
        "[fe80::1%25eth0]:8000",
        "-prefill:8000",
        "pre fill:8000",
        "a..b:8000",
    ],
)
def test_a_header_that_is_not_host_port_is_a_400_naming_it(consumer, tiny_llama_dir, value):
    app, _ = decode_app(consumer, tiny_llama_dir)
    response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: value})

    assert response.status_code == 400
    error = response.json()["error"]
    assert PREFILLER_HEADER in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == PREFILLER_HEADER
    assert consumer.submitted == []


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1:8000", "[::1]:8000", "[::ffff:10.0.0.1]:1", "prefill-0.pd.svc.cluster.local:65535"],
)
def test_host_port_values_that_pass(value):
    assert prefiller_address(value) == value


def test_a_prefill_instance_that_cannot_be_reached_leaves_the_prompt_here(
    consumer, tiny_llama_dir, caplog
):
    app, metrics = decode_app(consumer, tiny_llama_dir)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: address})

    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == scripted(consumer)
    assert consumer.submitted[0].kv_transfer_params is None
    assert fallbacks(metrics)["unreachable"] == 1
    assert any(r.levelno == logging.WARNING and address in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (dict(status=503), "server_error"),
        (dict(status=500), "server_error"),
        (dict(answer={"id": "cmpl-1", "choices": []}), "bad_response"),
        (dict(answer={"kv_transfer_params": {"do_remote_prefill": True}}), "bad_response"),
        (dict(answer=["not", "an", "object"]), "bad_response"),
        (dict(redirect=True), "bad_response"),
    ],
    ids=["503", "500", "no-params", "bad-params", "not-an-object", "redirect"],
)
def test_a_failed_prefill_leg_falls_back_to_computing_the_prompt_and_counts(
    consumer, tiny_llama_dir, fake_prefill, setup, reason
):
    prefill, address = fake_prefill
    for name, value in setup.items():
        setattr(prefill, name, value)
    app, metrics = decode_app(consumer, tiny_llama_dir)
    response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: address})

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == scripted(consumer)
    assert consumer.submitted[0].kv_transfer_params is None
    counted = fallbacks(metrics)
    assert counted == {r: float(r == reason) for r in PREFILL_FALLBACK_REASONS}
    # A redirect is not followed: the prompt goes only where the picker pointed.
    assert [got.path for got in prefill.received] == [COMPLETIONS_PATH]


def test_a_prefill_leg_that_times_out_falls_back(
    consumer, tiny_llama_dir, fake_prefill, monkeypatch
):
    prefill, address = fake_prefill
    prefill.hold = True
    monkeypatch.setattr(prefill_via_header, "PREFILL_TIMEOUT", httpx.Timeout(0.3, connect=2.0))
    app, metrics = decode_app(consumer, tiny_llama_dir)
    response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: address})

    assert response.status_code == 200
    assert consumer.submitted[0].kv_transfer_params is None
    assert fallbacks(metrics)["timeout"] == 1
    assert prefill.hung_up.wait(TIMEOUT_S)  # the leg given up is closed, so it is aborted


@pytest.mark.parametrize(("status", "retry_after"), [(400, None), (404, None), (429, "3")])
def test_a_4xx_from_the_prefill_instance_is_the_clients_answer(
    consumer, tiny_llama_dir, fake_prefill, status, retry_after
):
    prefill, address = fake_prefill
    prefill.status, prefill.retry_after = status, retry_after
    app, metrics = decode_app(consumer, tiny_llama_dir)
    response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: address})

    assert response.status_code == status
    assert response.json()["error"]["message"] == "the prefill refuses"
    assert response.headers.get("retry-after") == retry_after
    assert consumer.submitted == []
    assert set(fallbacks(metrics).values()) == {0.0}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS_PATH, {**COMPLETION, "n": 2}),
        (COMPLETIONS_PATH, {**COMPLETION, "prompt": ["one", "two"]}),
        (COMPLETIONS_PATH, {**COMPLETION, "prompt": [[5, 6], [7, 8]]}),
        (COMPLETIONS_PATH, {**COMPLETION, "kv_transfer_params": remote_prefill("router")}),
        (CHAT_PATH, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}),
    ],
    ids=["n", "batch", "token-batch", "router-ran-it", "chat-n"],
)
def test_requests_p_d_does_not_serve_run_here_without_a_prefill_leg(
    consumer, tiny_llama_dir, fake_prefill, path, body
):
    prefill, address = fake_prefill
    app, metrics = decode_app(consumer, tiny_llama_dir)
    response = post(app, path, body, {PREFILLER_HEADER: address})

    assert response.status_code == 200, response.text
    assert prefill.received == []
    assert set(fallbacks(metrics).values()) == {0.0}
    # Only the params a router sent, if any: none came from a prefill leg.
    sent = body.get("kv_transfer_params")
    for request in consumer.submitted:
        got = request.kv_transfer_params
        assert got is None if sent is None else got["remote_request_id"] == "router"


def test_a_client_that_leaves_during_the_prefill_leg_cancels_it(
    consumer, tiny_llama_dir, fake_prefill
):
    prefill, address = fake_prefill
    prefill.hold = True
    app, metrics = decode_app(consumer, tiny_llama_dir)
    payload = json.dumps(COMPLETION).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": COMPLETIONS_PATH,
        "raw_path": COMPLETIONS_PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (PREFILLER_HEADER.encode(), address.encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.to_thread(prefill.held.wait, TIMEOUT_S)  # the leg has started
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), TIMEOUT_S)

    asyncio.run(main())
    assert prefill.hung_up.wait(TIMEOUT_S)
    assert consumer.submitted == []
    assert sent[0]["status"] == 499
    assert set(fallbacks(metrics).values()) == {0.0}


@pytest.mark.parametrize("role", ["none", "producer"])
def test_only_a_consumer_takes_the_header(engine, tiny_llama_dir, role):
    engine.kv_role = role
    with pytest.raises(ValueError, match="consumer"):
        decode_app(engine, tiny_llama_dir)


@pytest.mark.parametrize("role", ["none", "producer"])
def test_serve_refuses_the_flag_beside_another_role_before_loading_anything(tmp_path, caplog, role):
    engine_args = EngineArgs(model=str(tmp_path / "no-model-here"), kv_role=role)
    server_args = ServerArgs(prefill_via_header=True)
    with caplog.at_level(logging.ERROR, logger="tidegate.serve"):
        assert asyncio.run(_serve(engine_args, server_args)) == 1
    [record] = caplog.records
    assert "--prefill-via-header needs --kv-role consumer" in record.getMessage()
    assert f"--kv-role {role}" in record.getMessage()


def test_the_fallback_counter_exists_only_with_the_flag(consumer, tiny_llama_dir):
    _, plain = decode_app(consumer, tiny_llama_dir, prefill_via_header=False)
    assert fallbacks(plain) == {}
    _, enabled = decode_app(consumer, tiny_llama_dir)
    assert fallbacks(enabled) == dict.fromkeys(PREFILL_FALLBACK_REASONS, 0.0)


# --- --prefill-hosts -------------------------------------------------------------------------


def test_a_host_outside_prefill_hosts_is_never_sent_the_prompt(
    consumer, tiny_llama_dir, fake_prefill
):
    prefill, address = fake_prefill
    # The listed instance is elsewhere: the header's (a real, answering server) is not it.
    app, metrics = decode_app(consumer, tiny_llama_dir, prefill_hosts=["10.0.0.7"])
    headers = {PREFILLER_HEADER: address, "authorization": "Bearer client-key"}
    response = post(app, COMPLETIONS_PATH, COMPLETION, headers)

    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == scripted(consumer)
    assert prefill.received == []  # neither the prompt nor the key left this server
    assert consumer.submitted[0].kv_transfer_params is None  # computed here
    assert fallbacks(metrics)["not_allowed"] == 1.0


def test_a_listed_name_allows_every_address_it_resolves_to(consumer, tiny_llama_dir, fake_prefill):
    prefill, address = fake_prefill
    # "localhost" stands for a headless Service: its addresses are the pods'.
    app, metrics = decode_app(consumer, tiny_llama_dir, prefill_hosts=["localhost"])
    response = post(app, COMPLETIONS_PATH, COMPLETION, {PREFILLER_HEADER: address})

    assert response.status_code == 200
    assert len(prefill.received) == 1
    assert consumer.submitted[0].kv_transfer_params is not None
    assert set(fallbacks(metrics).values()) == {0.0}


def test_allowed_hosts_resolve_again_for_an_address_not_known_yet() -> None:
    answers = [{"10.0.0.1"}, {"10.0.0.1", "10.0.0.2"}]
    calls: list[str] = []
    now = [100.0]

    async def resolve(name: str) -> set[str]:
        calls.append(name)
        return answers[min(len(calls), len(answers)) - 1]

    allowed = prefill_via_header.AllowedHosts(
        ["prefill.ns.svc", "[fd00::5]"], resolve=resolve, clock=lambda: now[0]
    )

    async def story() -> list[bool]:
        seen = [await allowed.allows("10.0.0.1"), await allowed.allows("fd00::5")]
        # A pod that just became ready: unknown, and the last lookup is too recent.
        seen.append(await allowed.allows("10.0.0.2"))
        now[0] += 1.0  # past MIN_REFRESH_S: an unknown address looks again
        seen.append(await allowed.allows("10.0.0.2"))
        seen.append(await allowed.allows("10.9.9.9"))  # not again within the second
        return seen

    assert asyncio.run(story()) == [True, True, False, True, False]
    assert calls == ["prefill.ns.svc", "prefill.ns.svc"]


def test_prefill_hosts_need_the_header_flag() -> None:
    with pytest.raises(ValueError, match="prefill_hosts needs prefill_via_header"):
        ServerArgs(prefill_hosts=["prefill.ns.svc"])
    ServerArgs(prefill_via_header=True, prefill_hosts=["prefill.ns.svc"])
