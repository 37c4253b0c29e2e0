"""The hostile inputs of issue 41 ("one request never hurts another, round 2"), for `kvserve bench hostile`: each is
sent by the hostile tenant while the bystander tenant's streams run. Each returns the HTTP status the server gave
(a 4xx, or a 200 that stayed bounded), or a string naming what went wrong (a leak across tenants, a refused
connection). Two cases of the issue are not HTTP inputs and are tested without a server: the KV-events replay bind
(tests/server/pipeline/test_hostile_round2.py, `--kv-events-replay-endpoint tcp://0.0.0.0:`) and an oversized disk-tier block
file (same file); `--record 'trace-{salt}.jsonl'`'s descriptors are tested there too.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

# The server flags these inputs assume (added to the bench server's command line): the inspector on, with an
# operator key, and small per-tenant stores so that their bounds are reached within a round.
SERVER_ARGS = ["--ui", "--operator-key", "sk-operator", "--max-stored-responses-per-tenant", "16",
               "--max-named-caches-per-tenant", "2", "--header-timeout", "5"]
HI = [{"role": "user", "content": "hi"}]
BILLING = "x-anthropic-billing-header:"

KEY_HOSTILE, KEY_BYSTANDER = "sk-hostile", "sk-bystander"  # the two tenants of every hostile run


def _post(url: str, headers: dict, path: str, body: Any = None, raw: bytes | None = None,
          timeout: float = 600.0) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=timeout,
                      headers={**headers, "Content-Type": "application/json"})


def _status(path: str, body: Any = None, raw: bytes | None = None) -> Callable[[str, dict], int]:
    return lambda url, headers: _post(url, headers, path, body, raw).status_code


def _chat(**fields: Any) -> Callable[[str, dict], int]:
    return _status("/v1/chat/completions", {"messages": HI, "max_tokens": 2, **fields})


def _messages(**fields: Any) -> Callable[[str, dict], int]:
    """An Anthropic Messages request (its `model` is required: the served one)."""
    def send(url: str, headers: dict) -> int:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
        return _post(url, headers, "/v1/messages", {"model": model, "max_tokens": 1, "messages": HI, **fields}
                     ).status_code
    return send


def _huge_header(url: str, headers: dict, size: int = 64 * 1024 * 1024) -> int | str:
    """A 64 MB header, before authentication: answered 431 after the limit, not buffered whole."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        chunk = b"a" * 65536
        try:
            for _ in range(size // len(chunk)):
                conn.sendall(chunk)
        except OSError:
            pass
        try:
            reply = conn.recv(65536)
        except OSError:
            return "connection cut without a reply"
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else "no HTTP reply"


def _idle_connections(url: str, headers: dict, count: int = 300) -> int | str:
    """Hundreds of idle connections that never send a byte: a new client is still served, and they are closed after
    the head timeout."""
    host, port = url.removeprefix("http://").split(":")
    idle = []
    try:
        for _ in range(count):
            idle.append(socket.create_connection((host, int(port)), timeout=30))
        status = httpx.get(url + "/health", timeout=30).status_code
        idle[0].settimeout(30)
        try:
            closed = idle[0].recv(1) == b""
        except ConnectionResetError:
            closed = True
        except OSError:
            closed = False
        return status if closed else "idle connections were not closed"
    finally:
        for conn in idle:
            conn.close()


def _prefix_probe_through_the_inspector(url: str, headers: dict) -> int | str:
    """The bystander tenant sends a secret system prompt; the hostile one sends the same prompt and reads its own
    request in the inspector: nothing there may depend on the bystander's blocks (different_salt was 336)."""
    secret = [{"role": "system", "content": "the launch code is " + "7" * 400}, *HI]
    _post(url, {"Authorization": f"Bearer {KEY_BYSTANDER}"}, "/v1/chat/completions",
          {"messages": secret, "max_tokens": 1}).raise_for_status()
    mine = _post(url, headers, "/v1/chat/completions", {"messages": secret, "max_tokens": 1})
    mine.raise_for_status()
    view = httpx.get(f"{url}/ui/api/requests/{mine.json()['id']}", headers=headers, timeout=60)
    if view.status_code != 200:
        return view.status_code
    misses = view.json()["request"]["misses"]
    return 200 if "different_salt" not in misses else f"leak: misses {misses}"


def _stored_responses_of_another_tenant_kept(url: str, headers: dict) -> int | str:
    """The bystander stores a response; the hostile tenant stores more than its own share: the bystander's
    previous_response_id still works."""
    bystander = {"Authorization": f"Bearer {KEY_BYSTANDER}"}
    kept = _post(url, bystander, "/v1/responses", {"input": "remember 1234", "max_output_tokens": 1, "store": True})
    kept.raise_for_status()
    for _ in range(20):
        _post(url, headers, "/v1/responses", {"input": "x", "max_output_tokens": 1, "store": True})
    follow = _post(url, bystander, "/v1/responses", {"input": "and?", "max_output_tokens": 1,
                                                     "previous_response_id": kept.json()["id"]})
    return follow.status_code if follow.status_code == 200 else f"bystander's response evicted: {follow.status_code}"


def _named_caches_beyond_the_share(url: str, headers: dict) -> int:
    """Three 24 h named caches of one tenant: the third is refused (429); the caches are deleted again."""
    status = 0
    for i in range(3):
        status = _post(url, headers, "/v1/caches", {"name": f"hostile-{i}", "ttl": 86400, "messages": [
            {"role": "system", "content": f"cache {i} " * 50}]}).status_code
    for i in range(3):
        httpx.delete(f"{url}/v1/caches/hostile-{i}", headers=headers, timeout=60)
    return status


def _concurrent_too_long_prompts(url: str, headers: dict, count: int = 20) -> int | str:
    """Twenty concurrent 250 KB prompts, each too long for the context (Qwen's tokenizer splits digits: 250,000
    tokens): all refused; the newcomer's preparation takes its turn between theirs."""
    body = {"messages": [{"role": "user", "content": "0123456789" * 25_000}], "max_tokens": 2}
    with ThreadPoolExecutor(count) as pool:
        statuses = list(pool.map(lambda _: _post(url, headers, "/v1/chat/completions", body).status_code,
                                 range(count)))
    return statuses[0] if len(set(statuses)) == 1 else f"statuses {sorted(set(statuses))}"


def _deep_json_string(depth: int) -> str:
    return "[" * depth + "]" * depth


def round2_inputs(Hostile: type) -> list:
    """The inputs of issue 41, as ``Hostile(name, send)`` (benchmarks/hostile.py's type)."""
    slow = {"type": "object", "properties": {"q": {"type": "string", "minLength": 143}}, "required": ["q"]}
    tool_call = [*HI, {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": '{"a": ' + _deep_json_string(2000) + "}"}}]}, {"role": "tool", "tool_call_id": "c",
                                                                           "content": "ok"}]
    return [
        Hostile("billing header + 20,000 blanks (ReDoS)", _chat(messages=[
            {"role": "system", "content": BILLING + " " * 20_000}, *HI])),
        Hostile("64 MB header", _huge_header),
        Hostile("another tenant's prompt probed through the inspector", _prefix_probe_through_the_inspector),
        Hostile("2,000 token-id prompts", _status("/v1/completions", {"prompt": [[1, 2, 3]] * 2000,
                                                                      "max_tokens": 1})),
        Hostile("300 idle connections", _idle_connections),
        Hostile("echo + logprobs 20 + n 16 on 4,000 tokens", _status("/v1/completions", {
            "prompt": [(7 * i) % 5000 + 10 for i in range(4000)], "echo": True, "logprobs": 20, "n": 16,
            "max_tokens": 1})),
        Hostile("prompt_logprobs 20 on 2,300 tokens", _status("/v1/completions", {
            "prompt": [(7 * i) % 5000 + 10 for i in range(2300)], "prompt_logprobs": 20, "max_tokens": 1})),
        Hostile("500,000 stop strings", _chat(stop=["s"] * 500_000)),
        Hostile("20,000 parts with cache_control", _chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 20_000}])),
        Hostile("NaN in Responses metadata", _status("/v1/responses", raw=b'{"input": "hi", "max_output_tokens": 1, '
                                                                          b'"metadata": {"a": NaN}}')),
        Hostile("a 5,000-digit integer", _status("/v1/chat/completions", raw=b'{"messages": [{"role": "user", '
                                                 b'"content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}")),
        Hostile("metadata.user_id nested 50,000 deep", _messages(metadata={"user_id": _deep_json_string(50_000)})),
        Hostile("tool-call arguments nested 2,000 deep", _chat(messages=tool_call)),
        Hostile("another tenant's stored responses past its share", _stored_responses_of_another_tenant_kept),
        Hostile("100,000 stop_token_ids", _chat(stop_token_ids=list(range(100_000)))),
        Hostile("named caches past the tenant's share", _named_caches_beyond_the_share),
        Hostile("20 concurrent 250 KB too-long prompts", _concurrent_too_long_prompts),
        Hostile("a too-long prompt with a slow grammar", _chat(
            messages=[{"role": "user", "content": "word " * 150_000}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": slow}})),
    ]
