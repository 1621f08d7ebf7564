"""Overload and deadlines on a real server: refused at once, or aborted late, nothing leaked."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.client import HEADERS, EventStream, metric, open_stream, wait_idle
from tests.e2e.conftest import SERVED_NAME
from tests.e2e.test_faults import start_server

pytestmark = pytest.mark.slow


def completion(max_tokens: int, **extra) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": "The tide comes in and",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def test_a_burst_past_the_queue_is_refused_at_once_and_the_admitted_all_finish(
    tiny_llama_dir, tmp_path
):
    server = start_server(
        tiny_llama_dir, tmp_path, "--max-num-seqs", "2", "--max-waiting-requests", "2"
    )
    burst = 16

    async def one(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        response = await client.post("/v1/completions", json=completion(64), headers=HEADERS)
        return response, time.monotonic()

    async def run() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(burst)))

    try:
        answers = asyncio.run(run())
        done = [at for response, at in answers if response.status_code == 200]
        refused = [at for response, at in answers if response.status_code == 429]
        assert len(done) + len(refused) == burst, [r.status_code for r, _ in answers]
        # At least the queue's two are admitted; the rest could only queue, so are refused.
        assert len(done) >= 2 and refused
        for response, _ in answers:
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["type"] == "rate_limit_error"
            else:
                choice = response.json()["choices"][0]
                assert choice["finish_reason"] == "length"
                assert response.json()["usage"]["completion_tokens"] == 64
        # At once: every refusal came back before any admitted request had finished.
        assert max(refused) < min(done)
        wait_idle(server.base_url)
    finally:
        server.stop()


def test_a_request_past_the_timeout_is_aborted_and_its_blocks_freed(tiny_llama_dir, tmp_path):
    timeout_s = 3.0
    server = start_server(tiny_llama_dir, tmp_path, "--request-timeout", str(timeout_s))

    async def run() -> tuple[httpx.Response, list[dict], EventStream, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            started = time.monotonic()
            stream = await open_stream(client, max_tokens=4000)
            late, short = await asyncio.gather(
                client.post("/v1/completions", json=completion(4000), headers=HEADERS),
                client.post("/v1/completions", json=completion(4), headers=HEADERS),
            )
            events = await stream.rest()
            return late, events, stream, short, time.monotonic() - started

    try:
        late, events, stream, short, elapsed = asyncio.run(run())
        assert late.status_code == 504
        error = late.json()["error"]
        assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
        assert "--request-timeout 3 s" in error["message"]
        # A stream that had started ends with the same error as its last event, then [DONE].
        assert isinstance(events[0]["choices"][0]["text"], str)  # a token's chunk (may be "")
        assert events[-1]["error"]["code"] == "request_timeout"
        assert stream.done
        assert short.status_code == 200
        assert timeout_s <= elapsed < 30
        wait_idle(server.base_url)
        aborted = metric(server.base_url, "tidegate:request_success_total", finished_reason="abort")
        assert aborted == 2
    finally:
        server.stop()


def test_one_tenants_burst_is_refused_at_its_own_limit_and_another_tenant_still_runs(
    tiny_llama_dir, tmp_path
):
    server = start_server(
        tiny_llama_dir,
        tmp_path,
        *("--max-num-seqs", "2", "--cache-salt-header", "x-tenant-id"),
        *("--max-waiting-per-tenant", "1", "--max-running-per-tenant", "1"),
        *("--scheduling-policy", "fair"),
    )

    async def one(client: httpx.AsyncClient, tenant: str, delay: float = 0.0) -> httpx.Response:
        await asyncio.sleep(delay)
        headers = {**HEADERS, "x-tenant-id": tenant}
        return await client.post("/v1/completions", json=completion(200), headers=headers)

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            *burst, quiet = await asyncio.gather(
                *(one(client, "flood") for _ in range(8)), one(client, "quiet", delay=0.3)
            )
            return burst, quiet

    try:
        burst, quiet = asyncio.run(run())
        refused = [r for r in burst if r.status_code == 429]
        assert refused and len(refused) + sum(r.status_code == 200 for r in burst) == 8
        for response in refused:
            assert int(response.headers["retry-after"]) >= 1
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "--max-waiting-per-tenant 1" in error["message"]
        # The queue is not shared: the other tenant's request is admitted and runs in full.
        assert quiet.status_code == 200
        assert quiet.json()["usage"]["completion_tokens"] == 200
        wait_idle(server.base_url)
    finally:
        server.stop()
