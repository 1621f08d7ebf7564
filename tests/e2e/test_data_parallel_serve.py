"""`tidegate serve --data-parallel-size-local 2`: two engine cores behind one API server."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.client import HEADERS, open_stream
from tests.e2e.conftest import CLIENT_FLAGS, SERVED_NAME
from tests.e2e.server import ServerProcess, serving

PROMPTS = ["The tide comes in and", "Once upon a time", "A harbour at night", "Salt and"]


def engine_metric(base_url: str, name: str, engine: str) -> float:
    """The samples of /metrics called `name` for one engine core (its `engine` label), summed."""
    body = httpx.get(f"{base_url}/metrics").text
    found = [
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and sample.labels.get("engine") == engine
    ]
    assert found, f"{name}{{engine={engine!r}}} not in /metrics"
    return sum(found)


def complete(base_url: str, prompt: str, max_tokens: int = 16) -> str:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=HEADERS,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def start_dp_server(model_dir: Path, log_dir: Path) -> ServerProcess:
    return ServerProcess(
        model_dir, log_dir, *CLIENT_FLAGS, "--data-parallel-size-local", "2"
    ).wait_healthy()


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serving(start_dp_server(tiny_llama_dir, tmp_path_factory.mktemp("dp-logs")))


def test_two_engine_cores_run_as_named_processes(dp_server):
    assert {"tidegate::engine_core_0", "tidegate::engine_core_1"} <= set(dp_server.children())


def test_greedy_output_equals_one_engine_core(dp_server, server):
    for prompt in PROMPTS:
        assert complete(dp_server.base_url, prompt) == complete(server.base_url, prompt)


def test_concurrent_requests_are_spread_over_both_cores(dp_server):
    success = "tidegate:request_success_total"
    before = [engine_metric(dp_server.base_url, success, e) for e in ("0", "1")]

    async def run() -> None:
        async with httpx.AsyncClient(base_url=dp_server.base_url, timeout=60) as client:
            streams = [await open_stream(client, max_tokens=64) for _ in range(4)]
            for stream in streams:
                await stream.rest()

    asyncio.run(run())
    after = [engine_metric(dp_server.base_url, success, e) for e in ("0", "1")]
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    # The vLLM names carry the same engine label.
    assert engine_metric(dp_server.base_url, "vllm:num_requests_running", "1") == 0


def test_a_shared_prefix_goes_to_the_core_that_has_it_cached(dp_server):
    hits = "tidegate:prefix_cache_hits_total"
    system = "You are a careful assistant of the harbour master. " * 6  # several full blocks

    async def run() -> None:
        async with httpx.AsyncClient(base_url=dp_server.base_url, timeout=60) as client:
            # Idle cores tie, so the first request goes to core 0 and caches the prefix there.
            first = await open_stream(client, max_tokens=1, prompt=system + "Who are you?")
            await first.rest()
            # Keep core 0 busy: plain least-loaded routing would now pick core 1.
            busy = await open_stream(client, max_tokens=400)
            assert await busy.next_event() is not None
            before = [engine_metric(dp_server.base_url, hits, e) for e in ("0", "1")]
            second = await open_stream(client, max_tokens=1, prompt=system + "What is a tide?")
            await second.rest()
            after = [engine_metric(dp_server.base_url, hits, e) for e in ("0", "1")]
            await busy.response.aclose()
            assert after[0] - before[0] >= 64, (before, after)
            assert after[1] == before[1]

    asyncio.run(run())


def test_killing_one_engine_core_fails_requests_and_the_server_exits_nonzero(
    tiny_llama_dir, tmp_path
):
    server = start_dp_server(tiny_llama_dir, tmp_path)
    try:
        victim = server.children()["tidegate::engine_core_1"]
        others = [p for t, p in server.children().items() if p.pid != victim.pid]

        async def run() -> tuple[list[list[dict]], float]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                # Short prompts have no full block: least loaded puts one on each core.
                streams = [await open_stream(client, max_tokens=3000) for _ in range(2)]
                for stream in streams:
                    assert await stream.next_event() is not None
                killed_at = time.monotonic()
                victim.send_signal(signal.SIGKILL)
                return [await stream.rest() for stream in streams], killed_at

        events, killed_at = asyncio.run(run())
        for stream_events in events:
            assert "error" in stream_events[-1], stream_events[-1]
        code = server.wait_exit(timeout=15)
        assert time.monotonic() - killed_at < 15
        assert code != 0
        _, alive = psutil.wait_procs(others, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        server.stop()
