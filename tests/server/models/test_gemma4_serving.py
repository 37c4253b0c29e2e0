"""A Gemma 4 checkpoint directory with google/gemma-4-*-it's released chat_template.jinja, served on 127.0.0.1
through the openai SDK: the directory is recognised as family gemma4, the prompt is the official template's as
transformers renders it, a named tool call comes out in Gemma's own `<|tool_call>call:NAME{...}<tool_call|>` notation
under the grammar and is parsed into JSON arguments, and the tool loop's next turn reads the shared prefix from the
cache. The weights are gemma4-tiny's (random, in Gemma4ForCausalLM's layout); its tokenizer is Gemma 3's, which
splits Gemma 4's markers into pieces (so the text, not the token ids, is what matches the real model)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.registry import resolve_model
from tests.server.conftest import LiveServer, _live_server

pytestmark = pytest.mark.slow  # compiles call grammars over 262,144 tokens

BLOCK_SIZE = 16
RELEASED = Path(__file__).parents[2] / "rendering" / "templates" / "google-gemma-4-31B-it.jinja"
MODE = {"type": "function", "function": {"name": "set_mode", "description": "Set the build mode", "parameters": {
    "type": "object", "required": ["mode", "dry_run"],
    "properties": {"mode": {"type": "string", "enum": ["fast", "safe"]}, "dry_run": {"type": "boolean"}}}}}
QUESTION = [{"role": "system", "content": "You are a build bot."}, {"role": "user", "content": "Build it safely."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma4") / "gemma-4-tiny-it"
    out.mkdir()
    for path in resolve_model("gemma4-tiny").iterdir():
        (out / path.name).symlink_to(path)
    shutil.copyfile(RELEASED, out / "chat_template.jinja")
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LiveServer]:
    yield from _live_server(tmp_path_factory, str(model_dir),
                            EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=256, max_model_len=1024))


def test_a_named_call_in_gemmas_notation_and_the_tool_loop_reads_the_cache(server: LiveServer) -> None:
    tokenizer = server.ctx.tokenizer  # the directory's own (Gemma 3's), as transformers loads it
    official = tokenizer.apply_chat_template(QUESTION, tools=[MODE], chat_template=RELEASED.read_text(),
                                             add_generation_prompt=True, tokenize=False)
    first = server.chat(messages=QUESTION, tools=[MODE], tool_choice=MODE, max_tokens=120, temperature=0)
    first_record = server.last_record()
    assert first_record["prompt_token_ids"] == tokenizer(official, add_special_tokens=False).input_ids
    [call] = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    raw = tokenizer.decode(first_record["output_token_ids"], skip_special_tokens=False)
    assert call.function.name == "set_mode" and first.choices[0].finish_reason == "tool_calls", raw
    assert raw.startswith("<|tool_call>call:set_mode{dry_run:")
    assert arguments["mode"] in ("fast", "safe") and isinstance(arguments["dry_run"], bool)
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Built."}]
    second = server.chat(messages=history, tools=[MODE], max_tokens=4, temperature=0)
    second_prompt, first_prompt = server.last_record()["prompt_token_ids"], first_record["prompt_token_ids"]
    text = tokenizer.decode(second_prompt, skip_special_tokens=False)
    assert '<|tool_response>response:set_mode{value:<|"|>Built.<|"|>}<tool_response|>' in text
    # The re-rendered turn drops the generation prompt's empty thought: the prefix up to it comes from the cache
    shared = next(i for i, (a, b) in enumerate(zip(first_prompt, second_prompt)) if a != b)
    assert shared > len(first_prompt) - 16
    assert second.usage.prompt_tokens_details.cached_tokens >= shared - BLOCK_SIZE
