"""engine/text/tokenizer_load.py: a model directory's tokenizer read once per process, each caller given a copy of
its own that behaves as `AutoTokenizer.from_pretrained` of the directory (the real Qwen3 and Gemma 3 tokenizers)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from engine.registry import resolve_model
from engine.text import tokenizer_load
from engine.text.tokenizer_load import load_tokenizer

TEXTS = ["def f(x):\n\treturn x ** 2  # ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>",
         "<start_of_turn>user\nhello<end_of_turn>\n", "  spaces \r\n\n"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _model_copy(model: str, tmp_path: Path) -> Path:
    """The registry model's files in a directory of this test's own (it rewrites one)."""
    return Path(shutil.copytree(resolve_model(model), tmp_path / model))


def _behaviour(tokenizer) -> tuple:
    """What a caller sees: the class, the Python side's attributes (the chat template among them), the Rust
    tokenizer, encodings, decodings."""
    attributes = {name: repr(value) for name, value in vars(tokenizer).items() if name != "_tokenizer"}
    ids = [tokenizer.encode(text) for text in TEXTS]
    return (type(tokenizer), attributes, tokenizer.backend_tokenizer.to_str(), tokenizer.all_special_ids, ids, [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS],
            [tokenizer.decode(i, skip_special_tokens=skip) for i in ids for skip in (True, False)])


def _loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The directories AutoTokenizer reads from here on."""
    calls: list[str] = []
    original = transformers.AutoTokenizer.from_pretrained

    def counted(path, *args, **kwargs):
        calls.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    monkeypatch.setattr(tokenizer_load, "_loads", type(tokenizer_load._loads)())
    return calls


def _check_copies(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = _model_copy(model, tmp_path)
    loads = _loads(monkeypatch)
    first = load_tokenizer(model_dir)  # AutoTokenizer's load itself
    expected = _behaviour(first)
    second = load_tokenizer(model_dir)
    assert loads == [str(model_dir)]  # the second is a copy
    assert first.backend_tokenizer is not second.backend_tokenizer  # each thread encodes with its own
    # What one holder changes stays with it: a copy is taken of the load as it was, not as the first holder left it.
    first.backend_tokenizer.enable_truncation(3)
    first.add_tokens(["<added-by-one-holder>"])
    first.init_kwargs["changed"] = True
    third = load_tokenizer(model_dir)
    for tokenizer in (second, third):
        assert _behaviour(tokenizer) == expected
    assert loads == [str(model_dir)]


def test_copies_behave_as_a_fresh_load_and_are_their_holders_own(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _check_copies("qwen3-tiny", tmp_path, monkeypatch)


@pytest.mark.slow
def test_copies_of_a_sentencepiece_style_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's 262k-entry vocabulary with byte fallback (GemmaTokenizer)."""
    _check_copies("gemma3-tiny", tmp_path, monkeypatch)


@pytest.mark.slow
def test_a_rewritten_file_loads_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = _model_copy("qwen3-tiny", tmp_path)
    loads = _loads(monkeypatch)
    before = load_tokenizer(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config_path.write_text(json.dumps(config))
    after = load_tokenizer(model_dir)
    assert loads == [str(model_dir)] * 2
    assert after.apply_chat_template(MESSAGES, tokenize=False) == "[What is 2 + 2?]"
    assert before.apply_chat_template(MESSAGES, tokenize=False) != "[What is 2 + 2?]"
