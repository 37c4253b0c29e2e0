"""The renderer interface: OpenAI messages (+ tools) in, the exact prompt text out."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from server.rendering.messages import MessagePolicy, normalize_messages, normalize_tools


def tojson(value: Any) -> str:
    """transformers' ``tojson`` filter, as the native renderers write it: no ASCII escaping, default separators,
    insertion order."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Prepared:
    """A request after normalization: exactly what the family's official template would be given."""

    messages: list[dict]
    tools: list[dict] | None


class Renderer(ABC):
    """Renders a chat request into the prompt string one model family was trained on.

    ``render`` = ``prepare`` (validate + normalize; shared with the golden generator, which feeds the prepared data
    to the official Jinja template) followed by ``render_prepared`` (the family's native, Jinja-free formatting).
    """

    family: str
    policy: MessagePolicy = MessagePolicy()
    bos_token: str = ""
    eos_token: str = ""
    # The template moves every system message to the top (DeepSeek): one in mid-conversation changes the head.
    hoists_system_messages: bool = False
    # The template refuses a system message anywhere but first (Qwen3.5/3.6): the server renders later ones as user
    # turns in place (server/cache/normalize.py) rather than failing an agent's request.
    refuses_late_system_messages: bool = False
    # The template kwarg that keeps the reasoning of every past turn in the prompt (Qwen3.6 `preserve_thinking`, GLM's
    # `clear_thinking`), and the value that does; the server sets it by default so that each agent turn extends the
    # previous prompt (docs/SERVER.md).
    keeps_reasoning_kwarg: str | None = None
    keeps_reasoning_value: Any = True

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> Prepared:
        return Prepared(normalize_messages(messages, self.policy), normalize_tools(tools))

    @abstractmethod
    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        """Format already-normalized data; ``kwargs`` are the template kwargs (``enable_thinking``, ``thinking``)."""

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        return self.render_prepared(self.prepare(messages, tools), add_generation_prompt, template_kwargs)
