"""A real `tidegate serve`, driven by the official openai package, behaves like OpenAI's API."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME
from tidegate.engine import LLM, SamplingParams

PROMPTS = ["The tide comes in", "A cluster of machines", "Once upon a time,"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=512, num_gpu_blocks=64)


def test_greedy_completions_match_the_offline_engine(client, offline):
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=24, temperature=0
        )
        assert got.choices[0].text == want.outputs[0].text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_uses_the_template_and_matches_the_offline_engine(client, offline):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a river."},
    ]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0]
    got = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=20, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streaming_chat_sends_deltas_then_usage(client):
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Tell me about tides."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    full = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Tell me about tides."}],
        max_tokens=16,
        temperature=0,
    )
    assert text == full.choices[0].message.content


def test_streaming_completion_equals_the_non_streaming_one(client):
    parts, usage = [], None
    for chunk in client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPTS[0],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        parts.extend(c.text for c in chunk.choices)
    whole = client.completions.create(
        model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0
    )
    assert "".join(parts) == whole.choices[0].text
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + 20


def test_stop_strings_end_the_text_and_never_leak_into_the_stream(client):
    full = (
        client.completions.create(
            model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    expected = full[: full.index(stop)]
    got = client.completions.create(
        model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == expected
    assert got.choices[0].finish_reason == "stop"
    streamed = ""
    for chunk in client.completions.create(
        model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop], stream=True
    ):
        streamed += "".join(c.text for c in chunk.choices)
        assert stop not in streamed
    assert streamed == expected


def test_seeded_sampling_is_reproducible_across_calls(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=SERVED_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logit_bias_and_allowed_token_ids_match_the_offline_engine(client, offline):
    # Token 77 biased up and the plain greedy first token banned: the offline engine, given
    # the same ids as ints, agrees token for token; OpenAI's keys are strings.
    plain = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1))
    first = plain[0].outputs[0].token_ids[0]
    bias = {77: 6.0, first: -100.0}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias)
    want = offline.generate([PROMPTS[1]], params)[0].outputs[0]
    got = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want.text and want.token_ids[0] != first

    messages = [{"role": "user", "content": "Name a river."}]
    allowed = [40, 41, 42, 77]
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)
    want = offline.chat(messages, params)[0].outputs[0]
    assert set(want.token_ids) <= set(allowed)
    got = client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"allowed_token_ids": allowed},
    )
    assert got.choices[0].message.content == want.text

    with pytest.raises(openai.BadRequestError, match="logit_bias values must be in"):
        client.completions.create(
            model=SERVED_NAME, prompt="x", max_tokens=1, logit_bias={"77": 200}
        )


def test_echo_with_logprobs_scores_a_prompt_as_lm_eval_does(client, offline):
    # lm-evaluation-harness's loglikelihood: echo the prompt with logprobs, one token.
    prompt = "The tide comes in and the tide goes out"
    want = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    )[0]
    got = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    choice = got.choices[0]
    assert choice.text == prompt + want.outputs[0].text
    ids = want.prompt_token_ids
    assert len(choice.logprobs.tokens) == len(ids) + 1
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    expected = [want.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    # With no tokens (OpenAI's legacy scoring), the prompt alone and the same logprobs.
    scored = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1
    )
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:-1]
    # vLLM's prompt_logprobs on a chat: the rendered prompt's, once for the response.
    messages = [{"role": "user", "content": prompt}]
    want = offline.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    ids = want.prompt_token_ids
    got = [chat.prompt_logprobs[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    expected = [want.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert chat.prompt_logprobs[0] is None and got == pytest.approx(expected, abs=1e-4)
    # Streamed, the prompt comes in the first chunk and the text adds up to the same.
    stream = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith(prompt)
    whole = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True
    )
    assert "".join(chunks) == whole.choices[0].text


def test_n_choices_are_indexed_and_differ(client):
    got = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPTS[0],
        max_tokens=16,
        temperature=1.0,
        n=3,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.completion_tokens == 3 * 16


def test_a_repeated_prompt_reports_cached_tokens(client):
    prompt = " ".join(["the sea rises and falls"] * 12)
    first = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens > 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole blocks of 16 are shared; the last prompt token is always recomputed.
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16


def test_64_concurrent_streams_all_complete(server):
    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        ) as aclient:

            async def one(i: int) -> tuple[str, int]:
                stream = await aclient.completions.create(
                    model=SERVED_NAME,
                    prompt=f"Request number {i} says",
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                finish, tokens = "", 0
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return finish, tokens

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 120)

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(finish in ("length", "stop") and tokens >= 1 for finish, tokens in results)
    assert sum(tokens == 12 for _, tokens in results) >= 32


def test_models_tokenize_detokenize_version(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{server.base_url}/v1/models", headers=headers).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert models["data"][0]["max_model_len"] == 512
    tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": "The tide"}, headers=headers
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(
        f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers
    ).json()
    assert text["prompt"] == "<s>The tide"  # special tokens are shown, as vLLM does
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_embeddings_match_the_offline_engine_as_floats_and_base64(client, offline, server):
    """The openai package asks for base64 unless told otherwise and decodes it itself."""
    texts = [*PROMPTS, PROMPTS[0] + " and goes out again"]
    want = [output.embedding for output in offline.embed(texts)]
    as_base64 = client.embeddings.create(model=SERVED_NAME, input=texts)
    as_floats = client.embeddings.create(model=SERVED_NAME, input=texts, encoding_format="float")
    for got in (as_base64, as_floats):
        assert [item.index for item in got.data] == [0, 1, 2, 3]
        for item, expected in zip(got.data, want, strict=True):
            assert item.embedding == pytest.approx(expected, abs=1e-5)
        assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline.embed(texts))
        assert got.usage.total_tokens == got.usage.prompt_tokens
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    by_ids = client.embeddings.create(model=SERVED_NAME, input=[ids], dimensions=8)
    assert by_ids.data[0].embedding == pytest.approx(
        offline.embed([ids], dimensions=8)[0].embedding, abs=1e-5
    )
    # vLLM's normalize field; mean pooling needs the server's --pooling.
    raw = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": SERVED_NAME, "input": PROMPTS[2], "normalize": False},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["data"][0]["embedding"]
    assert raw == pytest.approx(offline.embed(PROMPTS[2], normalize=False)[0].embedding, abs=1e-4)


def test_an_embedding_model_scores_and_reranks_by_cosine_similarity(offline, server):
    """The shared server's model is no classifier: /score and /rerank compare its embeddings."""
    documents = [PROMPTS[1], PROMPTS[0] + " and goes out again", PROMPTS[0]]
    want = [s.score for s in offline.score(PROMPTS[0], documents)]
    scored = httpx.post(
        f"{server.base_url}/score",
        json={"model": SERVED_NAME, "text_1": PROMPTS[0], "text_2": documents},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-4)
    assert want[2] == pytest.approx(1.0)
    ranked = httpx.post(
        f"{server.base_url}/v1/rerank",
        json={"model": SERVED_NAME, "query": PROMPTS[0], "documents": documents, "top_n": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
    refused = httpx.post(
        f"{server.base_url}/classify",
        json={"model": SERVED_NAME, "input": "the tide"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert refused.status_code == 400 and "not a sequence classifier" in refused.text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "input must not be empty"),
        ({"input": ["a", []]}, "input must be a string, a list of strings"),
        ({"input": [[]]}, "input must not be empty"),
        ({"input": "tide", "dimensions": 100000}, "dimensions must be between 1 and"),
        ({"input": "tide", "dimensions": 0}, "dimensions"),
        ({"input": "tide", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1] * 600]}, "the input has 600 tokens; this model embeds at most 511"),
        ({"input": [[10**9]]}, "outside this model's vocabulary"),
        ({"input": ["x"] * 2049}, "at most 2048 per request"),
    ],
)
def test_bad_embedding_requests_get_an_openai_400(server, body, message):
    response = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": SERVED_NAME, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
