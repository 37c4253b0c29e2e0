"""minimax-m2-tiny's stand-in tokenizer (engine/model_sources/minimax_tokenizer.py): MiniMax's format tokens are one
token each, the turn markers special and the tags not (decoding keeps them), and the stored official template in its
tokenizer_config renders what the native renderer writes."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.model_sources.minimax_tokenizer import MINIMAX_ADDED_TOKENS, MINIMAX_STAND_IN
from engine.registry import resolve_model
from server.rendering import get_renderer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List files."},
            {"role": "assistant", "content": "", "reasoning_content": "Use ls.",
             "tool_calls": [{"id": "a", "type": "function", "function": {"name": "ls", "arguments": "{\"depth\": 1}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "main.py"}]
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {
    "depth": {"type": "integer"}}}}}]


@pytest.mark.slow  # the tiny model's build and a 151k-token tokenizer
def test_format_tokens_and_the_template() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("minimax-m2-tiny")))
    vocab = MINIMAX_STAND_IN.vocab
    for token in MINIMAX_ADDED_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [vocab.token_id(token)]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("]~!b[", "[e~[")
    prepared = get_renderer("minimax-m2").prepare(MESSAGES, TOOLS)  # arguments as objects, as the template takes them
    prompt = tokenizer.apply_chat_template(prepared.messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt == get_renderer("minimax-m2").render(MESSAGES, TOOLS)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("system\nBe brief.")
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<think>\nUse ls.\n</think>" in kept and '<minimax:tool_call>\n<invoke name="ls">' in kept
