"""The field audit (server/api/request_fields.py): every field the official SDKs can send is classified, SERVER.md's
tables are the registry's, and every refused field gets its 400 in its API's error shape."""
from __future__ import annotations

from pathlib import Path

import pytest
from anthropic.types import message_create_params
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from server.api.anthropic_protocol import MessagesRequest
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.request_fields import FIELDS, markdown_table
from server.api.responses_protocol import ResponsesRequest
from tests.server.conftest import LiveServer

SDK_PARAMS = {
    "chat": chat_create_params.CompletionCreateParamsStreaming,
    "completions": completion_create_params.CompletionCreateParamsStreaming,
    "responses": response_create_params.ResponseCreateParamsStreaming,
    "messages": message_create_params.MessageCreateParamsStreaming,
}
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest,
          "messages": MessagesRequest}
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
          "messages": "/v1/messages"}
MINIMAL = {
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "completions": {"prompt": "hi", "max_tokens": 1},
    "responses": {"input": "hi", "max_output_tokens": 1},
    "messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}
REFUSED = [(api, name, field.example) for api, fields in FIELDS.items() for name, field in fields.items()
           if field.status == "refused"]


@pytest.mark.parametrize("api", sorted(FIELDS))
def test_every_sdk_field_is_classified_and_every_honoured_field_is_read(api: str) -> None:
    params = SDK_PARAMS[api]
    assert set(params.__required_keys__ | params.__optional_keys__) - set(FIELDS[api]) == set()
    honoured = {name for name, field in FIELDS[api].items() if field.status == "honoured"}
    assert honoured - set(MODELS[api].model_fields) == set()


@pytest.mark.parametrize("api", sorted(FIELDS))
def test_server_md_tables_are_the_registry(api: str) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "SERVER.md").read_text()
    assert markdown_table(api) in doc


@pytest.mark.parametrize("api, name, example", REFUSED, ids=[f"{a}-{n}" for a, n, _ in REFUSED])
def test_a_refused_field_is_a_400_in_the_apis_shape(qwen_server: LiveServer, api: str, name: str, example) -> None:
    response = qwen_server.http().post(ROUTES[api], json={"model": "qwen3-tiny", **MINIMAL[api], name: example})
    assert response.status_code == 400, response.text
    body = response.json()
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert f"'{name}' is not supported" in body["error"]["message"]
    else:
        assert body["error"]["param"] == name and body["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("api, extra", [
    ("chat", {"logit_bias": {}, "modalities": ["text"], "functions": None, "store": True, "verbosity": "low"}),
    ("completions", {"best_of": 1, "suffix": "", "user": "u"}),
    ("responses", {"truncation": "disabled", "top_logprobs": 0, "background": False, "service_tier": "auto"}),
    ("messages", {"container": None, "cache_control": {"type": "ephemeral"}, "service_tier": "auto"}),
])
def test_neutral_values_and_ignored_fields_pass(qwen_server: LiveServer, api: str, extra: dict) -> None:
    response = qwen_server.http().post(ROUTES[api], json={"model": "qwen3-tiny", **MINIMAL[api], **extra})
    assert response.status_code == 200, response.text


def test_stop_token_ids_end_the_output(qwen_server: LiveServer) -> None:
    """An honoured vLLM field that was ignored before: the first generated token, named as a stop token, ends it."""
    http = qwen_server.http()
    body = {"model": "qwen3-tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    free = http.post("/v1/completions", json=body).json()["choices"][0]
    first = qwen_server.ctx.encode(free["text"])[0]
    stopped = http.post("/v1/completions", json={**body, "stop_token_ids": [first]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(qwen_server.ctx.encode(stopped["text"])) <= 1
