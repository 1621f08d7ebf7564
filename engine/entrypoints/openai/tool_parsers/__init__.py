"""Tool-call parsers: which text of a model's output is a call, by the model family's format.

`--tool-call-parser` names one of `TOOL_PARSERS` for tool_choice "auto".
"""

from __future__ import annotations

from tidegate.engine.entrypoints.openai.tool_parsers.base import ToolParser
from tidegate.engine.entrypoints.openai.tool_parsers.events import (
    CallArguments,
    CallStart,
    Content,
    Event,
    ParsedOutput,
    ToolCall,
    fold,
)
from tidegate.engine.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
)
from tidegate.engine.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tidegate.engine.entrypoints.openai.tool_parsers.llama3_json import Llama3JSONToolParser
from tidegate.engine.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JSONToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "CallArguments",
    "CallStart",
    "Content",
    "Event",
    "NamedToolParser",
    "ParsedOutput",
    "RequiredToolParser",
    "ToolCall",
    "ToolParser",
    "fold",
]
