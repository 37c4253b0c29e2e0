"""Devstral Small 2 / Devstral 2's prompts (server/rendering/native/devstral.py) byte- and token-equal to
`mistral-common`'s own v13 encoder (tests/rendering/mistral_reference.py, offline, the tekken vocabulary its wheel
ships): a system prompt and tools, multi-turn tool loops, parallel calls whose results come back out of order,
consecutive user / system messages, JSON and non-JSON tool results, empty and object arguments, non-ASCII text."""
from __future__ import annotations

import pytest

from server.rendering import get_renderer
from server.rendering.native.devstral import call_text

pytest.importorskip("mistral_common")
from tests.rendering import mistral_reference  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "Absolute path"},
                                         "limit": {"type": ["integer", "null"], "default": None}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "bash", "description": "Run a command — carefully.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def _call(cid: str, name: str, args) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


LOOP = [
    {"role": "system", "content": "You are Devstral, a coding agent."},
    {"role": "user", "content": "Fix the failing test in /src/app.py"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c00000001", "read_file", '{"path":"/src/app.py"}')]},
    {"role": "tool", "tool_call_id": "c00000001", "content": "def f():\n    return 1/0\n"},
]
PARALLEL = LOOP + [
    {"role": "assistant", "content": "Running both.  ", "tool_calls": [
        _call("c00000002", "bash", {"command": "pytest -q", "timeout": 60}), _call("c00000003", "now", "")]},
    # results out of order: mistral-common puts them back in the calls' order
    {"role": "tool", "tool_call_id": "c00000003", "content": "12:00"},
    {"role": "tool", "tool_call_id": "c00000002", "content": '{"exit": 1,  "out": "ZeroDivisionError — é"}'},
]
CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hello!"}], None),
    "system_tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS),
    "loop_open": (LOOP, TOOLS),
    "parallel_calls": (PARALLEL, TOOLS),
    "loop_answered": (PARALLEL + [
        {"role": "assistant", "content": "Fixed: the division by zero is gone."},
        {"role": "user", "content": "Thanks."}, {"role": "user", "content": "And the time?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c00000004", "now", "{}")]},
        {"role": "tool", "tool_call_id": "c00000004", "content": "12:01"},
    ], TOOLS),
    "multi_turn_no_tools": ([
        {"role": "system", "content": "One."}, {"role": "system", "content": "Two."},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2 ünïcode 日本"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"}], None),
    # mid-conversation system messages stay where they are (mistral-common refuses one right after an assistant)
    "late_system": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "user", "content": "c"}, {"role": "system", "content": "Now answer in French."},
                     {"role": "user", "content": "d"}], TOOLS),
}


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_byte_and_token_equal_to_mistral_common(name):
    messages, tools = CONVERSATIONS[name]
    want_text, want_ids = mistral_reference.encode(messages, tools)
    got = get_renderer("devstral").render(messages, tools)
    assert got == want_text
    assert mistral_reference.tokenize_rendered(got) == want_ids


def test_layout():
    text = get_renderer("devstral").render(*CONVERSATIONS["parallel_calls"])
    assert text.startswith("<s>[SYSTEM_PROMPT]You are Devstral, a coding agent.[/SYSTEM_PROMPT][AVAILABLE_TOOLS][")
    assert call_text("bash", '{"command": "pytest -q", "timeout": 60}') + call_text("now", "{}") + "</s>" in text
    # the results in the calls' order, JSON re-serialized
    assert text.endswith('[TOOL_RESULTS]{"exit": 1, "out": "ZeroDivisionError — é"}[/TOOL_RESULTS]'
                         '[TOOL_RESULTS]12:00[/TOOL_RESULTS]')


def test_each_turn_extends_the_last():
    """An agent's next request renders the previous prompt and reply unchanged, then the new messages: the prefix
    cache reads the whole previous turn (v13 puts the tools at the first user message for this)."""
    renderer = get_renderer("devstral")
    messages, tools = CONVERSATIONS["loop_answered"]
    for cut in range(2, len(messages)):
        if messages[cut - 1]["role"] in ("user", "tool") and messages[cut]["role"] == "assistant":
            prompt = renderer.render(messages[:cut], tools)
            assert renderer.render(messages, tools).startswith(prompt)
