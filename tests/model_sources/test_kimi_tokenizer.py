"""kimi-linear-tiny's stand-in tokenizer (engine/model_sources/kimi_tokenizer.py): Kimi's format tokens are one token
each, the turn markers special and the tool-call markers and think tags not (decoding keeps them), and the stored
template in its tokenizer_config renders what the native renderer writes."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.model_sources.kimi_tokenizer import (
    KIMI_ADDED_TOKENS, KIMI_K3_STAND_IN, KIMI_STAND_IN, write_kimi_k3_tokenizer,
)
from engine.registry import resolve_model
from server.rendering import get_renderer

CALL = {"id": "functions.ls:0", "type": "function", "function": {"name": "ls", "arguments": "{\"depth\": 1}"}}
MESSAGES = [{"role": "user", "content": "List files."},
            {"role": "assistant", "content": "", "reasoning_content": "Use ls.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "functions.ls:0", "content": "main.py"}]
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {
    "depth": {"type": "integer"}}}}}]


@pytest.mark.slow  # the tiny model's build and a 151k-token tokenizer
def test_format_tokens_and_the_template() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("kimi-linear-tiny")))
    vocab = KIMI_STAND_IN.vocab
    for token in KIMI_ADDED_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [vocab.token_id(token)]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("[BOS]", "<|im_end|>", "[PAD]")
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt == get_renderer("kimi-k2").render(MESSAGES, TOOLS)
    kept = tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False), skip_special_tokens=True)
    assert kept.startswith("tool_declare[") and "<|im_" not in kept
    assert ("<think>Use ls.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0"
            '<|tool_call_argument_begin|>{"depth": 1}<|tool_call_end|><|tool_calls_section_end|>') in kept


@pytest.mark.slow  # a 151k-token tokenizer
def test_kimi_k3_stand_in_tokens_and_its_template(tmp_path) -> None:
    """Kimi-K3's stand-in: its tokens in the release's order after Qwen3's ranks, one token each, <|end_of_msg|> the
    stop and the XTML markers kept by decoding; its tokenizer_config's template renders what the native renderer
    writes."""
    info = write_kimi_k3_tokenizer(tmp_path, "kimi-k3")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    vocab = KIMI_K3_STAND_IN.vocab
    for token in KIMI_K3_STAND_IN.added_tokens:
        assert tokenizer.encode(token, add_special_tokens=False) == [vocab.token_id(token)]
    assert tokenizer.eos_token == "<|end_of_msg|>" and info.eos_token_ids[0] == vocab.token_id("<|end_of_msg|>")
    # The renderer parses a JSON arguments string, as Kimi-K3's encoder does; the Jinja port takes the object
    messages = [*MESSAGES[:1], {**MESSAGES[1], "tool_calls": [{**CALL, "function": {"name": "ls",
                                                                                    "arguments": {"depth": 1}}}]},
                MESSAGES[2]]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt == get_renderer("kimi-k3").render(MESSAGES, TOOLS)
    kept = tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False), skip_special_tokens=True)
    assert ('<|open|>call tool="ls" index="1"<|sep|><|open|>argument key="depth" type="number"<|sep|>1'
            '<|close|>argument<|sep|><|close|>call<|sep|>') in kept and "<|end_of_msg|>" not in kept
