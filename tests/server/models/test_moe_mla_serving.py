"""`kvserve serve` with the agents' own architectures: qwen3-moe-tiny (Qwen3-MoE, Qwen3-Coder template and XML tool
calls) and deepseek-v3-tiny (MLA + MoE, DeepSeek-V3.1 template, its tool-call tokens and thinking), through the real
`openai` client against uvicorn. Random weights rarely write a valid call or close their thinking, so each response
is checked against what the server's parsers make of the raw continuation (from the --record line)."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from server.parsing import parse_output
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import LiveServer, serve
from tests.server.api.test_tools import AGENT_HISTORY, READ_FILE, _streamed_message

BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=["qwen3-moe-tiny", "deepseek-v3-tiny"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    record = tmp_path_factory.mktemp("record") / "requests.jsonl"
    ctx = load_context(request.param, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=1024, max_model_len=2048),
                       ServerSettings(), record_path=str(record))
    with serve(ctx) as url:
        yield LiveServer(ctx, url, record)


def _thinking(server: LiveServer) -> dict:
    """Thinking on where the template has it (DeepSeek-V3.1); Qwen3-Coder has no thinking mode."""
    return {"thinking": True} if server.ctx.family == "deepseek-v3.1" else {}


def _parsed_raw_output(server: LiveServer, tool_choice) -> object:
    record = json.loads(server.record_path.read_text().splitlines()[-1])
    raw = server.ctx.tokenizer.decode(record["output_token_ids"], skip_special_tokens=False)
    return parse_output(server.ctx.family, raw, [READ_FILE], tool_choice, reasoning=bool(_thinking(server)),
                        id_prefix="x")


@pytest.mark.fast_cases("deepseek-v3-tiny")
def test_agent_turns_parse_tools_and_reasoning_and_hit_the_cache(server: LiveServer) -> None:
    kwargs = _thinking(server)
    first = server.chat(messages=AGENT_HISTORY, tools=[READ_FILE], tool_choice="auto", max_tokens=12, seed=1,
                        extra_body={"chat_template_kwargs": kwargs})
    expected = _parsed_raw_output(server, "auto")
    message = first.choices[0].message
    assert message.content == expected.content
    assert getattr(message, "reasoning_content", None) == expected.reasoning_content
    assert [c.function.name for c in message.tool_calls or []] == [c["function"]["name"] for c in
                                                                     expected.tool_calls]
    if kwargs:  # the V3.1 prompt ends in <think>: what the model writes first is reasoning
        assert expected.reasoning_content

    second_turn = AGENT_HISTORY + [{"role": "assistant", "content": "Listing them."},
                                   {"role": "user", "content": "Go on."}]
    second = server.chat(messages=second_turn, tools=[READ_FILE], max_tokens=4,
                         extra_body={"chat_template_kwargs": kwargs})
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt is cached up to where the history's rendering of the reply departs from it.
    assert first.usage.prompt_tokens - 2 * BLOCK_SIZE <= cached < second.usage.prompt_tokens


@pytest.mark.slow
def test_forced_tool_call_is_a_valid_call_streamed_and_not(server: LiveServer) -> None:
    # The grammar writes the call in the model's own format (Qwen3-Coder XML, DeepSeek-V3.1 call tokens); a
    # length-capped path lets a random model close its string within the budget (12 characters of up to 4 byte
    # tokens each, plus the markup: seed 3 took 98 tokens on deepseek-v3-tiny). Thinking off: a random model may
    # never close it, and the guarantee covers the answer after it.
    tool = {"type": "function", "function": {**READ_FILE["function"], "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"],
        "additionalProperties": False}}}
    named = {"type": "function", "function": {"name": "read_file"}}
    thinking_off = {"thinking": False} if server.ctx.family == "deepseek-v3.1" else {}
    kwargs = dict(messages=AGENT_HISTORY, tools=[tool], tool_choice=named, max_tokens=192, seed=3, temperature=1.0,
                  extra_body={"chat_template_kwargs": thinking_off})
    response = server.chat(**kwargs)
    message = response.choices[0].message
    [call] = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "read_file" and set(arguments) == {"path"} and len(arguments["path"]) <= 12
    assert response.choices[0].finish_reason == "tool_calls"
    content, calls, finish = _streamed_message(list(server.chat(**kwargs, stream=True)))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("read_file", arguments)]
    assert finish == "tool_calls" and not (content or "").strip()
