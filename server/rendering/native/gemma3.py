"""Native renderer for Gemma 3's chat template (family ``gemma3``; the google/gemma-3-*-it chat_template).

It reproduces the official template byte for byte (tests/rendering/templates/google-gemma-3-it.jinja): ``<bos>``,
then ``<start_of_turn>ROLE⏎CONTENT<end_of_turn>⏎`` per message, the assistant's role written ``model`` and every
content trimmed; a first system message is not a turn but the head of the first one (its text and a blank line);
the roles must alternate user / model, starting with the user; the generation prompt is ``<start_of_turn>model⏎``.

The template knows no tools: Gemma 3 calls functions the way Google's function-calling guide for it prompts it to
(ai.google.dev/gemma/docs/capabilities/function-calling, its JSON variant). ``prepare`` writes the request in those
terms before the template sees it, so the official template renders the result as it renders any conversation:
- ``tools``: the guide's instructions and the functions as a JSON list, at the end of the system prompt (which the
  template puts at the head of the first user turn);
- an assistant's ``tool_calls``: its text, then one ``{"name": NAME, "parameters": ARGUMENTS}`` per line, the
  arguments as the client sent them (so a call the model wrote comes back byte for byte);
- ``tool`` results: a user turn, each result in a ```` ```tool_output ```` block (as Gemma's guides return them);
  user turns that end up next to each other (results, then the next user message) are joined by a blank line, since
  the template refuses two user turns in a row.
Past reasoning is not rendered (the template has no place for it), and Gemma 3 has no thinking switch.
"""
from __future__ import annotations

import json
from typing import Any

from server.rendering.base import Prepared, Renderer
from server.rendering.messages import MessagePolicy

TOOLS_HEAD = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the format of\n"
    '{"name": function name, "parameters": dictionary of argument name and its value}\n\n'
    "You SHOULD NOT include any other text in the response if you call a function\n"
)
OUTPUT_OPEN = "```tool_output\n"
OUTPUT_CLOSE = "\n```"
_ALTERNATION = "Conversation roles must alternate user/assistant/user/assistant/..."


def tools_text(tools: list[dict]) -> str:
    """The guide's instructions, then the functions (name, description, parameters) as an indented JSON list."""
    functions = [tool["function"] for tool in tools]
    return TOOLS_HEAD + json.dumps(functions, ensure_ascii=False, indent=2)


def call_text(function: dict) -> str:
    """One call as the model writes it: the guide's JSON object, the arguments as they were given."""
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f'{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "parameters": {arguments}}}'


class Gemma3Renderer(Renderer):
    """Gemma 3 (instruction-tuned 270M to 27B). No template kwargs."""

    family = "gemma3"
    policy = MessagePolicy(arguments="as_given")
    bos_token = "<bos>"
    eos_token = "<eos>"
    # A later system message would be a `system` turn the alternation check refuses: the server makes it a user turn
    refuses_late_system_messages = True

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> Prepared:
        prepared = super().prepare(messages, tools)
        out: list[dict] = []
        for message in prepared.messages:
            role, content = message["role"], message["content"]
            if role == "tool":
                role, content = "user", OUTPUT_OPEN + content + OUTPUT_CLOSE
            elif role == "assistant" and message.get("tool_calls"):
                calls = "\n".join(call_text(call["function"]) for call in message["tool_calls"])
                content = f"{content}\n{calls}" if content else calls
            result = message["role"] == "tool"
            if role == "user" and out and out[-1]["role"] == "user":
                separator = "\n" if result and out[-1]["result"] else "\n\n"  # results of one turn: a line apart
                out[-1] = {**out[-1], "content": out[-1]["content"] + separator + content, "result": result}
                continue
            out.append({"role": role, "content": content, "result": result})
        if prepared.tools:
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tools_text(prepared.tools)}
            else:
                out.insert(0, {"role": "system", "content": tools_text(prepared.tools)})
        return Prepared([{"role": m["role"], "content": m["content"]} for m in out], None)

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages = prepared.messages
        head = ""
        if messages and messages[0]["role"] == "system":
            head, messages = messages[0]["content"] + "\n\n", messages[1:]
        out = [self.bos_token]
        for i, message in enumerate(messages):
            if (message["role"] == "user") != (i % 2 == 0):
                raise ValueError(_ALTERNATION)
            role = "model" if message["role"] == "assistant" else message["role"]
            out.append(f"<start_of_turn>{role}\n{head if i == 0 else ''}{message['content'].strip()}<end_of_turn>\n")
        if add_generation_prompt:
            out.append("<start_of_turn>model\n")
        return "".join(out)
