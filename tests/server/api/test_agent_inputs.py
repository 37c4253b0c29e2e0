"""The agent adapters' inputs, without a server: Anthropic and Responses requests -> chat requests, the
cache-stability normalizations, and the session ids."""
from __future__ import annotations

import pytest

from server.api.anthropic_protocol import MessagesRequest
from server.api.messages_input import to_turn as messages_to_turn
from server.cache.normalize import normalize_for_cache, strip_billing_nonce, system_messages_in_place
from server.api.protocol import APIError
from server.rendering import get_renderer
from server.api.responses_input import ResponseStore, to_turn as responses_to_turn
from server.api.responses_protocol import ResponsesRequest
from server.cache.session import claude_code_session, prompt_cache_key_session

HEADER = "x-anthropic-billing-header: cc_version=2.1.328.661; cc_entrypoint=sdk-cli;"


def test_billing_nonce_is_stripped_and_the_rest_of_the_header_kept() -> None:
    assert strip_billing_nonce(HEADER + " cch=a1b2c;") == HEADER
    assert strip_billing_nonce("x-anthropic-billing-header: cch=00f; cc_version=1;\nrest") == \
        "x-anthropic-billing-header: cc_version=1;\nrest"
    assert strip_billing_nonce("cch=1; not a header") == "cch=1; not a header"
    two_turns = [normalize_for_cache([{"role": "system", "content": [{"type": "text", "text": f"{HEADER} cch={n};"}]},
                                      {"role": "user", "content": "hi"}], get_renderer("qwen3")) for n in ("1", "2")]
    assert two_turns[0] == two_turns[1]


def test_mid_conversation_system_messages_stay_in_place_or_become_user_turns_for_deepseek() -> None:
    messages = [{"role": "system", "content": "head"}, {"role": "user", "content": "a"},
                {"role": "system", "content": "env"}, {"role": "user", "content": "b"}]
    assert system_messages_in_place(messages, get_renderer("qwen3")) == messages
    moved = system_messages_in_place(messages, get_renderer("deepseek-v3.1"))
    assert [m["role"] for m in moved] == ["system", "user", "user", "user"] and moved[2]["content"] == "env"
    # DeepSeek: turn N+1 (one more exchange) extends turn N's prompt only with the rule.
    renderer = get_renderer("deepseek-v3.1")
    turn = [messages[0], messages[1], {"role": "assistant", "content": "ok"}]
    later = [*turn, messages[2], messages[3]]
    plain = renderer.render(turn, add_generation_prompt=False), renderer.render(later)
    assert not plain[1].startswith(plain[0])  # the template hoists "env" into the head
    fixed = (renderer.render(normalize_for_cache(turn, renderer), add_generation_prompt=False),
             renderer.render(normalize_for_cache(later, renderer)))
    assert fixed[1].startswith(fixed[0])


def test_anthropic_request_becomes_the_chat_form() -> None:
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "stop_sequences": ["\n\n"], "thinking": {"type": "adaptive"},
        "system": [{"type": "text", "text": "sys"}],
        "tools": [{"name": "read", "input_schema": {"type": "object"}}, {"type": "web_search_20250305",
                                                                        "name": "web_search"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "read it"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "redacted_thinking", "data": "x"},
                                              {"type": "text", "text": "Reading."},
                                              {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "é"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "no such file"}]},
                                         {"type": "text", "text": "try again"}]},
        ],
    })
    chat = messages_to_turn(req, "qwen3")
    assert chat.messages == [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"p": "é"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: no such file"},
        {"role": "user", "content": [{"type": "text", "text": "try again"}]},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.sampling.stop == ("\n\n",) and chat.sampling.max_tokens == 5
    assert chat.template_kwargs == {"enable_thinking": True}
    assert messages_to_turn(req.model_copy(update={"thinking": None}), "deepseek-v3.1").template_kwargs == \
        {"thinking": False}
    with pytest.raises(APIError, match="document blocks are not supported"):
        messages_to_turn(MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "document", "source": {}}]}]}), "qwen3")


def test_responses_request_becomes_the_chat_form_with_flat_namespaced_tools() -> None:
    req = ResponsesRequest.model_validate({
        "model": "m", "instructions": "be brief", "reasoning": {"effort": "minimal"}, "max_output_tokens": 9,
        "tools": [{"type": "function", "name": "exec", "parameters": {"type": "object"}, "strict": False},
                  {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
                  {"type": "web_search"}],
        "tool_choice": {"type": "function", "name": "spawn", "namespace": "agents"},
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
            {"role": "user", "content": "go"},
            {"type": "reasoning", "summary": [], "encrypted_content": "thought"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
            {"type": "web_search_call", "id": "ws"},
        ],
    })
    chat, names = responses_to_turn(req, "qwen3", history=[], session=None)
    assert chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "agents__spawn", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    assert [t["function"]["name"] for t in chat.tools] == ["exec", "agents__spawn"]
    assert names == {"exec": (None, "exec"), "agents__spawn": ("agents", "spawn")}
    assert chat.tool_choice == {"type": "function", "function": {"name": "agents__spawn"}}
    assert chat.sampling.max_tokens == 9 and chat.template_kwargs == {"enable_thinking": False}


def test_response_store_is_bounded() -> None:
    store = ResponseStore(capacity_per_tenant=2)
    for i in range(3):
        store.put("tenant-a", f"r{i}", [{"role": "user", "content": str(i)}])
    assert store.history("tenant-a", "r2") == [{"role": "user", "content": "2"}]
    with pytest.raises(APIError, match="evicted"):
        store.history("tenant-a", "r0")
    with pytest.raises(APIError, match="unknown"):
        store.history("tenant-b", "r2")  # another tenant's id is unknown, like one that never existed


def test_session_ids_from_each_client() -> None:
    assert prompt_cache_key_session(" thread-1 ", {}) == "thread-1" and prompt_cache_key_session("", {}) is None
    assert prompt_cache_key_session(None, {"x-session-id": "s-2"}) == "s-2"
    assert prompt_cache_key_session("thread-1", {"x-session-id": "s-2"}) == "thread-1"
    metadata = {"user_id": '{"device_id": "d", "account_uuid": "", "session_id": "s-9"}'}
    assert claude_code_session({}, metadata) == "s-9"
    assert claude_code_session({"x-claude-code-session-id": "h-1"}, metadata) == "h-1"
    assert claude_code_session({}, {"user_id": "not json"}) is None and claude_code_session({}, None) is None
    assert claude_code_session({"x-session-id": "s-3"}, None) == "s-3"
