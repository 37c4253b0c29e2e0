"""`/v1/messages` through the official `anthropic` client: text, streaming events, tool use with streamed arguments,
tool results, thinking, stop sequences, usage from the prefix cache, errors in Anthropic's shape."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.conftest import KEY_A, LiveServer
from tests.server.api.test_tools import call_text

HELLO = [{"role": "user", "content": "What is the capital of France?"}]
# The anthropic SDK no longer takes sampling parameters as arguments; the API does (greedy keeps runs comparable).
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# SmolLM2's template does not show tools: earlier turns show it the call format, as in tests/server/api/test_tools.py.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": call_text("London")},
    {"role": "user", "content": "London: rain, 12 C. What is the weather in Berlin?"},
    {"role": "assistant", "content": call_text("Berlin")},
    {"role": "user", "content": "Berlin: sunny, 20 C. What is the weather in Paris?"},
]


def test_text_streamed_equals_not_streamed_and_usage_splits_the_prompt(qwen_server: LiveServer) -> None:
    client = qwen_server.anthropic()
    kwargs = dict(model="qwen3-tiny", max_tokens=6, extra_body={"temperature": 0}, system="Answer briefly.",
                  messages=HELLO)
    full = client.messages.create(**kwargs)
    assert full.type == "message" and full.role == "assistant" and full.model == "qwen3-tiny"
    assert [b.type for b in full.content] == ["text"] and full.content[0].text
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 6
    prompt_tokens = client.messages.count_tokens(model="qwen3-tiny", system="Answer briefly.", messages=HELLO)
    usage = full.usage
    # count_tokens renders exactly as messages do (thinking off: Qwen3's empty think block is in both).
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == \
        prompt_tokens.input_tokens

    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == full.content[0].text and streamed.stop_reason == "max_tokens"
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.index("content_block_start") < events.index("content_block_stop") < events.index("message_delta")
    # The same prompt again: its full blocks come from the cache.
    bs = qwen_server.ctx.engine.facts.block_size
    total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    assert streamed.usage.cache_read_input_tokens == (total - 1) // bs * bs


@pytest.mark.slow
def test_forced_tool_use_streams_its_arguments_as_input_json(smol_server: LiveServer) -> None:
    client = smol_server.anthropic()
    kwargs = dict(model=smol_server.ctx.model_name, max_tokens=48, extra_body={"temperature": 0}, messages=FEW_SHOT,
                  tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    full = client.messages.create(**kwargs)
    [call] = full.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert full.stop_reason == "tool_use"

    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    assert "".join(fragments) == '{"city": "Paris"}'
    assert streamed.content[0].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"

    # The tool's result goes back as a tool_result block, and the model sees it.
    follow_up = [*FEW_SHOT, {"role": "assistant", "content": [c.model_dump() for c in full.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": "Paris: cloudy, 15 C"}]}]}]
    client.messages.create(model=smol_server.ctx.model_name, max_tokens=3, messages=follow_up, tools=[WEATHER])
    prompt = smol_server.ctx.tokenizer.decode(smol_server.last_record()["prompt_token_ids"])
    assert "Paris: cloudy, 15 C" in prompt  # (this template does not show calls; test_agent_inputs.py does)


@pytest.mark.slow
def test_thinking_streams_a_thinking_block_and_disabled_thinks_not(deepseek_server: LiveServer) -> None:
    client = deepseek_server.anthropic()
    kwargs = dict(model="deepseek-tiny", max_tokens=8, extra_body={"temperature": 0}, messages=HELLO)
    with client.messages.stream(**kwargs, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        message = stream.get_final_message()
    assert message.content[0].type == "thinking" and message.content[0].thinking
    assert "thinking_delta" in deltas
    prompt = deepseek_server.ctx.tokenizer.decode(deepseek_server.last_record()["prompt_token_ids"])
    assert prompt.endswith("<｜Assistant｜><think>")

    plain = client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert all(block.type == "text" for block in plain.content)
    prompt = deepseek_server.ctx.tokenizer.decode(deepseek_server.last_record()["prompt_token_ids"])
    assert prompt.endswith("<｜Assistant｜></think>")


def test_stop_sequence_ends_the_text_and_is_reported(qwen_server: LiveServer) -> None:
    client = qwen_server.anthropic()
    kwargs = dict(model="qwen3-tiny", max_tokens=12, extra_body={"temperature": 0}, messages=HELLO)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.messages.create(**kwargs, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_claude_code_shape_system_blocks_mid_conversation_system_and_session(qwen_server: LiveServer) -> None:
    """The billing header's nonce is stripped, the mid-conversation system message renders in place, and the
    session id is recorded."""
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.661; cc_entrypoint=cli; cch=9f3a1;"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "system", "content": [{"type": "text", "text": "# Environment\nlinux"}]},
                {"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]}]
    qwen_server.anthropic().messages.create(
        model="qwen3-tiny", max_tokens=2, system=system, messages=messages, thinking={"type": "adaptive"},
        metadata={"user_id": '{"device_id": "d", "session_id": "sess-42"}'},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
    )
    record = qwen_server.last_record()
    prompt = qwen_server.ctx.tokenizer.decode(record["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\nx-anthropic-billing-header: cc_version=2.1.328.661; "
                             "cc_entrypoint=cli;\nYou are Claude Code.<|im_end|>")
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\n# Environment\nlinux<|im_end|>\n" in prompt
    assert record["session"] == "sess-42" and record["endpoint"] == "messages"
    assert prompt.endswith("<|im_start|>assistant\n")  # adaptive thinking: Qwen3 thinks


@pytest.mark.parametrize("body, status, kind, needle", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, 400, "invalid_request_error",
     "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "source"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "claude-opus"}, 404, "not_found_error", "does not exist"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
     "tool"),
])
def test_bad_requests_get_anthropic_errors(qwen_server: LiveServer, body: dict, status: int, kind: str,
                                           needle: str) -> None:
    payload = {"model": "qwen3-tiny", "max_tokens": 2, **body}
    response = httpx.post(f"{qwen_server.base_url}/v1/messages?beta=true", json=payload, timeout=60,
                          headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"})
    error = response.json()
    assert response.status_code == status and error["type"] == "error" and error["error"]["type"] == kind
    assert needle in error["error"]["message"]


def test_auth_by_x_api_key_and_models_in_anthropic_shape(qwen_server: LiveServer) -> None:
    with pytest.raises(anthropic.AuthenticationError) as err:
        qwen_server.anthropic(api_key="sk-wrong").messages.create(model="qwen3-tiny", max_tokens=1, messages=HELLO)
    assert err.value.body["error"]["type"] == "authentication_error"
    [model] = qwen_server.anthropic().models.list().data
    assert model.id == "qwen3-tiny" and model.type == "model"
    # Bearer works on the Anthropic route too, and x-api-key on the OpenAI ones.
    headers = {"Authorization": f"Bearer {KEY_A}"}
    ok = httpx.post(f"{qwen_server.base_url}/v1/messages", json={"model": "qwen3-tiny", "max_tokens": 1,
                                                                 "messages": HELLO}, headers=headers, timeout=60)
    assert ok.status_code == 200
    models = httpx.get(f"{qwen_server.base_url}/v1/models", headers={"x-api-key": KEY_A}, timeout=60).json()
    assert models["object"] == "list"


def test_an_identical_repeat_reads_its_whole_breakpoint_prefix(qwen_server: LiveServer) -> None:
    """Anthropic's cache accounting: the first request writes the prefix up to its last breakpoint, an identical
    repeat reads all of it and writes nothing (though kvserve recomputes the tail of its last, partial block)."""
    client = qwen_server.anthropic()
    text = "Summarize the design of a paged KV cache with a radix prefix tree, in three sentences, for a newcomer."
    kwargs = dict(model="qwen3-tiny", max_tokens=1, system="You are terse.", messages=[{"role": "user", "content": [
        {"type": "text", "text": text + " (breakpoint accounting)", "cache_control": {"type": "ephemeral"}}]}])
    first, repeat = client.messages.create(**kwargs).usage, client.messages.create(**kwargs).usage
    assert first.cache_creation_input_tokens > 4  # (the start of the prompt may be cached by earlier tests)
    assert repeat.cache_creation_input_tokens == 0
    # At least the whole breakpoint prefix is read; kvserve's automatic block cache may serve a little past it.
    prefix = first.cache_read_input_tokens + first.cache_creation_input_tokens
    assert prefix <= repeat.cache_read_input_tokens < prefix + 8
    assert repeat.input_tokens + repeat.cache_read_input_tokens == first.input_tokens + prefix
