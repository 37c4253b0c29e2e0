"""A hybrid model's prefix cache through the API (qwen3.6-tiny): the server hints the message boundaries, so a
request that shares only the system prompt and tools with an earlier one reads that whole part (block-aligned), and
a conversation's next turn reads all but at most one block of the previous prompt and reply; images get a 400."""
from __future__ import annotations

import uuid

import openai
import pytest

from tests.server.conftest import LiveServer

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _system() -> dict:
    return {"role": "system", "content": f"You are a coding agent in session {uuid.uuid4()}. Be brief."}


def test_requests_sharing_the_system_prompt_and_tools_read_it_whole(hybrid_server: LiveServer) -> None:
    bs = hybrid_server.ctx.engine.engine.cfg.block_size
    system = _system()
    first = hybrid_server.chat(messages=[system, {"role": "user", "content": "Alpha: list the files."}], tools=TOOLS,
                               max_tokens=4, temperature=0)
    first_ids = hybrid_server.last_record()["prompt_token_ids"]
    second = hybrid_server.chat(messages=[system, {"role": "user", "content": "Beta: fix the bug."}], tools=TOOLS,
                                max_tokens=4, temperature=0)
    second_ids = hybrid_server.last_record()["prompt_token_ids"]
    shared = _common_prefix(first_ids, second_ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == shared // bs * bs > 0


def test_next_turn_resumes_where_a_snapshot_is(hybrid_server: LiveServer) -> None:
    """The next turn resumes at the deepest snapshot its prompt shares: the reply's end where the re-rendered reply
    equals the generated tokens, else the previous prompt's end (a random model's reply, detokenized and encoded
    again, need not give the same tokens; tests/engine/test_hybrid_prefix_cache.py checks the reply end on ids)."""
    bs = hybrid_server.ctx.engine.engine.cfg.block_size
    messages = [_system(), {"role": "user", "content": "Name three rivers."}]
    first = hybrid_server.chat(messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    record = hybrid_server.last_record()
    reply = first.choices[0].message
    messages += [{"role": "assistant", "content": reply.content or "",
                  "reasoning_content": (reply.model_extra or {}).get("reasoning_content")},
                 {"role": "user", "content": "And three mountains?"}]
    second = hybrid_server.chat(messages=messages, max_tokens=4, temperature=0)
    generated = record["prompt_token_ids"] + record["output_token_ids"][:-1]  # the last token was never computed
    reused = _common_prefix(generated, hybrid_server.last_record()["prompt_token_ids"])
    prompt_end = (len(record["prompt_token_ids"]) - 1) // bs * bs
    expected = reused // bs * bs if reused == len(generated) else prompt_end
    assert second.usage.prompt_tokens_details.cached_tokens >= min(expected, reused // bs * bs) >= prompt_end


def test_an_image_gets_a_clear_400(hybrid_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError, match="text only"):
        hybrid_server.chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], max_tokens=4)
