"""MiniMax-M2 served end to end (minimax-m2-tiny: the architecture, the official template, a stand-in tokenizer with
MiniMax's special tokens) through the real clients against uvicorn. MiniMax always thinks (its generation prompt opens
`<think>`), so the server bounds a random model's thinking (--reasoning-budget), after which tool_choice required
makes it write a valid call in MiniMax's own `<minimax:tool_call>` block; the tool result goes back, and the next
turn reads from the cache everything it shares with the first turn's prompt and reply but at most one block. A named
tool comes back the same through chat completions (streamed as returned whole), Anthropic Messages (a tool_use
block) and Responses (a function_call item)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import LiveServer, serve
from tests.server.models.test_glm_serving import FORECAST, QUESTION, assert_named_call_streams_as_returned_whole

pytestmark = pytest.mark.slow  # the module's server, and grammars over a 200k vocabulary

BLOCK_SIZE = 4
NAMED = {"type": "function", "function": {"name": "forecast"}}


def thinking_server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`model` served with a thinking budget of 8 tokens (a random model never ends its thinking by itself)."""
    record = tmp_path_factory.mktemp("record") / "requests.jsonl"
    ctx = load_context(model, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=1024, max_model_len=4096),
                       ServerSettings(reasoning_budget=8), record_path=str(record))
    with serve(ctx) as url:
        yield LiveServer(ctx, url, record)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from thinking_server("minimax-m2-tiny", tmp_path_factory)


def decode(server: LiveServer, ids: list[int]) -> str:
    return server.ctx.tokenizer.decode(ids, skip_special_tokens=False)


def required_forecast(server: LiveServer, max_tokens: int = 120) -> tuple[Any, Any]:
    """tool_choice required on QUESTION: one valid `forecast` call; returns the message and its call."""
    first = server.client().chat.completions.create(model=server.ctx.model_name, messages=QUESTION, tools=[FORECAST],
                                                    tool_choice="required", parallel_tool_calls=False,
                                                    max_tokens=max_tokens,
                                                    temperature=1.0, seed=3)
    message = first.choices[0].message
    [call] = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "forecast" and set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
    assert first.choices[0].finish_reason == "tool_calls"
    return message, call


def test_a_required_call_round_trip_reads_the_first_turn_from_the_cache(server: LiveServer) -> None:
    client = server.client()
    message, call = required_forecast(server)
    first_record = server.last_record()
    prompt = decode(server, first_record["prompt_token_ids"])
    assert prompt.startswith("]~!b[]~b]system\nYou are a travel agent.\n\n# Tools\n") and prompt.endswith(
        "[e~[\n]~b]user\nPlan Rome.[e~[\n]~b]ai\n<think>\n")
    raw = decode(server, first_record["output_token_ids"])
    # MiniMax's own format (xgrammar's minimax_xml lets a whitespace character frame a tag or a value)
    assert re.search(r'</think>\s*<minimax:tool_call>\s*<invoke name="forecast">\s*<parameter name="', raw), raw
    assert message.model_extra["reasoning_content"]  # the thinking comes back for the client to send again

    history = QUESTION + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week."}]
    second = client.chat.completions.create(model=server.ctx.model_name, messages=history, tools=[FORECAST],
                                            max_tokens=4)
    second_record = server.last_record()
    # The history re-renders the first prompt and the reasoning the model wrote (MiniMax keeps a tool loop's
    # thinking), so the cache serves all of it but the last partial block.
    reasoning = raw.split("</think>")[0].strip("\n")
    assert decode(server, second_record["prompt_token_ids"]).startswith(prompt + reasoning)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(first_record["prompt_token_ids"]) - BLOCK_SIZE


def named_call_in_all_three_apis(server: LiveServer, max_tokens: int = 120) -> tuple[Any, Any]:
    """tool_choice naming `forecast` through chat (streamed as returned whole), Anthropic Messages (a tool_use block
    after the thinking) and Responses (a function_call item); returns the tool_use block and the item."""
    assert_named_call_streams_as_returned_whole(server, max_tokens=max_tokens)
    tool = {"name": "forecast", "description": FORECAST["function"]["description"],
            "input_schema": FORECAST["function"]["parameters"]}
    reply = server.anthropic().messages.create(model=server.ctx.model_name, max_tokens=max_tokens, system="Plan trips.",
                                               messages=[{"role": "user", "content": "Plan Rome."}], tools=[tool],
                                               tool_choice={"type": "tool", "name": "forecast"})
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "forecast" and set(use.input) == {"city", "days"}
    assert any(block.type == "thinking" for block in reply.content)
    response = server.client().responses.create(
        model=server.ctx.model_name, input="Plan Rome.", max_output_tokens=max_tokens,
        tools=[{"type": "function", **FORECAST["function"]}], tool_choice={"type": "function", "name": "forecast"})
    [item] = [item for item in response.output if item.type == "function_call"]
    assert item.name == "forecast" and set(json.loads(item.arguments)) == {"city", "days"}
    return use, item


def test_a_named_call_in_all_three_apis(server: LiveServer) -> None:
    named_call_in_all_three_apis(server)
