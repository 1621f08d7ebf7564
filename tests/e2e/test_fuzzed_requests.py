"""Odd and fuzzed requests against a real `tidegate serve`: each answered in time with a 2xx or
OpenAI's 4xx, streams read to their [DONE]; afterwards the server is healthy, logged no
traceback, and holds no request and no KV block.

The bodies are those of tests/engine/entrypoints/test_api_properties.py, bounded to a few
tokens per completion so that the real engine answers quickly.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.e2e.client import HEADERS, wait_idle
from tests.e2e.conftest import SERVED_NAME
from tests.engine.entrypoints.request_fuzz import (
    CHAT,
    COMPLETIONS,
    JSON_HEADERS,
    assert_openai_answer,
    chat_bodies,
    completion_bodies,
    edge_bodies,
    encode,
)

# A bounded request takes well under a second on the tiny model; 30 s means it hangs.
TIMEOUT_S = 30.0
BODIES = {
    COMPLETIONS: completion_bodies(SERVED_NAME, bounded=True),
    CHAT: chat_bodies(SERVED_NAME, bounded=True),
}


@pytest.fixture
def client(server):
    """A client of the shared server; the server is checked for leftovers once it is done."""
    log_before = len(server.log())
    headers = {**HEADERS, **JSON_HEADERS}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=TIMEOUT_S) as client:
        yield client
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert "Traceback" not in server.log()[log_before:]
    wait_idle(server.base_url)


def test_every_edge_value_gets_a_2xx_or_an_openai_4xx(client):
    failures = []
    for path in (COMPLETIONS, CHAT):
        # Streamed in turns: each value once, to keep the run short.
        for body in edge_bodies(path, SERVED_NAME, bounded=True, both_ways=False):
            try:
                assert_openai_answer(client.post(path, content=encode(body)), path)
            except (AssertionError, httpx.HTTPError) as error:
                failures.append(f"{ascii(body)[:300]}: {type(error).__name__}: {error}"[:800])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_fuzzed_requests_get_a_2xx_or_an_openai_4xx(client, path):
    @given(body=BODIES[path])
    @settings(
        max_examples=250,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    def run(body):
        assert_openai_answer(client.post(path, content=encode(body)), path)

    run()
