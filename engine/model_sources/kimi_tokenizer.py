"""A stand-in for Kimi's tokenizer (stand_in_tokenizer.py): Kimi-K2's and Kimi Linear's tokenizer is a tiktoken
model read by remote code (tokenization_kimi.py over tiktoken.model), which no package on the index ships, so the tiny
Kimi model uses Qwen3's real byte-level BPE followed by the tokens Kimi's chat format is written in, with Kimi's names,
each one token as in the real tokenizer: the turn markers special (``[BOS]``, ``<|im_end|>`` the end of every turn and
the released config's eos, ``<|im_user|>``, ``<|im_assistant|>``, ``<|im_system|>``, ``<|im_middle|>``, ``[EOS]``,
``[PAD]``), and the tool-call section, call and argument markers and ``<think>`` / ``</think>`` ordinary added tokens
(special: false in the release too), so that a grammar writes each as its one token and decoding keeps them.

What differs from moonshotai/Kimi-Linear-48B-A3B-Instruct's tokenizer (163,840 ids; ``[BOS]`` 163584, ``<|im_end|>``
163586, ``<|im_middle|>`` 163601, ``<|tool_calls_section_begin|>`` 163595): the ranks, so the ids of ordinary text
and of these tokens, and the added tokens it has beyond these (media and reserved tokens) that its format never writes.
"""
from __future__ import annotations

from pathlib import Path

from .hf_layout import TokenizerInfo
from .stand_in_tokenizer import StandIn, write_stand_in_tokenizer

KIMI_FORMAT_TOKENS: tuple[str, ...] = (
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>",
)
# in the release's id order: the turn markers, the format's tokens, then the pad
KIMI_ADDED_TOKENS: tuple[str, ...] = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", *KIMI_FORMAT_TOKENS[:5],
    "<|im_middle|>", *KIMI_FORMAT_TOKENS[5:], "[PAD]",
)
# Kimi Linear's config.json ends a turn at <|im_end|>; [EOS] ends a text
KIMI_STAND_IN = StandIn("kimi-stand-in", KIMI_ADDED_TOKENS, ("<|im_end|>", "[EOS]"), pad_token="[PAD]",
                        model_max_length=1_048_576, bos_token="[BOS]", text_tokens=KIMI_FORMAT_TOKENS)


def write_kimi_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json (with the family's stored chat template) of the Kimi stand-in."""
    return write_stand_in_tokenizer(KIMI_STAND_IN, out_dir, template_family)


# Kimi-K3's tokenizer (moonshotai/Kimi-K3, the same remote-code tiktoken form): its format is XTML over three
# tokens, each message ended by <|end_of_msg|> (its stop token). In the release's id order from 163584: [BOS], [EOS],
# <|end_of_msg|>, <|open|>, <|close|>, <|sep|>, ... [PAD] (163839). The three XTML markers are ordinary added tokens
# here, so that a grammar's markup (xgrammar's kimi_k3_xml arguments) can be written as them.
KIMI_K3_MARKERS: tuple[str, ...] = ("<|open|>", "<|close|>", "<|sep|>")
KIMI_K3_STAND_IN = StandIn("kimi-k3-stand-in", ("[BOS]", "[EOS]", "<|end_of_msg|>", *KIMI_K3_MARKERS, "[PAD]"),
                           ("<|end_of_msg|>", "[EOS]"), pad_token="[PAD]", model_max_length=1_048_576,
                           bos_token="[BOS]", text_tokens=KIMI_K3_MARKERS)


def write_kimi_k3_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json (with the family's stored chat template) of the Kimi-K3 stand-in."""
    return write_stand_in_tokenizer(KIMI_K3_STAND_IN, out_dir, template_family)
