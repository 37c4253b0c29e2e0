"""A stand-in for MiniMax-M2's tokenizer (stand_in_tokenizer.py): no package on the index ships MiniMax's
tokenizer.json, so the tiny MiniMax model uses Qwen3's real byte-level BPE followed by the MiniMax tokens its format
is written in, with MiniMax's names, each one token as in the real tokenizer: the turn markers, special (``]~!b[`` the
bos, ``]~b]`` before a role, ``[e~[`` the eos that ends every turn), and ``<think>`` / ``</think>`` and the
``<minimax:tool_call>`` block tags as ordinary added tokens (as Qwen3's tokenizer has its ``<think>`` and
``<tool_call>``), so that a grammar writes each as its one token and decoding keeps them.

What differs from MiniMaxAI/MiniMax-M2's tokenizer (200,064 ids; ``]~b]`` 200019, ``[e~[`` 200020, ``]~!b[`` 200034,
``<think>`` 200050): the ranks, so the ids of ordinary text and of these tokens, and the added tokens it has beyond
these (fill-in-the-middle, repository and media markers) that its chat format never writes.
"""
from __future__ import annotations

from pathlib import Path

from .hf_layout import TokenizerInfo
from .stand_in_tokenizer import StandIn, write_stand_in_tokenizer

MINIMAX_ADDED_TOKENS: tuple[str, ...] = (
    "]~b]", "[e~[", "]~!b[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>",
)
# MiniMax-M2's generation_config stops on [e~[ alone; its eos is also its pad.
MINIMAX_STAND_IN = StandIn("minimax-stand-in", MINIMAX_ADDED_TOKENS, ("[e~[",), pad_token="[e~[",
                           model_max_length=196_608, bos_token="]~!b[", text_tokens=MINIMAX_ADDED_TOKENS[3:])


def write_minimax_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json (with the family's stored chat template) of the MiniMax stand-in."""
    return write_stand_in_tokenizer(MINIMAX_STAND_IN, out_dir, template_family)
