"""Tool calls end to end: forced calls parsed into `tool_calls` (streamed and not), the response is what the parser
makes of the model's raw output, and conversations with tool calls and tool results render and run. (The guarantee
over many seeds and every family is in test_structured_output.py.)"""
from __future__ import annotations

import json

import openai
import pytest

from server.pipeline.plan import request_thinking
from server.parsing import parse_output
from tests.server.conftest import LiveServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def call_text(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


# SmolLM2's own template knows no tools: kvserve renders them the generic way (server/rendering/generic_tools.py),
# and two earlier turns show the call format (plain assistant text) and their tool results.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": call_text("London")},
    {"role": "tool", "content": "London: rain, 12 C"},
    {"role": "assistant", "content": "It rains in London."},
    {"role": "user", "content": "What is the weather in Berlin?"},
    {"role": "assistant", "content": call_text("Berlin")},
    {"role": "tool", "content": "Berlin: sunny, 20 C"},
    {"role": "assistant", "content": "It is sunny in Berlin."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _streamed_message(chunks: list) -> tuple[str | None, list[dict], str | None]:
    """(content, tool calls, finish reason) assembled from stream deltas, the way an agent client does."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _expected(server: LiveServer, messages: list[dict], tools: list[dict], tool_choice) -> tuple:
    """What the parser makes of the raw continuation the engine produced (from the --record line)."""
    record = json.loads(server.record_path.read_text().splitlines()[-1])
    raw = server.ctx.tokenizer.decode(record["output_token_ids"], skip_special_tokens=False)
    thinking = request_thinking(server.ctx.family, record["body"].get("chat_template_kwargs") or {})
    return parse_output(server.ctx.family, raw, tools, tool_choice, reasoning=thinking, id_prefix="x")


@pytest.mark.slow
def test_named_tool_choice_yields_a_parsed_call_streamed_and_not(smol_server: LiveServer) -> None:
    kwargs = dict(messages=FEW_SHOT, tools=[WEATHER], tool_choice=NAMED, max_tokens=48, temperature=0)
    response = smol_server.chat(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content

    content, calls, finish = _streamed_message(list(smol_server.chat(**kwargs, stream=True)))
    assert finish == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.slow
def test_a_forced_call_is_what_the_parser_makes_of_the_raw_output(qwen_server: LiveServer) -> None:
    """qwen3-tiny has random weights: only the grammar makes its output a call to the named function. (Its strings
    are bounded: a random model never ends one by choice.)"""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["properties"]["city"]["maxLength"] = 12
    for seed in (1, 2):
        response = qwen_server.chat(messages=messages, tools=[weather], tool_choice=NAMED, max_tokens=200, seed=seed,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        expected = _expected(qwen_server, messages, [weather], NAMED)
        message = response.choices[0].message
        got_calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert got_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in expected.tool_calls]
        assert [name for name, _ in got_calls] == ["get_weather"] and "city" in json.loads(got_calls[0][1])
        assert response.choices[0].finish_reason == "tool_calls" and not message.content


AGENT_HISTORY = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is in README.md?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps({"path": "README.md"})}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "# kvserve\nLocal LLM inference."},
    {"role": "assistant", "content": "It describes kvserve."},
    {"role": "user", "content": "Thanks. Now list the files."},
]
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}}


@pytest.mark.fast_cases("qwen")
def test_history_with_tool_calls_and_results_renders_and_runs(any_server: LiveServer) -> None:
    response = any_server.chat(messages=AGENT_HISTORY, tools=[READ_FILE], tool_choice="auto", max_tokens=3)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with any_server.http() as http:
        prompt = http.post("/tokenize", json={"messages": AGENT_HISTORY, "tools": [READ_FILE]}).json()["prompt"]
    assert "# kvserve\nLocal LLM inference." in prompt and response.usage.prompt_tokens > 40


def test_tool_choice_none_and_required_validate_against_tools(qwen_server: LiveServer) -> None:
    plain = qwen_server.chat(messages=AGENT_HISTORY, tools=[READ_FILE], tool_choice="none", max_tokens=2)
    assert not plain.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as err:
        qwen_server.chat(messages=AGENT_HISTORY, tool_choice="required", max_tokens=2)
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_leaves_no_markup_in_content(qwen_server: LiveServer, stream: bool) -> None:
    """The grammar makes qwen3-tiny open a call at once; 4 tokens cut it before its name is out."""
    kwargs = dict(model="qwen3-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice="required", max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    client = qwen_server.client()
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    else:
        content, calls, finish = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
    assert not content and not calls and finish == "length"


@pytest.mark.slow
def test_a_template_without_tools_gets_them_rendered_generically_and_calls_round_trip(smol_server: LiveServer) -> None:
    """SmolLM2's template reads neither `tools` nor `tool_calls`: the tools reach the prompt, the model's call comes
    back parsed, and on the next turn the call renders as the text the model wrote, after the same prompt."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with smol_server.http() as http:
        prompt = http.post("/tokenize", json={"messages": question, "tools": [WEATHER]}).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    first = smol_server.chat(messages=question, tools=[WEATHER], tool_choice=NAMED, max_tokens=48, temperature=0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    raw = smol_server.ctx.tokenizer.decode(smol_server.last_record()["output_token_ids"], skip_special_tokens=False)
    follow = [*question, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Paris: sunny, 24 C"}]
    with smol_server.http() as http:
        rendered = http.post("/tokenize", json={"messages": follow, "tools": [WEATHER]}).json()["prompt"]
    assert rendered.startswith(prompt + raw) and raw.startswith("<tool_call>\n")
    assert rendered.endswith("<tool_response>\nParis: sunny, 24 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    second = smol_server.chat(messages=follow, tools=[WEATHER], max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16
