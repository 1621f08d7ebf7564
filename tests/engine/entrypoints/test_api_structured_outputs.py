"""response_format, structured_outputs and guided_*: what the engine is asked, and what is refused."""

from __future__ import annotations

import json

import pytest

from tests.engine.entrypoints.fake_engine import MODEL
from tests.engine.entrypoints.test_api_errors import error_of
from tidegate.engine.sampling_params import StructuredOutputsParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Keys out of alphabetical order: the order is kept, since it is the order the model writes.
SCHEMA = {
    "type": "object",
    "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}},
    "required": ["zeta", "alpha"],
}
SCHEMA_TEXT = '{"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}},"required":["zeta","alpha"]}'


def body_for(path: str, **fields) -> dict:
    base = {"model": MODEL, "max_tokens": 3}
    if path == CHAT:
        return {**base, "messages": [{"role": "user", "content": "hi"}], **fields}
    return {**base, "prompt": "hi", **fields}


def constraint_sent(api, engine, path: str, **fields) -> StructuredOutputsParams | None:
    response = api.post(path, body_for(path, **fields))
    assert response.status_code == 200, response.text
    return engine.submitted[-1].sampling_params.structured_outputs


SHAPES = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "person-2_x",
                    "description": "who",
                    "schema": SCHEMA,
                    "strict": True,
                },
            }
        },
        StructuredOutputsParams(json=SCHEMA_TEXT),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": True}}},
        StructuredOutputsParams(json="true"),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA_TEXT)),
    (
        {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
        StructuredOutputsParams(json=SCHEMA_TEXT),
    ),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    (
        {"structured_outputs": {"choice": ["yes", "no"]}},
        StructuredOutputsParams(choice=["yes", "no"]),
    ),
    (
        {"structured_outputs": {"grammar": 'root ::= "a"'}},
        StructuredOutputsParams(grammar='root ::= "a"'),
    ),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA_TEXT)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA_TEXT)),
    ({"guided_regex": "\\d+"}, StructuredOutputsParams(regex="\\d+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
    ({}, None),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "expected"), SHAPES)
def test_each_shape_reaches_the_engine(api, engine, path, fields, expected):
    assert constraint_sent(api, engine, path, **fields) == expected


def test_every_choice_and_prompt_gets_the_constraint(api, engine):
    body = body_for(COMPLETIONS, prompt=["a", "b"], n=2, seed=1, guided_regex="x+")
    assert api.post(COMPLETIONS, body).status_code == 200
    assert [r.sampling_params.structured_outputs for r in engine.submitted] == [
        StructuredOutputsParams(regex="x+")
    ] * 4


def test_streamed_requests_are_constrained_too(api, engine):
    fields = {"response_format": {"type": "json_object"}, "stream": True}
    for path in (CHAT, COMPLETIONS):
        assert api.post(path, body_for(path, **fields)).status_code == 200
    assert all(r.sampling_params.structured_outputs.json_object for r in engine.submitted)


def json_schema(**fields) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": fields}}


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"response_format": "json"}, "response_format", "valid dictionary"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    (json_schema(schema=SCHEMA), "response_format.json_schema.name", "is required"),
    (
        json_schema(name="has space", schema=SCHEMA),
        "response_format.json_schema.name",
        "1 to 64 letters",
    ),
    (json_schema(name="x" * 65, schema=SCHEMA), "response_format.json_schema.name", "1 to 64"),
    (json_schema(name="s"), "response_format.json_schema.schema", "is required"),
    (
        json_schema(name="s", schema=[1]),
        "response_format.json_schema.schema",
        "an object or a boolean; got an array",
    ),
    (
        json_schema(name="s", schema="{}"),
        "response_format.json_schema.schema",
        "got a string",
    ),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of json"),
    (
        {"structured_outputs": {"regex": "a", "grammar": "b"}},
        "structured_outputs",
        "got regex, grammar",
    ),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "got an array"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json", "got a number"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar", "non-empty string"),
    (
        {"structured_outputs": {"structural_tag": {"x": 1}}},
        "structured_outputs.structural_tag",
        "not supported",
    ),
    ({"guided_json": "nope"}, "guided_json", "not valid JSON"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_choice": "a"}, "guided_choice", "non-empty list of non-empty strings"),
    ({"guided_grammar": ["x"]}, "guided_grammar", "non-empty string"),
    (
        {"guided_regex": "a", "guided_choice": ["a"]},
        "guided_choice",
        "guided_choice and guided_regex both constrain the output",
    ),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "structured_outputs and response_format both constrain",
    ),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "param", "words"), BAD)
def test_malformed_shapes_are_400_naming_the_field(api, engine, path, fields, param, words):
    error = error_of(api.post(path, body_for(path, **fields)), 400, param=param)
    assert param in error["message"] and words in error["message"], error["message"]
    assert not engine.submitted


def test_nan_in_a_schema_is_400(api):
    # Python clients send NaN; JSON (and so the grammar compiler) has none.
    content = json.dumps(body_for(COMPLETIONS, guided_json={"maximum": float("nan")}))
    response = api.request(
        "POST", COMPLETIONS, content=content, headers={"content-type": "application/json"}
    )
    error = error_of(response, 400, param="guided_json")
    assert "NaN" in error["message"]


def test_text_format_with_a_constraint_is_no_conflict(api, engine):
    fields = {"response_format": {"type": "text"}, "guided_regex": "a"}
    assert constraint_sent(api, engine, CHAT, **fields) == StructuredOutputsParams(regex="a")
