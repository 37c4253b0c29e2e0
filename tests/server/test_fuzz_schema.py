"""Property-based fuzzing of the generation routes from the app's own OpenAPI schema (schemathesis + hypothesis):
bodies that fit the schema and bodies that break it. No answer is a 5xx, every error is in its API's shape, and the
server keeps serving. Bounded: a few hundred cases, each generating at most two tokens."""
from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.server.conftest import KEY_A, LiveServer

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]


def _check_error_shape(path: str, error: dict) -> None:
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and isinstance(error["error"]["message"], str), error
        assert error["error"]["type"].endswith("_error"), error
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"}, error


def _check_sse(path: str, text: str) -> None:
    """An error after the 200 is an event in the API's shape (Responses: its own `error` event)."""
    for frame in text.split("\n\n"):
        data = next((line[6:] for line in frame.splitlines() if line.startswith("data: ")), None)
        if data is None or data == "[DONE]":
            continue
        event = json.loads(data)
        if path == "/v1/responses":
            assert event["type"] != "error" or isinstance(event["message"], str), event
        elif event.get("type") == "error" or "error" in event:
            _check_error_shape(path, event)


def test_no_5xx_and_errors_in_each_apis_shape(qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qwen_server.ctx, "settings", replace(qwen_server.ctx.settings, max_output_tokens=2))
    schema = schemathesis.openapi.from_url(f"{qwen_server.base_url}/openapi.json",
                                           headers={"Authorization": f"Bearer {KEY_A}"})
    cases = st.one_of([
        schema[path]["POST"].as_strategy(generation_mode=mode).map(lambda case, path=path: (path, case))
        for path in ROUTES for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ])
    seen: dict[tuple[str, int], int] = {}

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def run(path_and_case) -> None:
        path, case = path_and_case
        response = case.call(base_url=qwen_server.base_url, headers={"Authorization": f"Bearer {KEY_A}"},
                             timeout=60)
        seen[path, response.status_code] = seen.get((path, response.status_code), 0) + 1
        assert response.status_code < 500, (path, response.text[:500])
        if "text/event-stream" in str(response.headers.get("content-type")):
            _check_sse(path, response.text)
        elif response.status_code >= 400:
            _check_error_shape(path, response.json())

    run()
    assert all(any(p == path for p, _ in seen) for path in ROUTES), seen
    # The server still serves every route.
    hello = [{"role": "user", "content": "hi"}]
    bodies = {"/v1/chat/completions": {"messages": hello}, "/v1/completions": {"prompt": "hi"},
              "/v1/messages": {"messages": hello, "max_tokens": 2}, "/v1/responses": {"input": "hi"}}
    with qwen_server.http() as http:
        for path, body in bodies.items():
            assert http.post(path, json={"model": "qwen3-tiny", **body}).status_code == 200, path
    assert httpx.get(f"{qwen_server.base_url}/health", timeout=30).json()["status"] == "ok"
    missing = httpx.get(f"{qwen_server.base_url}/v1/nowhere", headers={"Authorization": f"Bearer {KEY_A}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
