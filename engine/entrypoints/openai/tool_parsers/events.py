"""What a tool parser hands out while it reads, and the whole output those events make."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Content:
    """Text for the message's content."""

    text: str


@dataclass
class CallStart:
    """Call `index` of the output begins; its arguments follow."""

    index: int
    name: str


@dataclass
class CallArguments:
    """More of call `index`'s arguments, as JSON text."""

    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str = ""


@dataclass
class ParsedOutput:
    """A whole output: its content (what is not a call) and its calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def fold(events: list[Event], into: ParsedOutput | None = None) -> ParsedOutput:
    """The output that a sequence of events describes."""
    parsed = into if into is not None else ParsedOutput()
    for event in events:
        if isinstance(event, Content):
            parsed.content += event.text
        elif isinstance(event, CallStart):
            parsed.calls.append(ToolCall(event.name))
        else:
            parsed.calls[event.index].arguments += event.text
    return parsed
