"""Any sampling parameters, any prompt or message shapes: a 2xx or a 4xx in OpenAI's body, at once.

Over the scripted engine (which also checks that a request could cross to an engine process),
so that a few thousand bodies run in seconds; tests/e2e/test_fuzzed_requests.py sends the same kinds
of bodies to a real server.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.engine.entrypoints.fake_engine import MODEL, FakeEngine
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
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.input_processor import InputProcessor

# A request to the scripted engine answers in milliseconds; 10 s means it hangs.
TIMEOUT_S = 10.0
PROPERTY_SETTINGS = settings(
    max_examples=500,  # about 8% of the chat bodies stream: 300 left that near the floor of 30
    deadline=None,  # the first chat request compiles the template
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
BODIES = {COMPLETIONS: completion_bodies(MODEL), CHAT: chat_bodies(MODEL)}
VALID_BODIES = {
    COMPLETIONS: completion_bodies(MODEL, max_odd=0),
    CHAT: chat_bodies(MODEL, max_odd=0),
}


def post(app, path: str, body) -> httpx.Response:
    """POST `body` through the app and read the answer whole, failing if it takes TIMEOUT_S."""

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            request = client.post(path, content=encode(body), headers=JSON_HEADERS)
            return await asyncio.wait_for(request, TIMEOUT_S)

    return asyncio.run(run())


def roomy_engine(tiny_input_processor: InputProcessor) -> FakeEngine:
    """A fake engine with a context long enough for any valid body's prompt."""
    processor = InputProcessor(
        tokenizer=tiny_input_processor.tokenizer,
        vocab_size=tiny_input_processor.vocab_size,
        max_model_len=4096,
        eos_token_ids=set(tiny_input_processor.eos_token_ids),
    )
    return FakeEngine(processor.tokenizer, processor)


@pytest.fixture
def roomy_app(tiny_input_processor, tiny_llama_dir):
    """The app over `roomy_engine`."""
    engine = roomy_engine(tiny_input_processor)
    return build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir))


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_edge_value_gets_a_2xx_or_an_openai_4xx(app, path):
    failures = []
    for body in edge_bodies(path, MODEL):
        try:
            assert_openai_answer(post(app, path, body), path)
        except Exception as error:  # every failing body is reported
            failures.append(f"{ascii(body)[:300]}: {type(error).__name__}: {error}"[:800])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_request_gets_a_2xx_or_an_openai_4xx(app, path):
    statuses: Counter[str] = Counter()

    @given(body=BODIES[path])
    @PROPERTY_SETTINGS
    def run(body):
        response = post(app, path, body)
        choices = assert_openai_answer(response, path)
        stream = response.headers["content-type"].startswith("text/event-stream")
        statuses[f"{response.status_code}{' stream' if stream else ''}"] += 1
        if response.status_code == 200 and not stream:
            prompts = body["prompt"] if path == COMPLETIONS else [None]
            many = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
            n = body.get("n")
            assert len(choices) == int(1 if n is None else n) * (len(prompts) if many else 1)

    run()
    # The bodies reach the engine often enough, streamed or not, to test the answers too.
    assert statuses["200"] >= 30 and statuses["200 stream"] >= 30, statuses


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_valid_request_is_served(roomy_app, path):
    @given(body=VALID_BODIES[path])
    @PROPERTY_SETTINGS
    def run(body):
        response = post(roomy_app, path, body)
        # As the server reads it: a high and a low surrogate in a row make one character.
        read = json.dumps(json.loads(encode(body)), ensure_ascii=False)
        if any("\ud800" <= char <= "\udfff" for char in read):
            assert response.status_code == 400, response.text
        else:
            assert response.status_code == 200, response.text
            assert_openai_answer(response, path)

    run()
