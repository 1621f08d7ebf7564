"""Tool calling through /v1/chat/completions: constraints asked of the engine, calls answered.

The scripted engine "generates" what each test sets, so the outputs are the ones a grammar
(or a model following its template) would give.
"""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from transformers import AutoTokenizer

from tests.engine.entrypoints.fake_engine import MODEL, FakeEngine, SyncAPI, parse_sse
from tests.engine.entrypoints.test_api_errors import error_of
from tests.engine.entrypoints.test_api_openai_client import API_KEY, with_client
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.input_processor import InputProcessor

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = '{"city": "Paris", "days": 2}'


@pytest.fixture
def engine(tiny_input_processor) -> FakeEngine:
    """The scripted engine with a context long enough for prompts that list tools."""
    processor = InputProcessor(
        tokenizer=tiny_input_processor.tokenizer,
        vocab_size=tiny_input_processor.vocab_size,
        max_model_len=4096,
        eos_token_ids=set(tiny_input_processor.eos_token_ids),
    )
    return FakeEngine(processor.tokenizer, processor)


def tool_app(engine, model_dir, parser: str | None = "hermes", api_key: str | None = None):
    return build_app(
        engine,
        served_model_names=[MODEL],
        model_path=str(model_dir),
        tool_call_parser=parser,
        api_key=api_key,
    )


@pytest.fixture
def tools_api(engine, tiny_llama_dir) -> SyncAPI:
    return SyncAPI(tool_app(engine, tiny_llama_dir))


def chat(api, texts: list[str] | None = None, engine=None, **fields) -> dict:
    if texts is not None:
        engine.texts = texts
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **fields}
    response = api.post(CHAT, body)
    assert response.status_code == 200, response.text
    return response.json()


def sent_schema(engine) -> dict:
    return json.loads(engine.submitted[-1].sampling_params.structured_outputs.json)


def without_ids(message: dict) -> dict:
    calls = [{**call, "id": None} for call in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls}


# -- what the engine is asked ---------------------------------------------------------------


def test_named_choice_constrains_to_the_parameters_and_answers_one_call(tools_api, engine):
    reply = chat(tools_api, [ARGS], engine, tool_choice=NAMED)
    assert engine.submitted[0].sampling_params.structured_outputs.json == (
        '{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},'
        '"required":["city"]}'
    )
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["role"] == "assistant"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    Draft202012Validator(WEATHER["function"]["parameters"]).validate(json.loads(ARGS))


def test_a_function_without_parameters_takes_an_empty_object(tools_api, engine):
    chat(
        tools_api,
        ["{}"],
        engine,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert sent_schema(engine) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_an_array_of_calls(tools_api, engine, parallel):
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    if not parallel:
        output = '[{"name": "get_time", "parameters": {}}]'
    reply = chat(tools_api, [output], engine, tool_choice="required", parallel_tool_calls=parallel)
    schema = sent_schema(engine)
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    validator.validate(json.loads(output))
    assert ("maxItems" in schema) is not parallel
    refused = [
        [],
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "get_weather", "parameters": {"city": 5}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_time", "parameters": {}, "extra": 1}],
        [{"name": "get_time"}],
        {"name": "get_time", "parameters": {}},
    ]
    if not parallel:
        refused.append([{"name": "get_time", "parameters": {}}] * 2)
    for sample in refused:
        with pytest.raises(ValidationError):
            validator.validate(sample)
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = [call["function"] for call in choice["message"]["tool_calls"]]
    expected = [{"name": "get_time", "arguments": "{}"}]
    if parallel:
        expected.insert(0, {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    assert calls == expected
    ids = [call["id"] for call in choice["message"]["tool_calls"]]
    assert len(set(ids)) == len(ids)


def test_auto_and_none_leave_the_output_free(tools_api, engine):
    chat(tools_api, ["hello"], engine)
    chat(tools_api, ["hello"], engine, tool_choice="auto")
    chat(tools_api, ["hello"], engine, tool_choice="none", response_format={"type": "json_object"})
    constraints = [r.sampling_params.structured_outputs for r in engine.submitted]
    assert constraints[:2] == [None, None] and constraints[2].json_object


# -- what the client gets -------------------------------------------------------------------

HERMES_OUTPUT = (
    "Let me check.\n"
    f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_auto_parses_calls_and_content(tools_api, engine):
    [choice] = chat(tools_api, [HERMES_OUTPUT], engine)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": ARGS},
        {"name": "get_time", "arguments": "{}"},
    ]


def test_auto_without_calls_is_a_plain_reply(tools_api, engine):
    text = "It is sunny. <tool_call> is how I would call a tool."
    [choice] = chat(tools_api, [text], engine)["choices"]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(tools_api, engine):
    [choice] = chat(tools_api, [HERMES_OUTPUT], engine, parallel_tool_calls=False)["choices"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_none_reads_no_calls(tools_api, engine):
    [choice] = chat(tools_api, [HERMES_OUTPUT], engine, tool_choice="none")["choices"]
    assert choice["message"] == {"role": "assistant", "content": HERMES_OUTPUT}
    assert choice["finish_reason"] == "stop"


def test_a_length_cut_stays_length_with_what_parsed(tools_api, engine):
    engine.texts = [HERMES_OUTPUT]
    cut = len(engine.tokenizer.encode(HERMES_OUTPUT, add_special_tokens=False)) - 12
    [choice] = chat(tools_api, max_tokens=cut)["choices"]
    assert choice["finish_reason"] == "length"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    [named] = chat(tools_api, tool_choice=NAMED, max_tokens=3)["choices"]
    assert named["finish_reason"] == "length"
    assert named["message"]["tool_calls"][0]["function"]["arguments"] == (
        engine.tokenizer.decode(engine.tokenizer.encode(HERMES_OUTPUT, False)[:3])
    )


def test_each_choice_is_parsed_on_its_own(tools_api, engine):
    texts = [HERMES_OUTPUT, "just words", '<tool_call>{"name": "get_time"}</tool_call>']
    reply = chat(tools_api, texts, engine, n=3)
    first, second, third = reply["choices"]
    assert len(first["message"]["tool_calls"]) == 2 and first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "just words"}
    assert second["finish_reason"] == "stop"
    assert third["message"]["content"] is None
    assert third["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize(
    ("parser", "output"),
    [
        ("llama3_json", f'{{"name": "get_weather", "parameters": {ARGS}}}'),
        ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}]'),
    ],
)
def test_other_parsers(engine, tiny_llama_dir, parser, output):
    api = SyncAPI(tool_app(engine, tiny_llama_dir, parser))
    [choice] = chat(api, [output], engine)["choices"]
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": ARGS,
    }
    assert choice["finish_reason"] == "tool_calls"


# -- streaming ------------------------------------------------------------------------------

STREAM_CASES = [
    ({}, [HERMES_OUTPUT, "plain words", HERMES_OUTPUT[:-20]]),
    ({"tool_choice": NAMED}, [ARGS, ARGS, ARGS]),
    (
        {"tool_choice": "required"},
        [
            '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
            + ARGS
            + "}]"
        ]
        * 3,
    ),
]


@pytest.mark.parametrize(("fields", "texts"), STREAM_CASES)
def test_streamed_deltas_reassemble_to_the_reply(engine, tiny_llama_dir, fields, texts):
    app = tool_app(engine, tiny_llama_dir, api_key=API_KEY)
    engine.texts = texts
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "n": 3, **fields}

    async def use(client):
        reply = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(stream=True, **kwargs)
        return reply, [chunk async for chunk in stream]

    reply, chunks = with_client(app, use)
    for index in range(3):
        deltas = [c.choices[0] for c in chunks if c.choices[0].index == index]
        content, calls, finish = "", {}, None
        for choice in deltas:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:  # a call's first delta: its name, arguments ""
                    assert call.index not in calls and call.type == "function"
                    assert call.function.arguments == ""
                    calls[call.index] = {"name": call.function.name, "arguments": ""}
                else:
                    assert call.function.name is None and call.type is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
        whole = reply.choices[index]
        assert finish == whole.finish_reason
        assert (content or None) == whole.message.content
        expected = [c.function.model_dump() for c in whole.message.tool_calls or []]
        assert [calls[i] for i in sorted(calls)] == expected


def test_streamed_call_deltas_have_openais_shape(tools_api, engine):
    engine.texts = [HERMES_OUTPUT]
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "stream": True}
    events = parse_sse(tools_api.post(CHAT, body))[:-1]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    call_deltas = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert all(
        len(calls) == 1 and set(d) == {"tool_calls"}
        for d, calls in zip([d for d in deltas if "tool_calls" in d], call_deltas, strict=True)
    )
    starts = [calls[0] for calls in call_deltas if "id" in calls[0]]
    assert [set(s) for s in starts] == [{"index", "id", "type", "function"}] * 2
    assert [s["function"] for s in starts] == [
        {"name": "get_weather", "arguments": ""},
        {"name": "get_time", "arguments": ""},
    ]
    fragments = [calls[0] for calls in call_deltas if "id" not in calls[0]]
    assert all(
        set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments
    )
    assert len([f for f in fragments if f["index"] == 0]) > 1, "arguments stream in pieces"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- refused --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' appears more than once"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among the tools ('get_weather', 'get_time')",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [], "tool_choice": NAMED}, "tool_choice", "needs tools"),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice", "needs tools"),
        (
            {"response_format": {"type": "json_object"}},
            "tool_choice",
            "tool_choice 'auto' and response_format both decide",
        ),
        (
            {"tool_choice": "required", "guided_json": {"type": "object"}},
            "tool_choice",
            "tool_choice 'required' and guided_json",
        ),
        ({"tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required' or"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "must be 'none', 'auto'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "is required"),
        ({"tools": [{"function": {"name": ""}}]}, "tools[0].function.name", "must not be empty"),
        (
            {"tools": [{"function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "valid dictionary",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "send tools (each"),
        ({"function_call": "auto"}, "function_call", "send tool_choice instead"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages[0]",
            "tool_calls belong to assistant messages",
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0]",
            "needs tool_call_id",
        ),
    ],
)
def test_what_does_not_fit_is_400(tools_api, engine, fields, param, words):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **fields}
    error = error_of(tools_api.post(CHAT, body), 400, param=param)
    assert words in error["message"] and param.split("[")[0] in error["message"]
    assert not engine.submitted


def test_auto_needs_a_parser(api, engine):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
    error = error_of(api.post(CHAT, body), 400, param="tool_choice")
    assert "--tool-call-parser (hermes, llama3_json, mistral)" in error["message"]
    assert not engine.submitted
    for choice in ("required", NAMED, "none"):
        assert api.post(CHAT, {**body, "tool_choice": choice}).status_code == 200


def test_an_unknown_parser_is_refused_at_start(engine, tiny_llama_dir):
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral"):
        tool_app(engine, tiny_llama_dir, parser="xml")


# -- the prompt -----------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGS},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
]
TEMPLATE_TOOLS = [
    WEATHER,
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
RENDERED = (
    "<s><|system|>\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n"
    + "\n".join(json.dumps(t, ensure_ascii=False) for t in TEMPLATE_TOOLS)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call></s>\n'
    "<|user|>\nWeather in Paris, and the time?</s>\n"
    f'<|assistant|>\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call></s>\n'
    "<|user|>\n<tool_response>\nsunny\n</tool_response></s>\n"
    "<|user|>\n<tool_response>\nnoon\n</tool_response></s>\n"
    "<|assistant|>\n"
)


def test_a_tool_conversation_renders_through_the_template(tools_api, engine, tiny_llama_dir):
    body = {"model": MODEL, "messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none"}
    assert tools_api.post(CHAT, body).status_code == 200
    tokenizer = engine.tokenizer
    assert tokenizer.decode(engine.submitted[0].prompt_token_ids, False) == RENDERED
    # Transformers renders the template the same way from the same messages.
    hf = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf_messages = [dict(m) for m in CONVERSATION]
    hf_messages[2] = {**hf_messages[2], "content": ""}
    for call in hf_messages[2]["tool_calls"]:
        call["function"] = {
            **call["function"],
            "arguments": json.loads(call["function"]["arguments"]),
        }
    hf_messages[4] = {**hf_messages[4], "content": "noon"}
    text = hf.apply_chat_template(
        hf_messages, tools=TEMPLATE_TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == RENDERED


def test_without_tools_the_prompt_is_unchanged(tools_api, engine):
    messages = [CONVERSATION[0], CONVERSATION[1], {"role": "assistant", "content": "Hi."}]
    assert tools_api.post(CHAT, {"model": MODEL, "messages": messages}).status_code == 200
    expected = (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nWeather in Paris, and the time?</s>\n"
        "<|assistant|>\nHi.</s>\n<|assistant|>\n"
    )
    assert engine.tokenizer.decode(engine.submitted[0].prompt_token_ids, False) == expected


def test_tokenize_counts_the_tools_as_chat_sends_them(tools_api, engine):
    chat(tools_api, ["hello"], engine, max_tokens=1)
    body = {"model": MODEL, "messages": MESSAGES}
    counted = tools_api.post("/tokenize", {**body, "tools": TOOLS}).json()
    assert counted["tokens"] == engine.submitted[-1].prompt_token_ids
    assert counted["count"] > tools_api.post("/tokenize", body).json()["count"]
