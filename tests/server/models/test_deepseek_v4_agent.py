"""A DeepSeek-V4 agent conversation through the server and the real openai client: the next turn (rendered by V4's
encoder, a tool call and its result on the way) reads the previous prompt and reply from the cache, at most one block
short, with V4's compressed entries and pooling state resumed from the cached blocks; and `kvserve serve` on a V4
checkpoint directory, with no flags but the model, serves it."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import serve
from tests.server.serve_process import serve_cli

BLOCK = 16
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def test_next_turn_reads_the_last_from_the_cache() -> None:
    from openai import OpenAI

    ctx = load_context("deepseek-v4-tiny", EngineConfig(block_size=BLOCK, num_kv_blocks=64),
                       ServerSettings(max_output_tokens=8))
    with serve(ctx) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        messages = [{"role": "system", "content": "You are a coding agent in a Python repository."},
                    {"role": "user", "content": "Why does main.py crash?"}]
        cached_before = 0
        for turn in range(3):
            reply = client.chat.completions.create(model="deepseek-v4-tiny", messages=messages, tools=[READ_FILE],
                                                   temperature=0, max_tokens=8)
            usage = reply.usage
            assert usage.prompt_tokens_details.cached_tokens >= cached_before
            assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
            cached_before = usage.prompt_tokens + usage.completion_tokens - BLOCK  # at most one block short
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}
            messages += [{"role": "assistant", "content": reply.choices[0].message.content, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": f"print({turn})"}]
        assert cached_before > 100


@pytest.mark.slow
@pytest.mark.slow
def test_serve_a_v4_checkpoint_directory_with_no_flags(tmp_path: Path) -> None:
    """A checkpoint saved by transformers (pools of 128 tokens) needs 128-token blocks: the engine picks them and the
    banner says so; a chat request through the openai client is answered."""
    from openai import OpenAI

    from tests.config.config_sweep import write_v4_of_transformers_defaults

    write_v4_of_transformers_defaults(tmp_path)
    with serve_cli("--model", str(tmp_path)) as server:
        assert "KV blocks of 128 tokens (the model default)" in "".join(server.output)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.chat.completions.create(model=tmp_path.name, max_tokens=5, temperature=0,
                                               messages=[{"role": "user", "content": "Fix the failing test."}])
        assert reply.usage.completion_tokens == 5 or reply.choices[0].finish_reason == "stop"
        assert reply.usage.prompt_tokens > 5
