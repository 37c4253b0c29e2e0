"""Chat rendering: OpenAI messages (+ tools) -> the exact prompt text a model family was trained on.

``get_renderer(family)`` returns a native (Jinja-free) renderer for the Qwen and DeepSeek families; ``JinjaRenderer``
renders any other model's own ``chat_template`` with transformers' semantics. Both expose
``render(messages, tools=None, add_generation_prompt=True, **template_kwargs) -> str`` and raise ``ValueError`` for
requests that cannot be rendered.
"""
from __future__ import annotations

from server.rendering.base import Prepared, Renderer
from server.rendering.families import FAMILIES, get_renderer
from server.rendering.jinja_renderer import JinjaRenderer
from server.rendering.request import render_request, renderer_for_model, serving_template_kwargs

__all__ = [
    "FAMILIES", "JinjaRenderer", "Prepared", "Renderer", "get_renderer", "render_request", "renderer_for_model",
    "serving_template_kwargs",
]
