"""gpt-oss-tiny served (the harmony format, the real o200k_harmony tokenizer, MXFP4 experts) through the real `openai`
SDK: a Responses tool loop (a call guaranteed by a named tool_choice in the harmony format, its result sent back with
`previous_response_id`, the next turn reading the first from the cache), chat completions with tools (a `required`
call, streamed and not, the same), Anthropic Messages with a named tool, and the reasoning effort reaching the system
message."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from tests.server.conftest import LiveServer, _live_server

pytestmark = pytest.mark.slow  # builds and serves gpt-oss-tiny (~45 s: the o200k_harmony merges, 201,088 rows)

# The city is an enum so that a random model's arguments end within a few tokens
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"]}}
OTHER = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                          "parameters": {"type": "object", "properties": {}}}}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}, OTHER]


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _live_server(tmp_path_factory, "gpt-oss-tiny",
                            EngineConfig(block_size=16, num_kv_blocks=512, max_model_len=4096))


def test_a_responses_tool_loop(gpt_oss_server: LiveServer) -> None:
    client = gpt_oss_server.client()
    first = client.responses.create(model="gpt-oss-tiny", input="What is the weather in Paris?",
                                    instructions="You are a weather bot.", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0, reasoning={"effort": "low"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments), dict)
    second = client.responses.create(model="gpt-oss-tiny", previous_response_id=first.id, tools=[WEATHER],
                                     instructions="You are a weather bot.",  # not carried over, as OpenAI's
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": '{"temperature": 21}'}],
                                     max_output_tokens=8, temperature=0, reasoning={"effort": "low"})
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_chat_completions_with_a_required_call_streamed_or_not(gpt_oss_server: LiveServer) -> None:
    kwargs = dict(messages=[{"role": "system", "content": "Use the tools."},
                            {"role": "user", "content": "Weather in Oslo?"}],
                  tools=CHAT_TOOLS, tool_choice="required", max_tokens=40, temperature=0, reasoning_effort="high")
    reply = gpt_oss_server.chat(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name in ("get_weather",
                                                                                                     "get_time")
    arguments = choice.message.tool_calls[0].function.arguments
    assert isinstance(json.loads(arguments), dict)
    chunks = list(gpt_oss_server.chat(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                       if c.choices and c.choices[0].delta.tool_calls)
    assert streamed == arguments


def test_the_reasoning_effort_reaches_the_system_message(gpt_oss_server: LiveServer) -> None:
    """Chat completions' reasoning_effort, rendered as the router-facing render route renders it (the same steps as a
    request), states the effort gpt-oss knows: the lowest as low, anything above high as high."""
    http, tokenizer = gpt_oss_server.http(), gpt_oss_server.ctx.tokenizer
    for effort, stated in (("minimal", "low"), ("medium", "medium"), ("xhigh", "high"), (None, "medium")):
        body = {"model": "gpt-oss-tiny", "messages": [{"role": "user", "content": "Hi"}]}
        if effort:
            body["reasoning_effort"] = effort
        rendered = http.post("/v1/chat/completions/render", json=body)
        assert rendered.status_code == 200, rendered.text
        assert f"Reasoning: {stated}\n" in tokenizer.decode(rendered.json()["token_ids"])


def test_anthropic_messages_with_a_named_tool(gpt_oss_server: LiveServer) -> None:
    """Claude Code's API: the named tool comes back as a tool_use block, its input the harmony call's arguments."""
    reply = gpt_oss_server.anthropic().messages.create(
        model="gpt-oss-tiny", max_tokens=40, system="Use the tools.",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"name": "get_weather", "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}],
        tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
