"""Devstral's tekken v13 tokenizer as devstral-small-tiny ships it (engine/model_sources/mistral_tokenizer.py,
converted offline for transformers from the vocabulary the mistral-common wheel holds): token for token what
mistral-common encodes on agent conversations, its control tokens one id each, and the ids the released Devstral
Small 2 gives a plain sentence."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_sources.mistral_tokenizer import NUM_TOKENS, control_tokens, write_tekken_tokenizer
from server.rendering import get_renderer

pytest.importorskip("mistral_common")
from tests.rendering import mistral_reference  # noqa: E402
from tests.rendering.test_devstral import CONVERSATIONS  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    out = Path(tmp_path_factory.mktemp("tekken"))
    info = write_tekken_tokenizer(out)
    assert (info.num_tokens, info.bos_token_id, info.eos_token_ids, info.pad_token_id) == (NUM_TOKENS, 1, (2,), 11)
    return AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_rendered_prompts_tokenize_as_mistral_common_encodes_them(tokenizer, name):
    messages, tools = CONVERSATIONS[name]
    text = get_renderer("devstral").render(messages, tools)
    assert tokenizer.encode(text, add_special_tokens=False) == mistral_reference.encode(messages, tools)[1]
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_control_tokens_and_a_sentence(tokenizer):
    assert len(tokenizer) == NUM_TOKENS
    for i, token in enumerate(control_tokens()[:40]):
        assert tokenizer.convert_tokens_to_ids(token) == i
    # Devstral-Small-2-24B-Instruct-2512's own tokenizer gives these ids (llama.cpp's conversion notes for it)
    assert tokenizer.encode("Hello, my name is", add_special_tokens=False) == [22177, 1044, 2036, 2564, 1395]
