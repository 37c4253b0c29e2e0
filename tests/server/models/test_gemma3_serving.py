"""Gemma 3 served with its chat template through the real SDKs on 127.0.0.1. The real Gemma 3 270M (gemma3-270m: its
Q4_K_M GGUF dequantized, its SentencePiece tokenizer): the chat prompt is the official template's, as transformers
renders and tokenizes it, and the greedy reply to it equals transformers' (the chat-template path of issue 37's
"the real gemma3-270m equals transformers on chat prompts"). On gemma3-tiny (Gemma 3's architecture and tokenizer,
random weights, so every valid call is the grammar's doing): tool calls in the format Google's function-calling
guide prompts for, guaranteed by grammar under tool_choice required / named, on chat completions (a round trip whose
next turn reads the first prompt from the cache), Responses and Anthropic Messages."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from engine.config import EngineConfig
from engine.registry import resolve_model
from tests.hf_oracle import hf_greedy
from tests.server.conftest import LiveServer, _live_server
from tests.server.models.test_glm_serving import FORECAST, QUESTION, assert_named_call_streams_as_returned_whole

pytestmark = pytest.mark.slow  # serves a real 270M model; compiles call grammars over 262,144 tokens

BLOCK_SIZE = 16
OFFICIAL = Path(__file__).parents[2] / "rendering" / "templates" / "google-gemma-3-it.jinja"
CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}]


def _gemma3_server(factory: pytest.TempPathFactory, model: str, **engine: int) -> Iterator[LiveServer]:
    yield from _live_server(factory, model, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=512, max_model_len=4096,
                                                         **engine))


@pytest.fixture  # one test: let go of the 270M when it ends
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real 270M: only where its weights are what the test proves (greedy parity with transformers)."""
    yield from _gemma3_server(tmp_path_factory, "gemma3-270m")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """gemma3-tiny for the tool calls: the same tokenizer, template and call grammars, decoding in a fraction of the
    270M's time."""
    yield from _gemma3_server(tmp_path_factory, "gemma3-tiny", num_window_blocks=64)  # a step of 993 tokens at most


def test_a_chat_prompt_is_the_official_templates_and_the_reply_equals_transformers(real_server: LiveServer) -> None:
    server = real_server
    tokenizer = server.ctx.tokenizer  # AutoTokenizer of the model's directory (loading another takes ~10 s)
    official = tokenizer.apply_chat_template(CHAT, chat_template=OFFICIAL.read_text(), add_generation_prompt=True,
                                             tokenize=False)
    want_prompt = tokenizer(official, add_special_tokens=False).input_ids
    reply = server.chat(messages=CHAT, max_tokens=12, temperature=0)
    record = server.last_record()
    assert record["prompt_token_ids"] == want_prompt and want_prompt[0] == tokenizer.bos_token_id
    want = hf_greedy(str(resolve_model("gemma3-270m")), want_prompt, 12)
    assert record["output_token_ids"] == want[:len(record["output_token_ids"])] and len(record["output_token_ids"]) > 1
    assert reply.choices[0].message.content == tokenizer.decode(record["output_token_ids"], skip_special_tokens=True)


def test_a_required_call_round_trip_reads_the_first_turn_from_the_cache(server: LiveServer) -> None:
    first = server.chat(messages=QUESTION, tools=[FORECAST], tool_choice="required", parallel_tool_calls=False,
                        max_tokens=60, temperature=0)
    [call] = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "forecast" and set(arguments) >= {"city", "days"} and 1 <= arguments["days"] <= 7
    assert first.choices[0].finish_reason == "tool_calls"
    first_record = server.last_record()
    raw = server.ctx.tokenizer.decode(first_record["output_token_ids"], skip_special_tokens=False)
    assert raw.startswith('{"name": "forecast", "parameters": {')
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week."}]
    second = server.chat(messages=history, tools=[FORECAST], max_tokens=4)
    second_prompt = server.last_record()["prompt_token_ids"]
    first_prompt = first_record["prompt_token_ids"]
    # The call comes back as the model wrote it, so the next prompt extends the first prompt and the reply...
    text = server.ctx.tokenizer.decode(second_prompt, skip_special_tokens=False)
    written = server.ctx.tokenizer.decode(first_record["output_token_ids"], skip_special_tokens=True)  # no <eos>
    assert second_prompt[:len(first_prompt)] == first_prompt and f"model\n{written}<end_of_turn>" in text
    assert "```tool_output\nSunny all week.\n```" in text
    # ... and the cache serves all of the first prompt but its last partial block
    assert second.usage.prompt_tokens_details.cached_tokens >= len(first_prompt) - BLOCK_SIZE


def test_a_named_call_streams_as_it_is_returned_whole(server: LiveServer) -> None:
    assert_named_call_streams_as_returned_whole(server, max_tokens=60)


def test_responses_and_anthropic_messages_call_a_named_tool(server: LiveServer) -> None:
    function = FORECAST["function"]
    response = server.client().responses.create(
        model=server.ctx.model_name, input="Plan Rome.", instructions="You are a travel agent.", max_output_tokens=60,
        tools=[{"type": "function", **function}], tool_choice={"type": "function", "name": "forecast"}, temperature=0)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "forecast" and set(json.loads(call.arguments)) >= {"city", "days"}
    reply = server.anthropic().messages.create(
        model=server.ctx.model_name, max_tokens=60, system="You are a travel agent.",
        messages=[{"role": "user", "content": "Plan Rome."}],
        tools=[{"name": "forecast", "description": function["description"], "input_schema": function["parameters"]}],
        tool_choice={"type": "tool", "name": "forecast"})
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "forecast" and set(use.input) >= {"city", "days"}



def test_a_request_whose_step_the_window_pool_cannot_hold_is_a_400_in_each_apis_shape(server: LiveServer) -> None:
    """The window pool of 64 pages (16-token window in 16-token blocks) holds a step of at most 993 tokens: a longer
    prompt is refused as a dense model's too-long prompt is, a 400 naming the numbers and the way out on chat
    completions and Anthropic Messages (it used to wait forever for pages no request frees)."""
    long = [{"role": "user", "content": "Tell me about Rome. " * 250}]
    with pytest.raises(openai.BadRequestError) as chat:
        server.chat(messages=long, max_tokens=4)
    error = chat.value.body
    assert chat.value.status_code == 400 and error["code"] == "kv_cache_too_small"
    assert "window pool has 64" in error["message"] and "--max-num-batched-tokens to 993 or less" in error["message"]
    with pytest.raises(anthropic.BadRequestError) as messages:
        server.anthropic().messages.create(model=server.ctx.model_name, max_tokens=4, messages=long)
    assert messages.value.status_code == 400 and "window pool has 64" in messages.value.body["error"]["message"]
