"""Every way a request can fail, as status code and OpenAI error body; none is a 500 or a hang."""

from __future__ import annotations

import json

import pytest

from tests.engine.entrypoints.fake_engine import MAX_MODEL_LEN, MODEL, SyncAPI, parse_sse
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.kv_transfer.params import parse_kv_transfer_params
from tidegate.engine.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "hi"}]


def error_of(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The error object of a response, after checking its status and OpenAI's shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    if status < 500:
        assert error["type"] in {"invalid_request_error", "rate_limit_error"}
    return error


def post_raw(api, path: str, content: bytes):
    return api.request("POST", path, content=content, headers={"content-type": "application/json"})


def test_malformed_json_is_400_not_422(api):
    error = error_of(post_raw(api, "/v1/completions", b'{"model": "tiny", "prompt": '), 400)
    assert "not valid JSON" in error["message"]
    error = error_of(post_raw(api, "/v1/chat/completions", b"[1, 2]"), 400)
    assert error["message"] == "the request body must be a JSON object"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", "hot", "valid number"),
        ("max_tokens", "many", "valid integer"),
        ("stream", [1], "valid boolean"),
        ("prompt", 5, "prompt must be a string"),
        ("prompt", ["a", [1]], "prompt must be a string"),
        ("prompt", [True], "prompt must be a string"),
        ("n", 17, "n must be between 1 and 16"),
        ("n", 0, "n must be between 1 and 16"),
        ("logprobs", 21, "less than or equal to 20"),
    ],
)
def test_a_bad_field_is_named(api, field, value, words):
    body = {"model": MODEL, "prompt": "a", field: value}
    error = error_of(api.post("/v1/completions", body), 400, param=field)
    assert field in error["message"] and words in error["message"]


def test_missing_fields_are_named(api):
    error = error_of(api.post("/v1/completions", {"prompt": "a"}), 400, param="model")
    assert error["message"] == "model is required"
    error = error_of(api.post("/v1/chat/completions", {"model": MODEL}), 400, param="messages")
    assert error["message"] == "messages is required"
    body = {"model": MODEL, "messages": [{"content": "hi"}]}
    error = error_of(api.post("/v1/chat/completions", body), 400, param="messages[0].role")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404_naming_what_is_served(api, engine, path):
    body = {"model": "gpt-4", "prompt": "a", "messages": CHAT}
    error = error_of(api.post(path, body), 404, param="model", code="model_not_found")
    assert "'gpt-4'" in error["message"] and "'tiny'" in error["message"]
    assert not engine.submitted
    assert api.post(path, {**body, "model": "alias"}).status_code == 200


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"temperature": -1}, "temperature must be in [0, 100]"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": []}, "the prompt is empty"),
        ({"prompt": [5] * MAX_MODEL_LEN}, f"at most {MAX_MODEL_LEN - 1}"),
        ({"prompt": [5, 6, 100_000]}, "outside this model's vocabulary"),
        ({"prompt": [5, 6], "max_tokens": MAX_MODEL_LEN}, "maximum context length"),
        ({"stop": ""}, "stop strings must not be empty"),
        ({"stop_token_ids": [100_000]}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
    ],
)
def test_values_the_engine_refuses_are_400(api, engine, fields, words):
    error = error_of(api.post("/v1/completions", {"model": MODEL, "prompt": "a", **fields}), 400)
    assert words in error["message"]
    assert not engine.submitted


def test_chat_too_long_for_the_context_is_400(api, engine):
    body = {"model": MODEL, "messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN}
    error = error_of(api.post("/v1/chat/completions", body), 400)
    assert "maximum context length" in error["message"]
    long_chat = [{"role": "user", "content": "the cat " * MAX_MODEL_LEN}]
    error = error_of(api.post("/v1/chat/completions", {"model": MODEL, "messages": long_chat}), 400)
    assert "this model accepts at most" in error["message"]


def test_one_bad_prompt_in_a_batch_submits_nothing(api, engine):
    body = {"model": MODEL, "prompt": [[5, 6], [], [7]], "n": 2}
    assert error_of(api.post("/v1/completions", body), 400)["message"].startswith("the prompt is")
    assert not engine.submitted


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),  # without tools
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_unsupported_features_are_400_naming_the_field(api, engine, path, fields, param):
    body = {"model": MODEL, "prompt": "a", "messages": CHAT, **fields}
    error = error_of(api.post(path, body), 400, param=param)
    assert param in error["message"]
    assert not engine.submitted


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids, got 'x'"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "keys must be token ids, got '-1'"),
        ({"logit_bias": {" 5": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"5": "y"}}, "logit_bias", "valid number"),
        ({"logit_bias": {"5": 101}}, None, "must be in [-100, 100], got 101.0 for token 5"),
        ({"logit_bias": {"99999": 1}}, None, "logit_bias contains 99999"),
        ({"allowed_token_ids": []}, None, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [1, 99999]}, None, "allowed_token_ids contains 99999"),
        ({"allowed_token_ids": ["a"]}, "allowed_token_ids[0]", "valid integer"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_logit_bias_or_allowed_token_list_is_400(api, engine, path, fields, param, words):
    body = {"model": MODEL, "prompt": "a", "messages": CHAT, **fields}
    error = error_of(api.post(path, body), 400, param=param)
    assert words in error["message"]
    assert not engine.submitted


def test_non_text_content_parts_are_400(api):
    parts = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    error = error_of(api.post("/v1/chat/completions", body), 400, param="messages[0].content")
    assert "'image_url'" in error["message"]


def test_a_role_the_template_refuses_is_400(api):
    body = {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}
    error = error_of(api.post("/v1/chat/completions", body), 400)
    assert "roles must be" in error["message"]


@pytest.mark.parametrize(
    ("path", "fields", "param", "where"),
    [
        ("/v1/completions", {"prompt": "a\ud800"}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt", "prompt[1]"),
        ("/v1/completions", {"stop": ["\ud800"]}, "stop", "stop[0]"),
        ("/v1/completions", {"cache_salt": "\ud800"}, "cache_salt", "cache_salt"),
        (
            "/v1/chat/completions",
            {"messages": [*CHAT, {"role": "user", "content": "\ud800"}]},
            "messages",
            "messages[1].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages",
            "messages[0].content[0].text",
        ),
        ("/tokenize", {"prompt": "\ud800"}, "prompt", "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_naming_where(api, engine, path, fields, param, where):
    # JSON can escape half of a surrogate pair alone; the tokenizer raised TypeError (a 500).
    given = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "a"}
    body = {"model": MODEL, **given, **fields}
    error = error_of(post_raw(api, path, json.dumps(body).encode()), 400, param=param)
    assert error["message"].startswith(f"{where} is not valid Unicode")
    assert not engine.submitted
    # A pair is one character, and fine.
    body = {**body, param: "\ud83c\udf0a" if param != "messages" else CHAT}
    assert post_raw(api, path, json.dumps(body).encode()).status_code == 200


def test_equal_best_of_and_unknown_fields_are_accepted(api):
    body = {"model": MODEL, "prompt": "a", "best_of": 2, "n": 2, "metadata": {"x": 1}}
    assert api.post("/v1/completions", body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_overload_is_429_with_retry_after_and_aborts_the_rest(api, engine, stream):
    engine.admit = 2  # the third and fourth of four sub-requests are refused
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": stream}
    response = api.post("/v1/completions", body)
    error = error_of(response, 429, code="rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "7"
    assert "waiting queue is full" in error["message"]
    # The two admitted sub-requests were aborted; the two refused ones never ran.
    assert sorted(engine.aborted) == [r.request_id for r in engine.submitted[:2]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_dead_engine_is_503_at_once(api, engine, path):
    engine.is_dead, engine.dead_reason = True, "engine core process 4242 exited"
    response = api.post(path, {"model": MODEL, "prompt": "a", "messages": CHAT})
    error = error_of(response, 503)
    assert error["type"] == "server_error" and "4242" in error["message"]
    assert not engine.submitted
    error = error_of(api.get("/health"), 503)
    assert error["type"] == "server_error"


def test_engine_death_during_a_request_is_503_and_aborts_the_rest(api, engine):
    engine.die_after, engine.die_suffix = 2, "-0-1"
    body = {"model": MODEL, "prompt": "a", "n": 3, "max_tokens": 8}
    error = error_of(api.post("/v1/completions", body), 503)
    assert "exited with code -9" in error["message"]
    ids = [r.request_id for r in engine.submitted]
    assert sorted(engine.aborted) == [ids[0], ids[2]]


def test_engine_death_mid_stream_is_an_error_event_then_done(api, engine):
    engine.die_after = 2
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "stream": True}
    response = api.post("/v1/chat/completions", body)
    assert response.status_code == 200
    events = parse_sse(response)
    *chunks, error_event, done = events
    assert done == "[DONE]"
    assert error_event["error"]["type"] == "server_error"
    assert "exited with code -9" in error_event["error"]["message"]
    # Role chunk, then the two outputs before the engine died.
    assert len(chunks) == 3 and all("choices" in c for c in chunks)


def test_unexpected_errors_are_a_generic_500(app, engine):
    async def broken(request, prompt=None):
        raise RuntimeError("secret internal detail")
        yield

    engine.generate = broken
    response = SyncAPI(app, raise_app_exceptions=False).post(
        "/v1/completions", {"model": MODEL, "prompt": "a"}
    )
    error = error_of(response, 500)
    assert error["type"] == "server_error" and "secret" not in error["message"]


def test_unknown_routes_and_methods_use_the_error_body(api):
    assert error_of(api.get("/v1/nothing-here"), 404)["message"] == "Not Found"
    assert error_of(api.get("/v1/completions"), 405)["message"] == "Method Not Allowed"


@pytest.fixture
def keyed(engine, tiny_llama_dir) -> SyncAPI:
    app = build_app(
        engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), api_key="sk-right"
    )
    return SyncAPI(app)


def test_api_key_is_required_on_api_routes(keyed):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    missing = error_of(keyed.post("/v1/completions", body), 401, code="invalid_api_key")
    assert "Authorization: Bearer" in missing["message"]
    for value in ("Bearer sk-wrong", "sk-right", "Basic sk-right"):
        response = keyed.post("/v1/completions", body, headers={"Authorization": value})
        error = error_of(response, 401, code="invalid_api_key")
        assert error["message"] == "the API key is not valid"
        assert response.headers["www-authenticate"] == "Bearer"
    error_of(keyed.get("/v1/models"), 401, code="invalid_api_key")
    error_of(keyed.post("/tokenize", {"prompt": "a"}), 401, code="invalid_api_key")
    # The key is checked before the body is even parsed.
    error_of(post_raw(keyed, "/v1/completions", b"{"), 401, code="invalid_api_key")
    good = {"Authorization": "Bearer sk-right"}
    assert keyed.post("/v1/completions", body, headers=good).status_code == 200
    assert keyed.get("/v1/models", headers=good).status_code == 200
    assert keyed.post("/tokenize", {"prompt": "a"}, headers=good).status_code == 200


def test_probes_need_no_api_key(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/metrics").status_code == 200
    assert keyed.get("/version").status_code == 200


def test_prompt_logprobs_out_of_range_or_with_a_kv_transfer_are_400(api, engine):
    body = {"model": MODEL, "prompt": "a", "prompt_logprobs": 21}
    assert (
        "less than or equal to 20"
        in error_of(api.post("/v1/completions", body), 400, param="prompt_logprobs")["message"]
    )
    # A producer or consumer server refuses them: the prompt is computed on one instance only.
    remote = parse_kv_transfer_params({"do_remote_decode": True})
    params = SamplingParams(prompt_logprobs=1)
    with pytest.raises(ValueError, match="cannot be combined with kv_transfer_params"):
        engine.input_processor.process("r", [5, 6], params, kv_transfer=remote)
