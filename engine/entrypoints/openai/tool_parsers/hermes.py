"""Hermes and Qwen's calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

from tidegate.engine.entrypoints.openai.tool_parsers.base import ToolParser


class HermesToolParser(ToolParser):
    """Each call in its own block; text around the blocks is content.

    The closing tag may be missing (a model often ends right after the object).
    """

    name = "hermes"
    tag = "<tool_call>"
    close_tag = "</tool_call>"
