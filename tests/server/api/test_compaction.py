"""Remote compaction (server/api/compaction.py) through the official `openai` client and raw SSE: the SDK's
`responses.compact`, Codex's `compaction_trigger`, the sealed item's round trip into a later request (its summary in
the prompt, the head read from the cache), and the 400s for a tampered or another tenant's item."""
from __future__ import annotations

import base64
import json

import httpx
import pytest

from server.api.compaction import SUMMARY_PREFIX, CompactionSealer, Summary
from tests.server.conftest import KEY_B, LiveServer

INSTRUCTIONS = "You are a coding agent. Work in the repository and use the tools. " * 4
SHELL = {"type": "function", "name": "shell", "description": "Run a shell command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
HISTORY = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsetup.py\nsrc"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Three entries."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now read the README."}]},
]
NEXT = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Carry on."}]}


def _request(server: LiveServer, **kwargs) -> dict:
    # tool_choice none: no tool-call grammar to compile (the prompt renders the tools all the same)
    return dict(model=server.ctx.model_name, instructions=INSTRUCTIONS, tools=[SHELL], tool_choice="none",
                max_output_tokens=8, temperature=0, reasoning={"effort": "none"}, **kwargs)


def _decoded_prompt(server: LiveServer) -> str:
    return server.ctx.tokenizer.decode(server.last_record()["prompt_token_ids"])


def _sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def _compact(server: LiveServer, api_key: str | None = None, **kwargs) -> tuple[object, list[dict]]:
    """`responses.compact` through the SDK: (the parsed response, its output items as sent)."""
    raw = server.client(api_key).responses.with_raw_response.compact(
        model=server.ctx.model_name, input=HISTORY, instructions=INSTRUCTIONS,
        extra_body={"tools": [SHELL], "max_output_tokens": 8}, **kwargs)
    return raw.parse(), json.loads(raw.text)["output"]


def test_compact_round_trips_and_reads_the_head_from_the_cache(qwen_server: LiveServer) -> None:
    compacted, output = _compact(qwen_server)
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    *kept, item = output
    assert item["type"] == "compaction" and item["id"].startswith("cmp_") and compacted.output[-1].encrypted_content
    assert [m["content"][0]["text"] for m in kept] == ["List the files.", "Now read the README."]
    summary = qwen_server.ctx.tokenizer.decode(qwen_server.last_record()["output_token_ids"],
                                               skip_special_tokens=True)

    later = qwen_server.client().responses.create(**_request(qwen_server, input=[*kept, item, NEXT]))
    assert later.status in ("completed", "incomplete")
    prompt = _decoded_prompt(qwen_server)
    assert SUMMARY_PREFIX.strip() in prompt and summary.strip()[:20] in prompt
    block = qwen_server.ctx.engine.facts.block_size
    head = len(qwen_server.ctx.encode(INSTRUCTIONS)) // block * block
    assert later.usage.input_tokens_details.cached_tokens >= head  # instructions and tools: read from the cache


def test_compaction_trigger_streams_exactly_one_compaction_item(qwen_server: LiveServer) -> None:
    body = _request(qwen_server, input=[*HISTORY, {"type": "compaction_trigger"}], stream=True, store=False)
    with qwen_server.http().stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = _sse_events(response)
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.output_item.done", "response.completed"]
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "compaction" and item == events[3]["item"]
    assert events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the history was cached

    # Codex sends it back after the user messages it kept; the next request carries it verbatim
    kept = [m for m in HISTORY if m.get("role") == "user"]
    later = qwen_server.client().responses.create(**_request(qwen_server, input=[*kept, item, NEXT]))
    assert later.status in ("completed", "incomplete") and SUMMARY_PREFIX.strip() in _decoded_prompt(qwen_server)


def test_a_tampered_or_foreign_compaction_item_is_a_400(qwen_server: LiveServer) -> None:
    item = _compact(qwen_server)[1][-1]
    raw = bytearray(base64.urlsafe_b64decode(item["encrypted_content"][5:] + "=="))
    raw[-1] ^= 1
    tampered = {**item, "encrypted_content": "kvc1." + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")}
    for api_key, sent in ((None, tampered), (KEY_B, item), (None, {**item, "encrypted_content": "forged"})):
        with pytest.raises(Exception) as failure:
            qwen_server.client(api_key).responses.create(**_request(qwen_server, input=[sent, NEXT]))
        assert getattr(failure.value, "status_code", None) == 400, failure.value
        assert failure.value.body["param"] == "input.0.encrypted_content"
        assert failure.value.body["code"] == "invalid_compaction_item"


def test_the_sealed_item_reveals_nothing_and_survives_a_restart_with_its_key() -> None:
    summary = Summary("the secret plan: rewrite parser.py with a state machine", 3)
    sealed = CompactionSealer("operator-secret").seal("tenant-a", summary)
    raw = base64.urlsafe_b64decode(sealed[5:] + "==")
    assert b"secret" not in raw and b"parser" not in raw and "secret" not in sealed
    assert CompactionSealer("operator-secret").open("tenant-a", sealed, "x") == summary  # a restart, the same key
    for sealer, tenant in ((CompactionSealer("operator-secret"), "tenant-b"), (CompactionSealer("other"), "tenant-a"),
                           (CompactionSealer(), "tenant-a")):
        with pytest.raises(Exception, match="not made by this server for this API key"):
            sealer.open(tenant, sealed, "x")
    assert sealed != CompactionSealer("operator-secret").seal("tenant-a", summary)  # a fresh nonce each time


def _auto(threshold: int) -> list[dict]:
    return [{"type": "compaction", "compact_threshold": threshold}]


@pytest.mark.slow  # four requests, one of two generations
def test_automatic_compaction_past_the_threshold_then_replies_in_the_same_response(qwen_server: LiveServer) -> None:
    """`context_management` `compact_threshold`: under it nothing changes; past it the summary turn runs first and
    the reply follows over the compacted input (the user messages and the item), its head read from the cache."""
    client = qwen_server.client()
    plain = client.responses.create(**_request(qwen_server, input=HISTORY, store=False))
    tokens = plain.usage.input_tokens
    kept = client.responses.create(**_request(qwen_server, input=HISTORY, store=False,
                                              context_management=_auto(tokens)))
    assert [item.type for item in kept.output] == [item.type for item in plain.output] != []

    compacted = client.responses.create(**_request(qwen_server, input=HISTORY, context_management=_auto(tokens - 1)))
    item, *reply = compacted.output
    assert item.type == "compaction" and item.encrypted_content and reply and reply[0].type != "compaction"
    summary_record, reply_record = [json.loads(line) for line in
                                    qwen_server.record_path.read_text().splitlines()[-2:]]
    assert compacted.id == summary_record["request_id"]
    prompt = qwen_server.ctx.tokenizer.decode(reply_record["prompt_token_ids"])
    assert "README.md\nsetup.py" not in prompt and "Now read the README." in prompt and SUMMARY_PREFIX.strip() in prompt
    block = qwen_server.ctx.engine.facts.block_size
    head = len(qwen_server.ctx.encode(INSTRUCTIONS)) // block * block
    assert reply_record["cached_tokens"] >= head and summary_record["cached_tokens"] >= tokens - 12 - block
    usage = compacted.usage  # both generations'
    assert usage.input_tokens == len(summary_record["prompt_token_ids"]) + len(reply_record["prompt_token_ids"])

    # stored: the next turn continues the compacted input, read from the cache
    later = client.responses.create(**_request(qwen_server, input=[NEXT], previous_response_id=compacted.id))
    later_prompt = _decoded_prompt(qwen_server)
    assert "README.md\nsetup.py" not in later_prompt and SUMMARY_PREFIX.strip() in later_prompt
    assert later.usage.input_tokens_details.cached_tokens >= len(reply_record["prompt_token_ids"]) - 12 - block


def test_automatic_compaction_streams_the_item_then_the_reply(qwen_server: LiveServer) -> None:
    body = _request(qwen_server, input=HISTORY, stream=True, store=False, context_management=_auto(1))
    with qwen_server.http().stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = _sse_events(response)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.output_item.done"] and types[-1] in ("response.completed", "response.incomplete")
    assert events[2]["item"]["type"] == "compaction" and events[2]["output_index"] == 0
    reply_indexes = {e["output_index"] for e in events[4:-1] if "output_index" in e}
    assert reply_indexes and min(reply_indexes) == 1
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and final["output"][0] == events[3]["item"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    with pytest.raises(Exception) as failure:
        qwen_server.client().responses.create(**_request(qwen_server, input=HISTORY,
                                                         context_management=[{"type": "summarize"}]))
    assert getattr(failure.value, "status_code", None) == 400 and failure.value.body["param"] == \
        "context_management.0.type"
