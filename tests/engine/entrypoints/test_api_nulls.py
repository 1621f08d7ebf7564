"""null wherever OpenAI's API reference allows it: read as the default, and declared so.

The tables list every field that openai/openai-openapi marks nullable (`nullable: true`, or
`anyOf` with `{"type": "null"}`) on POST /v1/completions and /v1/chat/completions and that this
server reads. Fields it ignores (metadata, store, service_tier, ...) take any value, null too.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.entrypoints.fake_engine import (
    MAX_MODEL_LEN,
    MODEL,
    FakeEngine,
    SyncAPI,
    parse_sse,
)
from tests.engine.entrypoints.test_api_properties import roomy_engine
from tidegate.engine.entrypoints.openai.api_server import build_app

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "the cat"
HI = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# The server here has no --tool-call-parser: tools need a tool_choice that is not auto.
REQUIRED = {"tool_choice": "required"}
SCHEMA = {"name": "s", "schema": {"type": "object"}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": SCHEMA}

# field: what the base body needs beside it for null to be tried where it matters.
COMPLETIONS_NULLABLE: dict[str, dict[str, Any]] = {
    "prompt": {},
    "best_of": {},
    "echo": {},
    "frequency_penalty": {},
    "logit_bias": {},
    "logprobs": {},
    "max_tokens": {},
    "n": {},
    "presence_penalty": {},
    "seed": {},
    "stop": {},
    "stream": {},
    "stream_options": {"stream": True},
    "suffix": {},
    "temperature": {},
    "top_p": {},
}
CHAT_NULLABLE: dict[str, dict[str, Any]] = {
    "frequency_penalty": {},
    "logit_bias": {},
    "logprobs": {},
    "max_completion_tokens": {},
    "max_tokens": {},
    "n": {},
    "presence_penalty": {},
    "seed": {},
    "stop": {},
    "stream": {},
    "stream_options": {"stream": True},
    "temperature": {},
    "top_logprobs": {"logprobs": True},
    "top_p": {},
}
# Nullable fields inside a chat body: (component in our document, field, a body with it null,
# the same body without it).
NESTED_NULLABLE = [
    (
        "ChatMessage",
        "content",
        {"messages": [HI, {"role": "assistant", "content": None}, HI]},
        {"messages": [HI, {"role": "assistant"}, HI]},
    ),
    (
        "FunctionDefinition",
        "strict",
        {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": None}}], **REQUIRED},
        {"tools": [TOOL], **REQUIRED},
    ),
    (
        "JSONSchemaFormat",
        "strict",
        {"response_format": {**SCHEMA_FORMAT, "json_schema": {**SCHEMA, "strict": None}}},
        {"response_format": SCHEMA_FORMAT},
    ),
]
# Chat fields OpenAI marks nullable that this server ignores.
IGNORED_NULLABLE = (
    "audio",
    "metadata",
    "modalities",
    "moderation",
    "prediction",
    "prompt_cache_key",
    "reasoning_effort",
    "safety_identifier",
    "service_tier",
    "store",
    "verbosity",
)


def base(path: str, field: str, extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"prompt": PROMPT} if path == COMPLETIONS else {"messages": [HI]})
    if field == "max_tokens":
        del body["max_tokens"]
    return body


def answer(api: SyncAPI, engine, path: str, body: dict[str, Any]) -> tuple[Any, list[Any]]:
    """The answer without its ids and times, and what reached the engine."""
    engine.submitted.clear()
    response = api.post(path, body)
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = parse_sse(response)
        shown: Any = [_timeless(e) if isinstance(e, dict) else e for e in events]
    else:
        shown = _timeless(response.json())
    return shown, [(r.prompt_token_ids, r.sampling_params) for r in engine.submitted]


def _timeless(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def null_and_default(path: str, field: str, extra: dict[str, Any]):
    """The body with `field` null, and the body the server must answer the same way."""
    with_null = {**base(path, field, extra), field: None}
    default = base(path, field, extra)
    if field == "prompt":
        default["prompt"] = ""  # required: its default is the start of a new document
    return with_null, default


CASES = [(COMPLETIONS, f, e) for f, e in COMPLETIONS_NULLABLE.items()] + [
    (CHAT, f, e) for f, e in CHAT_NULLABLE.items()
]


@pytest.mark.parametrize(
    ("path", "field", "extra"), CASES, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in CASES]
)
def test_null_is_accepted_and_read_as_the_default(api, engine, path, field, extra):
    with_null, default = null_and_default(path, field, extra)
    if path == COMPLETIONS and field == "max_tokens":
        # The one exception, as in vLLM: absent is OpenAI's 16, null is up to the context limit.
        default["max_tokens"] = MAX_MODEL_LEN - len(engine.tokenizer.encode(PROMPT))
    assert answer(api, engine, path, with_null) == answer(api, engine, path, default)


def test_a_null_prompt_is_the_start_of_a_document(api, engine):
    api.post(COMPLETIONS, {"model": MODEL, "prompt": None, "max_tokens": 2})
    [request] = engine.submitted
    assert request.prompt_token_ids == [engine.tokenizer.bos_token_id]


@pytest.fixture
def roomy(tiny_input_processor, tiny_llama_dir) -> tuple[SyncAPI, FakeEngine]:
    """The API over an engine whose context holds a prompt that lists tools."""
    engine = roomy_engine(tiny_input_processor)
    app = build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir))
    return SyncAPI(app), engine


@pytest.mark.parametrize(("component", "field", "with_null", "default"), NESTED_NULLABLE)
def test_null_inside_a_chat_body_is_read_as_the_default(
    roomy, component, field, with_null, default
):
    body = {"model": MODEL, "messages": [HI], "max_tokens": 4}
    assert answer(*roomy, CHAT, {**body, **with_null}) == answer(*roomy, CHAT, {**body, **default})


def test_fields_the_server_ignores_take_null(api, engine):
    body = {"model": MODEL, "messages": [HI], "max_tokens": 4}
    nulls = dict.fromkeys(IGNORED_NULLABLE)
    assert answer(api, engine, CHAT, {**body, **nulls}) == answer(api, engine, CHAT, body)


def test_every_field_at_null_at_once(api, engine):
    nulls = {f: None for f in COMPLETIONS_NULLABLE if f not in ("prompt", "max_tokens")}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    assert answer(api, engine, COMPLETIONS, {**body, **nulls}) == answer(
        api, engine, COMPLETIONS, body
    )
    nulls = {f: None for f in CHAT_NULLABLE if f != "max_tokens"}
    body = {"model": MODEL, "messages": [HI], "max_tokens": 4}
    assert answer(api, engine, CHAT, {**body, **nulls}) == answer(api, engine, CHAT, body)


def allows_null(schema: dict[str, Any]) -> bool:
    """Whether a property's JSON schema (OpenAPI 3.1) admits null."""
    kinds = schema.get("type")
    return (
        kinds == "null"
        or (isinstance(kinds, list) and "null" in kinds)
        or any(allows_null(branch) for branch in schema.get("anyOf", []))
    )


@pytest.fixture(scope="module")
def document(tiny_input_processor, tiny_llama_dir) -> dict[str, Any]:
    engine = FakeEngine(tiny_input_processor.tokenizer, tiny_input_processor)
    app = build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir))
    return SyncAPI(app).get("/openapi.json").json()


def request_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return document["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]


@pytest.mark.parametrize(
    ("path", "fields"), [(COMPLETIONS, COMPLETIONS_NULLABLE), (CHAT, CHAT_NULLABLE)]
)
def test_the_openapi_document_declares_each_nullable_field(document, path, fields):
    properties = request_schema(document, path)["properties"]
    refused = [field for field in fields if not allows_null(properties[field])]
    assert not refused, f"{path}: null not allowed for {refused}"
    # Null means the default, which the document names.
    for field in ("n", "stream"):
        assert "default" in properties[field], field


def test_the_openapi_document_declares_the_nested_nullable_fields(document):
    schemas = document["components"]["schemas"]
    for component, field, _, _ in NESTED_NULLABLE:
        assert allows_null(schemas[component]["properties"][field]), (component, field)
