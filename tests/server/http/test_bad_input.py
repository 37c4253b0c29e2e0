"""Every kind of bad input gets its status and the OpenAI error shape, never a 500, and the server keeps serving."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import KEY_A, LiveServer

OK_MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@dataclass
class Case:
    id: str
    status: int
    body: Any = None  # JSON-encoded unless `raw` is given
    raw: bytes | None = None
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {KEY_A}"})
    param: str | None = None
    code: str | None = None
    message_has: str = ""


def chat(**fields: Any) -> dict:
    return {"messages": OK_MESSAGES, "max_tokens": 2, **fields}


CASES = [
    Case("malformed json", 400, raw=b'{"messages": [', code="invalid_json"),
    Case("json not an object", 400, body=[1, 2], code="invalid_json"),
    Case("non-utf8 body", 400, raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
         code="invalid_encoding"),
    Case("oversized body", 413, body=chat(messages=[{"role": "user", "content": "x" * 300_000}]),
         code="request_too_large"),
    Case("messages of the wrong type", 400, body={"messages": "hello"}, param="messages"),
    Case("temperature of the wrong type", 400, body=chat(temperature="hot"), param="temperature"),
    Case("n of the wrong type", 400, body=chat(n="two"), param="n"),
    Case("stream_options of the wrong type", 400, body=chat(stream_options=[1]), param="stream_options"),
    Case("missing messages", 400, body={"max_tokens": 2}, param="messages"),
    Case("empty messages", 400, body=chat(messages=[]), param="messages"),
    Case("message with a bad role", 400, body=chat(messages=[{"role": "wizard", "content": "x"}]),
         message_has="role"),
    Case("unknown model", 404, body=chat(model="gpt-17"), param="model", code="model_not_found"),
    Case("prompt longer than the context", 400,
         body=chat(messages=[{"role": "user", "content": " a" * 600}]),
         code="context_length_exceeded", message_has="too long"),
    Case("n too large", 400, body=chat(n=5), param="n"),
    Case("n zero", 400, body=chat(n=0), param="n"),
    Case("temperature above 2", 400, body=chat(temperature=2.5), param="temperature"),
    Case("negative temperature", 400, body=chat(temperature=-0.1), param="temperature"),
    Case("top_p zero", 400, body=chat(top_p=0), param="top_p"),
    Case("top_p above 1", 400, body=chat(top_p=1.5), param="top_p"),
    Case("max_tokens zero", 400, body=chat(max_tokens=0), param="max_tokens"),
    Case("top_logprobs without logprobs", 400, body=chat(top_logprobs=2), param="top_logprobs"),
    Case("tool without a name", 400, body=chat(tools=[{"type": "function", "function": {"name": ""}}]),
         message_has="tools[0]"),
    Case("tool parameters not a schema object", 400,
         body=chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "string"}}]),
         message_has="parameters"),
    Case("tools not a list", 400, body=chat(tools={"name": "f"}), param="tools"),
    Case("tool_choice naming a missing function", 400,
         body=chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "send_mail"}}),
         param="tool_choice", message_has="send_mail"),
    Case("tool_choice unknown mode", 400, body=chat(tools=[WEATHER], tool_choice="sometimes"), param="tool_choice"),
    Case("cache_salt not allowed", 400, body=chat(cache_salt="mine"), code="cache_salt_not_allowed"),
    Case("no api key", 401, body=chat(), headers={}, code="invalid_api_key"),
    Case("wrong api key", 401, body=chat(), headers={"Authorization": "Bearer sk-nope"}, code="invalid_api_key"),
    Case("unknown route", 404, body={}, path="/v1/embeddings"),
    Case("wrong method", 405, method="GET"),
    Case("completion with an empty prompt", 400, body={"prompt": ""}, path="/v1/completions"),
    Case("completion with a token outside the vocabulary", 400, body={"prompt": [1, 10**9]},
         path="/v1/completions", message_has="vocabulary"),
    Case("completion prompt of the wrong type", 400, body={"prompt": {"text": "x"}}, path="/v1/completions",
         param="prompt"),
    Case("detokenize outside the vocabulary", 400, body={"tokens": [-1]}, path="/detokenize", param="tokens"),
    Case("tokenize with neither prompt nor messages", 400, body={}, path="/tokenize"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow_cases("malformed json", "json not an object", "non-utf8 body")
def test_bad_input_gets_its_status_and_the_openai_error_shape(qwen_server: LiveServer, case: Case) -> None:
    content = case.raw if case.raw is not None else (json.dumps(case.body).encode() if case.body is not None else None)
    headers = {"Content-Type": "application/json", **case.headers}
    response = httpx.request(case.method, qwen_server.base_url + case.path, content=content, headers=headers,
                             timeout=60)
    assert response.status_code == case.status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if case.param is not None:
        assert error["param"] == case.param or error["param"].startswith(case.param + "."), error
    if case.code is not None:
        assert error["code"] == case.code, error
    assert case.message_has in error["message"]


def test_prompt_too_long_says_by_how_much(qwen_server: LiveServer) -> None:
    messages = [{"role": "user", "content": " a" * 600}]
    with qwen_server.http() as http:
        count = http.post("/tokenize", json={"messages": messages}).json()["count"]
        error = http.post("/v1/chat/completions", json=chat(messages=messages)).json()["error"]
    over = count - qwen_server.ctx.max_model_len + 1
    assert f"{over} token(s) too long" in error["message"]


def test_the_openai_client_raises_its_typed_errors(qwen_server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError):
        qwen_server.client().chat.completions.create(model="gpt-17", messages=OK_MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        qwen_server.chat(api_key="sk-nope", messages=OK_MESSAGES)
    with pytest.raises(openai.BadRequestError):
        qwen_server.chat(messages=OK_MESSAGES, temperature=3)


@pytest.mark.slow
def test_the_server_keeps_serving_after_bad_input(qwen_server: LiveServer) -> None:
    for case in CASES:
        content = case.raw if case.raw is not None else json.dumps(case.body).encode()
        httpx.post(qwen_server.base_url + "/v1/chat/completions", content=content, headers=case.headers, timeout=60)
    assert httpx.get(qwen_server.base_url + "/health", timeout=10).json()["status"] == "ok"
    assert qwen_server.chat(messages=OK_MESSAGES, max_tokens=2).usage.completion_tokens == 2
    qwen_server.wait_until_idle()


def test_a_stream_echoing_an_integer_beyond_64_bits_ends_well_formed(qwen_server: LiveServer) -> None:
    """Found by the 5,000-case schemathesis run: Responses' `response.created` echoes the request, and orjson refuses
    integers beyond 64 bits, so the stream broke off mid-body (a truncated chunked response)."""
    body = {"input": "hi", "stream": True, "max_output_tokens": 2, "model": "qwen3-tiny",
            "metadata": None, "tool_choice": {"": -9223372036854775809}}
    with qwen_server.http() as http:
        response = http.post("/v1/responses", json=body)  # reads the whole body: a broken stream raises here
    assert response.status_code < 500
    if response.status_code == 200:
        events = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: ")]
        assert events[-1]["type"] in {"response.completed", "response.incomplete", "error"}, events[-1]
