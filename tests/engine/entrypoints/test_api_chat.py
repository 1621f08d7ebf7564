"""POST /v1/chat/completions as a client sees it: the template, replies, streaming, logprobs."""

from __future__ import annotations

from tests.engine.entrypoints.fake_engine import MAX_MODEL_LEN, MODEL, SCRIPT, parse_sse

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "where is the cat?"},
]


def chat_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_reply_through_the_chat_template(api, engine):
    response = api.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": SCRIPT}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    [request] = engine.submitted
    # The template writes BOS; the server must not add a second one.
    assert request.prompt_token_ids == chat_ids(engine, MESSAGES)
    assert request.prompt_token_ids.count(engine.tokenizer.bos_token_id) == 1
    # No max_tokens: up to the context limit.
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)
    prompt_tokens = len(request.prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(engine.script_ids),
        "total_tokens": prompt_tokens + len(engine.script_ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_text_parts_are_joined(api, engine):
    parts = [{"type": "text", "text": "where is"}, {"type": "text", "text": "the cat?"}]
    messages = [{"role": "user", "content": parts}]
    assert api.post("/v1/chat/completions", {"model": MODEL, "messages": messages}).is_success
    expected = chat_ids(engine, [{"role": "user", "content": "where is\nthe cat?"}])
    assert engine.submitted[0].prompt_token_ids == expected


def test_max_completion_tokens_wins_over_max_tokens(api, engine):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3}
    reply = api.post("/v1/chat/completions", body).json()
    assert engine.submitted[0].sampling_params.max_tokens == 3
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3


def test_n_choices_with_seeds(api, engine):
    body = {"model": MODEL, "messages": MESSAGES, "n": 3, "max_tokens": 2, "seed": 7}
    reply = api.post("/v1/chat/completions", body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [r.request_id for r in engine.submitted] == [f"{reply['id']}-0-{i}" for i in range(3)]
    assert [r.sampling_params.seed for r in engine.submitted] == [7, 8, 9]
    assert reply["usage"]["prompt_tokens"] == len(engine.submitted[0].prompt_token_ids)
    assert reply["usage"]["completion_tokens"] == 6


def test_stream_role_first_then_content_then_finish_then_usage(api, engine):
    engine.held_back_steps = {1}
    response = api.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "n": 2,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    *chunks, usage_chunk, done = parse_sse(response)
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        contents = [c["delta"].get("content") for c in mine[1:]]
        # One chunk per step: the step whose text is held back sends empty content.
        assert len(contents) == 4 and contents[1] == ""
        assert all(contents[:1] + contents[2:])
        assert "".join(contents) == engine.tokenizer.decode(engine.script_ids[:4])
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    # Both role chunks come before any content.
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8


def test_steps_without_new_text_send_empty_content_and_the_last_carries_it_all(api, engine):
    engine.held_back_steps = {0, 1, 2}  # the last output carries all the text ...
    events = parse_sse(
        api.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True},
        )
    )
    deltas = [e["choices"][0] for e in events[:-1]]
    # The role, then one chunk per step: empty while the text is held back.
    assert [d["delta"] for d in deltas[1:3]] == [{"content": ""}] * 2
    assert len(deltas) == 4 and deltas[3]["finish_reason"] == "length"
    assert deltas[3]["delta"] == {"content": engine.tokenizer.decode(engine.script_ids[:3])}


def test_logprobs_in_the_chat_format(api, engine):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
    }
    reply = api.post("/v1/chat/completions", body).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert engine.submitted[0].sampling_params.logprobs == 3
    for token_id, entry in zip(engine.script_ids[:2], content, strict=True):
        token = engine.tokenizer.decode([token_id])
        assert entry["token"] == token and entry["logprob"] == -0.5
        assert entry["bytes"] == list(token.encode())
        tops = entry["top_logprobs"]
        assert [t["logprob"] for t in tops] == [-0.5, -2.0, -3.0]
        assert tops[0]["token"] == token
        assert all(t["bytes"] == list(t["token"].encode()) for t in tops)


def test_logprobs_without_top_logprobs(api, engine):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "logprobs": True}
    reply = api.post("/v1/chat/completions", body).json()
    [entry] = reply["choices"][0]["logprobs"]["content"]
    assert entry["top_logprobs"] == [] and entry["logprob"] == -0.5
    assert engine.submitted[0].sampling_params.logprobs == 0


def test_streamed_logprobs(api, engine):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "stream": True,
    }
    events = parse_sse(api.post("/v1/chat/completions", body))
    role, *content_chunks, _ = events
    assert role["choices"][0]["logprobs"] is None
    tokens = [
        entry["token"] for c in content_chunks for entry in c["choices"][0]["logprobs"]["content"]
    ]
    assert tokens == [engine.tokenizer.decode([t]) for t in engine.script_ids[:2]]


def test_plain_text_response_format_is_accepted(api):
    body = {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "text"}}
    assert api.post("/v1/chat/completions", body).status_code == 200


def test_prompt_logprobs_come_once_for_all_choices_and_not_streamed(api, engine):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n": 2, "prompt_logprobs": 0}
    reply = api.post("/v1/chat/completions", body).json()
    ids = chat_ids(engine, MESSAGES)
    logprobs = reply["prompt_logprobs"]
    assert len(logprobs) == len(ids) and logprobs[0] is None
    # The scripted engine's prompt token i has logprob -1 - i / 10 (and no others at k = 0).
    assert logprobs[1] == {
        str(ids[1]): {
            "logprob": -1.1,
            "rank": 2,
            "decoded_token": engine.tokenizer.decode([ids[1]]),
        }
    }
    assert [r.sampling_params.prompt_logprobs for r in engine.submitted] == [0, 0]
    plain = api.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}).json()
    assert plain["prompt_logprobs"] is None
    # A chat stream has no place for them: refused, as vLLM does.
    response = api.post("/v1/chat/completions", {**body, "stream": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt_logprobs" and "stream" in error["message"]


def prompt_text(engine) -> str:
    return engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(api, engine):
    # Qwen3's switch: enable_thinking false opens the reply with an empty thinking block.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    assert api.post("/v1/chat/completions", body).is_success
    assert prompt_text(engine).endswith("<|assistant|>\n")
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert api.post("/v1/chat/completions", {**body, **kwargs}).is_success
    assert prompt_text(engine).endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    counted = api.post("/tokenize", {"messages": MESSAGES, **kwargs}).json()
    assert counted["tokens"] == engine.submitted[-1].prompt_token_ids
    for taken in ("messages", "add_generation_prompt", "bos_token"):
        refused = api.post("/v1/chat/completions", {**body, "chat_template_kwargs": {taken: 1}})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "chat_template_kwargs" and repr(taken) in error["message"]


def test_add_generation_prompt_false_leaves_the_turn_unopened(api, engine):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    assert api.post("/v1/chat/completions", {**body, "add_generation_prompt": False}).is_success
    assert prompt_text(engine).endswith("where is the cat?</s>\n")
    assert api.post("/v1/chat/completions", {**body, "add_generation_prompt": None}).is_success
    assert prompt_text(engine).endswith("<|assistant|>\n")  # null: the default, true


def test_continue_final_message_continues_it_and_echo_repeats_it(api, engine):
    # A prefilled answer: the prompt ends inside the assistant's turn, where its text does
    # (the template's "</s>\n" closing the turn is cut, trailing spaces kept).
    started = [*MESSAGES, {"role": "assistant", "content": "It is on the "}]
    body = {
        "model": MODEL,
        "messages": started,
        "max_tokens": 3,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    reply = api.post("/v1/chat/completions", body).json()
    assert prompt_text(engine).endswith("<|assistant|>\nIt is on the ")
    assert reply["choices"][0]["message"]["content"] == engine.tokenizer.decode(
        engine.script_ids[:3]
    )
    counted = api.post("/tokenize", {"messages": started, **{k: body[k] for k in list(body)[3:]}})
    assert counted.json()["tokens"] == engine.submitted[-1].prompt_token_ids

    generated = reply["choices"][0]["message"]["content"]
    echoed = api.post("/v1/chat/completions", {**body, "echo": True, "n": 2}).json()
    assert [c["message"]["content"] for c in echoed["choices"]] == ["It is on the " + generated] * 2
    assert echoed["usage"]["completion_tokens"] == 6  # the echoed text is not generated
    events = parse_sse(api.post("/v1/chat/completions", {**body, "echo": True, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "It is on the "}]
    assert "".join(d.get("content") or "" for d in deltas) == "It is on the " + generated
    # Echo repeats only a final message the reply continues: not the user's question.
    plain = api.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "echo": True})
    assert plain.json()["choices"][0]["message"]["content"] == SCRIPT


def test_continue_final_message_is_refused_where_it_cannot_continue(api):
    body = {"model": MODEL, "messages": MESSAGES, "continue_final_message": True}
    both = api.post("/v1/chat/completions", body)  # add_generation_prompt defaults to true
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"
    assert "send add_generation_prompt false" in both.json()["error"]["message"]
    empty = [*MESSAGES, {"role": "assistant", "content": ""}]
    body = {**body, "messages": empty, "add_generation_prompt": False}
    refused = api.post("/v1/chat/completions", body)
    assert refused.status_code == 400
    assert "a final message with content to continue" in refused.json()["error"]["message"]
