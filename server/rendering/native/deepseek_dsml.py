"""Native renderers for DeepSeek-V3.2 and DeepSeek-V4, whose prompts come from Python encoders, not Jinja templates
(``encoding/encoding_dsv32.py`` and ``encoding/encoding_dsv4.py`` of the model repos; copies with their sources in
tests/rendering/encoders/, which the golden tests run as the oracle).

Both write tool calls in DSML, DeepSeek's markup around the special token ``｜DSML｜``::

    ⏎⏎<｜DSML｜function_calls>⏎<｜DSML｜invoke name="NAME">⏎<｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter>⏎
    </｜DSML｜invoke>⏎</｜DSML｜function_calls>

(V4 names the block ``tool_calls``); a string value is written as is (``string="true"``), any other as JSON. The tool
list goes into the system prompt (``prepare`` attaches the request's ``tools`` to the first system message, or to an
empty one in front, as DeepSeek's examples do). Thinking mode (template kwarg ``thinking``, or ``enable_thinking``)
opens ``<think>`` after the last user turn and drops the reasoning of turns before it (``drop_thinking``). V3.2
writes tool results as ``<function_results>`` after the calls; V4 has no tool role: results become
``<tool_result>`` blocks of a user turn (sorted by call order, merged with the user text that follows), V4 keeps all
reasoning when tools are present, and adds ``reasoning_effort="max"`` (a prefix before the system prompt),
``latest_reminder`` messages and the quick-instruction ``task`` tokens. The encoders always end with the assistant
prefix after a user turn, so ``add_generation_prompt`` changes nothing here.
"""
from __future__ import annotations

import json
from typing import Any

from server import json_text
from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.native.deepseek import ASSISTANT, BOS, EOS, USER
from server.rendering.messages import MessagePolicy

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
REASONING_EFFORTS = ("high", "max")
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_V32_TOOLS = (
    "## Tools\n\nYou have access to a set of tools you can use to answer the user's question.\n"
    'You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to '
    "the user:\n<{dsml}function_calls>\n<{dsml}invoke name=\"$FUNCTION_NAME\">\n"
    '<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>\n...\n'
    '</{dsml}invoke>\n<{dsml}invoke name="$FUNCTION_NAME2">\n...\n</{dsml}invoke>\n</{dsml}function_calls>\n\n'
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects "
    'should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" '
    "for other types (numbers, booleans, arrays, objects).\n\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking "
    "block. Here is an example:\n\n<{dsml}function_calls>\n...\n</{dsml}function_calls>\n\n<function_results>\n...\n"
    "</function_results>\n\n<think>...thinking about results</think>\n\n"
    "Here are the functions available in JSONSchema format:\n<functions>\n{schemas}\n</functions>\n"
)
_V4_TOOLS = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing "
    'a "<{dsml}tool_calls>" block like the following:\n\n<{dsml}tool_calls>\n<{dsml}invoke name="$TOOL_NAME">\n'
    '<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>\n...\n'
    '</{dsml}invoke>\n<{dsml}invoke name="$TOOL_NAME2">\n...\n</{dsml}invoke>\n</{dsml}tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def dsml_parameter(name: str, value: Any) -> str:
    is_str = isinstance(value, str)
    text = value if is_str else tojson(value)
    return f'<{DSML}parameter name="{name}" string="{"true" if is_str else "false"}">{text}</{DSML}parameter>'


def dsml_calls(calls: list[dict], block: str, arguments_of) -> str:
    """The call block the assistant turn ends with (before EOS), ``⏎⏎`` included."""
    invokes = [
        f'<{DSML}invoke name="{call["function"]["name"]}">\n'
        + "\n".join(dsml_parameter(k, v) for k, v in arguments_of(call["function"]["arguments"]).items())
        + f"\n</{DSML}invoke>"
        for call in calls
    ]
    return f"\n\n<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def _object(arguments: Any) -> dict:
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must encode a JSON object")
    return arguments


def strict_arguments(text: str) -> dict:
    """V3.2: the arguments string must be a JSON object."""
    try:
        return _object(json_text.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call arguments are not valid JSON ({exc.msg})") from None


def lenient_arguments(text: str) -> dict:
    """V4: a string that is not JSON becomes one string parameter named `arguments`."""
    try:
        value = json_text.loads(text)
    except json.JSONDecodeError:
        return {"arguments": text}
    return _object(value)


def tools_section(tools: list[dict], template: str) -> str:
    return template.format(dsml=DSML, schemas="\n".join(tojson(tool["function"]) for tool in tools))


def last_user_index(messages: list[dict]) -> int:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] in ("user", "developer")), -1)


def drop_old_reasoning(messages: list[dict], keep_roles: tuple[str, ...]) -> list[dict]:
    """Thinking mode drops the reasoning of assistant turns before the last user turn; the encoders also drop any
    other message there whose role is not in `keep_roles` (a developer turn)."""
    last_user = last_user_index(messages)
    kept = []
    for i, message in enumerate(messages):
        if message["role"] in keep_roles or i >= last_user:
            kept.append(message)
        elif message["role"] == "assistant":
            kept.append({k: v for k, v in message.items() if k != "reasoning_content"})
    return kept


def thinking_on(kwargs: dict[str, Any]) -> bool:
    """Thinking mode, read as the server reads it (server/api/chat.py): off unless asked for."""
    if "enable_thinking" in kwargs:
        return kwargs["enable_thinking"] is not False
    return bool(kwargs.get("thinking"))


class _DsmlRenderer(Renderer):
    bos_token = BOS
    eos_token = EOS

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> Prepared:
        """The request's tools travel on the first system message (an empty one is put in front if needed)."""
        prepared = super().prepare(messages, tools)
        if not prepared.tools:
            return prepared
        messages = list(prepared.messages)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "tools": prepared.tools}
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": prepared.tools})
        return Prepared(messages, prepared.tools)


class DeepSeekV32Renderer(_DsmlRenderer):
    """DeepSeek-V3.2 (``encoding_dsv32.py``). Kwargs: ``thinking`` (or ``enable_thinking``), ``drop_thinking``."""

    family = "deepseek-v3.2"
    policy = MessagePolicy(arguments="string")

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        thinking = thinking_on(kwargs)
        messages = prepared.messages
        if thinking and kwargs.get("drop_thinking", True):
            messages = drop_old_reasoning(messages, ("user", "system", "tool"))
        last_user = last_user_index(messages)
        out = [BOS]
        for i, message in enumerate(messages):
            role, content = message["role"], message.get("content") or ""
            think = THINK_OPEN if thinking and i >= last_user else THINK_CLOSE
            if role == "system":
                out.append(content + self._extras(message))
            elif role in ("user", "developer"):
                if role == "developer":
                    if not content:
                        raise ValueError(f"messages[{i}]: a developer message needs content")
                    content = self._extras(message) + f"\n\n# The user's message is: {content}"
                out.append(f"{USER}{content}{ASSISTANT}" + (think if i == last_user else THINK_CLOSE))
            elif role == "tool":
                out.append(self._tool_result(messages, i, think))
            elif role == "assistant":
                calls = message.get("tool_calls")
                if thinking and i > last_user and not (message.get("reasoning_content") or calls):
                    raise ValueError(f"messages[{i}]: in thinking mode an assistant turn after the last user message "
                                     "needs reasoning_content or tool_calls")
                reasoning = (message.get("reasoning_content") or "") + THINK_CLOSE if thinking and i > last_user else ""
                tool_text = dsml_calls(calls, "function_calls", strict_arguments) if calls else ""
                out.append(f"{reasoning}{content}{tool_text}{EOS}")
            else:
                raise ValueError(f"messages[{i}]: role {role!r} is not supported by DeepSeek-V3.2")
        return "".join(out)

    @staticmethod
    def _extras(message: dict) -> str:
        return "\n\n" + tools_section(message["tools"], _V32_TOOLS) if message.get("tools") else ""

    @staticmethod
    def _tool_result(messages: list[dict], index: int, think: str) -> str:
        """`<function_results>` opens at the first result of a call round and closes at its last."""
        start = index
        while start > 0 and messages[start - 1]["role"] == "tool":
            start -= 1
        answered = messages[start - 1] if start > 0 and messages[start - 1]["role"] == "assistant" else {}
        calls, order = answered.get("tool_calls"), index - start + 1
        if not calls or len(calls) < order:
            raise ValueError(f"messages[{index}]: a tool result needs the assistant tool call it answers")
        result = f"\n<result>{messages[index].get('content') or ''}</result>"
        out = ("\n\n<function_results>" if order == 1 else "") + result
        if order == len(calls):
            out += "\n</function_results>\n\n" + think
        return out


class DeepSeekV4Renderer(_DsmlRenderer):
    """DeepSeek-V4 (``encoding_dsv4.py``). Kwargs: ``thinking`` (or ``enable_thinking``), ``drop_thinking``,
    ``reasoning_effort`` (``"high"`` or ``"max"``)."""

    family = "deepseek-v4"
    policy = MessagePolicy(arguments="string", extra_roles=("latest_reminder",), kept_fields=("task",))

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        thinking = thinking_on(kwargs)
        effort = kwargs.get("reasoning_effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be {' or '.join(REASONING_EFFORTS)} (or absent), not {effort!r}")
        messages = _tool_results_in_user_turns(prepared.messages)
        # With tools in the prompt the reasoning of every turn stays (agent prefixes remain stable).
        drop = kwargs.get("drop_thinking", True) and not any(m.get("tools") for m in messages)
        if thinking and drop:
            messages = drop_old_reasoning(messages, ("user", "system", "tool", "latest_reminder"))
        last_user = last_user_index(messages)
        out = [BOS, REASONING_EFFORT_MAX if thinking and effort == "max" and messages else ""]
        for i, message in enumerate(messages):
            keeps_reasoning = thinking and (not drop or i > last_user)
            out.append(self._message(messages, i, keeps_reasoning))
            following = messages[i + 1]["role"] if i + 1 < len(messages) else None
            if following not in (None, "assistant", "latest_reminder"):
                continue
            task = message.get("task")
            if task is not None:
                if task not in TASK_TOKENS:
                    raise ValueError(f"messages[{i}]: unknown task {task!r} (known: {', '.join(TASK_TOKENS)})")
                if task == "action":
                    out.append(ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE))
                out.append(TASK_TOKENS[task])
            elif message["role"] in ("user", "developer"):
                opens = thinking and (not drop or i >= last_user)
                out.append(ASSISTANT + (THINK_OPEN if opens else THINK_CLOSE))
        return "".join(out)

    @staticmethod
    def _message(messages: list[dict], index: int, keeps_reasoning: bool) -> str:
        message = messages[index]
        role, content = message["role"], message.get("content") or ""
        extras = "\n\n" + tools_section(message["tools"], _V4_TOOLS) if message.get("tools") else ""
        if role == "system":
            return content + extras
        if role == "developer":
            if not content:
                raise ValueError(f"messages[{index}]: a developer message needs content")
            return USER + content + extras
        if role == "user":
            return USER + "\n\n".join(message["blocks"])
        if role == "latest_reminder":
            return LATEST_REMINDER + content
        if role == "assistant":
            calls = message.get("tool_calls")
            tool_text = dsml_calls(calls, "tool_calls", lenient_arguments) if calls else ""
            after_task = index > 0 and messages[index - 1].get("task") is not None
            reasoning = (message.get("reasoning_content") or "") + THINK_CLOSE if keeps_reasoning and not after_task \
                else ""
            return f"{reasoning}{content}{tool_text}{EOS}"
        raise ValueError(f"messages[{index}]: role {role!r} is not supported by DeepSeek-V4")


def _tool_results_in_user_turns(messages: list[dict]) -> list[dict]:
    """V4 has no tool role: tool results become `<tool_result>` blocks of a user turn, and consecutive user turns
    (results and texts, unless one carries a task) merge into one whose blocks join with a blank line. Within a turn
    the results are put in the order of the calls they answer (the last assistant turn's call ids)."""
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            call_order = {c["id"]: i for i, c in enumerate(message["tool_calls"]) if c.get("id")}
        if role not in ("user", "tool"):
            merged.append(message)
            continue
        if role == "tool":
            block = (True, f"<tool_result>{message['content']}</tool_result>", message.get("tool_call_id") or "")
        else:
            block = (False, message["content"], "")
        previous = merged[-1] if merged and merged[-1]["role"] == "user" else None
        if previous is not None and (role == "tool" or previous.get("task") is None):
            previous["blocks"].append(block)
        elif role == "tool":
            merged.append({"role": "user", "content": "", "blocks": [block], "order": call_order})
        else:
            merged.append({**message, "blocks": [block], "order": call_order})
    return [_ordered(m) for m in merged]


def _ordered(message: dict) -> dict:
    """A merged user turn with its block texts, the tool results sorted by call order in the results' places."""
    if "blocks" not in message:
        return message
    blocks, order = message["blocks"], message["order"]
    results = [b for b in blocks if b[0]]
    if len(results) > 1 and order:
        results = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
        blocks = [next(results) if b[0] else b for b in blocks]
    return {k: v for k, v in message.items() if k != "order"} | {"blocks": [b[1] for b in blocks]}
