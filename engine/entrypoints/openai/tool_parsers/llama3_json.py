"""Llama 3.1's JSON calls: `{"name": ..., "parameters": {...}}`, several separated by `;`."""

from __future__ import annotations

from tidegate.engine.entrypoints.openai.tool_parsers.base import ToolParser


class Llama3JSONToolParser(ToolParser):
    """Calls open the output, or follow `<|python_tag|>` (after some text).

    `<|python_tag|>` is a special token: the text has it only when the request keeps special
    tokens (skip_special_tokens false); an output that starts with `{` is read either way.
    """

    name = "llama3_json"
    tag = "<|python_tag|>"
    opens_at_start = "{"
    separator = ";"
