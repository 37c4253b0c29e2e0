"""Chat completions through the real `openai` client: streaming vs not, SSE order, stops, max_tokens, n, logprobs."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import openai
import pytest

from tests.server.conftest import LiveServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.fast_cases("qwen")
def test_streamed_text_equals_non_streamed_text_for_the_same_seed(any_server: LiveServer) -> None:
    name = any_server.ctx.model_name
    kwargs = dict(messages=QUESTION, max_tokens=6, temperature=0.8, seed=11)
    full = any_server.chat(**kwargs)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == name
    assert abs(full.created - time.time()) < 600
    assert isinstance(full.usage.prompt_tokens_details.cached_tokens, int)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 6

    chunks = list(any_server.chat(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-") and chunks[0].id != full.id
    assert all(c.model == name and c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    # The same prompt again: its full blocks (all but the last token, block-aligned) come from the cache.
    bs = any_server.ctx.engine.facts.block_size
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // bs * bs


def test_sse_frames_role_content_finish_usage_then_done(qwen_server: LiveServer) -> None:
    body = {"messages": QUESTION, "max_tokens": 4, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    with qwen_server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in frames)
    assert frames[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in frames[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish_at = [i for i, e in enumerate(events) if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish_at == [len(events) - 2], "one finish chunk, right before the usage chunk"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in events[-1]["usage"]["prompt_tokens_details"]
    assert all(e["usage"] is None for e in events[:-1]), "include_usage: every other chunk carries usage null"


def test_usage_always_reports_cached_tokens_even_zero(qwen_server: LiveServer) -> None:
    with qwen_server.http() as http:
        body = {"messages": [{"role": "user", "content": f"unique {time.time_ns()}"}], "max_tokens": 1}
        usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_stop_string_ends_the_text_and_never_leaks(qwen_server: LiveServer) -> None:
    kwargs = dict(messages=QUESTION, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = qwen_server.chat(**kwargs).choices[0].message.content
    assert len(text) >= 8, "the test needs some text to cut"
    stop = text[4:7]
    expected = text[: text.index(stop)]

    cut = qwen_server.chat(**kwargs, stop=[stop])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in qwen_server.chat(**kwargs, stop=stop,
                                                                                          stream=True)]
    assert "".join(pieces) == expected


def test_max_tokens_beyond_the_context_is_clamped_or_refused_when_strict(
    qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = qwen_server.ctx
    with qwen_server.http() as http:
        base = http.post("/tokenize", json={"messages": [{"role": "user", "content": ""}]}).json()["count"]
        # One " a" is one token: fill the context up to 5 tokens of room.
        filler = " a" * (ctx.max_model_len - 5 - base)
        messages = [{"role": "user", "content": filler}]
        assert http.post("/tokenize", json={"messages": messages}).json()["count"] == ctx.max_model_len - 5
    response = qwen_server.chat(messages=messages, max_tokens=32000, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 5

    monkeypatch.setattr(ctx, "settings", replace(ctx.settings, strict_max_tokens=True))
    with pytest.raises(openai.BadRequestError) as err:
        qwen_server.chat(messages=messages, max_tokens=32000)
    assert err.value.body["code"] == "context_length_exceeded" and "at most 5" in err.value.body["message"]
    assert qwen_server.chat(messages=messages, max_tokens=5).usage.completion_tokens <= 5


def test_n_choices_with_logprobs(qwen_server: LiveServer) -> None:
    response = qwen_server.chat(
        messages=QUESTION, max_tokens=4, n=2, seed=5, temperature=1.0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 8
    for choice in response.choices:
        entries = choice.logprobs.content
        assert len(entries) == 4
        for entry in entries:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
            assert entry.top_logprobs[0].logprob >= entry.logprob
            assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_streamed_logprobs_cover_every_token(qwen_server: LiveServer) -> None:
    chunks = list(qwen_server.chat(
        messages=QUESTION, max_tokens=5, seed=3, logprobs=True, top_logprobs=1, stream=True,
        extra_body={"ignore_eos": True},
    ))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5
