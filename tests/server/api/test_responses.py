"""`/v1/responses` through the official `openai` client: text, the official event order, function calls with
streamed arguments (namespaced too), tool results, reasoning, `previous_response_id`, cache stability across turns
and errors."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import LiveServer
from tests.server.api.test_anthropic_messages import FEW_SHOT

GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HOSTED = [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, {"type": "local_shell"}]
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def _dedup(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


@pytest.mark.slow
def test_text_streamed_in_official_order_equals_not_streamed(qwen_server: LiveServer) -> None:
    client = qwen_server.client()
    kwargs = dict(model="qwen3-tiny", input="What is the capital of France?", instructions="Answer briefly.",
                  max_output_tokens=6, temperature=0, reasoning={"effort": "none"}, tools=HOSTED)
    full = client.responses.create(**kwargs)
    assert full.object == "response" and full.status == "incomplete"
    assert full.incomplete_details.reason == "max_output_tokens" and full.usage.output_tokens == 6
    [message] = full.output
    assert message.type == "message" and message.content[0].type == "output_text" and full.output_text

    with client.responses.stream(**kwargs) as stream:
        types = [event.type for event in stream]
    assert _dedup(types) == [*TEXT_EVENTS[:-1], "response.incomplete"]
    with client.responses.stream(**{**kwargs, "max_output_tokens": None}) as stream:  # the context's room only
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text.startswith(full.output_text)
    assert final.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_function_call_streams_arguments_and_maps_namespaces_back(smol_server: LiveServer) -> None:
    client = smol_server.client()
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools",
                 "tools": [WEATHER | {"name": "get_weather"}]}
    for tools, forced, expected_namespace in (([WEATHER], "get_weather", None),
                                              ([namespace, *HOSTED], "weather__get_weather", "weather")):
        with client.responses.stream(model=smol_server.ctx.model_name, input=FEW_SHOT, tools=tools, temperature=0,
                                     tool_choice={"type": "function", "name": forced}, max_output_tokens=48) as stream:
            events = list(stream)
            final = stream.get_final_response()
        [call] = final.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        assert json.loads(call.arguments) == {"city": "Paris"} and call.namespace == expected_namespace
        fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(fragments) == call.arguments and final.status == "completed"

    # The call and its output go back as input items; the model sees the result.
    follow_up = [*FEW_SHOT, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "Paris: cloudy, 15 C"}]
    client.responses.create(model=smol_server.ctx.model_name, input=follow_up, tools=[namespace], max_output_tokens=2)
    assert "Paris: cloudy, 15 C" in smol_server.ctx.tokenizer.decode(smol_server.last_record()["prompt_token_ids"])


@pytest.mark.slow
def test_reasoning_item_streams_and_round_trips_as_encrypted_content(deepseek_server: LiveServer) -> None:
    client = deepseek_server.client()
    kwargs = dict(model="deepseek-tiny", input="Hello", max_output_tokens=8, temperature=0,
                  reasoning={"effort": "high"}, include=["reasoning.encrypted_content"], store=False)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types[-1] == "response.incomplete"  # cut at its own max_output_tokens, inside the reasoning
    reasoning = events[-1].response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text and "response.reasoning_text.delta" in types
    assert reasoning.encrypted_content == reasoning.content[0].text
    # Sent back, the reasoning item is the assistant turn's reasoning again.
    item = reasoning.model_dump(exclude_none=True) | {"content": None}
    client.responses.create(model="deepseek-tiny", input=[{"role": "user", "content": "Hello"},
                                                          {k: v for k, v in item.items() if v is not None},
                                                          {"role": "user", "content": "More"}], max_output_tokens=2)
    assert deepseek_server.last_record()["endpoint"] == "responses"
    off = client.responses.create(**{**kwargs, "reasoning": {"effort": "none"}})
    assert all(item.type == "message" for item in off.output)


def test_each_turn_extends_the_last_so_the_cache_covers_it(qwen_server: LiveServer) -> None:
    """Codex resends the whole history (store: false); with previous_response_id the server keeps it. Either way
    turn 2's prompt starts with turn 1's prompt, which the cache holds. (Thinking stays on: Qwen3's template does
    not re-render the empty think block of a non-thinking turn, a template-made miss the benchmark reports.)"""
    client = qwen_server.client()
    first_input = [{"role": "developer", "content": "You are a coding agent."},
                   {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    first = client.responses.create(model="qwen3-tiny", input=first_input, max_output_tokens=6, store=True,
                                    prompt_cache_key="thread-7")
    assert qwen_server.last_record()["session"] == "thread-7"
    bs = qwen_server.ctx.engine.facts.block_size
    covered = (first.usage.input_tokens - 1) // bs * bs
    resent = [*first_input, *[o.model_dump(exclude_none=True) for o in first.output],
              {"role": "user", "content": "Thanks."}]
    again = client.responses.create(model="qwen3-tiny", input=resent, max_output_tokens=2, store=False)
    assert again.usage.input_tokens_details.cached_tokens >= covered
    chained = client.responses.create(model="qwen3-tiny", input="Thanks.", previous_response_id=first.id,
                                      max_output_tokens=2)
    assert chained.usage.input_tokens == again.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens >= covered


@pytest.mark.parametrize("body, needle, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text only",
     "input.0.content.0"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "unknown or was evicted", "previous_response_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "role", "input.0"),
    ({"input": "hi", "tool_choice": "required", "tools": HOSTED}, "at least one tool", "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
])
def test_bad_requests_get_openai_errors(qwen_server: LiveServer, body: dict, needle: str, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        qwen_server.client().responses.create(model="qwen3-tiny", **body)
    assert needle in err.value.body["message"] and err.value.body["param"] == param
