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
