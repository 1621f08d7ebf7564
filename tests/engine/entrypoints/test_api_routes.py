"""The routes around generation: models, tokenize, detokenize, health, metrics, version."""

from __future__ import annotations

import importlib.metadata

from tests.engine.entrypoints.fake_engine import MAX_MODEL_LEN, MODEL, SyncAPI
from tidegate.engine.entrypoints.openai.api_server import build_app


def test_models_lists_every_served_name(api, tiny_llama_dir):
    body = api.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL, "alias"]
    for card in body["data"]:
        assert card["object"] == "model" and card["owned_by"] == "tidegate"
        assert card["root"] == str(tiny_llama_dir) and card["max_model_len"] == MAX_MODEL_LEN
        assert isinstance(card["created"], int)
    assert api.get("/v1/models/alias").json()["id"] == "alias"
    assert api.get("/v1/models/other").status_code == 404


def test_tokenize_a_prompt(api, engine):
    body = api.post("/tokenize", {"prompt": "the cat"}).json()
    assert body == {
        "count": len(body["tokens"]),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": engine.tokenizer.encode("the cat"),
    }
    assert body["tokens"][0] == engine.tokenizer.bos_token_id
    plain = api.post("/tokenize", {"prompt": "the cat", "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][1:]


def test_tokenize_messages_counts_what_chat_sends(api, engine):
    messages = [{"role": "user", "content": "where is the cat?"}]
    counted = api.post("/tokenize", {"model": MODEL, "messages": messages}).json()
    api.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert counted["tokens"] == engine.submitted[0].prompt_token_ids


def test_tokenize_needs_exactly_one_input_and_a_served_model(api):
    response = api.post("/tokenize", {})
    assert response.status_code == 400
    assert "exactly one of prompt and messages" in response.json()["error"]["message"]
    assert api.post("/tokenize", {"prompt": "a", "model": "other"}).status_code == 404


def test_detokenize_round_trips_and_refuses_unknown_ids(api, engine):
    tokens = engine.tokenizer.encode("the cat sat")
    body = api.post("/detokenize", {"tokens": tokens}).json()
    assert body == {"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)}
    assert body["prompt"].endswith("the cat sat")
    response = api.post("/detokenize", {"model": MODEL, "tokens": [5, 10**6]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens" and "1000000" in error["message"]
    assert api.post("/detokenize", {"tokens": [-1]}).status_code == 400


def test_health_is_empty_200_while_the_engine_lives(api):
    response = api.get("/health")
    assert response.status_code == 200 and response.content == b""


class Metrics:
    def render(self) -> tuple[bytes, str]:
        return b"tidegate:num_requests_running 0\n", "text/plain; version=0.0.4; charset=utf-8"


def test_metrics_renders_the_registry_or_nothing(api, engine, tiny_llama_dir):
    response = api.get("/metrics")
    assert response.status_code == 200 and response.content == b""
    app = build_app(
        engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), metrics=Metrics()
    )
    response = SyncAPI(app).get("/metrics")
    assert response.content == b"tidegate:num_requests_running 0\n"
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_version(api):
    assert api.get("/version").json() == {"version": importlib.metadata.version("tidegate")}


def test_the_openapi_document_declares_every_answer(engine, tiny_llama_dir):
    app = build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), api_key="k")
    document = SyncAPI(app).get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    paths = document["paths"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        answers = paths[path]["post"]["responses"]
        # Errors are 4xx (never FastAPI's 422) and 503/504, all in OpenAI's error body.
        assert set(answers) == {"200", "4XX", "503", "504"}
        assert all(
            answers[s]["content"]["application/json"]["schema"] == error
            for s in ("4XX", "503", "504")
        )
        assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
        assert paths[path]["post"]["security"] == [{"apiKey": []}]
    assert "ChatCompletionChunk" in document["components"]["schemas"]
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert document["components"]["securitySchemes"] == {
        "apiKey": {"type": "http", "scheme": "bearer"}
    }
    # Probes need no key; /health answers with no body, /metrics with text.
    assert "security" not in paths["/health"]["get"]
    assert "content" not in paths["/health"]["get"]["responses"]["200"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
