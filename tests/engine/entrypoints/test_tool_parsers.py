"""Tool-call parsers: whole texts, and the same texts streamed in pieces split anywhere."""

from __future__ import annotations

import json
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidegate.engine.config import ServerArgs
from tidegate.engine.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    CallArguments,
    CallStart,
    Content,
    NamedToolParser,
    ParsedOutput,
    RequiredToolParser,
    ToolCall,
    ToolParser,
    fold,
)
from tidegate.engine.entrypoints.openai.tool_parsers.json_scan import (
    DONE,
    DONE_BEFORE,
    ERROR,
    JSONScanner,
)

HERMES = TOOL_PARSERS["hermes"]
LLAMA = TOOL_PARSERS["llama3_json"]
MISTRAL = TOOL_PARSERS["mistral"]
WEATHER = '{"city": "Paris", "days": [1, 2.5e3, -0.5], "metric": true, "note": "a \\"b\\" \\u00e9"}'


def streamed(parser_type: type[ToolParser], pieces: list[str]) -> ParsedOutput:
    """What a stream of these pieces parses to."""
    parser = parser_type()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return fold(events + parser.finish())


def splits_everywhere(parser_type: type[ToolParser], text: str) -> None:
    """Every split in two, and one character at a time, parse as the whole text does."""
    whole = parser_type.parse(text)
    for at in range(len(text) + 1):
        assert streamed(parser_type, [text[:at], text[at:]]) == whole, at
    assert streamed(parser_type, list(text)) == whole


CASES = [
    # (parser, model text, content, calls)
    (
        HERMES,
        f'<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>',
        "",
        [ToolCall("weather", WEATHER)],
    ),
    (
        HERMES,
        'Let me look.\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"arguments": {"x": [1]}, "name": "b"}</tool_call>',
        "Let me look.",
        [ToolCall("a", "{}"), ToolCall("b", '{"x": [1]}')],
    ),
    (HERMES, '<tool_call>{"name": "now"}</tool_call>', "", [ToolCall("now", "{}")]),
    (
        HERMES,
        '<tool_call>{"name": "a", "arguments": {"q": 1}}',  # no closing tag: ended at EOS
        "",
        [ToolCall("a", '{"q": 1}')],
    ),
    (
        HERMES,
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> and after',
        " and after",
        [ToolCall("a", "{}")],
    ),
    (
        HERMES,
        "no calls here, < or <tool or <tool_call",
        "no calls here, < or <tool or <tool_call",
        [],
    ),
    (HERMES, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (HERMES, '<tool_call>{"nam": "a"}</tool_call>', '<tool_call>{"nam": "a"}</tool_call>', []),
    (HERMES, '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
    (HERMES, '<tool_call>{"name": ""}</tool_call>', '<tool_call>{"name": ""}</tool_call>', []),
    (HERMES, '<tool_call>{"name": "a", "argu', '<tool_call>{"name": "a", "argu', []),
    (
        HERMES,
        '<tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call>',
        "<tool_call>",
        [ToolCall("a", "{}")],
    ),
    (
        LLAMA,
        f'{{"name": "weather", "parameters": {WEATHER}}}',
        "",
        [ToolCall("weather", WEATHER)],
    ),
    (
        LLAMA,
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")],
    ),
    (
        LLAMA,
        'Checking. <|python_tag|>{"name": "a", "arguments": {}}',
        "Checking.",
        [ToolCall("a", "{}")],
    ),
    (LLAMA, '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    (LLAMA, 'The answer is {"name": "a"}', 'The answer is {"name": "a"}', []),  # not at the start
    (
        LLAMA,
        '{"name": "a", "parameters": {}}; {"oops": 1}',
        '; {"oops": 1}',
        [ToolCall("a", "{}")],
    ),
    (
        MISTRAL,
        f'[TOOL_CALLS][{{"name": "weather", "arguments": {WEATHER}}}, '
        '{"name": "b", "arguments": {"k": null}}]',
        "",
        [ToolCall("weather", WEATHER), ToolCall("b", '{"k": null}')],
    ),
    (
        MISTRAL,
        'Sure. [TOOL_CALLS] {"name": "a", "arguments": {}}',
        "Sure.",
        [ToolCall("a", "{}")],
    ),
    (MISTRAL, '[{"name": "a", "arguments": {}}]', "", [ToolCall("a", "{}")]),
    (MISTRAL, "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (MISTRAL, "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    (
        RequiredToolParser,
        '[{"name": "a", "parameters": {"n": 5}}, {"name": "b", "parameters": {}}]',
        "",
        [ToolCall("a", '{"n": 5}'), ToolCall("b", "{}")],
    ),
]


@pytest.mark.parametrize(("parser_type", "text", "content", "calls"), CASES)
def test_whole_text_and_every_split(parser_type, text, content, calls):
    assert parser_type.parse(text) == ParsedOutput(content, calls)
    splits_everywhere(parser_type, text)


def test_arguments_stream_as_they_are_written():
    parser = HERMES()
    assert parser.feed("Hi <tool_") == [Content("Hi")]
    assert parser.feed('call>{"name": "f", "argu') == []  # no call before its name and arguments
    assert parser.feed('ments": {"a') == [CallStart(0, "f"), CallArguments(0, '{"a')]
    assert parser.feed('": 1}}</tool_call>') == [CallArguments(0, '": 1}')]
    assert parser.finish() == []


def test_a_call_broken_after_it_started_keeps_what_streamed():
    text = '<tool_call>{"name": "f", "arguments": {"a": }} rest</tool_call>'
    parsed = HERMES.parse(text)
    assert parsed.calls == [ToolCall("f", '{"a": ')]
    assert parsed.content == "}} rest</tool_call>"
    splits_everywhere(HERMES, text)


def test_a_call_cut_by_the_end_keeps_its_arguments():
    assert HERMES.parse('<tool_call>{"name": "f", "arguments": {"a": [1, ').calls == [
        ToolCall("f", '{"a": [1, ')
    ]


def test_text_without_calls_is_content_unchanged():
    for text in ("  padded  \n", "<tool_call", "[TOOL_CALLS", '{"name": 1}', "\n\n"):
        for parser_type in (*TOOL_PARSERS.values(), RequiredToolParser):
            parsed = parser_type.parse(text)
            assert parsed.calls or parsed.content == text


def test_named_parser_makes_the_whole_output_the_arguments():
    parser = NamedToolParser("f")
    events = parser.feed('{"a"') + parser.feed(": 1}") + parser.finish()
    assert fold(events) == ParsedOutput("", [ToolCall("f", '{"a": 1}')])
    empty = NamedToolParser("f")
    assert fold(empty.finish()) == ParsedOutput("", [ToolCall("f", "")])


def test_the_registry_is_the_flag():
    annotation = ServerArgs.model_fields["tool_call_parser"].annotation
    [literal] = [a for a in typing.get_args(annotation) if a is not type(None)]
    assert set(typing.get_args(literal)) == set(TOOL_PARSERS)
    assert all(name == parser.name for name, parser in TOOL_PARSERS.items())


@pytest.mark.parametrize(
    "text",
    ["{}", "[]", '{"a": [1, {"b": null}], "c": "\\u00e9\\n"}', "-0.5e+3", "true", '"x"', "[1,2]"],
)
def test_the_scanner_knows_where_json_ends(text):
    scanner = JSONScanner()
    statuses = [scanner.feed(char) for char in text]
    assert ERROR not in statuses
    assert statuses[-1] == DONE or scanner.complete_at_end()
    assert json.loads(text) is not None or text == "null"


@pytest.mark.parametrize("text", ["{,}", "[1,]", '{"a" 1}', "01", "tru ", '"\\x"', "{]", '"a\nb"'])
def test_the_scanner_refuses_what_is_not_json(text):
    scanner = JSONScanner()
    statuses = [scanner.feed(char) for char in text]
    assert ERROR in statuses or not scanner.complete_at_end()


def test_a_number_ends_at_the_character_after_it():
    scanner = JSONScanner()
    assert [scanner.feed(c) for c in "12,"] == [0, 0, DONE_BEFORE]


# Pieces of call syntax and text, so that random texts come near calls often.
PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"arguments"',
        '"parameters"',
        ":",
        ",",
        ";",
        " ",
        "\n",
        '"f"',
        "1",
        "true",
        "text",
        "<",
        '"\\ud800"',
        '"',
        "\\",
    ]
)
TEXTS = st.lists(PIECES, max_size=30).map("".join)
PARSERS = st.sampled_from([*TOOL_PARSERS.values(), RequiredToolParser])


@given(parser_type=PARSERS, text=TEXTS, cuts=st.lists(st.integers(0, 400), max_size=6))
@settings(
    max_examples=1500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_any_text_split_anywhere_parses_as_the_whole(parser_type, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    whole = parser_type.parse(text)
    assert streamed(parser_type, pieces) == whole
    # Nothing is lost: what is not content is a call (whose text it came from).
    if not whole.calls:
        assert whole.content == text
    for call in whole.calls:
        assert call.name and "\ud800" not in call.name
