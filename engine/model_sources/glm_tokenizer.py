"""A stand-in for GLM-4.7-Flash's tokenizer (stand_in_tokenizer.py): no package on the index ships GLM's
tokenizer.json, so the tiny GLM model uses Qwen3's real byte-level BPE followed by GLM's own added tokens, in GLM's
order and with GLM's names (``[gMASK]``, ``<sop>``, ``<|user|>``, ``<think>``, ``<tool_call>``, ``<arg_key>``, ...),
each one token as in the real tokenizer.

What differs from zai-org/GLM-4.7-Flash's tokenizer: the ranks (GLM's own BPE has 154,820 of them, so the real ids of
these added tokens are 154,820 + their index here, e.g. ``<|endoftext|>`` 154820, ``<|user|>`` 154827), and so the
token ids of ordinary text.
"""
from __future__ import annotations

from pathlib import Path

from .hf_layout import TokenizerInfo
from .stand_in_tokenizer import StandIn, write_stand_in_tokenizer

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


GLM_STAND_IN = StandIn("glm-stand-in", GLM_ADDED_TOKENS, GLM_STOP_TOKENS, pad_token="<|endoftext|>",
                       model_max_length=202_752)


def write_glm_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json (with the family's stored chat template) of the GLM stand-in."""
    return write_stand_in_tokenizer(GLM_STAND_IN, out_dir, template_family)
