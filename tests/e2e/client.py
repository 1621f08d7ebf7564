"""What the e2e tests do as clients of a server: authenticate, read /metrics, follow SSE, poll."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import API_KEY, SERVED_NAME

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of the /metrics samples called `name` whose labels include `labels`."""
    body = httpx.get(f"{base_url}/metrics").text
    found = [
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    if not found:
        raise AssertionError(f"{name}{labels or ''} not in /metrics")
    return sum(found)


def finished(base_url: str) -> float:
    """Requests the server has finished, for any reason (0 before the first)."""
    try:
        return metric(base_url, "tidegate:request_success_total")
    except AssertionError:
        return 0.0


def wait_for(condition, deadline_s: float, what: str) -> None:
    """Poll `condition` until it holds or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_idle(base_url: str, deadline_s: float = 15) -> None:
    """Poll until nothing runs, nothing waits and every KV block is free.

    Blocks that keep a cached prefix but belong to no request count as free.
    """
    wait_for(
        lambda: (
            metric(base_url, "tidegate:num_requests_running") == 0
            and metric(base_url, "tidegate:num_requests_waiting") == 0
            and metric(base_url, "tidegate:kv_cache_usage_perc") == 0
        ),
        deadline_s,
        "the engine to go idle with every KV block free",
    )


class EventStream:
    """The SSE events of one streaming response, read incrementally."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()
        self.done = False  # [DONE] was read

    async def next_event(self) -> dict | None:
        """The next event, or None at [DONE] or the end of the connection."""
        async for line in self._lines:
            if line == "data: [DONE]":
                self.done = True
                return None
            if line.startswith("data: "):
                return json.loads(line[len("data: ") :])
        return None

    async def rest(self) -> list[dict]:
        """Every remaining event."""
        events = []
        while (event := await self.next_event()) is not None:
            events.append(event)
        return events


async def open_stream(client: httpx.AsyncClient, max_tokens: int, **extra) -> EventStream:
    """A streaming completion that has answered 200 (so it is admitted and running)."""
    request = client.build_request(
        "POST",
        "/v1/completions",
        json={
            "model": SERVED_NAME,
            "prompt": "The tide comes in and",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            **extra,
        },
        headers=HEADERS,
    )
    response = await client.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    return EventStream(response)


def chat_stream(base_url: str, body: dict) -> tuple[str, int]:
    """A streamed chat completion's content, and how many content events carried it."""
    text, events = [], 0
    with httpx.stream(
        "POST",
        f"{base_url}/v1/chat/completions",
        json={"model": SERVED_NAME, **body, "stream": True},
        headers=HEADERS,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
                events += 1
    return "".join(text), events


def close_streams_midway(base_url: str, streams: int = 4, **extra) -> None:
    """Open streams of 480 tokens, read three events of each, close them all: each request
    ends once (aborted, or at its length if every token was written before the server saw the
    close), and the engine goes idle with every block free."""
    finished_before = metric(base_url, "tidegate:request_success_total")

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            opened = [await open_stream(client, max_tokens=480, **extra) for _ in range(streams)]
            for stream in opened:
                for _ in range(3):
                    assert await stream.next_event() is not None
            for stream in opened:
                await stream.response.aclose()

    asyncio.run(run())
    wait_idle(base_url)
    assert metric(base_url, "tidegate:request_success_total") - finished_before == streams
