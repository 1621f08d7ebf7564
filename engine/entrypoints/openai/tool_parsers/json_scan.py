"""JSON read a character at a time, so that tool-call arguments stream as the model writes them.

`JSONScanner` checks one JSON value without building it; `CallScanner` reads one call object,
`{"name": ..., "arguments": {...}}`, and says when it knows the call (its name and the start
of its arguments) and which characters are arguments.
"""

from __future__ import annotations

import json
import re

# What feeding one character says.
MORE = 0  # the character belongs to the value, which goes on
DONE = 1  # the character ends the value
DONE_BEFORE = 2  # the value (a number) had ended: the character is not part of it
ERROR = 3  # the character cannot come here

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class JSONScanner:
    """Checks one JSON value, fed a character at a time from its first one."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._state = "value"
        self._is_key = False  # the string being read is an object's key
        self._rest = ""  # what a literal still needs
        self._number = ""
        self._hex_left = 0

    def feed(self, char: str) -> int:
        """MORE, DONE, DONE_BEFORE or ERROR for the next character."""
        state = self._state
        if state == "string":
            if char == '"':
                return self._end_string()
            if char == "\\":
                self._state = "escape"
            elif char < " ":
                return ERROR
            return MORE
        if state == "escape":
            if char == "u":
                self._state, self._hex_left = "hex", 4
            elif char in '"\\/bfnrt':
                self._state = "string"
            else:
                return ERROR
            return MORE
        if state == "hex":
            if char not in _HEX:
                return ERROR
            self._hex_left -= 1
            if not self._hex_left:
                self._state = "string"
            return MORE
        if state == "number":
            if char in _NUMBER_CHARS:
                self._number += char
                return MORE
            if not _NUMBER.fullmatch(self._number):
                return ERROR
            # The number ended at the character before: at the top that ends the value, inside
            # a container the character is read in the container's next state.
            return DONE_BEFORE if self._end_value() == DONE else self.feed(char)
        if state == "literal":
            if char != self._rest[0]:
                return ERROR
            self._rest = self._rest[1:]
            return MORE if self._rest else self._end_value()
        if char in _WHITESPACE and state != "done":
            return MORE
        return self._structure(state, char)

    def complete_at_end(self) -> bool:
        """Whether the text fed so far is a whole value (a number ends only with the text)."""
        if self._state == "number":
            return not self._stack and bool(_NUMBER.fullmatch(self._number))
        return self._state == "done"

    def _structure(self, state: str, char: str) -> int:
        if state == "value" or (state == "array_first" and char != "]"):
            return self._start_value(char)
        if state == "array_first" or (state == "array_comma" and char == "]"):
            self._stack.pop()
            return self._end_value()
        if state == "array_comma":
            if char != ",":
                return ERROR
            self._state = "value"
            return MORE
        if state in ("object_first", "object_key") and char == '"':
            self._state, self._is_key = "string", True
            return MORE
        if (state == "object_first" or state == "object_comma") and char == "}":
            self._stack.pop()
            return self._end_value()
        if state == "object_comma" and char == ",":
            self._state = "object_key"
            return MORE
        if state == "colon" and char == ":":
            self._state = "value"
            return MORE
        return ERROR

    def _start_value(self, char: str) -> int:
        if char == "{" or char == "[":
            self._stack.append(char)
            self._state = "object_first" if char == "{" else "array_first"
        elif char == '"':
            self._state = "string"
        elif char == "-" or "0" <= char <= "9":
            self._state, self._number = "number", char
        elif char in _LITERALS:
            self._state, self._rest = "literal", _LITERALS[char]
        else:
            return ERROR
        return MORE

    def _end_string(self) -> int:
        if self._is_key:
            self._state, self._is_key = "colon", False
            return MORE
        return self._end_value()

    def _end_value(self) -> int:
        if not self._stack:
            self._state = "done"
            return DONE
        self._state = "object_comma" if self._stack[-1] == "{" else "array_comma"
        return MORE


class CallScanner:
    """One call object, `{"name": "f", "arguments": {...}}`, keys in any order.

    The call is known (`started`) once it has a name and its arguments begin; from then on
    `take()` hands out the arguments' characters as they come. Arguments written before the
    name wait for it. A call object without arguments has "{}"; one without a name is no call.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.started = False
        self._state = "open"
        self._value: JSONScanner | None = None
        self._raw = ""  # the key or name being read, or arguments waiting for the name
        self._key = ""
        self._has_arguments = False
        self._raw_arguments = ""
        self._new: list[tuple[str, str]] = []  # ("start", name) or ("arguments", text)

    def take(self) -> list[tuple[str, str]]:
        """What became known since the last call: the start, then argument text."""
        new, self._new = self._new, []
        return new

    def feed(self, char: str) -> int:
        """MORE, DONE (the object closed) or ERROR for the next character."""
        state = self._state
        if state == "value":
            return self._feed_value(char)
        if state == "key":
            return self._feed_key(char)
        if char in _WHITESPACE:
            return MORE
        if state == "open":
            return self._expect(char == "{", "first_key")
        if state in ("first_key", "key_start") and char == '"':
            self._value, self._raw = JSONScanner(), char
            self._value.feed(char)
            self._state = "key"
            return MORE
        if state in ("first_key", "after_value") and char == "}":
            return self._close()
        if state == "after_value":
            return self._expect(char == ",", "key_start")
        if state == "colon":
            return self._expect(char == ":", "value_start")
        if state == "value_start":
            self._value, self._raw = JSONScanner(), ""
            self._state = "value"
            return self._feed_value(char)
        return ERROR

    def _expect(self, ok: bool, next_state: str) -> int:
        if not ok:
            return ERROR
        self._state = next_state
        return MORE

    def _feed_key(self, char: str) -> int:
        assert self._value is not None
        status = self._value.feed(char)
        self._raw += char
        if status == ERROR:
            return ERROR
        if status == DONE:  # the closing quote
            self._key = json.loads(self._raw)
            self._state = "colon"
        return MORE

    def _feed_value(self, char: str) -> int:
        assert self._value is not None
        status = self._value.feed(char)
        if status == ERROR:
            return ERROR
        if status == DONE_BEFORE:
            if not self._end_value():
                return ERROR
            self._state = "after_value"
            return self.feed(char)
        self._record(char)
        if status == DONE:
            if not self._end_value():
                return ERROR
            self._state = "after_value"
        return MORE

    def _record(self, char: str) -> None:
        if self._key == "name":
            self._raw += char
        elif self._key in ARGUMENT_KEYS and not self._has_arguments:
            if self.name is None:
                self._raw += char
            else:
                if not self.started:
                    self._start()
                self._new.append(("arguments", char))

    def _end_value(self) -> bool:
        """Take in a finished value; False when it cannot be what its key needs."""
        if self._key == "name":
            name = json.loads(self._raw)
            # A JSON escape can make a lone surrogate, which no response could carry.
            if not isinstance(name, str) or not name or not _is_text(name):
                return False
            if self.name is None:
                self.name = name
                if self._has_arguments and not self.started:
                    self._start()
                    self._new.append(("arguments", self._raw_arguments))
        elif self._key in ARGUMENT_KEYS and not self._has_arguments:
            self._has_arguments = True
            if self.name is None:
                self._raw_arguments = self._raw
        return True

    def _start(self) -> None:
        assert self.name is not None
        self.started = True
        self._new.append(("start", self.name))

    def _close(self) -> int:
        if self.name is not None and not self.started:
            self._start()
            self._new.append(("arguments", "{}"))
        return DONE


def _is_text(value: str) -> bool:
    return not any("\ud800" <= char <= "\udfff" for char in value)
