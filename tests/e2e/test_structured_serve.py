"""Structured outputs and tool calls through `tidegate serve` on the tiny random model, with two
data-parallel engine cores: every constrained output of the schema corpus validates, the
official client's parse helper returns an object, forced tool calls validate and stream, bad
constraints are 400s, and nothing is left running or holding KV blocks afterwards."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.server import ServerProcess, serving

KEY = "sk-structured-71c2"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
CORPUS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "structured" / "schemas.json").read_text()
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_table",
        "parameters": {
            "type": "object",
            "properties": {
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            },
            "required": ["people", "time"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, BOOK]
SCHEMAS_BY_TOOL = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("structured-serve")
    proc = ServerProcess(
        tiny_llama_dir,
        directory,
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--max-model-len",
        "2048",
        "--tool-call-parser",
        "hermes",
        "--data-parallel-size-local",
        "2",
    )
    yield from serving(proc)


def bounded(schema):
    """The schema with every free-form string given a maxLength of 16.

    The random model closes a free string only by chance (about one token in a thousand
    allows it), so an unbounded string would run to max_tokens. Bounding it keeps the test
    finite; the output is still validated against the schema as written, which it satisfies.
    """
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: bounded(value) for key, value in schema.items()}
    types = schema.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    free = not any(key in schema for key in ("maxLength", "enum", "const", "pattern", "format"))
    if is_string and free:
        result["maxLength"] = max(16, schema.get("minLength", 0))
    return result


def chat_body(content: str, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 600,
        "temperature": 1.0,
        **extra,
    }


async def post_all(server: ServerProcess, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """Send the bodies at once (the engine batches them), at most 16 in flight."""
    limit = asyncio.Semaphore(16)

    async def one(client: httpx.AsyncClient, body: dict) -> httpx.Response:
        async with limit:
            return await client.post(path, json=body)

    async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=300) as client:
        return await asyncio.gather(*(one(client, body) for body in bodies))


def assert_idle(server: ServerProcess) -> None:
    """No request running or waiting and no KV block held, on every engine core."""
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        values = re.findall(rf"^tidegate:{name}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        assert values and all(float(v) == 0 for v in values), (name, values)


def test_every_schema_of_the_corpus_gives_valid_json(server):
    schemas = CORPUS["schemas"]
    assert len(schemas) >= 30
    bodies = [
        chat_body(
            f"Describe item {i} as JSON.",
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": bounded(schema), "strict": True},
            },
        )
        for i, (name, schema) in enumerate(schemas.items())
    ]
    responses = asyncio.run(post_all(server, "/v1/chat/completions", bodies))
    for (name, schema), response in zip(schemas.items(), responses, strict=True):
        assert response.status_code == 200, (name, response.text)
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (name, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert_idle(server)


def test_regexes_choices_and_grammars_on_completions(server):
    bodies, checks = [], []
    for i, regex in enumerate(CORPUS["regexes"]):
        bodies.append({"structured_outputs": {"regex": regex}, "seed": i})
        checks.append(lambda text, regex=regex: re.fullmatch(regex, text))
    for i, choices in enumerate(CORPUS["choices"]):
        bodies.append({"guided_choice": choices, "seed": i})
        checks.append(lambda text, choices=choices: text in choices)
    # Grammars of a bounded language (the arithmetic one never has to end: the random model
    # runs it to max_tokens; tests/engine/structured_output walks it to an end).
    for i, grammar in enumerate(g for g in CORPUS["grammars"] if "fullmatch" in g):
        text = grammar.get("ebnf") or grammar["lark"]
        bodies.append({"structured_outputs": {"grammar": text}, "seed": i})
        checks.append(lambda text, regex=grammar["fullmatch"]: re.fullmatch(regex, text))
    for body in bodies:
        body.update(model=MODEL, prompt="Answer:", max_tokens=400, temperature=1.0)
    responses = asyncio.run(post_all(server, "/v1/completions", bodies))
    for body, check, response in zip(bodies, checks, responses, strict=True):
        assert response.status_code == 200, (body, response.text)
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (body, choice)


def test_json_object_outputs_are_objects(server):
    # Any object: its keys are free strings, which the random model closes only by chance, so
    # some seeds run to max_tokens; those that end are objects, and every one starts as one.
    bodies = [
        chat_body("JSON please.", seed=seed, response_format={"type": "json_object"})
        for seed in range(8)
    ]
    responses = asyncio.run(post_all(server, "/v1/chat/completions", bodies))
    choices = [response.json()["choices"][0] for response in responses]
    finished = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all(c["message"]["content"].lstrip().startswith("{") for c in choices)


def test_n_choices_with_a_seed_are_each_valid_and_reproducible(server):
    schema = CORPUS["schemas"]["array_of_objects"]
    body = chat_body(
        "List things.",
        n=3,
        seed=42,
        structured_outputs={"json": schema},
    )
    first, again = asyncio.run(post_all(server, "/v1/chat/completions", [body, body]))
    texts = [c["message"]["content"] for c in first.json()["choices"]]
    assert texts == [c["message"]["content"] for c in again.json()["choices"]]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


class Step(pydantic.BaseModel):
    explanation: str = pydantic.Field(max_length=40)
    output: str = pydantic.Field(max_length=20)


class MathReasoning(pydantic.BaseModel):
    steps: list[Step] = pydantic.Field(max_length=3)
    final_answer: str = pydantic.Field(max_length=20)


def test_the_openai_clients_parse_helper_returns_a_parsed_object(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Solve 8x + 7 = -23."}],
        response_format=MathReasoning,
        max_tokens=600,
        seed=1,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, MathReasoning)
    assert message.parsed == MathReasoning.model_validate_json(message.content)


def test_required_and_named_tool_choices_return_valid_calls(server):
    bodies = [
        chat_body("What is the weather in Oslo?", tools=TOOLS, tool_choice="required", seed=s)
        for s in range(4)
    ] + [
        chat_body(
            "Book a table.",
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "book_table"}},
            seed=s,
        )
        for s in range(4)
    ]
    bodies.append(
        chat_body(
            "One call only.",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=9,
        )
    )
    responses = asyncio.run(post_all(server, "/v1/chat/completions", bodies))
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and calls, choice
        assert choice["message"]["content"] is None
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS_BY_TOOL[name])
        if isinstance(body["tool_choice"], dict):
            assert [c["function"]["name"] for c in calls] == ["book_table"]
        if body.get("parallel_tool_calls") is False:
            assert len(calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_streamed_tool_calls_reassemble_to_the_whole_answer(server, tool_choice):
    choice = (
        "required"
        if tool_choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Lima?"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=600,
        seed=5,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta_choice in chunk.choices:
            finish = delta_choice.finish_reason or finish
            for delta in delta_choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(calls[i]["id"] for i in calls)
    for name, arguments in streamed:
        jsonschema.validate(json.loads(arguments), SCHEMAS_BY_TOOL[name])


def refused_cases() -> list[tuple[dict, list[str]]]:
    """The corpus's refused constraints that the default backend refuses, as request fields."""
    cases = []
    for entry in CORPUS["refused"]:
        if "guidance" not in entry.get("backends", ["guidance"]):
            continue
        if "schema" in entry:
            cases.append(({"structured_outputs": {"json": entry["schema"]}}, entry["words"]))
        elif "json" in entry:
            # Text that is no schema at all: the API server's own check answers, naming the field.
            cases.append(
                ({"structured_outputs": {"json": entry["json"]}}, ["structured_outputs.json"])
            )
        else:
            field = {key: entry[key] for key in ("regex", "grammar") if key in entry}
            cases.append(({"structured_outputs": field}, entry["words"]))
    return cases


def test_bad_constraints_are_400s_that_name_the_problem_and_leave_nothing(server):
    cases = refused_cases()
    assert len(cases) >= 20
    for stream in (False, True):
        bodies = [chat_body("x", stream=stream, **extra) for extra, _ in cases]
        responses = asyncio.run(post_all(server, "/v1/chat/completions", bodies))
        for (extra, words), response in zip(cases, responses, strict=True):
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error", error
            for word in words:
                assert word.lower() in error["message"].lower(), (word, error)
    assert_idle(server)


def test_a_grammar_that_cannot_finish_ends_with_length(server):
    body = chat_body(
        "x", max_tokens=4, structured_outputs={"json": CORPUS["schemas"]["nested_object"]}
    )
    (response,) = asyncio.run(post_all(server, "/v1/chat/completions", [body]))
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 4
    assert_idle(server)
