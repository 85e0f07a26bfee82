"""A tool call's JSON body read as it is generated: {"name": ..., "arguments": {...}}.

mlx-lm's parsers read a call once it is complete; clients want its name as soon as it is
known and its arguments as they are generated. This scanner follows the JSON text char by
char (strings, escapes, nesting) and hands out the name once its string closes and the
arguments' raw text as it arrives, so that the pieces joined are the arguments exactly as
the model wrote them. The whole call is still parsed by mlx-lm's parser at its end.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = " \t\r\n"


class CallStream:
    __slots__ = (
        "_args_done",
        "_capture",
        "_depth",
        "_escape",
        "_expect_key",
        "_key",
        "_literal",
        "_pending",
        "_scalar",
        "_string",
        "_value_for",
        "arguments",
        "name",
        "sent",
    )

    def __init__(self) -> None:
        self.name: str | None = None  # once its string has closed
        self.arguments = ""  # the arguments' raw text so far
        self.sent = 0  # of which handed out
        self._depth = 0
        self._string = False
        self._escape = False
        self._expect_key = False
        self._key: str | None = None  # the last key read at the top level
        self._literal = ""  # the raw text of the top-level string being read
        self._value_for: str | None = None  # a top-level value is due for this key
        self._capture = False  # inside the arguments' value
        self._scalar = False  # the arguments' value is a number, true, false or null
        self._args_done = False
        self._pending = False  # a name string is being read

    @property
    def complete(self) -> bool:
        return self.name is not None and self._args_done

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def take(self) -> str:
        """The arguments' text not handed out yet (only once the name is known, and only
        for an object or array: a string or scalar is sent normalized when the call ends)."""
        if self.name is None or self.sent == len(self.arguments):
            return ""
        if not self.arguments.startswith(("{", "[")):
            return ""
        piece, self.sent = self.arguments[self.sent :], len(self.arguments)
        return piece

    def _char(self, ch: str) -> None:
        if self._capture:
            self._argument_char(ch)
            return
        if self._string:
            self._in_string(ch)
            return
        depth = self._depth
        if depth == 1 and self._value_for in ARGUMENT_KEYS and ch not in _SPACE:
            self._value_for = None
            self._start_arguments(ch)
            return
        if ch == '"':
            self._string, self._literal = True, ""
            if depth == 1 and self._value_for == "name":
                self._pending = True
            return
        if ch in "{[":
            self._depth += 1
            self._expect_key = ch == "{" and self._depth == 1
        elif ch in "}]":
            self._depth -= 1
        elif depth == 1 and ch == ":":
            self._value_for, self._key = self._key, None
        elif depth == 1 and ch == ",":
            self._expect_key, self._value_for = True, None

    def _in_string(self, ch: str) -> None:
        self._literal += ch
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._string = False
            text = _unquote(self._literal[:-1])
            if self._depth == 1 and self._expect_key:
                self._key, self._expect_key = text, False
            elif self._pending:
                self._pending, self._value_for = False, None
                self.name = text

    def _start_arguments(self, ch: str) -> None:
        self._capture = True
        self._scalar = ch not in '{["'
        self._string = ch == '"'
        if ch in "{[":
            self._depth += 1
        self.arguments += ch

    def _argument_char(self, ch: str) -> None:
        if self._scalar:
            if ch in ",}" or ch in _SPACE:
                self._end_arguments()
                self._char(ch)
                return
            self.arguments += ch
            return
        self.arguments += ch
        if self._string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string = False
                if self._depth == 1:  # the arguments were one string
                    self._end_arguments()
            return
        if ch == '"':
            self._string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_arguments()

    def _end_arguments(self) -> None:
        self._capture = False
        self._args_done = True


def _unquote(raw: str) -> str:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw
