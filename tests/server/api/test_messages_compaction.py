"""Anthropic server-side compaction (`compact_20260112`, server/api/messages_compaction.py) through the official
`anthropic` SDK's beta client against a live server: the summary turn and the reply in one request (the summary
extends the cached conversation, the reply reads the system prompt and tools from the cache), the `compaction`
block streamed as the SDK accumulates it, `pause_after_compaction`, the block sent back (the history before it
dropped, the reply's prompt read from the cache), and the 400s."""
from __future__ import annotations

import json

import anthropic
import pytest

from server.api.anthropic_protocol import Conversation
from server.api.compaction import COMPACTION_PROMPT, SUMMARY_PREFIX
from server.api.messages_compaction import from_last_compaction
from tests.server.conftest import LiveServer

BETA = ["compact-2026-01-12"]
SYSTEM = "You are a coding agent. Work in the repository and use the tools. " * 4
TOOLS = [{"name": "read", "description": "read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
HISTORY = [
    {"role": "user", "content": "Fix the failing test in parser.py."},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read",
                                       "input": {"path": "parser.py"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": "def parse(text):\n    return text.split(',')\n"}]},
]
GENERATION_PROMPT_TOKENS = 8  # Qwen3's assistant header and empty think block end a prompt, not the next one's history


def _compact(**edit) -> dict:
    return {"edits": [{"type": "compact_20260112", **edit}]}


def _create(server: LiveServer, messages: list[dict], management: dict | None = None, **kwargs):
    extra = {} if management is None else {"context_management": management}
    return server.anthropic().beta.messages.create(model=server.ctx.model_name, max_tokens=6, system=SYSTEM,
                                                   messages=messages, tools=TOOLS, betas=BETA, **extra, **kwargs)


def _count(server: LiveServer, messages: list[dict]) -> int:
    return server.anthropic().beta.messages.count_tokens(model=server.ctx.model_name, system=SYSTEM,
                                                         messages=messages, tools=TOOLS, betas=BETA).input_tokens


def _decoded(server: LiveServer, record: dict) -> str:
    return server.ctx.tokenizer.decode(record["prompt_token_ids"])


def _records(server: LiveServer, n: int) -> list[dict]:
    return [json.loads(line) for line in server.record_path.read_text().splitlines()[-n:]]


def _whole(block: int, n: int) -> int:
    return n // block * block


@pytest.mark.slow  # two generations (a summary and a reply) per request
def test_compaction_summarises_then_replies_from_the_summary_with_the_head_cached(qwen_server: LiveServer) -> None:
    block = qwen_server.ctx.engine.facts.block_size
    tokens = _count(qwen_server, HISTORY)
    untouched = _create(qwen_server, HISTORY, _compact(trigger={"type": "input_tokens", "value": tokens + 1}))
    assert [b.type for b in untouched.content] != [] and untouched.content[0].type != "compaction"
    assert untouched.usage.iterations is None

    # The prompt just sent is cached: the summary turn extends it; the reply reads the head from the cache
    reply = _create(qwen_server, HISTORY, _compact(trigger={"type": "input_tokens", "value": tokens}))
    compaction, *answer = reply.content
    assert compaction.type == "compaction" and compaction.content and answer
    summary_record, reply_record = _records(qwen_server, 2)
    summary_prompt, reply_prompt = _decoded(qwen_server, summary_record), _decoded(qwen_server, reply_record)
    assert summary_prompt.index("parser.py") < summary_prompt.index(COMPACTION_PROMPT)  # asked after the history
    assert "parser.py" not in reply_prompt
    assert SUMMARY_PREFIX + compaction.content in reply_prompt
    summary_usage, message_usage = reply.usage.iterations
    assert (summary_usage.type, message_usage.type) == ("compaction", "message")
    assert summary_usage.cache_read_input_tokens >= _whole(block, tokens - GENERATION_PROMPT_TOKENS)
    head = len(qwen_server.ctx.encode(SYSTEM))
    assert message_usage.cache_read_input_tokens >= _whole(block, head)  # system prompt and tools: from the cache
    assert reply.usage.input_tokens == message_usage.input_tokens  # the top level is the reply's alone
    assert reply.usage.output_tokens == message_usage.output_tokens

    # Sent back: the history before the block is dropped, and the reply's prompt is read from the cache
    later_messages = [*HISTORY, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                                  for b in reply.content]},
                      {"role": "user", "content": "Carry on."}]
    later = _create(qwen_server, later_messages)
    later_prompt = _decoded(qwen_server, _records(qwen_server, 1)[0])
    assert "parser.py" not in later_prompt and later_prompt.startswith(reply_prompt[: len(reply_prompt) - 40])
    assert later.usage.cache_read_input_tokens >= _whole(block, len(reply_record["prompt_token_ids"])
                                                         - GENERATION_PROMPT_TOKENS)
    used = later.usage
    assert used.input_tokens + used.cache_read_input_tokens + used.cache_creation_input_tokens == _count(
        qwen_server, later_messages)


@pytest.mark.slow  # two generations (a summary and a reply) per request
def test_streamed_compaction_and_pause_after_compaction(qwen_server: LiveServer) -> None:
    management = _compact(trigger={"type": "input_tokens", "value": 1}, instructions="Summarise in one line.")
    with qwen_server.anthropic().beta.messages.stream(model=qwen_server.ctx.model_name, max_tokens=6, system=SYSTEM,
                                                     messages=HISTORY, tools=TOOLS, betas=BETA,
                                                     context_management=management) as stream:
        events = list(stream)
        message = stream.get_final_message()
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts[0] == (0, "compaction") and all(index >= 1 for index, _ in starts[1:]) and len(starts) > 1
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.index == 0]
    assert [d.type for d in deltas] == ["compaction_delta"]  # the summary whole, in one delta
    assert message.content[0].type == "compaction" and message.content[0].content == deltas[0].content
    assert [i.type for i in message.usage.iterations] == ["compaction", "message"]
    assert "Summarise in one line." in _decoded(qwen_server, _records(qwen_server, 2)[0])  # replaces the default
    assert COMPACTION_PROMPT not in _decoded(qwen_server, _records(qwen_server, 2)[0])

    paused = _create(qwen_server, HISTORY, _compact(trigger={"type": "input_tokens", "value": 1},
                                                    pause_after_compaction=True))
    [compaction] = paused.content
    assert paused.stop_reason == "compaction" and compaction.type == "compaction"
    assert [i.type for i in paused.usage.iterations] == ["compaction"] and paused.usage.output_tokens == 0
    # Sent back as it came, the block asks for the reply: generated from the summary alone
    resumed = _create(qwen_server, [*HISTORY, {"role": "assistant", "content": [compaction.model_dump()]}])
    prompt = _decoded(qwen_server, _records(qwen_server, 1)[0])
    assert resumed.stop_reason in ("end_turn", "max_tokens", "tool_use") and "parser.py" not in prompt
    assert SUMMARY_PREFIX + compaction.content in prompt


@pytest.mark.slow  # a server round trip per case
def test_bad_compaction_input_is_a_400_and_a_null_block_a_no_op(qwen_server: LiveServer) -> None:
    cases = [
        ([{"role": "user", "content": [{"type": "compaction", "content": "x"}]}], None, "messages.0.content.0"),
        ([*HISTORY, {"role": "assistant", "content": [{"type": "compaction", "content": ""}]}], None,
         "messages.3.content.0.content"),
        (HISTORY, _compact(trigger={"type": "tool_uses", "value": 3}), "context_management.edits.0.trigger"),
        (HISTORY, _compact(pause_after_compaction="yes"), "context_management.edits.0.pause_after_compaction"),
    ]
    for messages, management, where in cases:
        with pytest.raises(anthropic.BadRequestError) as failure:
            _create(qwen_server, messages, management)
        assert failure.value.body["type"] == "error" and where in str(failure.value), failure.value
    failed = [*HISTORY, {"role": "assistant", "content": [{"type": "compaction", "content": None},
                                                         {"type": "text", "text": "Reading it."}]},
              {"role": "user", "content": "Go on."}]
    plain = [*HISTORY, {"role": "assistant", "content": "Reading it."}, {"role": "user", "content": "Go on."}]
    assert _count(qwen_server, failed) == _count(qwen_server, plain)


def test_the_last_compaction_block_restarts_the_conversation_from_its_summary() -> None:
    """Every message and block before the last block with content is dropped; its assistant message keeps what
    follows it; null blocks are no-ops; the epoch counts the compactions."""
    first = {"type": "compaction", "content": "first summary"}
    second = {"type": "compaction", "content": "second summary"}
    conversation = Conversation.model_validate({"model": "m", "system": "sys", "messages": [
        *HISTORY, {"role": "assistant", "content": [first, {"type": "text", "text": "old"}]},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": [{"type": "text", "text": "dropped"}, second,
                                          {"type": "compaction", "content": None}, {"type": "text", "text": "kept"}]},
        {"role": "user", "content": "next"}]})
    restarted, epoch = from_last_compaction(conversation)
    assert epoch == 2 and restarted.system == "sys"
    assert [(m.role, m.content) for m in restarted.messages] == [
        ("user", [{"type": "text", "text": SUMMARY_PREFIX + "second summary"}]),
        ("assistant", [{"type": "text", "text": "kept"}]), ("user", "next")]
    untouched = Conversation.model_validate({"model": "m", "messages": HISTORY})
    assert from_last_compaction(untouched) == (untouched, 0)
