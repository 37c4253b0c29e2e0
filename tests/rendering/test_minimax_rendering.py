"""MiniMax-M2's template beyond the shared corpus: a tool result with no call before it is refused, as the official
template raises; a later system message is dropped and past reasoning kept after the last user message only, as it
renders them."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from server.rendering import get_renderer

TEMPLATE = (Path(__file__).parent / "templates" / "MiniMaxAI-MiniMax-M2.jinja").read_text(encoding="utf-8")
CALL = {"id": "c0", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}


def official(messages: list[dict]) -> str:
    prepared = get_renderer("minimax-m2").prepare(messages)
    rendered, _ = render_jinja_template(conversations=[prepared.messages], chat_template=TEMPLATE,
                                        add_generation_prompt=True, bos_token="]~!b[", eos_token="[e~[")
    return rendered[0]


def test_a_tool_result_without_a_call_before_it_is_refused():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "tool", "tool_call_id": "c0", "content": "out"}]
    with pytest.raises(Exception, match="no previous assistant message with a tool call"):
        official(messages)
    with pytest.raises(ValueError, match="must follow an assistant message with tool calls"):
        get_renderer("minimax-m2").render(messages)


def test_reasoning_is_kept_through_a_tool_loop_and_dropped_before_a_new_query():
    loop = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List."},
            {"role": "assistant", "content": "", "reasoning_content": "Use ls.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c0", "content": "a.py"},
            {"role": "system", "content": "dropped"},
            {"role": "assistant", "content": "<think>\nDone.\n</think>\n\nOne file."}]
    for messages, kept in ((loop, True), (loop + [{"role": "user", "content": "And?"}], False)):
        prompt = get_renderer("minimax-m2").render(messages)
        assert prompt == official(messages)
        assert ("<think>\nUse ls.\n</think>" in prompt) is kept and "dropped" not in prompt
