"""Speculative decoding through the server: the per-request `speculative` field, the session's suffix tree, the
counters in /metrics and --record, and a clear 400 for a bad value."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from engine.config import EngineConfig
from tests.server.conftest import LiveServer, _live_server

MESSAGES = [{"role": "user", "content": "Write the list of the first primes, then say it again."}]


def test_a_session_drafts_from_its_earlier_reply_and_the_tokens_do_not_change(qwen_server: LiveServer) -> None:
    client = qwen_server.client()
    plain = client.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    accepted = qwen_server.metric("kvserve_spec_accepted_tokens_total")
    headers = {"X-Session-Id": "spec-session-1"}
    replies = [
        client.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                       extra_body={"speculative": "suffix"}, extra_headers=headers)
        for _ in range(2)
    ]
    assert [r.choices[0].message.content for r in replies] == [plain.choices[0].message.content] * 2
    # the second request drafted the first one's reply from the session's suffix tree
    assert qwen_server.metric("kvserve_spec_accepted_tokens_total") - accepted >= 10
    record = qwen_server.last_record()
    assert record["session"] == "spec-session-1"
    assert record["speculation"]["accepted_tokens"] >= 10 and record["speculation"]["acceptance_rate"] > 0.5
    assert qwen_server.metric("kvserve_decode_steps_total") > 0


FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": FORECAST}}]


@pytest.mark.slow
def test_required_tool_calls_speculate_under_their_grammar(qwen_server: LiveServer) -> None:
    """tool_choice required: the session's second request drafts the first one's call, each draft verified under
    the call grammar; the calls are identical to no speculation and valid."""
    client = qwen_server.client()
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # a random model never stops thinking
    kwargs = dict(model="qwen3-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=128,
                  temperature=0)
    plain = client.chat.completions.create(**kwargs, extra_body=no_thinking)
    accepted = qwen_server.metric("kvserve_spec_accepted_tokens_total")
    headers = {"X-Session-Id": "spec-session-tools"}
    replies = [client.chat.completions.create(**kwargs, extra_body={"speculative": "suffix", **no_thinking},
                                              extra_headers=headers) for _ in range(2)]
    calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] for r in replies]
    assert calls == [[(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]] * 2
    for name, arguments in calls[0]:
        assert name == "forecast"
        jsonschema.validate(json.loads(arguments), FORECAST)
    assert qwen_server.metric("kvserve_spec_accepted_tokens_total") - accepted >= 5


def test_a_bad_speculative_value_is_a_400(qwen_server: LiveServer) -> None:
    response = qwen_server.http().post("/v1/chat/completions", json={
        "model": "qwen3-tiny", "messages": MESSAGES, "max_tokens": 1, "speculative": "eagle"})
    assert response.status_code == 400, response.text
    assert "speculative" in response.text


@pytest.fixture(scope="module")
def mtp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """deepseek-v3-tiny started with --speculative mtp: its random MTP layer (model.layers.3.*) drafts."""
    yield from _live_server(tmp_path_factory, "deepseek-v3-tiny",
                            EngineConfig(block_size=4, num_kv_blocks=1024, max_model_len=512, speculative="mtp"))


@pytest.mark.slow
@pytest.mark.slow
def test_mtp_drafts_through_the_server_and_the_tokens_do_not_change(mtp_server: LiveServer) -> None:
    """The server's default proposer is the model's MTP layer: the reply equals one with ``"speculative": "off"``,
    and the drafts and their acceptance are counted in /metrics and in the request's --record row."""
    client = mtp_server.client()
    kwargs = dict(model="deepseek-v3-tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**kwargs, extra_body={"speculative": "off"})
    drafted = mtp_server.metric("kvserve_spec_draft_tokens_total")
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.usage.completion_tokens == plain.usage.completion_tokens == 16
    assert mtp_server.metric("kvserve_spec_draft_tokens_total") - drafted > 16  # several drafts a step
    speculation = mtp_server.last_record()["speculation"]
    assert speculation["draft_tokens"] > 16 and 0 <= speculation["acceptance_rate"] <= 1
