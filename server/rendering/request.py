"""Rendering of a whole OpenAI chat-completions request body, and the choice of renderer for a model."""
from __future__ import annotations

from typing import Any

from server.rendering.base import Renderer
from server.rendering.families import FAMILIES, get_renderer
from server.rendering.jinja_renderer import JinjaRenderer


def serving_template_kwargs(renderer: Renderer, preserve_thinking: bool = True) -> dict[str, Any]:
    """The template kwargs the server sets unless a request sets them itself: with ``preserve_thinking``, the kwarg
    that keeps every past turn's reasoning (Qwen3.6's `preserve_thinking: true`, GLM's `clear_thinking: false`), so
    that each agent turn's prompt extends the previous one."""
    key = renderer.keeps_reasoning_kwarg
    return {key: renderer.keeps_reasoning_value} if key and preserve_thinking else {}


def render_request(renderer: Renderer, body: Any, defaults: dict[str, Any] | None = None) -> str:
    """The prompt for a request body: ``messages``, ``tools``, ``chat_template_kwargs`` (over ``defaults``),
    ``add_generation_prompt`` (default true). Other fields (sampling, ``tool_choice``) do not change the prompt and are
    ignored here."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise ValueError("add_generation_prompt must be a boolean")
    kwargs = {**(defaults or {}), **kwargs}
    return renderer.render(body.get("messages"), body.get("tools"), add_generation_prompt, **kwargs)


def renderer_for_model(template: str, tokenizer: Any) -> Renderer:
    """The renderer for a model whose models.yaml ``template`` is ``template``: a native family, or ``jinja`` for the
    model's own ``chat_template`` (taken, with its special tokens, from the loaded HF ``tokenizer``)."""
    if template in FAMILIES:
        return get_renderer(template)
    if template != "jinja":
        raise ValueError(f"unknown template family {template!r}")
    chat_template = tokenizer.chat_template
    if isinstance(chat_template, dict):  # named templates: the default one renders chats
        chat_template = chat_template.get("default")
    if not isinstance(chat_template, str):
        raise ValueError("the model's tokenizer has no chat_template")
    return JinjaRenderer(
        chat_template,
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
        special_tokens=dict(tokenizer.special_tokens_map),
    )
