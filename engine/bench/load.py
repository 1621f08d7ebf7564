"""The load generator's engine: send a workload to an OpenAI-compatible server and time it."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tidegate.engine.bench.workloads import BenchRequest, Workload


@dataclass
class RequestRecord:
    """What one request saw, in seconds since the benchmark started."""

    group: str
    prompt_len: int
    max_tokens: int
    sent: float = 0.0
    ok: bool = False
    error: str | None = None
    # Arrival time of every chunk that carried text: [0] is the first token.
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finished: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.finished - self.sent

    @property
    def itls(self) -> list[float]:
        """Gaps between successive chunks: the latency users feel between tokens."""
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.finished - self.chunk_times[0]) / (self.output_tokens - 1)


def arrival_times(requests: list[BenchRequest], request_rate: float, seed: int) -> list[float]:
    """Send times: a request's own `send_at`, else a Poisson process at `request_rate`."""
    rng = random.Random(seed)
    now, times = 0.0, []
    for request in requests:
        if request.send_at is not None:
            times.append(request.send_at)
            continue
        if request_rate != float("inf"):
            now += rng.expovariate(request_rate)
        times.append(now)
    return times


async def _one(
    client: httpx.AsyncClient,
    model: str,
    request: BenchRequest,
    record: RequestRecord,
    start: float,
    extra_body: dict,
) -> None:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra_body,
    }
    record.sent = time.perf_counter() - start
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = str(event["error"].get("message"))
                    return
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in event.get("choices") or []):
                    record.chunk_times.append(time.perf_counter() - start)
                    chunks += 1
        record.output_tokens = record.output_tokens or chunks
        record.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
    finally:
        record.finished = time.perf_counter() - start


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    extra_body: dict | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    timeout_s: float = 600.0,
    headers: dict[str, str] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (at most `max_concurrency` in flight), with
    `headers` on each (a tenant's, say).

    Returns the records, in workload order, and the wall time of the whole run.
    """
    requests = workload.requests
    times = arrival_times(requests, request_rate, seed)
    records = [RequestRecord(r.group, len(r.prompt), r.max_tokens) for r in requests]
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    connections = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout_s, limits=connections
    ) as client:
        start = time.perf_counter()

        async def send(index: int) -> None:
            delay = times[index] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process, not synchronisation
            async with limit:
                await _one(client, model, requests[index], records[index], start, extra_body or {})
            if on_done is not None:
                on_done(records[index])

        await asyncio.gather(*(send(i) for i in range(len(requests))))
        return records, time.perf_counter() - start
