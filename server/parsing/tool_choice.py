"""`tool_choice` validation (the grammar that enforces it is in `call_grammar`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # the function, when mode == "function"

    @property
    def parses_calls(self) -> bool:
        """`none` keeps the tools in the prompt but the output is plain content."""
        return self.mode != "none"


def tool_names(tools: list[dict] | None) -> list[str]:
    names = []
    for tool in tools or []:
        name = (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
        if isinstance(name, str):
            names.append(name)
    return names


def parse_tool_choice(tool_choice: str | dict | None, tools: list[dict] | None) -> ToolChoice:
    """Validates `tool_choice` against `tools`; raises ValueError with a message fit for a 400 response."""
    names = tool_names(tools)
    if tool_choice is None:  # the OpenAI default
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or a function object, not {tool_choice!r}"
            )
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in 'tools'")
        if not names or tool_choice == "none":
            return ToolChoice("none")
        return ToolChoice("required" if tool_choice == "required" else "auto")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice of type 'function' needs function.name")
        if name not in names:
            available = ", ".join(repr(n) for n in names) or "none"
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools (available: {available})")
        return ToolChoice("function", name)
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )

