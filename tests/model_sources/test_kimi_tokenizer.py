"""kimi-linear-tiny's stand-in tokenizer (engine/model_sources/kimi_tokenizer.py): Kimi's format tokens are one token
each, the turn markers special and the tool-call markers and think tags not (decoding keeps them), and the stored
template in its tokenizer_config renders what the native renderer writes."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.model_sources.kimi_tokenizer import KIMI_ADDED_TOKENS, KIMI_STAND_IN
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
