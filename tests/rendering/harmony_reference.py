"""gpt-oss' reference rendering: OpenAI's `openai-harmony` library (the encoder gpt-oss was trained with), run offline.

Its o200k vocabulary comes from the copy the bpe-openai package embeds (``TIKTOKEN_ENCODINGS_BASE`` points at it),
never from the network. `render` maps chat messages to harmony messages as server/rendering/native/harmony.py
documents (the first system message as the developer's instructions, the tools as function tools, reasoning on
``analysis``, answers on ``final``, text beside calls on ``commentary``, each call its own message to
``functions.NAME`` with ``<|constrain|>json``, tool results from ``functions.NAME``) and lets the library render them.
"""
from __future__ import annotations

import functools
import gzip
import os
import tempfile
from pathlib import Path
from typing import Any

from engine.model_sources.harmony_tokenizer import o200k_ranks_file


@functools.lru_cache(maxsize=1)
def encoding() -> Any:
    import openai_harmony as h

    vocab = Path(tempfile.mkdtemp(prefix="harmony_vocab_"))
    (vocab / "o200k_base.tiktoken").write_bytes(gzip.decompress(o200k_ranks_file().read_bytes()))
    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab)
    try:
        return h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous


def render(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True,
           reasoning_effort: str | None = None) -> str:
    """Normalized chat ``messages`` (``MessagePolicy(arguments="string")``) rendered by openai-harmony."""
    import openai_harmony as h

    system = h.SystemContent.new()
    if reasoning_effort:
        system = system.with_reasoning_effort(h.ReasoningEffort(reasoning_effort.capitalize()))
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    first = messages[0]["content"] if messages[0]["role"] == "system" else None
    developer = h.DeveloperContent.new()
    if first:
        developer = developer.with_instructions(first)
    if tools:
        developer = developer.with_function_tools([h.ToolDescription.new(
            t["function"]["name"], t["function"].get("description") or "", parameters=t["function"].get("parameters"))
            for t in tools])
    if first or tools:
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    names: dict[str, str] = {}
    last_call = ""
    for message in messages[1:] if first is not None else messages:
        role, text = message["role"], message["content"]
        if role == "system":
            out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(text)))
        elif role == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, text))
        elif role == "tool":
            name = names.get(message.get("tool_call_id", ""), message.get("name") or last_call)
            author = h.Author.new(h.Role.TOOL, f"functions.{name}")
            out.append(h.Message.from_author_and_content(author, text).with_channel("commentary")
                       .with_recipient("assistant"))
        else:
            if message.get("reasoning_content"):
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, message["reasoning_content"])
                           .with_channel("analysis"))
            calls = message.get("tool_calls") or []
            if text or not calls:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, text)
                           .with_channel("commentary" if calls else "final"))
            for call in calls:
                last_call = call["function"]["name"]
                names[call.get("id", "")] = last_call
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, call["function"]["arguments"])
                           .with_channel("commentary").with_recipient(f"functions.{last_call}")
                           .with_content_type("<|constrain|>json"))
    conversation = h.Conversation.from_messages(out)
    if add_generation_prompt:
        tokens = encoding().render_conversation_for_completion(conversation, h.Role.ASSISTANT)
    else:
        tokens = encoding().render_conversation(conversation)
    return encoding().decode_utf8(tokens)
