"""Disaggregated serving with real processes: producers, consumers and `tidegate router`.

Greedy output through the router equals a unified server's; whatever clients or processes
do, both sides' KV pools end up entirely free; a dead prefill instance is skipped, and with
none left a router that holds no requests (--max-pending 0) answers 503 at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess
from tidegate.common.local_server import LocalServer

MODEL = "tiny"
ADAPTER = "tiny-lora"
# Small enough that a test can watch an unclaimed pin expire.
KV_TIMEOUT_S = 4.0
ENGINE_FLAGS = ("--served-model-name", MODEL, "--max-model-len", "2048")
KV_FLAGS = ("--kv-host", "127.0.0.1", "--kv-port", "0", "--kv-transfer-timeout", str(KV_TIMEOUT_S))


# The shared stack's producer and consumer plan each step while the last one runs: its tests
# compare them, through the router, with a unified server that schedules synchronously.
ASYNC = ("--async-scheduling",)


def producer(model_dir: Path, logs: Path, *flags: str) -> ServerProcess:
    return ServerProcess(model_dir, logs, *ENGINE_FLAGS, *KV_FLAGS, "--kv-role", "producer", *flags)


def consumer(model_dir: Path, logs: Path, *flags: str) -> ServerProcess:
    return ServerProcess(model_dir, logs, *ENGINE_FLAGS, *KV_FLAGS, "--kv-role", "consumer", *flags)


def router(
    prefill: list[ServerProcess], decode: list[ServerProcess], logs: Path, *flags: str
) -> LocalServer:
    return LocalServer.tidegate_router(
        [p.base_url for p in prefill],
        [d.base_url for d in decode],
        "--health-interval",
        "0.5",
        *flags,
        log=logs / "router.log",
    )


def start_all(*servers: LocalServer) -> None:
    for server in servers:
        server.wait_healthy(90.0)


def kill(server: LocalServer) -> None:
    """SIGKILL a server and every process of its session (engine cores, workers)."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)


def metric(server: LocalServer, name: str) -> float:
    """The sum over series of a `tidegate:` metric."""
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    pattern = re.compile(rf"^tidegate:{name}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def wait_all_free(servers: list[LocalServer], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    state: dict[str, tuple[float, ...]] = {}
    while time.monotonic() < deadline:
        state = {
            s.base_url: tuple(
                metric(s, name)
                for name in ("kv_cache_usage_perc", "kv_pinned_blocks", "num_requests_running")
            )
            for s in servers
        }
        if all(values == (0.0, 0.0, 0.0) for values in state.values()):
            return
        time.sleep(0.1)  # polling with a deadline
    raise AssertionError(f"KV blocks still held (usage, pinned, running): {state}")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    logs = tmp_path_factory.mktemp("pd-logs")
    # Every instance serves one LoRA adapter too (both pools get the same adapters).
    adapter = make_tiny_adapter(tiny_llama_dir, logs / ADAPTER, rank=8, seed=5)
    lora = ("--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}")
    unified = ServerProcess(tiny_llama_dir, logs, *ENGINE_FLAGS, *lora)
    prod = producer(tiny_llama_dir, logs, *ASYNC, *lora)
    cons = consumer(tiny_llama_dir, logs, *ASYNC, *lora)
    servers: list[LocalServer] = [unified, prod, cons]
    try:
        start_all(*servers)
        proxy = router([prod], [cons], logs)
        servers.append(proxy)
        proxy.wait_healthy(30.0)
        yield {"unified": unified, "producer": prod, "consumer": cons, "router": proxy}
    finally:
        codes = {server.base_url: server.stop() for server in reversed(servers)}
    # Every process (connectors and their threads included) drains and exits 0 on SIGTERM.
    assert set(codes.values()) == {0}, codes


def client(server: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def token_prompt(length: int) -> list[int]:
    return [(13 * i + length) % 900 + 3 for i in range(length)]


def complete(
    server: LocalServer, prompt, stream: bool, max_tokens: int = 16, model: str = MODEL
) -> str:
    kwargs = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, timeout=60)
    if not stream:
        return client(server).completions.create(**kwargs).choices[0].text
    chunks = client(server).completions.create(**kwargs, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 1100])
def test_router_output_equals_unified(stack: dict, length: int, stream: bool) -> None:
    prompt = token_prompt(length)
    expected = complete(stack["unified"], prompt, stream=False)
    assert complete(stack["router"], prompt, stream=stream) == expected


def test_chat_through_the_router_equals_unified(stack: dict) -> None:
    messages = [
        {"role": "system", "content": "You answer briefly. " * 20},
        {"role": "user", "content": "What is the tide doing today?"},
    ]

    def chat(server: LocalServer, stream: bool) -> str:
        kwargs = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, timeout=60)
        if not stream:
            return client(server).chat.completions.create(**kwargs).choices[0].message.content
        chunks = client(server).chat.completions.create(**kwargs, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    expected = chat(stack["unified"], stream=False)
    assert chat(stack["router"], stream=False) == expected
    assert chat(stack["router"], stream=True) == expected


def test_the_prompt_is_computed_on_the_producer_and_pulled(stack: dict) -> None:
    prompt = token_prompt(300)
    computed = metric(stack["consumer"], "prompt_tokens_computed_total")
    received = metric(stack["consumer"], "kv_received_bytes_total")
    complete(stack["router"], prompt, stream=False)
    # The consumer computed one token of the prompt (the last); the rest came over the wire.
    assert metric(stack["consumer"], "prompt_tokens_computed_total") - computed == 1
    assert metric(stack["consumer"], "kv_received_bytes_total") > received
    assert metric(stack["consumer"], "kv_transfer_fallbacks_total") == 0


def test_an_adapters_prompt_is_pulled_and_decoded_under_the_same_adapter(stack: dict) -> None:
    prompt = token_prompt(300)
    expected = complete(stack["unified"], prompt, stream=False, model=ADAPTER)
    assert expected != complete(stack["unified"], prompt, stream=False)
    computed = metric(stack["consumer"], "prompt_tokens_computed_total")
    assert complete(stack["router"], prompt, stream=True, model=ADAPTER) == expected
    assert metric(stack["consumer"], "prompt_tokens_computed_total") - computed == 1
    assert metric(stack["consumer"], "kv_transfer_fallbacks_total") == 0


def test_the_consumer_constrains_a_structured_request(stack: dict) -> None:
    """The producer computes the prompt unconstrained (its one token is thrown away); the
    consumer compiles the grammar and constrains every token, as a unified server does."""
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["id", "tags"],
        "additionalProperties": False,
    }
    messages = [
        {"role": "system", "content": "You answer in JSON. " * 30},
        {"role": "user", "content": "Give me a record."},
    ]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=200,
        temperature=0,
        timeout=60,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    expected = client(stack["unified"]).chat.completions.create(**kwargs).choices[0].message
    computed = metric(stack["consumer"], "prompt_tokens_computed_total")
    got = client(stack["router"]).chat.completions.create(**kwargs).choices[0].message
    assert got.content == expected.content
    assert set(json.loads(got.content)) == {"id", "tags"}
    assert metric(stack["consumer"], "prompt_tokens_computed_total") - computed == 1
    chunks = client(stack["router"]).chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.content


def test_kv_computed_under_an_adapter_is_never_decoded_under_another(stack: dict) -> None:
    """A consumer request whose adapter differs from the producer's computes the prompt itself
    (a fallback), and answers what a unified server answers."""
    prompt = token_prompt(200)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    first = httpx.post(
        stack["producer"].base_url + "/v1/completions",
        json={**body, "model": ADAPTER, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    ).json()
    params = first["kv_transfer_params"]
    assert params["lora_name"] == ADAPTER
    fallbacks = metric(stack["consumer"], "kv_transfer_fallbacks_total")
    second = httpx.post(
        stack["consumer"].base_url + "/v1/completions",
        json={**body, "model": MODEL, "max_tokens": 16, "kv_transfer_params": params},
        timeout=60,
    )
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["text"] == complete(stack["unified"], prompt, False)
    assert metric(stack["consumer"], "kv_transfer_fallbacks_total") == fallbacks + 1


def test_aborted_streams_and_a_killed_consumer_leave_no_block_held(
    stack: dict, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    proxy, prod, cons = stack["router"], stack["producer"], stack["consumer"]
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=proxy.base_url, timeout=60) as http:
        for i in range(8):
            prompt = token_prompt(40 + 37 * i)
            if i % 2:
                response = http.post("/v1/completions", json={**body, "prompt": prompt})
                assert response.status_code == 200
                continue
            # Read a few events, then hang up mid-stream.
            with http.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
    # Clients that give up while their long prompt is still on the producer.
    for i in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                proxy.base_url + "/v1/completions",
                json={**body, "stream": False, "prompt": token_prompt(1500 + i)},
                timeout=httpx.Timeout(0.05, connect=5.0),
            )
    # A consumer dies after the prefill leg and before pulling: the pin waits for nobody.
    doomed = consumer(tiny_llama_dir, tmp_path)
    doomed.wait_healthy(90.0)
    prefill_leg = httpx.post(
        prod.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": token_prompt(500), "max_tokens": 1,
              "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    )  # fmt: skip
    assert prefill_leg.json()["kv_transfer_params"]["do_remote_prefill"]
    assert metric(prod, "kv_pinned_blocks") > 0
    kill(doomed)
    started = time.monotonic()
    wait_all_free([prod, cons], timeout_s=KV_TIMEOUT_S + 10)
    assert time.monotonic() - started <= KV_TIMEOUT_S + 10
    assert metric(prod, "kv_pins_expired_total") >= 1


def test_a_dead_prefill_instance_is_skipped_and_none_left_is_a_quick_503(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    first, second = producer(tiny_llama_dir, tmp_path), producer(tiny_llama_dir, tmp_path)
    cons = consumer(tiny_llama_dir, tmp_path)
    servers: list[LocalServer] = [first, second, cons]
    try:
        start_all(*servers)
        # Not held for a pool at zero (tests/router/test_router_pending.py): refused at once.
        proxy = router([first, second], [cons], tmp_path, "--max-pending", "0")
        servers.append(proxy)
        proxy.wait_healthy(30.0)
        prompts = [token_prompt(20 + i) for i in range(6)]
        expected = [complete(proxy, p, stream=False, max_tokens=8) for p in prompts]
        kill(first)
        for prompt, text in zip(prompts, expected, strict=True):
            assert complete(proxy, prompt, stream=False, max_tokens=8) == text
        kill(second)
        for _ in range(3):
            started = time.monotonic()
            response = httpx.post(
                proxy.base_url + "/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                timeout=30,
            )
            assert time.monotonic() - started < 5.0
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "server_error"
            assert "retry-after" in response.headers
        assert httpx.get(proxy.base_url + "/health", timeout=5).status_code == 503
        assert cons.process.poll() is None  # the decode side is untouched
    finally:
        for server in reversed(servers):
            if server.process.poll() is None:
                server.stop()
