"""Mistral's calls: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`."""

from __future__ import annotations

from tidegate.engine.entrypoints.openai.tool_parsers.base import ToolParser


class MistralToolParser(ToolParser):
    """The array (or one call object) follows `[TOOL_CALLS]`, or opens the output.

    `[TOOL_CALLS]` is a special token: the text has it only when the request keeps special
    tokens (skip_special_tokens false); an output that starts with `[` is read either way.
    """

    name = "mistral"
    tag = "[TOOL_CALLS]"
    opens_at_start = "["
    arrays = True
