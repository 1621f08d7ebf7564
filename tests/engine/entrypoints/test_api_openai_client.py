"""The official `openai` package against the app: what real clients parse must parse."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.engine.entrypoints.fake_engine import MODEL, SCRIPT
from tidegate.engine.entrypoints.openai.api_server import build_app

API_KEY = "sk-test"


@pytest.fixture
def keyed_app(engine, tiny_llama_dir):
    return build_app(
        engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), api_key=API_KEY
    )


def with_client(app, use, api_key: str = API_KEY):
    """Run `use(client)` with an AsyncOpenAI talking to the app in-process."""

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(
            base_url="http://api/v1", api_key=api_key, http_client=http, max_retries=0
        )
        async with client:
            return await use(client)

    return asyncio.run(main())


def test_completions(keyed_app, engine):
    async def use(client):
        return await client.completions.create(
            model=MODEL, prompt=["a", "b"], n=2, max_tokens=3, logprobs=1
        )

    completion = with_client(keyed_app, use)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    expected = engine.tokenizer.decode(engine.script_ids[:3])
    assert all(c.text == expected and c.finish_reason == "length" for c in completion.choices)
    assert completion.choices[0].logprobs.token_logprobs == [-0.5] * 3
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_stream(keyed_app, engine):
    async def use(client):
        stream = await client.completions.create(
            model=MODEL,
            prompt="a",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]

    *chunks, last = with_client(keyed_app, use)
    assert "".join(c.choices[0].text for c in chunks) == engine.tokenizer.decode(
        engine.script_ids[:4]
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 4


def test_chat(keyed_app):
    async def use(client):
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            logprobs=True,
            top_logprobs=2,
            seed=3,
        )

    reply = with_client(keyed_app, use)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == SCRIPT
    assert reply.choices[0].finish_reason == "stop"
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2


def test_chat_stream(keyed_app):
    async def use(client):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        return [chunk async for chunk in stream]

    chunks = with_client(keyed_app, use)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == SCRIPT
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models(keyed_app, tiny_llama_dir):
    async def use(client):
        return [model async for model in client.models.list()], await client.models.retrieve(MODEL)

    listed, retrieved = with_client(keyed_app, use)
    assert [m.id for m in listed] == [MODEL] and retrieved.owned_by == "tidegate"


@pytest.mark.parametrize(
    ("call", "error_type", "status"),
    [
        (lambda c: c.completions.create(model="nope", prompt="a"), openai.NotFoundError, 404),
        (
            lambda c: c.completions.create(model=MODEL, prompt="a", n=17),
            openai.BadRequestError,
            400,
        ),
        (
            lambda c: c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**5
            ),
            openai.BadRequestError,
            400,
        ),
    ],
)
def test_errors_surface_as_the_clients_exceptions(keyed_app, call, error_type, status):
    with pytest.raises(error_type) as caught:
        with_client(keyed_app, call)
    assert caught.value.status_code == status
    assert caught.value.body["message"] and caught.value.body["type"] == "invalid_request_error"


def test_bad_key_overload_and_dead_engine(keyed_app, engine):
    def create(client):
        return client.completions.create(model=MODEL, prompt="a")

    with pytest.raises(openai.AuthenticationError) as caught:
        with_client(keyed_app, create, api_key="sk-wrong")
    assert caught.value.code == "invalid_api_key"

    engine.admit = 0
    with pytest.raises(openai.RateLimitError) as caught:
        with_client(keyed_app, create)
    assert caught.value.response.headers["retry-after"] == "7"

    engine.is_dead = True
    with pytest.raises(openai.InternalServerError) as caught:
        with_client(keyed_app, create)
    assert caught.value.status_code == 503


def test_mid_stream_error_reaches_the_client(keyed_app, engine):
    engine.die_after = 2

    async def use(client):
        stream = await client.completions.create(model=MODEL, prompt="a", stream=True)
        return [chunk async for chunk in stream]

    with pytest.raises(openai.APIError, match="exited with code -9"):
        with_client(keyed_app, use)
