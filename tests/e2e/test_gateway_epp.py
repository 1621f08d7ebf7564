"""A gateway asks `tidegate router --epp-port` where each request goes; real engines answer.

Two tiny-model instances form the InferencePool (a unified pool, publishing their KV-cache
events); the router's endpoint picker chooses among them for a client that plays the gateway
(tests/router/envoy_client.py): the request over ext_proc, then over HTTP to the endpoint
picked, and the response relayed through ext_proc's response phase. Which instance is picked
is the router's business (tests/e2e/test_kv_routing.py): here, only that it is a healthy one
of the pool, that it is the one that answers, and that the header and the metadata agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.client import finished
from tests.e2e.server import ServerProcess
from tests.router.envoy_client import EnvoyClient, Mode
from tidegate.common.local_server import LocalServer, free_port
from tidegate.engine.router.epp import endpoint_of

# Two engines start and stop with the module: about 25 s on 2 cores.
pytestmark = pytest.mark.slow

MODEL = "tiny"
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "512", "--kv-events-port", "0")
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the tide."}],
    "max_tokens": 8,
    "temperature": 0,
}
COMPLETION = {"model": MODEL, "prompt": "The gateway asks", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("gateway-epp")
    engines = [ServerProcess(tiny_llama_dir, logs, *FLAGS) for _ in range(2)]
    started: list[LocalServer] = list(engines)
    try:
        for engine in engines:
            engine.wait_healthy()
        epp_port = free_port()
        router = LocalServer.tidegate_router(
            [],
            [e.base_url for e in engines],
            "--health-interval",
            "0.5",
            "--tokenizer",
            str(tiny_llama_dir),
            "--epp-port",
            str(epp_port),
            log=logs / "router.log",
        )
        started.append(router)
        router.wait_healthy(30.0)
        yield {
            "engines": {endpoint_of(e.base_url): e for e in engines},
            "router": router,
            "epp": f"127.0.0.1:{epp_port}",
        }
    finally:
        codes = {server.base_url: server.stop() for server in reversed(started)}
    # The router stops its picker with its HTTP server, and exits 0 like the engines.
    assert set(codes.values()) == {0}, codes


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_picked_endpoint_answers_through_the_gateway(gateway: dict, mode: Mode, stream: bool):
    engines = gateway["engines"]
    body = {**CHAT, "stream": stream}
    before = {endpoint: finished(e.base_url) for endpoint, e in engines.items()}
    with EnvoyClient(gateway["epp"], mode=mode, timeout_s=60.0) as client:
        relayed = client.request("/v1/chat/completions", body, {"x-request-id": "gw-1"})
    assert relayed.status == 200, relayed.body
    decision = relayed.decision
    assert decision is not None
    # Both instances, primary first, in the header and in the metadata alike.
    assert decision.endpoints == decision.metadata_endpoints
    assert sorted(decision.endpoints) == sorted(engines)
    assert relayed.endpoint == decision.endpoints[0]
    after = {endpoint: finished(e.base_url) for endpoint, e in engines.items()}
    assert {e: after[e] - before[e] for e in engines} == {
        e: 1.0 if e == relayed.endpoint else 0.0 for e in engines
    }
    # What the gateway relays is what the engine answers to the same request straight.
    direct = httpx.post(
        engines[relayed.endpoint].base_url + "/v1/chat/completions", json=body, timeout=60
    )
    if stream:
        assert relayed.body.rstrip().endswith(b"data: [DONE]")
        assert text_of_sse(relayed.body) == text_of_sse(direct.content)
    else:
        assert json.loads(relayed.body)["choices"] == direct.json()["choices"]


def text_of_sse(raw: bytes) -> str:
    events = [line[len(b"data: ") :] for line in raw.splitlines() if line.startswith(b"data: ")]
    chunks = [json.loads(e) for e in events if e != b"[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def test_a_subset_of_one_goes_there_and_one_outside_the_pool_is_a_503(gateway: dict):
    engines = gateway["engines"]
    with EnvoyClient(gateway["epp"], timeout_s=60.0) as client:
        for endpoint in engines:
            relayed = client.request("/v1/completions", COMPLETION, subset=[endpoint])
            assert relayed.status == 200
            assert relayed.endpoint == endpoint
            assert relayed.decision is not None and relayed.decision.endpoints == [endpoint]
        before = {endpoint: finished(e.base_url) for endpoint, e in engines.items()}
        refused = client.request("/v1/completions", COMPLETION, subset=["10.255.255.1:8000"])
    assert refused.status == 503
    assert refused.decision is not None
    assert "subset" in refused.decision.error()["message"]
    assert {endpoint: finished(e.base_url) for endpoint, e in engines.items()} == before


def test_with_the_picker_down_fail_open_still_answers_and_fail_close_refuses(gateway: dict):
    pool = list(gateway["engines"])
    nobody = f"127.0.0.1:{free_port()}"
    with EnvoyClient(nobody, failure_mode="FailOpen", pool=pool, timeout_s=60.0) as client:
        relayed = client.request("/v1/completions", COMPLETION)
    assert relayed.status == 200
    assert relayed.endpoint in pool
    assert json.loads(relayed.body)["choices"][0]["text"]
    with EnvoyClient(nobody, failure_mode="FailClose", pool=pool) as client:
        assert client.request("/v1/completions", COMPLETION).status == 503


def test_the_picker_is_ready_and_every_request_gave_its_count_back(gateway: dict):
    with EnvoyClient(gateway["epp"]) as client:
        assert client.health("readiness") == "SERVING"
        assert client.health("liveness") == "SERVING"
        assert client.health("envoy.service.ext_proc.v3.ExternalProcessor") == "SERVING"
    text = httpx.get(gateway["router"].base_url + "/metrics", timeout=5).text
    counts = re.findall(r"^tidegate:router_backend_in_flight\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert counts and all(float(c) == 0.0 for c in counts)
    assert re.search(r'^tidegate:router_epp_picks_total\{outcome="picked"\} ', text, re.MULTILINE)
