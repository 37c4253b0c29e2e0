"""Thinking budgets through the APIs (server/pipeline/reasoning_budget.py, the engine's phase budget): Anthropic
`thinking.budget_tokens`, OpenAI `reasoning_effort` / Responses `reasoning.effort`, `--reasoning-budget`; usage's
reasoning tokens. The tiny random models think forever once their prompt opens `<think>` (DeepSeek-V3.1 with
thinking on, Qwen3.6): the budget is what ends their thinking, with the closing phrase and `</think>`."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from server.pipeline.reasoning_budget import CLOSING_PHRASE, EFFORT_BUDGETS, request_budget
from tests.server.conftest import LiveServer

THINK = {"chat_template_kwargs": {"thinking": True}}  # DeepSeek-V3.1's switch


def closing_tokens(server: LiveServer) -> int:
    """The forced tokens: the closing phrase, then </think>."""
    return len(server.ctx.encode(CLOSING_PHRASE)) + len(server.ctx.encode("</think>"))


def test_a_requests_budget_comes_from_its_tokens_its_effort_or_the_server():
    assert request_budget(64, "high", 999) == 64
    assert [request_budget(None, e, 999) for e in ("low", "medium", "high")] == list(EFFORT_BUDGETS.values())
    assert request_budget(None, "xhigh", 999) is None and request_budget(None, "max", 999) is None
    assert request_budget(None, None, 999) == 999 and request_budget(None, None, None) is None


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_budget_tokens_ends_the_thinking(deepseek_server: LiveServer, stream: bool):
    client = deepseek_server.anthropic()
    args = dict(model=deepseek_server.ctx.model_name, max_tokens=150, messages=[{"role": "user", "content": "Why?"}],
                thinking={"type": "enabled", "budget_tokens": 64})
    if stream:
        with client.messages.stream(**args) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**args)
    thinking = [b for b in message.content if b.type == "thinking"]
    assert len(thinking) == 1 and thinking[0].thinking.endswith(CLOSING_PHRASE.rstrip("\n"))
    own = thinking[0].thinking[: -len(CLOSING_PHRASE.rstrip("\n"))]
    # (exactly 64 tokens were generated, tests/server/api and tests/engine count them; random tokens' text
    # re-encodes to a few more or fewer)
    assert 48 < len(deepseek_server.ctx.encode(own)) < 80
    assert message.usage.output_tokens > 64 + closing_tokens(deepseek_server)  # it answered after the thinking


def test_no_budget_thinks_on(deepseek_server: LiveServer):
    """Without a budget the random model never closes its thinking: every token is reasoning."""
    response = deepseek_server.chat(messages=[{"role": "user", "content": "Why?"}], max_tokens=80, temperature=0,
                                    extra_body=THINK)
    assert response.usage.completion_tokens == 80
    assert response.usage.completion_tokens_details.reasoning_tokens == 80
    assert response.choices[0].message.content in (None, "")


@contextmanager
def server_budget(server: LiveServer, budget: int | None) -> Iterator[None]:
    """The server as started with --reasoning-budget ``budget``."""
    old = server.ctx.settings
    server.ctx.settings = dataclasses.replace(old, reasoning_budget=budget)
    try:
        yield
    finally:
        server.ctx.settings = old


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_default_and_reasoning_tokens_in_usage(deepseek_server: LiveServer, stream: bool):
    with server_budget(deepseek_server, 64):
        kwargs = dict(messages=[{"role": "user", "content": "Why?"}], max_tokens=120, temperature=0, extra_body=THINK)
        if stream:
            chunks = list(deepseek_server.chat(stream=True, stream_options={"include_usage": True}, **kwargs))
            usage = chunks[-1].usage
        else:
            usage = deepseek_server.chat(**kwargs).usage
    assert usage.completion_tokens_details.reasoning_tokens == 64 + closing_tokens(deepseek_server)
    assert usage.completion_tokens == 120


@pytest.mark.slow
def test_tool_choice_required_after_a_spent_budget(deepseek_server: LiveServer):
    """The forced closing ends the free thinking the call grammar allows; the call follows it."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}]
    with server_budget(deepseek_server, 32):
        response = deepseek_server.chat(messages=[{"role": "user", "content": "Look it up."}], max_tokens=200,
                                        temperature=0, tools=tools, tool_choice="required", extra_body=THINK)
    assert response.usage.completion_tokens_details.reasoning_tokens == 32 + closing_tokens(deepseek_server)
    calls = response.choices[0].message.tool_calls
    assert calls and all(call.function.name == "lookup" for call in calls)


@pytest.mark.slow  # a qwen3.6-tiny server of its own (~10 s)
def test_an_effort_sets_the_budget_on_a_hybrid(hybrid_server: LiveServer):
    """Qwen3.6 (its prompt opens <think>): `reasoning_effort` low is 1,024 tokens, more than this reply's 48, so all
    48 are thinking; the server's default of 16 applies when the request names no effort."""
    base = dict(messages=[{"role": "user", "content": "Why?"}], max_tokens=48, temperature=0)
    low = hybrid_server.chat(reasoning_effort="low", **base).usage
    assert low.completion_tokens_details.reasoning_tokens == 48
    with server_budget(hybrid_server, 16):
        default = hybrid_server.chat(**base).usage
        overridden = hybrid_server.chat(reasoning_effort="low", **base).usage
    assert default.completion_tokens_details.reasoning_tokens == 16 + closing_tokens(hybrid_server)
    assert overridden.completion_tokens_details.reasoning_tokens == 48


def test_responses_report_reasoning_tokens(hybrid_server: LiveServer):
    with server_budget(hybrid_server, 16):
        response = hybrid_server.client().responses.create(model=hybrid_server.ctx.model_name, input="Why?",
                                                           max_output_tokens=48, temperature=0)
    assert response.usage.output_tokens_details.reasoning_tokens == 16 + closing_tokens(hybrid_server)


def test_a_bad_budget_is_a_400(deepseek_server: LiveServer):
    response = httpx.post(f"{deepseek_server.base_url}/v1/messages", timeout=60, json={
        "model": deepseek_server.ctx.model_name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": -1}})
    assert response.status_code == 400 and "thinking.budget_tokens" in response.json()["error"]["message"]
