"""An Anthropic Messages request -> a turn (`server.pipeline.turn.Turn`): messages, tools, tool_choice, sampling, the thinking
switch and the `cache_control` breakpoints, so that it renders through the same templates as a chat request.

- `system` (a string or text blocks) becomes the first system message; mid-conversation `system` messages stay
  where they are (server/cache/normalize.py decides how a template that hoists them gets them).
- User turns: text blocks become a user message, each `tool_result` a tool message, in block order; assistant
  turns: text, `thinking` (as reasoning) and `tool_use` (as tool calls, `input` serialized the way the model writes
  JSON). `redacted_thinking` is dropped. `image` blocks (base64 or URL sources), in user turns and inside
  `tool_result` content (Claude Code's Read tool returns a screenshot so), become chat's `image_url` parts
  (server/pipeline/images.py reads them); documents are a 400.
- Tools with `input_schema` become functions; server tools (`web_search_...`, `bash_...`) are left out.
- `output_config.format` (or the beta's `output_format`), `{"type": "json_schema", "schema": ...}`, becomes chat's
  `response_format`: the same grammar guarantees it; errors name the Anthropic field (`FORMAT_PARAMS`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from server.api.anthropic_protocol import AnthropicMessage, Conversation, MessagesRequest
from server.cache.cache_control import Breakpoint, counted, mark_ttl
from server.pipeline.plan import effort_kwargs, thinking_kwargs
from server.api.protocol import APIError
from server.pipeline.turn import Sampling, Turn

_MEDIA_BLOCKS = ("document",)
# Chat's name of a field -> its name in a Messages request, for errors.
FORMAT_PARAMS = {"response_format.json_schema.schema": "output_config.format.schema"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs a string 'text'", where)
    return text


def _check_block(block: Any, where: str) -> str:
    """The block's type, once it is known to be a block the model can read."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"{where}: a content block must be an object with a 'type'", where)
    if block["type"] in _MEDIA_BLOCKS:
        raise _bad(f"{where}: {block['type']} blocks are not supported: kvserve reads text, and images where the "
                   "model has a vision tower", where)
    return block["type"]


def _image_part(block: dict, where: str) -> dict:
    """An `image` block as chat's image part: a base64 source as a data URL, a URL source as its URL."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type") or "image/png"
        url = f"data:{media_type};base64,{source['data']}"
        return {"type": "image_url", "image_url": {"url": url}, "where": where}
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}, "where": where}
    raise _bad(f"{where}: an image block needs a 'source' of type base64 (with 'data') or url (with 'url')", where)


def _tool_result_content(content: str | list, where: str, is_error: bool) -> str | list[dict]:
    """A `tool_result`'s content as a tool message's: its text (text blocks joined with newlines), or, where it
    holds images, its text and image parts in order."""
    if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "image" for b in content):
        parts = [{"type": "text", "text": "Error: "}] if is_error else []
        for i, block in enumerate(content):
            kind = _check_block(block, f"{where}.{i}")
            if kind == "text":
                parts.append({"type": "text", "text": _text_of(block, f"{where}.{i}")})
            elif kind == "image":
                parts.append(_image_part(block, f"{where}.{i}"))
        return parts
    text = _blocks_text(content, where)
    return f"Error: {text}" if is_error else text


def _blocks_text(content: str | list, where: str) -> str:
    """Text blocks (or a string) joined with newlines, as chat content parts are."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of blocks", where)
    texts = []
    for i, block in enumerate(content):
        if _check_block(block, f"{where}.{i}") == "text":
            texts.append(_text_of(block, f"{where}.{i}"))
    return "\n".join(texts)


def system_content(system: str | list | None) -> str | list[dict]:
    """The system prompt as chat content (text parts keep their boundaries for the normalizations)."""
    if isinstance(system, str):
        return system
    if any(isinstance(b, dict) and b.get("type") == "image" for b in system or []):
        raise _bad("system: the system prompt cannot contain images", "system")
    return [{"type": "text", "text": _text_of(b, f"system.{i}")} for i, b in enumerate(system or [])
            if _check_block(b, f"system.{i}") == "text"]


def _user_side(message: AnthropicMessage, where: str) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict] = []
    parts: list[dict] = []
    for i, block in enumerate(message.content):
        kind = _check_block(block, f"{where}.content.{i}")
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, f"{where}.content.{i}")})
        elif kind == "image":
            parts.append(_image_part(block, f"{where}.content.{i}"))
        elif kind == "tool_result":
            if parts:
                out.append({"role": message.role, "content": parts})
                parts = []
            content = _tool_result_content(block.get("content") or "", f"{where}.content.{i}.content",
                                           bool(block.get("is_error")))
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": content})
    if parts or not out:
        out.append({"role": message.role, "content": parts})
    return out


def _assistant(message: AnthropicMessage, where: str) -> dict:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(message.content):
        at = f"{where}.content.{i}"
        kind = _check_block(block, at)
        if kind == "image":
            raise _bad(f"{at}: an assistant turn cannot contain images", at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise _bad(f"{at}: a tool_use block needs a 'name' and an object 'input'", at)
            # The model writes JSON with the default separators: the re-rendered call matches what it generated.
            calls.append({"id": str(block.get("id") or f"toolu_{i}"), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def chat_messages(req: Conversation) -> list[dict]:
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": system_content(req.system)})
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        messages += [_assistant(message, where)] if message.role == "assistant" else _user_side(message, where)
    return messages


def breakpoints(req: Conversation) -> list[Breakpoint]:
    """The request's `cache_control` marks (tools, system blocks, message content blocks), each as the chat
    conversation cut right after the marked block. Anthropic's prefix order is tools, system, messages: a mark on a
    tool cuts the tool list there and keeps the system prompt, which the templates render around the tools."""
    def cut(system: str | list | None, messages: list[AnthropicMessage]) -> list[dict]:
        return chat_messages(Conversation.model_construct(model=req.model, system=system, messages=messages))

    system = req.system if isinstance(req.system, list) else []

    def marks() -> Iterator[tuple[tuple[str, int, int], float | None]]:
        for i, tool in enumerate(req.tools or []):
            yield ("tool", i, 0), mark_ttl(tool, f"tools.{i}")
        for j, block in enumerate(system):
            yield ("system", j, 0), mark_ttl(block, f"system.{j}")
        for i, message in enumerate(req.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else []):
                yield ("message", i, j), mark_ttl(block, f"messages.{i}.content.{j}")

    found = counted(marks())  # all counted before any cut is built
    tools = chat_tools(req.tools)
    points = []
    for (kind, i, j), ttl in found:
        if kind == "tool":
            points.append(Breakpoint(cut(req.system, []), chat_tools(req.tools[: i + 1]), ttl))
        elif kind == "system":
            points.append(Breakpoint(cut(system[: i + 1], []), tools, ttl))
        else:
            message = req.messages[i]
            cut_message = message.model_copy(update={"content": message.content[: j + 1]})
            points.append(Breakpoint(cut(req.system, [*req.messages[:i], cut_message]), tools, ttl))
    return points


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools.{i}: a tool needs a 'name'", f"tools.{i}")
        if "input_schema" not in tool:
            continue  # a server tool (web search, code execution...): nothing the model can call here
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """(chat `tool_choice`, `parallel_tool_calls`) for an Anthropic `tool_choice`."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise _bad("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice")


def response_format(req: MessagesRequest) -> dict | None:
    """`output_config.format` (or the beta's top-level `output_format`) as chat's `response_format`."""
    fmt = (req.output_config or {}).get("format") or req.output_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad("output_config.format.type must be 'json_schema'", "output_config.format.type")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def thinking_on(thinking: dict | None) -> bool:
    """`enabled` and `adaptive` think, `disabled` or nothing does not (Anthropic's default)."""
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def budget_tokens(thinking: dict | None) -> int | None:
    """`thinking.budget_tokens`: the most tokens the model may think (the engine forces its end after them)."""
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise _bad("thinking.budget_tokens must be an integer >= 0", "thinking.budget_tokens")
    return budget


def template_kwargs(family: str, req: Conversation) -> dict[str, Any]:
    """`thinking` turns the template's thinking on or off; with it on, `output_config.effort` picks the effort of a
    family that takes one (DeepSeek-V4)."""
    on = thinking_on(req.thinking)
    effort = (req.output_config or {}).get("effort") if on else None
    return {**thinking_kwargs(family, on), **effort_kwargs(family, effort)}


def to_turn(req: Conversation, family: str, session: str | None = None) -> Turn:
    """The request as a turn (a `CountTokensRequest` too: its conversation, nothing sampled)."""
    tool_choice, parallel = chat_tool_choice(req.tool_choice)
    tools = chat_tools(req.tools)
    if tools is None and tool_choice not in (None, "none", "auto"):
        raise _bad("tool_choice needs at least one tool with an input_schema in 'tools'", "tool_choice")
    turn = Turn(messages=chat_messages(req), model=req.model, tools=tools, tool_choice=tool_choice,
                parallel_tool_calls=parallel, template_kwargs=template_kwargs(family, req),
                cached_content=req.cached_content, session=session, breakpoints=breakpoints(req))
    if not isinstance(req, MessagesRequest):
        return turn
    on = thinking_on(req.thinking)
    sampling = Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        stop=tuple(req.stop_sequences or ()), reasoning_budget=budget_tokens(req.thinking) if on else None,
                        reasoning_effort=(req.output_config or {}).get("effort") if on else None)
    return replace(turn, sampling=sampling, response_format=response_format(req))
