"""A run of output text whose edges are trimmed, emitted incrementally."""
from __future__ import annotations

WHITESPACE = " \t\r\n"


class TrimmedText:
    """Drops leading characters in `lead`; holds trailing characters in `trail` back until later text shows they
    are inside the run (then they are released) or the run ends (then the caller keeps or drops them).

    Templates normalise the whitespace around tags (`</think>⏎⏎`, `⏎<tool_call>`); trimming it here makes the parsed
    message re-render to the bytes the model produced.
    """

    def __init__(self, lead: str = "", trail: str = ""):
        self._lead = lead
        self._trail = trail
        self._started = not lead
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip(self._lead)
            if not text:
                return ""
            self._started = True
        text = self._held + text
        if not self._trail:
            return text
        body = text.rstrip(self._trail)
        self._held = text[len(body) :]
        return body

    def take_held(self) -> str:
        held, self._held = self._held, ""
        return held


class CodeFences:
    """Whether the text so far is inside a markdown code fence: a line whose first non-blank characters are ```
    or ~~~ opens or closes one. Only the start of the current line is kept, so any split gives the same answer."""

    _MARKERS = ("```", "~~~")

    def __init__(self) -> None:
        self.inside = False
        # The current line's first non-blank characters while they may still be a marker; None once decided.
        self._line_start: str | None = ""

    def feed(self, text: str) -> None:
        for char in text:
            if char == "\n":
                self._line_start = ""
            elif self._line_start is not None and (char not in " \t" or self._line_start):
                self._line_start += char
                if self._line_start in self._MARKERS:
                    self.inside = not self.inside
                    self._line_start = None
                elif not any(marker.startswith(self._line_start) for marker in self._MARKERS):
                    self._line_start = None
