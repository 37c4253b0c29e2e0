"""gpt-oss' harmony rendering (server/rendering/native/harmony.py) byte-equal to OpenAI's own `openai-harmony` library
(tests/rendering/harmony_reference.py: ``render_conversation_for_completion``, run offline); the whole rendering corpus
is checked the same way through goldens/gpt-oss.json (test_goldens.py). The conversations are an agent's: instructions and tools with the
schemas agents send (optional parameters with defaults, enums, arrays, nested objects, nullable types, unions), tool
loops with reasoning (dropped before the last final answer, kept while a turn is still calling tools), several calls
in one message, a preamble beside a call, a late system message, every reasoning effort."""
from __future__ import annotations

import json

import pytest

from server.rendering import get_renderer
from server.rendering.native.harmony import HarmonyRenderer
from tests.rendering import harmony_reference

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.\nReturns its text.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "description": "Absolute path"},
                                          "offset": {"type": "integer", "default": 0},
                                          "limit": {"type": ["integer", "null"]},
                                          "encoding": {"type": "string", "enum": ["utf-8", "latin-1"],
                                                       "default": "utf-8"}},
                                          "required": ["path"]}}},
    {"type": "function", "function": {"name": "edit", "description": "Edit files.", "parameters": {
        "type": "object", "properties": {
            "edits": {"type": "array", "description": "The edits", "items": {"type": "object", "properties": {
                "old": {"type": "string"}, "new": {"type": "string"}}, "required": ["old", "new"]}},
            "options": {"type": "object", "description": "How", "properties": {
                "dry_run": {"type": "boolean", "default": False}, "tags": {"type": "array", "items": {"type": "string"}},
                "mode": {"oneOf": [{"type": "string", "description": "named"}, {"type": "number"}]}}},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "extra": {"type": "array"}, "title": {"type": "string", "default": "untitled edit"}}}}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "/a.py"}'}}
CALL2 = {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
LOOP = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in /a.py"},
    {"role": "assistant", "content": "", "reasoning_content": "I should read it.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "def f():\n    return 1/0\n"},
]
CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hello!"}], None, None),
    "system_low": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None, "low"),
    "tools_high": ([{"role": "user", "content": "Go"}], TOOLS, "high"),
    "loop_open": (LOOP, TOOLS, None),  # mid-turn: the reasoning before the call is kept
    "loop_answered": (LOOP + [
        {"role": "assistant", "content": "Division by zero; fixed.", "reasoning_content": "Found it."},
        {"role": "user", "content": "Thanks. And the time?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call now.", "tool_calls": [CALL2, CALL]},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ], TOOLS, "medium"),
    "two_answers": ([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
                     {"role": "user", "content": "q3"}], None, "high"),
    "answered_after_tools": (LOOP + [{"role": "assistant", "content": "Fixed.", "reasoning_content": "Done."},
                                     {"role": "user", "content": "Thanks"}], TOOLS, None),
    "late_system": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "system", "content": "Now answer in French."}, {"role": "user", "content": "c"}],
                    None, None),
}


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_byte_equal_to_openai_harmony(name):
    pytest.importorskip("openai_harmony")
    messages, tools, effort = CONVERSATIONS[name]
    renderer = get_renderer("gpt-oss")
    prepared = renderer.prepare(messages, tools)
    want = harmony_reference.render(prepared.messages, prepared.tools, reasoning_effort=effort)
    assert renderer.render(messages, tools, **({"reasoning_effort": effort} if effort else {})) == want


def test_reasoning_is_dropped_up_to_the_first_answer_once_the_last_turn_answers():
    renderer = HarmonyRenderer()
    open_turn = renderer.render(LOOP, TOOLS)
    assert "<|channel|>analysis<|message|>I should read it.<|end|>" in open_turn
    assert open_turn.endswith('<|start|>assistant to=functions.read_file<|channel|>commentary <|constrain|>json'
                              '<|message|>{"path": "/a.py"}<|call|><|start|>functions.read_file to=assistant'
                              '<|channel|>commentary<|message|>def f():\n    return 1/0\n<|end|><|start|>assistant')
    calling = renderer.render(CONVERSATIONS["loop_answered"][0], TOOLS)  # its last turn calls: everything kept
    assert all(text in calling for text in ("I should read it.", "Found it.", "Call now."))
    answered = renderer.render(CONVERSATIONS["loop_answered"][0][:5] + [{"role": "user", "content": "Thanks"}], TOOLS)
    assert "I should read it." not in answered and "Found it." not in answered


def test_arguments_objects_and_bad_efforts():
    renderer = HarmonyRenderer()
    as_object = [LOOP[1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "function": {"name": "read_file", "arguments": {"path": "/é"}}}]}]
    assert json.dumps({"path": "/é"}, ensure_ascii=False) + "<|call|>" in renderer.render(as_object, TOOLS)
    with pytest.raises(ValueError, match="reasoning_effort"):
        renderer.render(LOOP, reasoning_effort="max")
    deep: dict = {"type": "string"}
    for _ in range(100):  # a hostile schema is bad input (400), never a RecursionError (500)
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="deeper"):
        renderer.render(LOOP[1:2], [{"type": "function", "function": {"name": "f", "parameters": deep}}])
    for bad in ({"p": 3}, {"p": {"oneOf": [1]}}):
        with pytest.raises(ValueError, match="tools"):
            renderer.render(LOOP[1:2], [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": bad}}}])


def test_the_official_jinja_template_agrees_where_it_follows_the_library():
    """openai/gpt-oss-20b's chat_template.jinja (templates/, cited in goldens/gpt-oss.json) renders the same bytes on
    every corpus case made of user turns and plain answers, once its "Current date" line (strftime_now: a different
    prompt every day) is taken out; where it departs from the library, the library (the training format) is kept."""
    import re

    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.rendering.corpus import CASES
    from tests.rendering.make_goldens import TEMPLATES

    template = (TEMPLATES / "openai-gpt-oss-20b.jinja").read_text(encoding="utf-8")
    renderer, compared = HarmonyRenderer(), 0
    for case in CASES:
        simple = all(isinstance(m.get("content"), str) and set(m) == {"role", "content"}
                     and m["role"] in ("user", "assistant") for m in case.messages)
        if not simple or not case.messages or case.tools or not case.add_generation_prompt:
            continue
        prepared = renderer.prepare(case.messages, None)
        official = render_jinja_template(conversations=[prepared.messages], chat_template=template,
                                         add_generation_prompt=True)[0][0]
        assert re.sub(r"Current date: \d{4}-\d\d-\d\d\n", "", official) == renderer.render(case.messages), case.name
        compared += 1
    assert compared >= 5
    # and where they differ: the template ends the instructions with a blank line and drops every past reasoning
    low = CONVERSATIONS["system_low"][0]
    official = render_jinja_template(conversations=[low], chat_template=template, add_generation_prompt=True)[0][0]
    assert "# Instructions\n\nBe brief.\n\n<|end|>" in official
    assert "# Instructions\n\nBe brief.<|end|>" in renderer.render(low)
