"""The shortest text that turns a cut-off JSON document into a valid one.

A streamed tool call cannot take back the argument text it already sent; when the output is cut off (max_tokens) or
the call closes early, the arguments end with this suffix so that a client's `JSON.parse` succeeds: an open string is
closed, a half-written number or literal completed, a key without a value gets `null` (a comma waiting for a member
gets `"": null`), and every open object and array is closed.
"""
from __future__ import annotations

_LITERALS = ("true", "false", "null")
_WHITESPACE = " \t\r\n"


def closing_suffix(prefix: str) -> str:
    """`prefix` is the start of a JSON value; returns what completes it ('' when it is already complete)."""
    state = _Scanner()
    for char in prefix:
        state.feed(char)
    return state.close()


# What closes a container, by what it expects next. Object: "open" (just after `{`), "key" (after a comma), "colon"
# (after a key), "value" (after a colon), "comma" (after a value); array: "open", "value" (after a comma), "comma".
_CLOSERS = {
    ("{", "open"): "}", ("{", "key"): '"": null}', ("{", "colon"): ": null}", ("{", "value"): "null}",
    ("{", "comma"): "}", ("[", "open"): "]", ("[", "value"): "null]", ("[", "comma"): "]",
}


class _Scanner:
    """A JSON tokenizer that tracks just enough to close: open containers and what each expects next, and the
    string, number or literal being read."""

    def __init__(self) -> None:
        self.stack: list[list[str]] = []  # [container, what it expects next] per open container
        self.string = False
        self.escape = ""  # the escape sequence read so far inside a string ("\\", "\\u12", ...)
        self.scalar = ""  # the number or literal being read

    def feed(self, char: str) -> None:
        if self.string:
            self._in_string(char)
            return
        if self.scalar:
            if char not in _WHITESPACE and char not in ",]}":
                self.scalar += char
                return
            self.scalar = ""
        if char in _WHITESPACE:
            return
        top = self.stack[-1] if self.stack else None
        if char in "{[":
            self._begin_value()
            self.stack.append([char, "open"])
        elif char in "}]":
            self.stack.pop()
        elif char == ":":
            top[1] = "value"
        elif char == ",":
            top[1] = "key" if top[0] == "{" else "value"
        elif char == '"':
            self.string = True
            if top is not None and top[0] == "{" and top[1] in ("open", "key"):
                top[1] = "colon"  # a key: closing it leaves the object waiting for its colon
            else:
                self._begin_value()
        else:
            self._begin_value()
            self.scalar = char

    def _begin_value(self) -> None:
        """A value starts: whatever it turns out to be, its container next expects a comma (or its end)."""
        if self.stack:
            self.stack[-1][1] = "comma"

    def _in_string(self, char: str) -> None:
        if self.escape:
            self.escape += char
            if not self.escape.startswith("\\u") or len(self.escape) == 6:
                self.escape = ""
        elif char == "\\":
            self.escape = char
        elif char == '"':
            self.string = False

    def close(self) -> str:
        out = []
        if self.string:
            if self.escape:  # finish the escape: "\\" + "\\" is a backslash, "\\u1" + "000" a character
                out.append("0" * (6 - len(self.escape)) if self.escape.startswith("\\u") else "\\")
            out.append('"')
        elif self.scalar:
            out.append(_complete_scalar(self.scalar))
        out += [_CLOSERS[container, expects] for container, expects in reversed(self.stack)]
        return "".join(out)


def _complete_scalar(text: str) -> str:
    for literal in _LITERALS:
        if literal.startswith(text):
            return literal[len(text) :]
    if text[-1] in "-+.eE":  # a number that needs one more digit: "-", "1.", "1e", "1e-"
        return "0"
    return ""
