"""Disaggregated serving with real processes: producers, consumers and `tidegate router`.

Greedy output through the router equals a unified server's; whatever clients or processes
do, both sides' KV pools end up entirely free; a dead prefill instance is skipped, and with
none left a router that holds no requests (--max-pending 0) answers 503 at once. Through a
Gateway, the consumer runs the prefill leg itself on the producer the endpoint picker names
(x-prefiller-host-port) and exports what the picker scrapes.
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
from tidegate.common.local_server import LocalServer, free_port

MODEL = "tiny"
ADAPTER = "tiny-lora"
# Small enough that a test can watch an unclaimed pin expire.
KV_TIMEOUT_S = 4.0
ENGINE_FLAGS = ("--served-model-name", MODEL, "--max-model-len", "2048")
KV_FLAGS = ("--kv-host", "127.0.0.1", "--kv-port", "0", "--kv-transfer-timeout", str(KV_TIMEOUT_S))


# The shared stack's producer and consumer plan each step while the last one runs: its tests
# compare them, through the router, with a unified server that schedules synchronously.
ASYNC = ("--async-scheduling",)
# The shared consumer also serves as a Gateway's decode pod: it takes the prefill instance
# from the request's header, and exports vLLM's metric names for the endpoint picker. Neither
# changes what the router's requests get (the router never sends the header).
GATEWAY = ("--prefill-via-header", "--metrics-compat", "vllm")
PREFILLER_HEADER = "x-prefiller-host-port"


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
    cons = consumer(tiny_llama_dir, logs, *ASYNC, *lora, *GATEWAY)
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


def host_port(server: LocalServer) -> str:
    """What an endpoint picker puts in x-prefiller-host-port for a server."""
    return server.base_url.removeprefix("http://")


def fallbacks(server: LocalServer) -> tuple[float, float]:
    """A consumer's KV pulls and prefill legs that failed so far."""
    return (
        metric(server, "kv_transfer_fallbacks_total"),
        metric(server, "prefill_header_fallbacks_total"),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_consumer_runs_the_prefill_leg_on_the_instance_the_header_names(
    stack: dict, stream: bool
) -> None:
    prod, cons = stack["producer"], stack["consumer"]
    prompt = token_prompt(321 + stream)  # a prompt neither side has cached
    expected = complete(stack["unified"], prompt, stream=False)
    computed = {s.base_url: metric(s, "prompt_tokens_computed_total") for s in (prod, cons)}
    received = metric(cons, "kv_received_bytes_total")
    failed = fallbacks(cons)
    headers = {PREFILLER_HEADER: host_port(prod), "x-request-id": f"gateway-{int(stream)}"}
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, timeout=60)
    completions = client(cons).with_options(default_headers=headers).completions
    if stream:
        chunks = completions.create(**kwargs, stream=True)
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    else:
        answer = completions.create(**kwargs)
        assert answer.id == f"cmpl-gateway-{int(stream)}"
        text = answer.choices[0].text
    assert text == expected
    # The producer computed the prompt; the consumer pulled it and computed its last token.
    assert metric(prod, "prompt_tokens_computed_total") - computed[prod.base_url] == len(prompt)
    assert metric(cons, "prompt_tokens_computed_total") - computed[cons.base_url] == 1
    assert metric(cons, "kv_received_bytes_total") > received
    assert fallbacks(cons) == failed


def test_a_chat_sent_to_the_consumer_with_the_header_equals_unified(stack: dict) -> None:
    messages = [
        {"role": "system", "content": "You answer through a gateway. " * 20},
        {"role": "user", "content": "Where does the prompt get computed?"},
    ]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, timeout=60)
    expected = client(stack["unified"]).chat.completions.create(**kwargs).choices[0].message
    received = metric(stack["consumer"], "kv_received_bytes_total")
    headers = {PREFILLER_HEADER: host_port(stack["producer"])}
    chat = client(stack["consumer"]).with_options(default_headers=headers).chat.completions
    assert chat.create(**kwargs).choices[0].message.content == expected.content
    assert metric(stack["consumer"], "kv_received_bytes_total") > received


def test_a_prefill_instance_the_consumer_cannot_reach_leaves_it_the_prompt(
    stack: dict,
) -> None:
    cons = stack["consumer"]
    prompt = token_prompt(333)
    expected = complete(stack["unified"], prompt, stream=False)
    computed = metric(cons, "prompt_tokens_computed_total")
    failed = metric(cons, "prefill_header_fallbacks_total")
    headers = {PREFILLER_HEADER: f"127.0.0.1:{free_port()}"}  # nothing listens there
    answer = (
        client(cons)
        .with_options(default_headers=headers)
        .completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    )
    assert answer.choices[0].text == expected
    assert metric(cons, "prompt_tokens_computed_total") - computed == len(prompt)
    assert metric(cons, "prefill_header_fallbacks_total") == failed + 1
    text = httpx.get(cons.base_url + "/metrics", timeout=5).text
    assert re.search(
        r'prefill_header_fallbacks_total\{[^}]*reason="unreachable"[^}]*\} [1-9]', text
    )


def test_the_consumer_exports_what_the_endpoint_picker_scrapes(
    stack: dict, tiny_llama_dir: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tidegate.engine.config import DEFAULT_KV_CACHE_MEMORY
    from tidegate.engine.model.config import ModelConfig

    cons = stack["consumer"]
    complete(cons, token_prompt(30), stream=False)  # an engine step, whatever ran before
    text = httpx.get(cons.base_url + "/metrics", timeout=5).text
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for name in (
        "num_requests_waiting",
        "num_requests_running",
        "kv_cache_usage_perc",
        "lora_requests_info",
        "cache_config_info",
    ):
        assert "vllm:" + name in samples, name
    info = samples["vllm:cache_config_info"]
    assert info.value == 1
    assert info.labels == samples["tidegate:cache_config_info"].labels
    config = ModelConfig.from_pretrained(tiny_llama_dir)
    # float32 K and V of every layer, 16 tokens a block, in the CPU's default KV memory.
    block_bytes = 2 * 16 * config.num_key_value_heads * config.head_dim * 4
    blocks = DEFAULT_KV_CACHE_MEMORY // (block_bytes * config.num_hidden_layers)
    assert info.labels == {
        "model_name": MODEL,
        "engine": "0",
        "block_size": "16",
        "num_gpu_blocks": str(blocks),
        "cache_dtype": "float32",
        "enable_prefix_caching": "True",
    }


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
