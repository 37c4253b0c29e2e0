"""An OpenAI Responses request -> a turn (`server.pipeline.turn.Turn`), and the bounded store that makes
`previous_response_id` work.

- `input`: a string (one user message) or items. `message` items (`developer` and `system` become system messages,
  in place), `reasoning` items (the next assistant message's reasoning: their `content` text, else the
  `encrypted_content` this server wrote, else the summary), `function_call` items (tool calls of the assistant
  message they follow), `function_call_output` items (tool messages) and `compaction` items (opened by the caller's
  ``expand``, server/api/compaction.py: the summary they seal, as a user message). Other item types are skipped.
- `tools`: `function` tools; the functions of a `namespace` tool are flattened to `<namespace>__<name>` (mapped back
  on output); hosted tools (`web_search`, `custom`, `local_shell`, ...) are accepted and left out of the prompt.
- `reasoning.effort`: `none` / `minimal` turn thinking off, any other effort on; absent, the model's default.
  DeepSeek-V4 also takes the effort (`high`, or `max` from `xhigh`); see `server.pipeline.plan.effort_kwargs`.
- `text.format` (`json_schema` flat, as `{type, name, schema, strict}`, or `json_object`) becomes chat's
  `response_format`: the same grammar guarantees it; errors name the Responses field (`FORMAT_PARAMS`).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.cache.cache_salt import salt_tenant
from server.pipeline.plan import effort_kwargs
from server.api.protocol import APIError
from server.rendering.messages import flatten_content
from server.api.responses_protocol import ResponsesRequest
from server.pipeline.turn import Sampling, Turn

NAMESPACE_SEPARATOR = "__"
# Chat's name of a field -> its name in a Responses request, for errors.
FORMAT_PARAMS = {"response_format.json_schema.schema": "text.format.schema", "response_format": "text.format"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text(content: Any, where: str) -> str:
    try:
        return flatten_content(content, where)
    except ValueError as exc:
        raise _bad(str(exc), where) from None


def _content(content: Any, where: str) -> str | list[dict]:
    """A message's content: its text, or, where it holds `input_image` parts, its text and image parts in order
    (server/pipeline/images.py reads the images; a `file_id` image is a 400: this server stores no files)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise _bad(f"{where}.{j}: an input_image needs an 'image_url' (a data URL); file_id is not "
                           "supported", f"{where}.{j}")
            parts.append({"type": "input_image", "image_url": part["image_url"], "where": f"{where}.content.{j}"})
        else:
            parts.append({"type": "text", "text": _text([part], f"{where}.{j}")})
    return parts


def _parts_text(parts: Any) -> str | None:
    if not isinstance(parts, list) or not parts:
        return None
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _reasoning_text(item: dict) -> str:
    text = _parts_text(item.get("content"))
    if text is None and isinstance(item.get("encrypted_content"), str):
        text = item["encrypted_content"]  # this server's reasoning, echoed back by a client that stores nothing
    return text if text is not None else _parts_text(item.get("summary")) or ""


def _open_assistant(messages: list[dict]) -> dict:
    """The assistant message the next output item belongs to: the last one while nothing else followed it."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": ""})
    return messages[-1]


# A `compaction` item and where it stands (`input.N`) -> the chat message it stands for.
Expand = Callable[[dict, str], dict]


def chat_messages(items: str | list[dict], tool_names: dict[tuple[str | None, str], str],
                  expand: Expand | None = None) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise _bad(f"{where}: role must be 'user', 'assistant', 'system' or 'developer'", where)
            text = _content(item.get("content"), where)
            last = messages[-1] if messages else None
            if role == "assistant" and last and last["role"] == "assistant" and not last["content"] \
                    and "tool_calls" not in last:
                last["content"] = text  # after its reasoning item
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": "", "reasoning_content": _reasoning_text(item)})
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not name or not isinstance(item.get("arguments", ""), str):
                raise _bad(f"{where}: a function_call needs a 'name' and string 'arguments'", where)
            flat = tool_names.get((item.get("namespace"), name), name)
            _open_assistant(messages).setdefault("tool_calls", []).append({
                "id": str(item.get("call_id") or ""), "type": "function",
                "function": {"name": flat, "arguments": item.get("arguments") or "{}"},
            })
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind == "compaction":
            if expand is None:
                raise _bad(f"{where}: a compaction item is not accepted here", where)
            messages.append(expand(item, where))
    return messages


def _function(tool: dict, name: str) -> dict:
    function: dict[str, Any] = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    return {"type": "function", "function": function}


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, dict[tuple[str | None, str], str]]:
    """(chat tools, {(namespace, name): flat name}) for Responses `tools`."""
    out, names = [], {}
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        inner = [(None, tool)] if kind == "function" else []
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            inner = [(tool.get("name"), t) for t in tool["tools"]
                     if isinstance(t, dict) and t.get("type") == "function"]
        for namespace, function in inner:
            name = function.get("name")
            if not isinstance(name, str) or not name or (namespace is not None and not isinstance(namespace, str)):
                raise _bad(f"tools.{i}: a function tool needs a 'name'", f"tools.{i}")
            flat = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
            names[(namespace, name)] = flat
            out.append(_function(function, flat))
    return out or None, names


def chat_tool_choice(choice: str | dict | None, names: dict[tuple[str | None, str], str]) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function":
        name = choice.get("name")
        return {"type": "function", "function": {"name": names.get((choice.get("namespace"), name), name)}}
    return "auto"  # a hosted tool or an allowed-tools list: the model chooses among what it has


def response_format(text: dict | None) -> dict | None:
    """Responses' `text.format` as chat's `response_format` (None: free text)."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")
    spec = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
    return {"type": "json_schema", "json_schema": spec}


def reasoning_effort(reasoning: dict | None) -> str | None:
    return reasoning.get("effort") if isinstance(reasoning, dict) else None


@dataclass
class ResponseStore:
    """`store: true` responses, as the conversation they end (chat messages, without `instructions`), bounded per
    tenant: each tenant (the API key behind the cache salt) keeps its last ``capacity_per_tenant`` (a tenant's
    oldest are forgotten first, so one tenant's traffic never evicts another's). Each belongs to its salt: another
    tenant's id is unknown, exactly like an id that never existed. Read on the prepare thread, written on the event
    loop: one lock."""

    capacity_per_tenant: int = 1024
    _items: dict[str | None, OrderedDict] = field(default_factory=dict)  # tenant -> (salt, id) -> messages
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, salt: str | None, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            items = self._items.setdefault(salt_tenant(salt), OrderedDict())
            items[salt, response_id] = messages
            while len(items) > self.capacity_per_tenant:
                items.popitem(last=False)

    def remember(self, salt: str | None, response_id: str, messages: list[dict], stored: bool) -> None:
        """A finished response's conversation: kept when its request asked for it (`store: true`)."""
        if stored:
            self.put(salt, response_id, messages)

    def history(self, salt: str | None, response_id: str) -> list[dict]:
        with self._lock:
            messages = self._items.get(salt_tenant(salt), {}).get((salt, response_id))
        if messages is None:
            raise _bad(f"previous response {response_id!r} is unknown or was evicted (this server keeps the last "
                       f"{self.capacity_per_tenant} stored responses of each API key in memory, "
                       "--max-stored-responses-per-tenant); resend the conversation instead", "previous_response_id")
        return list(messages)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(items) for items in self._items.values())


def to_turn(req: ResponsesRequest, family: str, history: list[dict], session: str | None,
            expand: Expand | None = None) -> tuple[Turn, dict]:
    """(the turn, {flat tool name: (namespace, name)} to map calls back). ``expand`` opens `compaction` items
    (server/api/compaction.py); without it they are a 400."""
    tools, names = chat_tools(req.tools)
    messages = [*history, *chat_messages(req.input, names, expand)]
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    turn = Turn(
        messages=messages or [{"role": "user", "content": ""}], model=req.model, tools=tools,
        tool_choice=chat_tool_choice(req.tool_choice, names), parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format(req.text), template_kwargs=effort_kwargs(family, reasoning_effort(req.reasoning)),
        sampling=Sampling(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                          reasoning_effort=reasoning_effort(req.reasoning)),
        session=session,
    )
    return turn, {flat: key for key, flat in names.items()}
