"""`tidegate serve --async-scheduling` behind the OpenAI API: the same tokens as the shared
(synchronous) server for n>1 with seeds, stop strings, logprobs and chat streams; two engine
cores (data parallel); aborted streams leave nothing behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.client import HEADERS, chat_stream, close_streams_midway
from tests.e2e.conftest import SERVED_NAME, SHARED_SERVER_FLAGS
from tests.e2e.server import ServerProcess, serving


@pytest.fixture(scope="module")
def async_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The shared server's flags, plus async scheduling on two engine cores."""
    proc = ServerProcess(
        tiny_llama_dir,
        tmp_path_factory.mktemp("async-logs"),
        *SHARED_SERVER_FLAGS,
        "--async-scheduling",
        "--data-parallel-size-local",
        "2",
    )
    yield from serving(proc)


def post(base_url: str, path: str, body: dict) -> dict:
    response = httpx.post(
        f"{base_url}{path}", json={"model": SERVED_NAME, **body}, headers=HEADERS, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def choices(result: dict) -> list[tuple]:
    """What must match between the servers: text, finish reason and logprobs per choice."""
    found = []
    for choice in sorted(result["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("logprobs")
        tokens = logprobs and logprobs.get("tokens")
        values = logprobs and [round(v, 3) for v in logprobs["token_logprobs"]]
        found.append((choice["text"], choice["finish_reason"], tokens, values))
    return found


COMPLETIONS = [
    # n > 1 with a seed: each choice is its own engine request, with its own seed.
    {"prompt": "The tide comes in", "n": 3, "seed": 11, "temperature": 0.9, "max_tokens": 40},
    # Stop strings end a request part-way through a step's tokens.
    {"prompt": "Once upon a time", "stop": ["e", "a"], "max_tokens": 60, "temperature": 0},
    {"prompt": [5, 6, 7, 8] * 20, "max_tokens": 50, "logprobs": 3, "temperature": 0},
    {"prompt": "A B C", "max_tokens": 1, "temperature": 0},
    {
        "prompt": "Salt and",
        "n": 2,
        "seed": 3,
        "temperature": 0.7,
        "top_k": 20,
        "max_tokens": 30,
        "presence_penalty": 0.5,
        "ignore_eos": True,
    },
]


@pytest.mark.parametrize("body", COMPLETIONS, ids=["n3-seed", "stop", "logprobs", "one", "n2"])
def test_async_completions_equal_the_sync_servers(server, async_server, body):
    expected = choices(post(server.base_url, "/v1/completions", body))
    # Twice: the second lands on the other engine core (and on a warm prefix cache).
    for _ in range(2):
        assert choices(post(async_server.base_url, "/v1/completions", body)) == expected


def test_concurrent_async_requests_equal_the_sync_servers(server, async_server):
    """Many requests at once: steps mix prefills and decodes, two steps in flight."""
    bodies = [
        {"prompt": f"Request {i} says", "max_tokens": 20 + 7 * i, "temperature": 0}
        for i in range(10)
    ]

    async def run(base_url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, headers=HEADERS, timeout=120) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json={"model": SERVED_NAME, **b}) for b in bodies)
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(run(async_server.base_url)) == asyncio.run(run(server.base_url))


def test_async_chat_stream_equals_the_sync_servers(server, async_server):
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea"}],
        "max_tokens": 40,
        "temperature": 0,
    }
    assert chat_stream(async_server.base_url, body)[0] == chat_stream(server.base_url, body)[0]


def test_closed_async_streams_free_every_block(async_server):
    """Streams closed while steps are in flight: each request ends once (aborted, or at its
    length if its tokens were all written before the server saw the close), none is held."""
    close_streams_midway(async_server.base_url)
