"""A hybrid model's prefix cache through the API (qwen3.6-tiny): the server hints the message boundaries, so a
request that shares only the system prompt and tools with an earlier one reads that whole part (block-aligned), and
a conversation's next turn reads all but at most one block of the previous prompt and reply; a broken image gets a
400 (qwen3.6-tiny reads images: tests/server/models/test_image_serving.py)."""
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


@pytest.mark.slow
def test_requests_sharing_the_system_prompt_and_tools_read_it_whole(hybrid_server: LiveServer) -> None:
    bs = hybrid_server.ctx.engine.facts.block_size
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


@pytest.mark.slow
def test_next_turn_resumes_where_a_snapshot_is(hybrid_server: LiveServer) -> None:
    """The next turn resumes at the deepest snapshot its prompt shares: the reply's end where the re-rendered reply
    equals the generated tokens, else the previous prompt's end (a random model's reply, detokenized and encoded
    again, need not give the same tokens; tests/kv/test_hybrid_prefix_cache.py checks the reply end on ids)."""
    bs = hybrid_server.ctx.engine.facts.block_size
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


def test_a_retry_appending_to_the_last_user_message_reads_what_a_dense_cache_would(hybrid_server: LiveServer) -> None:
    """Claude Code's retry after a reply with no visible output: the same request with one more text part on its last
    user message, which an environment message follows. It branches off the first request at the end of that
    message's content, so a snapshot must be there (the server hints it): the retry reads the shared prefix's full
    blocks, as a dense cache would."""
    bs = hybrid_server.ctx.engine.facts.block_size
    tools = [{"name": "Read", "description": "Read a file of the project.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    reminder = ("<system-reminder>\nEnd git commit messages with a Co-Authored-By line naming the agent, and pull "
                "request descriptions with a generated-by line; the user's own instructions take precedence.\n"
                "</system-reminder>\n")
    environment = {"role": "system", "content": "# Environment\n - Primary working directory: /tmp/project\n - Is a "
                                                "git repository: false\n - Platform: linux\nToday's date is 2026-12-01."}
    system = f"You are a coding agent in session {uuid.uuid4()}. Be brief."

    def ask(question: list[dict]) -> tuple[int, list[int]]:
        message = hybrid_server.anthropic().messages.create(
            model=hybrid_server.ctx.model_name, max_tokens=2, system=system, tools=tools,
            messages=[{"role": "user", "content": [{"type": "text", "text": reminder}, *question]}, environment],
            extra_body={"temperature": 0})
        return message.usage.cache_read_input_tokens, hybrid_server.last_record()["prompt_token_ids"]

    _, first = ask([{"type": "text", "text": "What is in this directory?"}])
    read, retry = ask([{"type": "text", "text": "What is in this directory?\n"},
                       {"type": "text", "text": "[Your previous response had no visible output. Please continue.]"}])
    shared = _common_prefix(first, retry)
    assert len(retry) - shared > 2 * bs  # the environment message follows the branch point
    assert read == shared // bs * bs


@pytest.mark.slow
def test_a_broken_image_gets_a_clear_400(hybrid_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot be read"):
        hybrid_server.chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], max_tokens=4)
