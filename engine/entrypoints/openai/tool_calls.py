"""One choice's output as OpenAI tool calls: deltas while it streams, a message at its end.

Which parser reads the output follows from tool_choice: "auto" the server's
`--tool-call-parser`, "required" the JSON array its grammar makes, a named function the
whole output as that function's arguments; "none" reads nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from tidegate.engine.entrypoints.openai.errors import bad_request
from tidegate.engine.entrypoints.openai.protocol import ChatCompletionRequest
from tidegate.engine.entrypoints.openai.responses import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tidegate.engine.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    CallArguments,
    CallStart,
    Content,
    Event,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
)


def parser_factory(
    body: ChatCompletionRequest, tool_call_parser: str | None
) -> Callable[[], ToolParser] | None:
    """What makes each choice's parser; None when the output is not read for calls.

    tool_choice "auto" on a server without --tool-call-parser is a 400.
    """
    mode = body.tool_choice_mode
    if mode == "none":
        return None
    if mode == "required":
        return RequiredToolParser
    if mode == "named":
        name = body.named_function
        assert name is not None
        return lambda: NamedToolParser(name)
    if tool_call_parser is None:
        raise bad_request(
            "tool_choice 'auto' (the default when a request has tools) needs a server started "
            f"with --tool-call-parser ({', '.join(TOOL_PARSERS)}); this one has none. Send "
            "tool_choice 'required', 'none' or a named function instead",
            param="tool_choice",
        )
    return TOOL_PARSERS[tool_call_parser]


class ChoiceToolCalls:
    """Reads one choice's output for calls, and gives each call its id."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self._parser = parser
        self._parallel = parallel
        self._ids: list[str] = []

    @property
    def has_calls(self) -> bool:
        return bool(self._ids)

    def deltas(self, text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas `text` makes, in OpenAI's shape: content, a call's start, its arguments."""
        events = self._parser.feed(text)
        if finished:
            events += self._parser.finish()
        deltas: list[DeltaMessage] = []
        for event in self._kept(events):
            if isinstance(event, Content):
                if deltas and deltas[-1].content is not None:
                    deltas[-1].content += event.text
                else:
                    deltas.append(DeltaMessage(content=event.text))
            elif isinstance(event, CallStart):
                function = DeltaFunctionCall(name=event.name, arguments="")
                call = DeltaToolCall(
                    index=event.index, id=self._new_id(), type="function", function=function
                )
                deltas.append(DeltaMessage(tool_calls=[call]))
            else:
                previous = deltas[-1].tool_calls if deltas else None
                if previous and previous[0].id is None and previous[0].index == event.index:
                    previous[0].function.arguments = (
                        previous[0].function.arguments or ""
                    ) + event.text
                else:
                    function = DeltaFunctionCall(arguments=event.text)
                    call = DeltaToolCall(index=event.index, function=function)
                    deltas.append(DeltaMessage(tool_calls=[call]))
        return deltas

    def message(self, text: str) -> AssistantMessage:
        """The whole output as the reply's message (content null when only calls)."""
        content = ""
        calls: list[ToolCall] = []
        for delta in self.deltas(text, finished=True):
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    function = FunctionCall(name=call.function.name or "", arguments="")
                    calls.append(ToolCall(id=call.id, function=function))
                calls[call.index].function.arguments += call.function.arguments or ""
        if not calls:
            return AssistantMessage(content=content)
        return AssistantMessage(content=content or None, tool_calls=calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """tool_calls for an output that ended of itself with calls; a length cut stays length."""
        if reason == "stop" and self.has_calls:
            return "tool_calls"
        return reason

    def _kept(self, events: list[Event]) -> list[Event]:
        if self._parallel:
            return events
        # parallel_tool_calls false: the first call only.
        return [e for e in events if not isinstance(e, CallStart | CallArguments) or e.index == 0]

    def _new_id(self) -> str:
        self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self._ids[-1]
