"""Incremental turns (server/pipeline/turn_cache.py): on every turn of an agent session, with each family's real
tokenizer and renderer, the ids equal a full tokenize of the rendered text and the reused block hashes are a prefix
of a full hash, whatever the turn does: append a tool call and its result (reused), answer with thinking that the
next turn's template drops, edit the system prompt, compact the history. Then over HTTP: a session's turns (served
incrementally) get the prompt sizes and greedy replies of the same turns sent without a session (served whole).
"""
from __future__ import annotations

import functools
import json
import os

import pytest
from transformers import AutoTokenizer

from engine.kv.block_hashing import BlockHasher
from engine.registry import get_model_spec, resolve_model
from engine.requests import EngineRequest
from engine.sampling_params import SamplingParams
from server.rendering import renderer_for_model
from server.pipeline.turn_cache import TurnCache

from benchmarks.prefix.text import TextGen

BLOCK = 4
FAMILIES = ["qwen3-tiny", "deepseek-v3-tiny", "qwen3.6-tiny", "gemma3-tiny", "glm4.7-flash-tiny", "gpt-oss-tiny",
            "devstral-small-tiny", "minimax-m2-tiny"]


def _tool_turn(gen: TextGen, i: int) -> list[dict]:
    call = {"id": f"call{i}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{i}.py"})}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call{i}", "content": gen.prose(60 + 17 * i)}]


def session_turns() -> list[tuple[str, list[dict]]]:
    """(what the turn does, its messages): appends, a reply with thinking then a new question (the template may
    drop the thinking), an edited system prompt, a compaction."""
    gen = TextGen(4)
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the cache."}]
    turns = [("first", msgs)]
    for i in range(3):
        msgs = [*msgs, *_tool_turn(gen, i)]
        turns.append(("append", msgs))
    msgs = [*msgs, {"role": "assistant", "content": "Found it.", "reasoning_content": gen.prose(30)},
            {"role": "user", "content": "Now add a test."}]
    turns.append(("thinking, then a question", msgs))
    msgs = [*msgs, *_tool_turn(gen, 3)]
    turns.append(("append", msgs))
    msgs = [{"role": "system", "content": "You are a careful coding agent."}, *msgs[1:]]
    turns.append(("system prompt edited", msgs))
    msgs = [msgs[0], {"role": "user", "content": "Summary so far: " + gen.prose(40)}, *_tool_turn(gen, 4)]
    turns.append(("compacted", msgs))
    msgs = [*msgs, *_tool_turn(gen, 5)]
    turns.append(("append", msgs))
    return turns


@functools.lru_cache(maxsize=None)
def _tools(model: str):
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    return tokenizer, renderer_for_model(get_model_spec(model).template, tokenizer)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.fast_cases("qwen3-tiny")
def test_every_turn_equals_a_full_tokenize_and_hash(model: str) -> None:
    tokenizer, renderer = _tools(model)
    cache = TurnCache.for_template(tokenizer, lambda m: renderer.render(m, None, True), BLOCK)
    assert cache.cuts, "every family's template markers are special tokens the tokenizer splits out first"
    hasher = BlockHasher(BLOCK, model)
    tokenized: list[int] = []

    def encode(text: str) -> list[int]:
        tokenized.append(len(text))
        return tokenizer.encode(text, add_special_tokens=False)

    last: list[int] = []
    last_text = ""
    for i, (what, messages) in enumerate(session_turns()):
        text = renderer.render(messages, None, True)
        tokenized.clear()
        tokens = cache.encode(("salt", "session"), text, encode)
        full = tokenizer.encode(text, add_special_tokens=False)
        assert tokens.token_ids == full, what
        known = tokens.known_block_hashes
        assert len(known) * BLOCK <= _first_difference(last, full), f"{what}: a hash reused past a change"
        hashes = list(known)
        hasher.extend(hashes, full, "salt")
        assert hashes == hasher.hashes(full, "salt"), what
        if what == "append":  # only what follows the last turn's text was tokenized, and the blocks before it were
            # not hashed again (but the last turn's generation prompt, which the new reply continues, and a block)
            assert sum(tokenized) <= len(text) - len(os.path.commonprefix([last_text, text])) + 32, what
            assert len(known) * BLOCK >= _first_difference(last, full) - 16, what
        request = EngineRequest(f"r{i}", full, SamplingParams(), "salt", block_hashes=hashes)
        tokens.remember(request)
        last, last_text = full, text


def test_sessions_apart_and_without_one_nothing_is_kept() -> None:
    tokenizer, renderer = _tools("qwen3-tiny")
    cache = TurnCache.for_template(tokenizer, lambda m: renderer.render(m, None, True), BLOCK)
    (_, first), (_, second) = session_turns()[:2]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def turn(session, messages, salt="a") -> list:
        tokens = cache.encode(session, renderer.render(messages, None, True), encode)
        hashes = BlockHasher(BLOCK).hashes(tokens.token_ids, salt)
        tokens.remember(EngineRequest("r", tokens.token_ids, SamplingParams(), salt, block_hashes=hashes))
        return tokens.known_block_hashes

    turn(("a", "s1"), first)
    assert turn(None, second) == [] and turn(("b", "s1"), second) == [], "no session, or another tenant's"
    assert turn(("a", "s1"), second), "the same session"



@pytest.mark.slow  # a turn of three requests pairs over HTTP
def test_a_session_served_incrementally_answers_as_without_one(qwen_server) -> None:
    # Over HTTP with the openai client: each turn of a tool loop sent in a session (prompt_cache_key: it reuses the
    # last turn's pieces and hashes) and without one (tokenized and hashed whole) gets the same prompt size and the
    # same greedy reply.
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    assert qwen_server.ctx.turns.cuts
    for what, messages in session_turns()[:3]:
        replies = []
        for extra in ({"prompt_cache_key": "agent-1"}, {}):
            reply = qwen_server.chat(messages=messages, tools=tools, max_tokens=6, temperature=0, extra_body=extra)
            replies.append((reply.choices[0].message.content, reply.usage.prompt_tokens))
        assert replies[0] == replies[1], what
