"""Native renderers for the Qwen chat formats (ChatML): Qwen2.5, Qwen3 (hybrid thinking) and Qwen3-Coder.

Each reproduces its official template byte for byte (reference ``chat_templates/*.jinja``), including the parts that
hurt prefix caching (Qwen3 drops old reasoning); NOTES.md §2.1-2.3 describe the formats.
"""
from __future__ import annotations

from typing import Any

from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.generic_tools import tools_text
from server.rendering.messages import MessagePolicy

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CODER_DEFAULT_SYSTEM = "You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks."

# The call-format instructions after the tool list, shared by Qwen3-Coder and Qwen3.5/3.6.
CODER_TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and do "
    "not tell the user about function calls\n</IMPORTANT>"
)


def jinja_str(value: Any) -> str:
    """Jinja's ``|string`` is Python ``str()``: ``True``, ``None``, ``1.0``, ``['a', 'b']``."""
    return value if isinstance(value, str) else str(value)


def turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def json_tools_block(tools: list[dict]) -> str:
    """The ``# Tools`` section shared by Qwen2.5 and Qwen3 (whole tool objects, one JSON per line): the Hermes text
    that generic tool rendering uses too, ending the system turn."""
    return tools_text(tools) + IM_END + "\n"


def json_tool_call(function: dict, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


def tool_response(messages: list[dict], index: int, first_index: int = 0) -> str:
    """Qwen2.5/Qwen3 merge consecutive tool results into one user turn, closed right after the last response."""
    opens = index == first_index or messages[index - 1]["role"] != "tool"
    closes = index == len(messages) - 1 or messages[index + 1]["role"] != "tool"
    return (
        (f"{IM_START}user" if opens else "")
        + f"\n<tool_response>\n{messages[index]['content']}\n</tool_response>"
        + (f"{IM_END}\n" if closes else "")
    )


def generation_prompt(add_generation_prompt: bool) -> str:
    return f"{IM_START}assistant\n" if add_generation_prompt else ""


class Qwen25Renderer(Renderer):
    """Qwen2.5-Instruct: a default system prompt always, tool-call arguments re-encoded from objects."""

    family = "qwen2.5"
    # The template `tojson`s arguments, so they must be objects; a string that is not JSON is kept (double-encoded).
    policy = MessagePolicy(arguments="object", lenient_object_arguments=True)
    eos_token = IM_END

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        system = messages[0]["content"] if messages[0]["role"] == "system" else QWEN25_DEFAULT_SYSTEM
        out = [f"{IM_START}system\n{system}\n\n" + json_tools_block(tools) if tools else turn("system", system)]
        for i, message in enumerate(messages):
            role = message["role"]
            if role == "user" or (role == "system" and i > 0) or (role == "assistant" and "tool_calls" not in message):
                out.append(turn(role, message["content"]))
            elif role == "assistant":
                text = f"\n{message['content']}" if message["content"] else ""
                calls = "".join(
                    "\n" + json_tool_call(call["function"], tojson(call["function"]["arguments"]))
                    for call in message["tool_calls"]
                )
                out.append(f"{IM_START}assistant{text}{calls}{IM_END}\n")
            elif role == "tool":
                out.append(tool_response(messages, i))
        out.append(generation_prompt(add_generation_prompt))
        return "".join(out)


def is_tool_response_text(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _last_query_index(messages: list[dict]) -> int:
    """Index of the last real user query (not a hand-written tool response); reasoning after it is kept."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message["role"] == "user" and not is_tool_response_text(message["content"]):
            return index
    return len(messages) - 1


def split_qwen3_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, content) as the Qwen3 template derives them: ``reasoning_content`` or inline ``<think>``."""
    content = message["content"]
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"], content
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")


class Qwen3Renderer(Renderer):
    """Qwen3 hybrid thinking. Template kwarg ``enable_thinking`` (only an explicit ``False`` changes anything)."""

    family = "qwen3"
    # String arguments are inserted verbatim, so the model's own bytes survive (prefix stability); objects go
    # through tojson. Either is valid for this template.
    policy = MessagePolicy(arguments="as_given")
    eos_token = IM_END

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        has_system = messages[0]["role"] == "system"
        out = []
        if tools:
            out.append(f"{IM_START}system\n" + (messages[0]["content"] + "\n\n" if has_system else ""))
            out.append(json_tools_block(tools))
        elif has_system:
            out.append(turn("system", messages[0]["content"]))
        last_query = _last_query_index(messages)
        last = len(messages) - 1
        for i, message in enumerate(messages):
            role = message["role"]
            if role == "user" or (role == "system" and i > 0):
                out.append(turn(role, message["content"]))
            elif role == "assistant":
                out.append(self._assistant(message, keep_reasoning_slot=i > last_query, is_last=i == last))
            elif role == "tool":
                out.append(tool_response(messages, i))
        out.append(generation_prompt(add_generation_prompt))
        if add_generation_prompt and kwargs.get("enable_thinking", True) is False:
            out.append("<think>\n\n</think>\n\n")
        return "".join(out)

    @staticmethod
    def _assistant(message: dict, keep_reasoning_slot: bool, is_last: bool) -> str:
        reasoning, content = split_qwen3_reasoning(message)
        # Reasoning survives only after the last user query, and then only if non-empty or on the final message.
        if keep_reasoning_slot and (is_last or reasoning):
            body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
        else:
            body = content
        calls = []
        for j, call in enumerate(message.get("tool_calls", [])):
            arguments = call["function"]["arguments"]
            arguments = arguments if isinstance(arguments, str) else tojson(arguments)
            separator = "\n" if j > 0 or content else ""
            calls.append(separator + json_tool_call(call["function"], arguments))
        return f"{IM_START}assistant\n{body}{''.join(calls)}{IM_END}\n"


def _extra_keys(fields: Any, handled: tuple[str, ...]) -> str:
    """Every key the Coder template has no dedicated tag for, as ``<key>value</key>`` (lists/objects as JSON)."""
    if not isinstance(fields, dict):
        return ""
    return "".join(
        f"\n<{key}>{tojson(value) if isinstance(value, (dict, list, tuple)) else jinja_str(value)}</{key}>"
        for key, value in fields.items()
        if key not in handled
    )


def _coder_function(function: dict) -> str:
    out = [f"\n<function>\n<name>{function['name']}</name>"]
    if "description" in function:
        out.append(f"\n<description>{jinja_str(function['description']).strip()}</description>")
    out.append("\n<parameters>")
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if isinstance(properties, dict):
        for name, fields in properties.items():
            fields = fields if isinstance(fields, dict) else {}
            out.append(f"\n<parameter>\n<name>{name}</name>")
            if "type" in fields:
                out.append(f"\n<type>{jinja_str(fields['type'])}</type>")
            if "description" in fields:
                out.append(f"\n<description>{jinja_str(fields['description']).strip()}</description>")
            out.append(_extra_keys(fields, ("name", "type", "description")) + "\n</parameter>")
    out.append(_extra_keys(parameters, ("type", "properties")) + "\n</parameters>")
    out.append(_extra_keys(function, ("type", "name", "description", "parameters")) + "\n</function>")
    return "".join(out)


def _coder_value(value: Any) -> str:
    return tojson(value) if isinstance(value, (dict, list, tuple)) else jinja_str(value)


def _coder_tool_call(function: dict) -> str:
    parameters = "".join(
        f"<parameter={name}>\n{_coder_value(value)}\n</parameter>\n" for name, value in function["arguments"].items()
    )
    return f"\n<tool_call>\n<function={function['name']}>\n{parameters}</function>\n</tool_call>"


class Qwen3CoderRenderer(Renderer):
    """Qwen3-Coder (Aug-2025 template): XML tool descriptions and XML tool calls with one tag per parameter."""

    family = "qwen3-coder"
    policy = MessagePolicy(arguments="object")  # the template iterates `arguments|items`
    eos_token = IM_END

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        start = 0
        out = []
        if messages[0]["role"] == "system":
            out.append(f"{IM_START}system\n{messages[0]['content']}")
            start = 1
        elif tools:
            out.append(f"{IM_START}system\n{CODER_DEFAULT_SYSTEM}")
        if tools:
            out.append("\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>")
            out.extend(_coder_function(tool["function"]) for tool in tools)
            out.append(CODER_TOOLS_TAIL)
        if out:
            out.append(f"{IM_END}\n")
        last = len(messages) - 1
        for i in range(start, len(messages)):
            message = messages[i]
            role = message["role"]
            if role == "assistant" and "tool_calls" in message:
                content = (message["content"] or "").strip()
                text = f"\n{content}\n" if content else ""
                calls = "".join(_coder_tool_call(call["function"]) for call in message["tool_calls"])
                out.append(f"{IM_START}assistant{text}{calls}{IM_END}\n")
            elif role == "tool":
                # The user header opens only after a non-tool message *of the loop* (none for the loop's first).
                opens = i > start and messages[i - 1]["role"] != "tool"
                closes = i == last or messages[i + 1]["role"] != "tool"
                out.append(
                    (f"{IM_START}user\n" if opens else "")
                    + f"<tool_response>\n{message['content']}\n</tool_response>\n"
                    + (f"{IM_END}\n" if closes else "")
                )
            else:
                out.append(turn(role, message["content"]))
        out.append(generation_prompt(add_generation_prompt))
        return "".join(out)
