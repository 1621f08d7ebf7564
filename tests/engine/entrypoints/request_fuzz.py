"""Request bodies for property tests, and what every answer to them must look like.

Each field of a body has valid values and odd ones: at or past the edge of its range, of the
wrong type, null, any JSON at all, or the field left out. `edge_cases` lists every field's edge
values, to be sent one at a time in an otherwise valid body; `completion_bodies` and
`chat_bodies` draw bodies valid field by field, then make up to two of their fields odd, so that
most bodies reach the engine and each odd value is tried where little else is wrong.
`bounded` bodies always cap the completion at a few tokens, so that a real engine answers
quickly: no odd value of theirs lets a completion run to the end of the context.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import httpx
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.engine.entrypoints.fake_engine import parse_sse
from tidegate.engine.entrypoints.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
)

BOUNDED_MAX_TOKENS = 8
VOCAB_SIZE = 1024  # the tiny test model's
MISSING = object()  # an odd "value": the field is left out

# -- values ---------------------------------------------------------------------------------

HUGE = (2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, 10**30)
ODD_FLOATS = (math.nan, math.inf, -math.inf, 5e-324, 1e-300, -0.0, 1e300)
# Lone surrogates are valid JSON (as \ud800 escapes) but not Unicode text.
ODD_STRINGS = ("", "\ud800", "a\udfffb", "\U0001f30a" * 3, "x" * 5000)
# Any JSON value, nested a little.
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
SHORT_TEXT = st.text(min_size=1, max_size=12)
# st.text leaves lone surrogates out (even from an alphabet that has them): one at a time.
SURROGATES = st.lists(
    st.characters(categories=["Cs"]) | st.characters(), min_size=1, max_size=6
).map("".join)


def pick(*choices: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One of `choices`, each as likely.

    (st.one_of flattens the one_ofs inside it and drops repeats, so a choice with many
    branches, such as JUNK, would crowd out the others.)
    """
    return st.sampled_from(choices).flatmap(lambda chosen: chosen)


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int):
    """`common`, and `rare` about once in `one_in` draws."""
    return pick(*[common] * (one_in - 1), rare)


# What a person may type, now and then with a lone surrogate.
TEXT = mostly(st.text(max_size=12), SURROGATES, one_in=20)
ODD_TEXT = pick(
    st.sampled_from(ODD_STRINGS),
    SURROGATES,
    st.builds(lambda unit, n: unit * n, st.text(min_size=1, max_size=3), st.integers(50, 3000)),
)

# -- fields and bodies ----------------------------------------------------------------------


class Field(NamedTuple):
    valid: st.SearchStrategy[Any]
    odd: st.SearchStrategy[Any]
    edges: tuple[Any, ...]  # odd values worth trying one by one


def field(
    valid: st.SearchStrategy[Any], *edges: Any, odd: st.SearchStrategy[Any] | None = None
) -> Field:
    """A field whose odd values are `edges`, `odd`, null, any JSON, or leaving it out."""
    choices = [st.sampled_from(edges)] if edges else []
    choices += [odd] if odd is not None else []
    return Field(
        valid, pick(*choices, st.sampled_from([None, MISSING]), JUNK), (*edges, None, MISSING)
    )


def with_value(body: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    """`body` with field `name` set to `value` (MISSING: left out)."""
    changed = {k: v for k, v in body.items() if k != name}
    if value is not MISSING:
        changed[name] = value
    return changed


@st.composite
def bodies(
    draw, required: dict[str, Field], optional: dict[str, Field], max_odd: int = 2
) -> dict[str, Any]:
    """Required fields and some optional ones, valid; then up to `max_odd` fields made odd."""
    fields = {**required, **optional}
    body = {name: draw(f.valid) for name, f in required.items()}
    body.update({name: draw(f.valid) for name, f in optional.items() if draw(st.booleans())})
    odd = st.lists(st.sampled_from(sorted(fields)), max_size=max_odd, unique=True)
    for name in draw(odd):
        body = with_value(body, name, draw(fields[name].odd))
    return body


def sampling_fields() -> dict[str, Field]:
    """The optional fields completions and chat share."""
    texts = SHORT_TEXT | st.lists(SHORT_TEXT, max_size=4)
    in_vocab = st.integers(0, VOCAB_SIZE - 1)
    return {
        "n": field(st.integers(1, 4), 0, -1, 16, 17, *HUGE),
        "temperature": field(st.floats(0, 2), 0.0, 1e-5, 100.0, 100.5, -0.5, *ODD_FLOATS),
        "top_p": field(st.floats(0.01, 1), 1.0, 0.0, 1.5, *ODD_FLOATS),
        "top_k": field(st.integers(-1, 50), VOCAB_SIZE - 1, VOCAB_SIZE, -2, *HUGE),
        "min_p": field(st.floats(0, 1), 1.0, 1.5, -0.1, *ODD_FLOATS),
        "seed": field(st.integers(0, 2**63 - 1), -1, *HUGE),
        "presence_penalty": field(st.floats(-2, 2), 2.0, -2.5, *ODD_FLOATS),
        "frequency_penalty": field(st.floats(-2, 2), -2.0, 2.5, *ODD_FLOATS),
        "repetition_penalty": field(st.floats(0.5, 2), 2.0, 0.0, 2.5, *ODD_FLOATS),
        "min_tokens": field(st.integers(0, 1), -1, BOUNDED_MAX_TOKENS + 1, *HUGE),
        "stop": field(texts, *ODD_STRINGS, [""], ["\n", " "], ["\ud800"], odd=ODD_TEXT),
        "stop_token_ids": field(st.lists(in_vocab, max_size=3), [-1], [VOCAB_SIZE], [*HUGE]),
        "ignore_eos": field(st.booleans()),
        "include_stop_str_in_output": field(st.booleans()),
        "skip_special_tokens": field(st.booleans()),
        "logit_bias": field(
            st.dictionaries(in_vocab.map(str), st.floats(-100, 100), max_size=3),
            {"x": 1.0},
            {"5": "y"},
            {"5": 100.5},
            {"-1": 1.0},
            {str(VOCAB_SIZE): 1.0},
            {"5": math.nan},
        ),
        # Five distinct tokens: at least one is not a stop token (at most three stop_token_ids
        # and EOS), so min_tokens can always be met.
        "allowed_token_ids": field(
            st.lists(in_vocab, min_size=5, max_size=6, unique=True),
            [],
            [-1],
            [VOCAB_SIZE],
            [*HUGE],
            [2],
        ),
        "stream": field(st.just(True), False),  # hypothesis favours False, the default
        "stream_options": field(
            st.fixed_dictionaries({"include_usage": st.booleans()}), {}, {"include_usage": None}
        ),
        "user": field(SHORT_TEXT, "\ud800"),
        "cache_salt": field(SHORT_TEXT, *ODD_STRINGS, odd=ODD_TEXT),
        "kv_transfer_params": field(st.just({}), {"do_remote_decode": True}),
    }


def max_tokens(bounded: bool) -> Field:
    """A completion limit; when bounded, its odd values are refused, or small once coerced."""
    refused = (0, -1, "8", 2.0, True, 10**6, "x", [], 1.5, *HUGE)
    if bounded:
        return Field(st.integers(1, BOUNDED_MAX_TOKENS), st.sampled_from(refused), refused)
    return field(st.integers(1, 16), 100, *refused)


def with_limit(
    required: dict[str, Field], optional: dict[str, Field], bounded: bool
) -> tuple[dict[str, Field], dict[str, Field]]:
    """The fields and max_tokens: optional, or when bounded, always there."""
    if bounded:
        return {**required, "max_tokens": max_tokens(bounded)}, optional
    return required, {**optional, "max_tokens": max_tokens(bounded)}


def edge_cases(required: dict[str, Field], optional: dict[str, Field]) -> list[tuple[str, Any]]:
    """Every field's edge values, as (name, value)."""
    return [(name, value) for name, f in {**required, **optional}.items() for value in f.edges]


# -- completions ----------------------------------------------------------------------------

PROMPT = field(
    TEXT.filter(bool)
    | st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)
    | st.lists(TEXT.filter(bool), min_size=1, max_size=3)
    | st.lists(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=6), min_size=1),
    *ODD_STRINGS,
    ["a", "\ud800"],
    [],
    [[]],
    [""],
    [-1],
    [VOCAB_SIZE],
    [*HUGE],
    [1, "a"],
    [True],
    [[1], "a"],
    [1.5],
    odd=pick(ODD_TEXT, st.lists(st.integers(-5, VOCAB_SIZE + 5), max_size=4)),
)


def completion_fields(
    model: str, bounded: bool = False
) -> tuple[dict[str, Field], dict[str, Field]]:
    """The required and the optional fields of POST /v1/completions."""
    required = {"model": field(st.just(model), "gpt-4", ""), "prompt": PROMPT}
    optional = {
        **sampling_fields(),
        "logprobs": field(st.integers(0, 5), 20, 21, -1),
        "echo": field(st.booleans()),
        "prompt_logprobs": field(st.integers(0, 3), 20, 21, -1, *HUGE),
        "suffix": field(st.just(""), "x"),
        "best_of": field(st.none(), 0, 1, 2),  # must equal n
    }
    return with_limit(required, optional, bounded)


def completion_bodies(
    model: str, bounded: bool = False, max_odd: int = 2
) -> st.SearchStrategy[dict[str, Any]]:
    """POST /v1/completions bodies; with max_odd 0, valid ones (but for lone surrogates)."""
    return bodies(*completion_fields(model, bounded), max_odd)


# -- chat -----------------------------------------------------------------------------------

TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
CONTENT = field(
    TEXT | st.lists(TEXT_PART, max_size=3),
    *ODD_STRINGS,
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
    [{"type": "text"}],
    [{"type": "text", "text": 5}],
    [{"type": "text", "text": "\ud800"}],
    [],
    odd=pick(ODD_TEXT, st.lists(JUNK, min_size=1, max_size=2)),
)
ROLE = field(st.sampled_from(["user", "assistant", "system"]), "", "tool", "developer", "robot")
# A call an assistant turn made; arguments are JSON text, or (passed as they are) any text.
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": SHORT_TEXT,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": SHORT_TEXT, "arguments": st.sampled_from(["{}", '{"a": [1]}', "not json"])}
        ),
    }
)
MESSAGE_FIELDS = (
    {"role": ROLE, "content": CONTENT},
    {
        "name": field(SHORT_TEXT),
        "tool_call_id": field(SHORT_TEXT),
        "tool_calls": field(st.lists(TOOL_CALL, max_size=2), [{"type": "function"}]),
    },
)


def _calls_only_from_the_assistant(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "assistant":
        return message
    return {k: v for k, v in message.items() if k != "tool_calls"}


VALID_MESSAGE = bodies(*MESSAGE_FIELDS, max_odd=0).map(_calls_only_from_the_assistant)
# A conversation has several messages: one odd in five leaves most conversations valid.
ANY_MESSAGE = mostly(VALID_MESSAGE, bodies(*MESSAGE_FIELDS, max_odd=1), one_in=5)
HI = {"role": "user", "content": "hi"}
# One odd message (or a conversation of odd shape), after a good one.
MESSAGES_EDGES = (
    [],
    [HI, None],
    [HI, "hi"],
    [HI, []],
    *(
        [HI, with_value(HI, name, value)]
        for name, f in MESSAGE_FIELDS[0].items()
        for value in f.edges
    ),
)


def messages(valid: bool) -> Field:
    """The messages of a conversation; odd ones when not `valid`."""
    message = VALID_MESSAGE if valid else ANY_MESSAGE
    odd = st.lists(pick(ANY_MESSAGE, JUNK), max_size=3)
    return field(st.lists(message, min_size=1, max_size=4), *MESSAGES_EDGES, odd=odd)


def chat_fields(
    model: str, bounded: bool = False, valid_messages: bool = False
) -> tuple[dict[str, Field], dict[str, Field]]:
    """The required and the optional fields of POST /v1/chat/completions."""
    required = {"model": field(st.just(model), "gpt-4"), "messages": messages(valid_messages)}
    optional = {
        **sampling_fields(),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.just(0), 1, 20, 21, -1),
        "max_completion_tokens": max_tokens(bounded),
        "response_format": field(st.just({"type": "text"}), {"type": "json_object"}),
        "tools": field(st.just([]), [{"type": "function"}]),
        "tool_choice": field(st.just("none"), "auto"),
        "echo": field(st.booleans()),
        "add_generation_prompt": field(st.booleans()),
        # True needs add_generation_prompt false and a final message with content.
        "continue_final_message": field(st.just(False), True, "yes"),
        "chat_template_kwargs": field(
            st.sampled_from([{}, {"enable_thinking": False}, {"enable_thinking": True}]),
            {"messages": []},
            {"bos_token": "x"},
            [],
            "enable_thinking",
        ),
    }
    return with_limit(required, optional, bounded)


def chat_bodies(
    model: str, bounded: bool = False, max_odd: int = 2
) -> st.SearchStrategy[dict[str, Any]]:
    """POST /v1/chat/completions bodies; with max_odd 0, valid ones (but for lone surrogates)."""
    return bodies(*chat_fields(model, bounded, valid_messages=max_odd == 0), max_odd)


# -- requests and answers -------------------------------------------------------------------

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def base_body(path: str, model: str) -> dict[str, Any]:
    """A small valid body, for edge values to be tried in one at a time."""
    if path == COMPLETIONS:
        return {"model": model, "prompt": "The tide", "max_tokens": 4}
    return {"model": model, "messages": [HI], "max_tokens": 4}


def edge_bodies(
    path: str, model: str, bounded: bool = False, both_ways: bool = True
) -> list[dict[str, Any]]:
    """The base body with each edge value of each field, streamed and not (or in turns)."""
    fields = (
        completion_fields(model, bounded) if path == COMPLETIONS else chat_fields(model, bounded)
    )
    base = base_body(path, model)
    cases = edge_cases(*fields)
    if not both_ways:
        return [
            with_value({**base, "stream": i % 2 == 1}, name, value)
            for i, (name, value) in enumerate(cases)
        ]
    return [
        with_value({**base, "stream": stream}, name, value)
        for name, value in cases
        for stream in (False, True)
    ]


def encode(body: Any) -> bytes:
    """JSON as Python clients send it: NaN and Infinity allowed, lone surrogates escaped.

    (httpx's `json=` refuses both, so the bodies go out as `content=`.)
    """
    return json.dumps(body).encode()


JSON_HEADERS = {"Content-Type": "application/json"}


def assert_error_body(body: Any) -> dict[str, Any]:
    """OpenAI's error body with a message; returns the error object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def assert_openai_answer(response: httpx.Response, path: str) -> list[Any]:
    """A 2xx whose body (or every streamed chunk) is the route's, or a 4xx in OpenAI's body.

    Returns the response's choices (every chunk's, when streamed), [] for an error.
    """
    status = response.status_code
    assert status == 200 or 400 <= status < 500, f"{status}: {response.text[:2000]}"
    if status >= 400:
        assert_error_body(response.json())
        return []
    if not response.headers["content-type"].startswith("text/event-stream"):
        model: type[BaseModel] = ChatCompletionResponse if path == CHAT else CompletionResponse
        return model.model_validate(response.json()).choices
    events = parse_sse(response)  # framing, and [DONE] last
    chunk: type[BaseModel] = ChatCompletionChunk if path == CHAT else CompletionResponse
    choices: list[Any] = []
    for index, event in enumerate(events[:-1]):
        if "error" in event:
            error = assert_error_body(event)
            assert index == len(events) - 2, "a stream goes on after its error event"
            assert error["type"] != "server_error", error
        else:
            choices.extend(chunk.model_validate(event).choices)
    return choices
