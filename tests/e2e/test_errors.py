"""Bad input against a real server: a 4xx with OpenAI's error body, and the server serves on."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
GOOD = {"model": SERVED_NAME, "prompt": "The tide", "max_tokens": 4}

CASES = [
    # (name, path, body (dict or raw bytes), status, words the message must contain)
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, ["JSON"]),
    ("wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}, 400, ["max_tokens"]),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, ["gpt-9", SERVED_NAME]),
    ("bad temperature", "/v1/completions", {**GOOD, "temperature": -1}, 400, ["temperature"]),
    (
        "bad top_p",
        "/v1/chat/completions",
        {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 0},
        400,
        ["top_p"],
    ),
    ("n too large", "/v1/completions", {**GOOD, "n": 17}, 400, ["n", "16"]),
    (
        "context overflow",
        "/v1/completions",
        {**GOOD, "max_tokens": 600},
        400,
        ["512", "max_tokens"],
    ),
    ("prompt too long", "/v1/completions", {**GOOD, "prompt": list(range(10, 610))}, 400, ["512"]),
    ("empty token prompt", "/v1/completions", {**GOOD, "prompt": []}, 400, ["empty"]),
    ("token outside vocab", "/v1/completions", {**GOOD, "prompt": [10**7]}, 400, ["vocabulary"]),
    ("no messages", "/v1/chat/completions", {"model": SERVED_NAME}, 400, ["messages"]),
    ("unsupported field", "/v1/completions", {**GOOD, "suffix": "x"}, 400, ["suffix"]),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_gets_a_4xx_that_names_the_problem(server, name, path, body, status, words):
    content = body if isinstance(body, bytes) else None
    response = httpx.post(
        f"{server.base_url}{path}",
        content=content,
        json=None if content else body,
        headers=HEADERS,
        timeout=30,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


def test_missing_or_wrong_api_key_is_401_but_probes_stay_open(server):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        response = httpx.post(f"{server.base_url}/v1/completions", json=GOOD, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    assert httpx.get(f"{server.base_url}/version").status_code == 200


def test_the_server_still_serves_and_leaked_nothing_after_bad_input(server):
    response = httpx.post(f"{server.base_url}/v1/completions", json=GOOD, headers=HEADERS)
    assert response.status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "tidegate:num_requests_running{" in metrics
    for line in metrics.splitlines():
        if line.startswith(("tidegate:num_requests_running{", "tidegate:kv_cache_usage_perc{")):
            assert float(line.rsplit(" ", 1)[1]) == 0.0, line
