"""Outputs a grammar shaped into calls: tool_choice "required" and a named function."""

from __future__ import annotations

from tidegate.engine.entrypoints.openai.tool_parsers.base import ToolParser
from tidegate.engine.entrypoints.openai.tool_parsers.events import CallArguments, CallStart, Event


class RequiredToolParser(ToolParser):
    """tool_choice "required": the output is `[{"name": ..., "parameters": {...}}, ...]`."""

    name = "required"
    opens_at_start = "["
    arrays = True


class NamedToolParser(ToolParser):
    """A named tool_choice: the whole output is the arguments of one call to that function."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def feed(self, text: str) -> list[Event]:
        """The call's start (first time), then the text as arguments."""
        events: list[Event] = []
        if not self.num_calls:
            self.num_calls = 1
            events.append(CallStart(0, self.function))
        if text:
            events.append(CallArguments(0, text))
        return events

    def finish(self) -> list[Event]:
        """Nothing is held back; an empty output is still the call (with empty arguments)."""
        return self.feed("")
