"""POST /v1/completions as a client sees it: prompts of every shape, n, streaming, logprobs."""

from __future__ import annotations

from tests.engine.entrypoints.fake_engine import MAX_MODEL_LEN, MODEL, SCRIPT, parse_sse


def script_prefix(engine, num_tokens: int) -> str:
    return engine.tokenizer.decode(engine.script_ids[:num_tokens])


def test_text_prompt_returns_text_finish_reason_and_usage(api, engine):
    response = api.post("/v1/completions", {"model": MODEL, "prompt": "the cat", "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": script_prefix(engine, 5),
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_logprobs": None,  # vLLM's field, set when prompt_logprobs asks
    }
    prompt_tokens = len(engine.tokenizer.encode("the cat"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    [request] = engine.submitted
    assert request.request_id == f"{body['id']}-0-0"
    assert request.sampling_params.max_tokens == 5


def test_default_max_tokens_is_16(api, engine):
    body = api.post("/v1/completions", {"model": MODEL, "prompt": "a"}).json()
    assert engine.submitted[0].sampling_params.max_tokens == 16
    assert body["usage"]["completion_tokens"] == min(16, len(engine.script_ids))


def test_an_engine_stop_is_finish_reason_stop(api, engine):
    body = api.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 40}).json()
    assert body["choices"][0]["text"] == SCRIPT
    assert body["choices"][0]["finish_reason"] == "stop"


def test_null_max_tokens_means_up_to_the_context_limit(api, engine):
    api.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": None})
    assert engine.submitted[0].sampling_params.max_tokens == MAX_MODEL_LEN - 3


def test_batch_of_texts_and_token_ids_keeps_prompt_order(api, engine):
    for prompt in (["the cat", "a dog sat"], [[5, 6, 7], [8, 9]]):
        engine.submitted.clear()
        body = api.post(
            "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        ).json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [r.request_id for r in engine.submitted] == [f"{body['id']}-{i}-0" for i in (0, 1)]
        lengths = [len(r.prompt_token_ids) for r in engine.submitted]
        assert body["usage"]["prompt_tokens"] == sum(lengths)
        assert body["usage"]["completion_tokens"] == 4
    assert engine.submitted[0].prompt_token_ids == [5, 6, 7]


def test_single_token_id_prompt(api, engine):
    body = api.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1})
    assert body.json()["choices"][0]["text"] == script_prefix(engine, 1)
    assert engine.submitted[0].prompt_token_ids == [5, 6, 7]


def test_n_fans_out_with_choice_index_prompt_times_n_and_seed_plus_choice(api, engine):
    body = api.post(
        "/v1/completions",
        {"model": MODEL, "prompt": ["x", "y"], "n": 2, "max_tokens": 3, "seed": 40},
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    ids = [r.request_id for r in engine.submitted]
    assert ids == [f"{body['id']}-{p}-{c}" for p in (0, 1) for c in (0, 1)]
    assert [r.sampling_params.seed for r in engine.submitted] == [40, 41, 40, 41]
    assert all(r.sampling_params.n == 1 for r in engine.submitted)
    # Each prompt's tokens are counted once, however many choices it has.
    assert body["usage"]["prompt_tokens"] == sum(
        len(engine.tokenizer.encode(p)) for p in ("x", "y")
    )
    assert body["usage"]["completion_tokens"] == 12


def test_seed_plus_choice_wraps_around_within_the_seed_range(api, engine):
    # The last seed with n > 1 was refused: "seed must be in [0, 2**63), got 2**63".
    body = {"model": MODEL, "prompt": "x", "n": 3, "max_tokens": 1, "seed": 2**63 - 1}
    assert api.post("/v1/completions", body).status_code == 200
    assert [r.sampling_params.seed for r in engine.submitted] == [2**63 - 1, 0, 1]


def test_a_top_k_past_the_vocabulary_is_no_top_k(api, engine):
    # Any top_k >= the vocabulary keeps every token; one past 2**64 - 1 could not be sent to
    # the engine process (msgspec's OverflowError, a 500).
    vocab_size = engine.input_processor.vocab_size
    for top_k in (vocab_size - 1, vocab_size, 2**64, 2**70):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "top_k": top_k}
        assert api.post("/v1/completions", body).status_code == 200
    assert [r.sampling_params.top_k for r in engine.submitted] == [vocab_size - 1, 0, 0, 0]


def test_sampling_fields_reach_the_engine(api, engine):
    api.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "a",
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "stop": "mat",
            "stop_token_ids": [7],
            "min_tokens": 1,
            "ignore_eos": True,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "logit_bias": {"5": 100, "17": -2.5},
            "allowed_token_ids": [5, 6, 17],
            "cache_salt": "tenant-a",
            "user": "someone",
            "some_future_field": {"ignored": True},
        },
    )
    [request] = engine.submitted
    params = request.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert params.stop == ["mat"] and params.stop_token_ids == [7]
    assert params.min_tokens == 1 and params.ignore_eos
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.2
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    # OpenAI's keys are token ids as strings; the engine takes ints.
    assert params.logit_bias == {5: 100.0, 17: -2.5} and params.allowed_token_ids == [5, 6, 17]
    assert request.cache_salt == "tenant-a"


def test_cached_prompt_tokens_are_reported(api, engine):
    engine.cached_tokens = 2
    body = api.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1})
    assert body.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_stream_frames_deltas_finish_and_done(api, engine):
    response = api.post(
        "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 4, "stream": True}
    )
    assert response.status_code == 200
    events = parse_sse(response)
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == script_prefix(engine, 4)
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_stream_usage_comes_last_with_no_choices(api, engine):
    events = parse_sse(
        api.post(
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": [5, 6, 7],
                "n": 2,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None for c in chunks)


def test_stream_sends_a_chunk_per_step_even_with_no_new_text(api, engine):
    # Like a stop-string prefix the engine holds back, or bytes of an incomplete character:
    # the step still gets its chunk (as vLLM sends it), so that clients counting chunks as
    # tokens, and timing the gaps between them, see every step.
    engine.held_back_steps = {1, 2}
    events = parse_sse(
        api.post(
            "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 5, "stream": True}
        )
    )
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert len(texts) == 5 and texts[1] == texts[2] == ""
    assert all(texts[:1] + texts[3:])
    assert "".join(texts) == script_prefix(engine, 5)


def test_logprobs_in_the_legacy_format(api, engine):
    body = api.post(
        "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 3, "logprobs": 2}
    ).json()
    logprobs = body["choices"][0]["logprobs"]
    tokens = [engine.tokenizer.decode([t]) for t in engine.script_ids[:3]]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [-0.5] * 3
    # The two most likely (the sampled token is the most likely here), by decoded text.
    for token, top in zip(tokens, logprobs["top_logprobs"], strict=True):
        assert len(top) == 2 and top[token] == -0.5
        assert sorted(top.values()) == [-2.0, -0.5]
    assert logprobs["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert engine.submitted[0].sampling_params.logprobs == 2


def test_logprobs_zero_still_reports_the_sampled_token(api, engine):
    body = api.post(
        "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, "logprobs": 0}
    ).json()
    logprobs = body["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [1, 1]


def test_streamed_logprobs_continue_the_text_offsets(api, engine):
    events = parse_sse(
        api.post(
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "max_tokens": 3, "logprobs": 1, "stream": True},
        )
    )
    offsets = [o for e in events[:-1] for o in e["choices"][0]["logprobs"]["text_offset"]]
    tokens = [engine.tokenizer.decode([t]) for t in engine.script_ids[:3]]
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


def test_echo_puts_the_prompt_before_the_completion(api, engine):
    for prompt, text in (
        ("the cat", "the cat"),
        ([40, 41, 42], engine.tokenizer.decode([40, 41, 42])),
    ):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "echo": True}
        [choice] = api.post("/v1/completions", body).json()["choices"]
        assert choice["text"] == text + script_prefix(engine, 3)
        assert choice["logprobs"] is None and choice["prompt_logprobs"] is None
    # Echo alone asks the engine for no logprobs.
    assert [r.sampling_params.prompt_logprobs for r in engine.submitted] == [None, None]


def test_echo_with_logprobs_lists_the_prompt_tokens_first(api, engine):
    # lm-evaluation-harness scores a text this way: echo, logprobs, one token.
    body = {"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 1, "echo": True, "logprobs": 1}
    [choice] = api.post("/v1/completions", body).json()["choices"]
    [request] = engine.submitted
    assert request.sampling_params.prompt_logprobs == 1
    logprobs = choice["logprobs"]
    decode = engine.tokenizer.decode
    tokens = [decode([t]) for t in [40, 41, 42, engine.script_ids[0]]]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"][:3] == [None, -1.1, -1.2]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {decode([301]): -0.5, tokens[1]: -1.1}
    assert logprobs["text_offset"] == [
        0,
        len(tokens[0]),
        len(tokens[0] + tokens[1]),
        len("".join(tokens[:3])),
    ]


def test_echo_streams_the_prompt_in_each_choices_first_chunk(api, engine):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 3, "echo": True, "n": 2}
    whole = api.post("/v1/completions", body).json()["choices"]
    events = parse_sse(api.post("/v1/completions", {**body, "logprobs": 0, "stream": True}))
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert chunks[0]["text"].startswith("the cat")
        assert not any(c["text"].startswith("the cat") for c in chunks[1:])
        assert "".join(c["text"] for c in chunks) == whole[index]["text"]
        # The prompt's tokens and the completion's, offsets running on across the chunks.
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        assert len(tokens) == len(engine.submitted[-1].prompt_token_ids) + 3
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_prompt_logprobs_come_in_vllms_format(api, engine):
    body = {"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 2, "prompt_logprobs": 1}
    [choice] = api.post("/v1/completions", body).json()["choices"]
    assert choice["text"] == script_prefix(engine, 2)  # no echo: the completion alone
    decode = engine.tokenizer.decode
    assert choice["prompt_logprobs"] == [
        None,
        {
            "41": {"logprob": -1.1, "rank": 2, "decoded_token": decode([41])},
            "301": {"logprob": -0.5, "rank": 1, "decoded_token": decode([301])},
        },
        {
            "42": {"logprob": -1.2, "rank": 2, "decoded_token": decode([42])},
            "302": {"logprob": -0.5, "rank": 1, "decoded_token": decode([302])},
        },
    ]
    # Echo with logprobs and prompt_logprobs: the engine computes the larger number.
    api.post("/v1/completions", {**body, "echo": True, "logprobs": 3})
    assert [r.sampling_params.prompt_logprobs for r in engine.submitted] == [1, 3]


def test_echo_with_no_tokens_returns_the_prompt_alone(api, engine):
    # OpenAI's legacy scoring: max_tokens 0 with echo; the engine's one token is dropped.
    body = {"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 0, "echo": True, "logprobs": 1}
    response = api.post("/v1/completions", body).json()
    [choice] = response["choices"]
    decode = engine.tokenizer.decode
    assert choice["text"] == decode([40, 41, 42]) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [decode([t]) for t in [40, 41, 42]]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.1, -1.2]
    assert response["usage"]["completion_tokens"] == 0
    assert response["usage"]["total_tokens"] == response["usage"]["prompt_tokens"] == 3
    assert engine.submitted[0].sampling_params.max_tokens == 1
    events = parse_sse(
        api.post(
            "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
    )
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["finish_reason"] == "length"
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    assert events[-2]["usage"]["completion_tokens"] == 0
    # Without echo, no tokens is no request.
    error = api.post("/v1/completions", {**body, "echo": False}).json()["error"]
    assert "max_tokens must be at least 1" in error["message"]
