"""o200k_harmony built offline (engine/model_sources/harmony_tokenizer.py) against tiktoken: the same ranks (bpe-openai's
o200k_base) with harmony's special tokens, encoded by tiktoken's own BPE, give the same ids as the written
tokenizer.json through transformers, on text and on harmony-formatted conversations; bpe-openai's own o200k_base
encoder agrees on plain text; 201,088 tokens with the harmony markers at their ids."""
from __future__ import annotations

import gzip

import pytest

from engine.model_sources.harmony_tokenizer import (EOS_TOKEN_IDS, NUM_TOKENS, O200K_PATTERN, harmony_special_tokens,
                                                    o200k_ranks_file, write_harmony_tokenizer)

pytestmark = pytest.mark.slow  # the BPE merges of 200k tokens take ~10 s to derive

TEXTS = [
    "Hello world! I'm here.\n\n  def f(x):\n\treturn x**2  # 12345 ünïcödé 日本語 🙂 don't WE'LL",
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "<|start|>user<|message|>What's the weather in Tokyo?<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "Need to call the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
    "<|constrain|>json<|message|>{\"city\":\"Tokyo\"}<|call|>",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("harmony")
    info = write_harmony_tokenizer(out, "gpt-oss")
    ranks = out / "ranks.tiktoken"
    ranks.write_bytes(gzip.decompress(o200k_ranks_file().read_bytes()))
    reference = tiktoken.Encoding("o200k_harmony", pat_str=O200K_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(ranks)),
                                  special_tokens=harmony_special_tokens())
    return info, AutoTokenizer.from_pretrained(out), reference


def test_the_vocabulary_and_the_harmony_markers(tokenizers):
    info, tok, reference = tokenizers
    assert len(tok) == reference.n_vocab == info.num_tokens == NUM_TOKENS == 201_088
    ids = tok.convert_tokens_to_ids(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                     "<|return|>", "<|call|>", "<|endoftext|>", "<|reserved_201087|>"])
    assert ids == [200006, 200007, 200008, 200005, 200003, 200002, 200012, 199999, 201087]
    assert tok.eos_token_id == EOS_TOKEN_IDS[0] == 200002


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_tiktoken_and_decode_back(tokenizers, text):
    _, tok, reference = tokenizers
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, allowed_special="all")
    assert tok.decode(ids) == text


def test_plain_text_equals_bpe_openai_o200k(tokenizers):
    import bpe_openai

    _, tok, _ = tokenizers
    assert tok.encode(TEXTS[0], add_special_tokens=False) == bpe_openai.get_encoding("o200k_base").encode(TEXTS[0])
