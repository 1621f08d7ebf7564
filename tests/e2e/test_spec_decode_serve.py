"""`tidegate serve --speculative-config` behind the OpenAI API: the same choices as the shared
server (n>1 with seeds, stop strings inside a step's tokens, logprobs, chat streams), guesses
counted in vLLM's spec_decode metrics, and closed streams leave nothing behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.client import chat_stream, close_streams_midway, metric
from tests.e2e.conftest import SHARED_SERVER_FLAGS
from tests.e2e.server import ServerProcess, serving
from tests.e2e.test_async_scheduling_serve import choices, post


@pytest.fixture(scope="module")
def spec_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The shared server's flags, plus prompt-lookup speculation of up to 4 tokens."""
    proc = ServerProcess(
        tiny_llama_dir,
        tmp_path_factory.mktemp("spec-logs"),
        *SHARED_SERVER_FLAGS,
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}),
    )
    yield from serving(proc)


# allowed_token_ids (vLLM's extra field) makes outputs repeat, so that guesses are made and
# kept, and stop strings fall inside a step's tokens.
COMPLETIONS = [
    {"prompt": "The tide comes in", "n": 3, "seed": 11, "temperature": 0.9, "max_tokens": 40},
    {
        "prompt": "Once upon a time",
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 60,
        "allowed_token_ids": [5, 6, 7, 8],
        "ignore_eos": True,
    },
    {"prompt": "Once upon a time", "stop": ["e", "a"], "max_tokens": 60, "temperature": 0},
    {
        "prompt": [5, 6, 7, 8] * 10,
        "max_tokens": 50,
        "logprobs": 3,
        "temperature": 0,
        "allowed_token_ids": [5, 6, 7],
    },
    {
        "prompt": "Salt and",
        "max_tokens": 80,
        "temperature": 0,
        "frequency_penalty": 0.3,
        "allowed_token_ids": [300, 301, 302, 303, 304],
        "stop": ["ab"],
        "ignore_eos": True,
    },
]


@pytest.mark.parametrize(
    "body", COMPLETIONS, ids=["n3-seed", "n2-seed-few", "stop", "logprobs", "penalty-stop"]
)
def test_speculative_completions_equal_the_shared_servers(server, spec_server, body):
    expected = choices(post(server.base_url, "/v1/completions", body))
    assert choices(post(spec_server.base_url, "/v1/completions", body)) == expected


def test_guesses_are_counted_in_vllms_metrics(spec_server):
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = [metric(spec_server.base_url, f"vllm:spec_decode_{n}_total") for n in names]
    body = {"prompt": [5] * 20, "max_tokens": 40, "temperature": 0, "allowed_token_ids": [5]}
    result = post(spec_server.base_url, "/v1/completions", body)
    assert result["usage"]["completion_tokens"] == 40
    drafts, tokens, accepted = (
        metric(spec_server.base_url, f"vllm:spec_decode_{n}_total") - b
        for n, b in zip(names, before, strict=True)
    )
    # Every guess is right: 39 tokens after the first in about a fifth of the steps.
    assert 0 < drafts <= 10
    assert accepted == tokens >= 30


def test_speculative_chat_stream_equals_the_shared_servers(server, spec_server):
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea"}],
        "max_tokens": 60,
        "temperature": 0,
        "allowed_token_ids": [300, 301, 302],
    }
    expected, events = chat_stream(server.base_url, body)
    got, spec_events = chat_stream(spec_server.base_url, body)
    assert got == expected
    assert spec_events < events  # several tokens a step go out in one event


def test_closed_speculative_streams_free_every_block(spec_server):
    close_streams_midway(spec_server.base_url, allowed_token_ids=[5, 6])
