"""The one machine every tool parser is a setting of.

A parser reads a model's output a character at a time, so a stream split anywhere gives the
same result as the whole text (`parse`). Text that may still become a call is held back; a
call is announced once its name is known and its arguments begin, and its arguments then
stream as they come. Text that looked like a call but turns out not to be one before that
point is content, as written. What cannot be taken back is not: a call whose arguments break
off keeps what streamed (the text after the break is content), and a call cut by the end of
the output keeps what it has.

Whitespace between content and a call, and at the end of an output that has calls, is dropped.
"""

from __future__ import annotations

from typing import ClassVar

from tidegate.engine.entrypoints.openai.tool_parsers.events import (
    CallArguments,
    CallStart,
    Content,
    Event,
    ParsedOutput,
    fold,
)
from tidegate.engine.entrypoints.openai.tool_parsers.json_scan import (
    DONE,
    ERROR,
    CallScanner,
)

_WHITESPACE = " \t\n\r"


# The machine's states.
_CONTENT = "content"
_OPEN = "open"  # after a marker or a separator: a call (or an array of calls) must come
_ARRAY_FIRST = "array_first"  # after "[": the first call object must come
_OBJECT = "object"  # inside a call object
_AFTER = "after"  # after a call object: a closing marker, a separator, or the array's end


class ToolParser:
    """Splits one output into content and calls, fed as it streams; one instance per output.

    Subclasses set how calls are marked: `tag` anywhere in the text, or one of
    `opens_at_start` as the output's first character (after whitespace); then a call object,
    or with `arrays` a JSON array of them; then optionally `close_tag`, or `separator` and
    another call.
    """

    name: ClassVar[str] = ""
    tag: ClassVar[str] = ""
    opens_at_start: ClassVar[str] = ""
    arrays: ClassVar[bool] = False
    close_tag: ClassVar[str] = ""
    separator: ClassVar[str] = ""

    def __init__(self) -> None:
        self.num_calls = 0
        self._events: list[Event] = []
        self._pending = ""  # text to read: what was fed, or held text given back
        self._pos = 0
        self._state = _CONTENT
        self._tag_prefix = ""  # content that may be the start of `tag`
        self._ws = ""  # content whitespace not handed out yet
        self._started = False  # the output has had a call or content other than whitespace
        # The attempt at a call that is not known yet: its text, and how much of it (the
        # marker) goes to the content as it is if it fails; the rest is read again.
        self._held = ""
        self._trigger = 0
        self._call: CallScanner | None = None
        self._in_array = False
        self._close_progress = ""

    @classmethod
    def parse(cls, text: str) -> ParsedOutput:
        """A whole output at once (the same as streaming it in any pieces)."""
        parser = cls()
        return fold(parser.feed(text) + parser.finish())

    def feed(self, text: str) -> list[Event]:
        """Read more of the output; what became known."""
        self._pending, self._pos = text, 0
        self._drain()
        return self._take()

    def finish(self) -> list[Event]:
        """The output ended: what was held back is decided."""
        while True:
            self._drain()
            if self._state == _CONTENT:
                if not self._tag_prefix:
                    break
                prefix, self._tag_prefix = self._tag_prefix, ""
                self._give_back(prefix[1:])
                self._plain(prefix[0])
            elif self._state == _OBJECT and self._call is not None and self._call.started:
                self._reset()  # a call cut short keeps what it has
            else:
                self._revert()
        if self._ws and not self.num_calls:
            self._emit(Content(self._ws))
        self._ws = ""
        return self._take()

    # -- reading ------------------------------------------------------------------------------

    def _drain(self) -> None:
        while self._pos < len(self._pending):
            char = self._pending[self._pos]
            self._pos += 1
            state = self._state
            if state == _CONTENT:
                self._read_content(char)
            elif state == _OBJECT:
                self._read_object(char)
            else:
                self._held += char
                if state == _AFTER:
                    self._read_after(char)
                elif char not in _WHITESPACE:
                    self._read_open(char)
        self._pending, self._pos = "", 0

    def _read_content(self, char: str) -> None:
        if self.tag:
            candidate = self._tag_prefix + char
            if self.tag.startswith(candidate):
                self._tag_prefix = "" if candidate == self.tag else candidate
                if candidate == self.tag:
                    self._begin(self.tag, _OPEN)
                return
            if self._tag_prefix:
                # Not the marker after all: its first character is text, the rest is read again.
                self._tag_prefix = ""
                self._give_back(candidate[1:])
                self._plain(candidate[0])
                return
        self._plain(char)

    def _plain(self, char: str) -> None:
        """A character of content, unless it opens the output with calls."""
        if not self._started and char in self.opens_at_start:
            self._begin(char, _ARRAY_FIRST if char == "[" else _OPEN)
            if char == "[":
                self._in_array = True
            else:
                self._start_object()
            return
        self._content(char)

    def _read_open(self, char: str) -> None:
        if char == "{":
            self._start_object()
        elif char == "[" and self._state == _OPEN and self.arrays and not self._in_array:
            self._state, self._in_array = _ARRAY_FIRST, True
        else:
            self._revert()

    def _start_object(self) -> None:
        self._call = CallScanner()
        self._call.feed("{")
        self._state = _OBJECT

    def _read_object(self, char: str) -> None:
        assert self._call is not None
        self._held += char
        status = self._call.feed(char)
        for kind, text in self._call.take():
            if kind == "start":
                self._ws, self._started = "", True  # whitespace before a call is dropped
                self._emit(CallStart(self.num_calls, text))
                self.num_calls += 1
            else:
                self._emit(CallArguments(self.num_calls - 1, text))
        if not self._call.started:
            if status != DONE and status != ERROR:
                return
            self._revert()  # no call after all: a closed object without a name, or bad JSON
            return
        # A known call cannot be taken back: only the character that breaks it is read again.
        self._held, self._trigger = "", 0
        if status == ERROR:
            self._reset()
            self._give_back(char)
        elif status == DONE:
            self._call = None
            nothing_follows = not (self._in_array or self.close_tag or self.separator)
            self._state = _CONTENT if nothing_follows else _AFTER

    def _read_after(self, char: str) -> None:
        if self.close_tag:
            candidate = self._close_progress + char
            if self.close_tag.startswith(candidate):
                self._close_progress = candidate
                if candidate == self.close_tag:
                    self._reset()
                return
            if not self._close_progress and char in _WHITESPACE:
                return
        elif char in _WHITESPACE:
            return
        elif self._in_array and char == ",":
            self._begin(char, _OPEN)
            return
        elif self._in_array and char == "]":
            self._reset()
            return
        elif not self._in_array and char == self.separator:
            self._begin(char, _OPEN)
            return
        self._revert()  # something else follows the call: read it as content

    # -- deciding -----------------------------------------------------------------------------

    def _begin(self, marker: str, state: str) -> None:
        self._held, self._trigger, self._state = marker, len(marker), state

    def _revert(self) -> None:
        """The attempt is no call: its marker is content, the rest is read again."""
        held, trigger = self._held, self._trigger
        self._reset()
        self._give_back(held[trigger:])
        for char in held[:trigger]:
            self._content(char)

    def _reset(self) -> None:
        self._state = _CONTENT
        self._held, self._trigger = "", 0
        self._call, self._in_array, self._close_progress = None, False, ""

    def _give_back(self, text: str) -> None:
        self._pending, self._pos = text + self._pending[self._pos :], 0

    def _content(self, char: str) -> None:
        if char in _WHITESPACE:
            self._ws += char  # shown with the next text; dropped before a call
            return
        self._started = True
        self._emit(Content(self._ws + char))
        self._ws = ""

    def _emit(self, event: Event) -> None:
        last = self._events[-1] if self._events else None
        same_content = isinstance(event, Content) and isinstance(last, Content)
        same_call = (
            isinstance(event, CallArguments)
            and isinstance(last, CallArguments)
            and last.index == event.index
        )
        if same_content or same_call:
            last.text += event.text  # type: ignore[union-attr]
        else:
            self._events.append(event)

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return [event for event in events if not isinstance(event, Content) or event.text]
