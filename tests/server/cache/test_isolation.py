"""One request never hurts another (issue 22): what a hostile or unlucky request carries is refused at the boundary
or fails that request alone, bounded by the operator's limits, while a bystander's stream carries on."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import httpx
import pytest
from starlette.testclient import TestClient

from engine.sampling_params import StructuredOutputSpec
from server.http.app import create_app
from server.http.limits import RequestLimits
from server.pipeline.recorder import Recorder, RequestRecord
from tests.server.conftest import KEY_A, KEY_B, LiveServer

HI = [{"role": "user", "content": "hi"}]


class Bystander:
    """A streaming chat request running beside the hostile one: its chunks, its worst gap between them, its end."""

    def __init__(self, server: LiveServer, max_tokens: int = 48) -> None:
        self.server, self.max_tokens = server, max_tokens
        self.chunks: list[dict] = []
        self.worst_gap = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with self.server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
                last = time.monotonic()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.monotonic()
                        self.worst_gap, last = max(self.worst_gap, now - last), now
                        self.chunks.append(json.loads(line[6:]))
        except BaseException as exc:  # noqa: BLE001 - reported by `result`
            self.error = exc

    def __enter__(self) -> "Bystander":
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.chunks and self.error is None:  # it runs before the hostile request arrives
            assert time.monotonic() < deadline, "the bystander did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info) -> None:
        self._thread.join(120)

    def result(self) -> str:
        """The finish reason; the stream must have ended whole, with every token."""
        assert self.error is None, self.error
        assert "error" not in self.chunks[-1], self.chunks[-1]
        finishes = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        return next(f for f in finishes if f)


def post(server: LiveServer, path: str, body: dict | None = None, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=120)


def test_a_seed_beyond_64_bits_is_a_400_and_a_bystander_finishes(qwen_server: LiveServer) -> None:
    with Bystander(qwen_server) as bystander:
        response = post(qwen_server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "seed": 2**64})
    assert response.status_code == 400 and response.json()["error"]["param"] == "seed", response.text
    assert bystander.result() == "length"
    assert httpx.get(f"{qwen_server.base_url}/health").json()["status"] == "ok"


SURROGATE = '"x\\ud800"'
SURROGATE_BODIES = {
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}',
    "/v1/completions": '{"prompt": %s, "max_tokens": 2}',
    "/v1/messages": '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}',
    "/v1/messages/count_tokens": '{"messages": [{"role": "user", "content": %s}]}',
    "/v1/responses": '{"input": %s, "max_output_tokens": 2}',
    "/tokenize": '{"prompt": %s}',
    "/v1/caches": '{"name": "c", "messages": [{"role": "user", "content": %s}]}',
}


@pytest.mark.parametrize("path", SURROGATE_BODIES)
def test_a_lone_surrogate_is_a_400(qwen_server: LiveServer, path: str) -> None:
    response = post(qwen_server, path, raw=(SURROGATE_BODIES[path] % SURROGATE).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "surrogate" in error["message"]
    # an escaped surrogate *pair* is one valid character
    assert post(qwen_server, "/tokenize", raw=b'{"prompt": "x\\ud83d\\ude00"}').status_code == 200


def test_deeply_nested_json_and_schemas_are_400s(qwen_server: LiveServer) -> None:
    deep = post(qwen_server, "/v1/chat/completions", raw=b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "limit_exceeded", deep.text
    schema = '{"type": "object", "properties": {"a": ' * 500 + '{"type": "string"}' + "}}" * 500  # too deep to dump
    for tool_choice in ("auto", "required"):
        body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "%s", "tools": '
                '[{"type": "function", "function": {"name": "f", "parameters": %s}}]}' % (tool_choice, schema))
        response = post(qwen_server, "/v1/chat/completions", raw=body.encode())
        assert response.status_code == 400 and "nest" in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_template_kwargs_cannot_replace_the_renderers_arguments(qwen_server: LiveServer, key: str) -> None:
    kwargs = {key: []}
    for path, body in (("/v1/chat/completions", {"messages": HI, "max_tokens": 2}), ("/tokenize", {"messages": HI}),
                       ("/v1/caches", {"name": f"kw-{key}", "messages": HI})):
        response = post(qwen_server, path, {**body, "chat_template_kwargs": kwargs})
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_request_limits_are_400s_naming_the_limit(qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    limits = RequestLimits(body_bytes=256 * 1024, messages=8, schema_bytes=2_000, schema_depth=8, enum_values=50,
                           grammar_bytes=500)
    monkeypatch.setattr(qwen_server.ctx, "settings", replace(qwen_server.ctx.settings, limits=limits))
    cases = {
        "messages": {"messages": HI * 9},
        "response_format.json_schema.schema": {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": {"type": "object", "description": "x" * 3_000}}}},
        "tools[0].function.parameters": {"messages": HI, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "array", "items": [[[[[[[[[{}]]]]]]]]]}}}]},
        None: {"messages": HI, "structured_outputs": {"choice": [f"c{i}" for i in range(51)]}},
        "structured_outputs.grammar": {"messages": HI, "structured_outputs": {"grammar": "root ::= " + "'a' | " * 100
                                                                                        + "'b'"}},
    }
    for param, body in cases.items():
        response = post(qwen_server, "/v1/chat/completions", {**body, "max_tokens": 2})
        assert response.status_code == 400, (param, response.text)
        error = response.json()["error"]
        assert error["code"] == "limit_exceeded" and error["param"] == param, error
    enum = {"type": "string", "enum": [f"v{i}" for i in range(51)]}
    response = post(qwen_server, "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "e", "schema": enum}}})
    assert response.status_code == 400 and "enum" in response.json()["error"]["message"], response.text


@pytest.mark.slow
def test_a_grammar_that_compiles_too_long_is_a_400_while_a_bystander_streams(
    qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enum of 100,000 strings took over 20 minutes (and 5.7 GB) to compile on the shared prepare thread, every
    other request waiting. With the limits raised out of the way, the compile's time limit ends it alone."""
    limits = RequestLimits(body_bytes=4 * 1024 * 1024, enum_values=200_000, schema_bytes=4 * 1024 * 1024,
                           compile_timeout_s=2.0)
    monkeypatch.setattr(qwen_server.ctx, "settings", replace(qwen_server.ctx.settings, limits=limits))
    warm = post(qwen_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": {
        "type": "json_object"}})  # the compile worker is started: its start does not count against the limit
    assert warm.status_code == 200, warm.text
    enum = {"type": "string", "enum": [f"value number {i}" for i in range(100_000)]}
    with Bystander(qwen_server, max_tokens=96) as bystander:
        started = time.monotonic()
        response = post(qwen_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "e", "schema": enum}}})
        took = time.monotonic() - started
        small = post(qwen_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
        assert small.status_code == 200
    assert response.status_code == 400 and "longer than 2 s" in response.json()["error"]["message"], response.text
    assert took < 30, took
    assert bystander.result() == "length" and bystander.worst_gap < 5.0, bystander.worst_gap


def _outside_strings(text: str) -> str:
    """The JSON text with every string literal removed."""
    out, in_string, escaped = [], False, False
    for char in text:
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), in_string and (escaped or char != '"')
        elif char == '"':
            in_string = True
        else:
            out.append(char)
    return "".join(out)


@pytest.mark.slow
def test_constrained_json_is_compact_so_a_model_cannot_spend_its_budget_on_whitespace(qwen_server: LiveServer):
    """Random weights looped on `{\\r\\n\\r\\n"city":"",\\n  \\n"days"\\r\\n ...` until max_tokens."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    for seed in range(6):
        reply = qwen_server.chat(messages=HI, max_tokens=64, temperature=1.0, seed=seed,
                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                 response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        assert json.loads(text).keys() == {"city", "days"}
        layout = _outside_strings(text).replace(", ", ",").replace(": ", ":")  # json.dumps' separators
        assert not any(c.isspace() for c in layout), repr(text)


# ---- tenant scope: nothing stored for one API key is visible to another ----------------------------------------------


def test_a_stored_response_belongs_to_its_tenant(qwen_server: LiveServer) -> None:
    """Key B continued key A's stored response with previous_response_id and got A's history in its prompt."""
    first = post(qwen_server, "/v1/responses", {"input": "my secret is 1234", "max_output_tokens": 2, "store": True})
    assert first.status_code == 200, first.text
    previous = first.json()["id"]
    headers = {"Authorization": f"Bearer {KEY_B}"}
    stolen = httpx.post(f"{qwen_server.base_url}/v1/responses", headers=headers, timeout=120,
                        json={"input": "what was it?", "max_output_tokens": 2, "previous_response_id": previous})
    assert stolen.status_code == 400 and stolen.json()["error"]["param"] == "previous_response_id", stolen.text
    unknown = httpx.post(f"{qwen_server.base_url}/v1/responses", headers=headers, timeout=120,
                         json={"input": "x", "max_output_tokens": 2, "previous_response_id": "resp-nonexistent"})
    assert stolen.json()["error"]["message"].replace(previous, "ID") == \
        unknown.json()["error"]["message"].replace("resp-nonexistent", "ID")  # indistinguishable from no such id
    own = post(qwen_server, "/v1/responses", {"input": "what was it?", "max_output_tokens": 2,
                                              "previous_response_id": previous})
    assert own.status_code == 200, own.text


@pytest.mark.parametrize("mode, without_key, with_key", [("key", 401, 200), ("public", 200, 200), ("off", 404, 404)])
def test_openapi_json_as_the_operator_chooses(qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch, mode: str,
                                              without_key: int, with_key: int) -> None:
    monkeypatch.setattr(qwen_server.ctx, "settings", replace(qwen_server.ctx.settings, openapi=mode))
    client = TestClient(create_app(qwen_server.ctx))  # no lifespan: the served engine is untouched
    assert client.get("/openapi.json").status_code == without_key
    response = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY_B}"})
    assert response.status_code == with_key
    if with_key == 200:
        assert "/v1/chat/completions" in response.json()["paths"]


def test_recordings_per_tenant_are_private(tmp_path) -> None:
    recorder = Recorder(tmp_path / "trace-{salt}.jsonl")
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        recorder.write(RequestRecord("r", "chat", "m", {}, [1], [2], 0, salt, None, "stop", {}, 0.0))
    recorder.close()
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3 and any(f.name == "trace-shared.jsonl" for f in files)
    for f in files:
        salts = {json.loads(line)["cache_salt"] for line in f.read_text().splitlines()}
        assert len(salts) == 1 and (f.stat().st_mode & 0o777) == 0o600, (f, salts)


@pytest.mark.slow
def test_a_compiled_grammar_is_a_hit_only_for_the_tenant_that_compiled_it(qwen_server: LiveServer) -> None:
    """Else a tenant could tell from a compile's speed that another tenant used the same schema."""
    grammars = qwen_server.ctx.grammars
    spec = StructuredOutputSpec("regex", "tenant-scope-[0-9]{3}")
    compiled = grammars.compile(spec)  # compiled in-process (the engine's path): no tenant has compiled it
    assert grammars._cached(spec, "tenant-a") is None
    grammars._remember(spec, compiled, "tenant-a")
    assert grammars._cached(spec, "tenant-a") is compiled and grammars._cached(spec, "tenant-b") is None
