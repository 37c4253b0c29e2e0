"""Devstral's reference rendering: `mistral-common`'s own encoder (``MistralTokenizer`` with its v13 instruct
tokenizer and request normalizer, the version Devstral Small 2 / Devstral 2 ship), run offline.

The tekken vocabulary is the one the mistral-common wheel ships (``data/tekken_240911.json``: 150,000 ranks, 131,072
used after 1,000 special tokens, as in every tekken model). Its file says v3 and lists no special tokens, so the
tokenizer is built with version v13 and the v13 special-token layout (``[ARGS]`` 32, ``[CALL_ID]`` 33, ``[THINK]`` /
``[/THINK]`` 34 / 35 after the 20 classic ones; the rest ``<SPECIAL_n>``).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SPECIAL_LAYOUT = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The v13 ``MistralTokenizer`` (validation in test mode)."""
    import mistral_common
    from mistral_common.protocol.instruct.normalize import normalizer_for_tokenizer_version
    from mistral_common.protocol.instruct.validator import MistralRequestValidatorV13, ValidationMode
    from mistral_common.tokens.tokenizers.base import TokenizerVersion
    from mistral_common.tokens.tokenizers.instruct import InstructTokenizerV13
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from mistral_common.tokens.tokenizers.tekken import SpecialTokenInfo, Tekkenizer

    data = json.loads((Path(mistral_common.__file__).parent / "data" / "tekken_240911.json").read_text())
    config = data["config"]
    special = list(Tekkenizer.DEPRECATED_SPECIAL_TOKENS)
    special += [SpecialTokenInfo(rank=i, token_str=SPECIAL_LAYOUT.get(i, f"<SPECIAL_{i}>"), is_control=True)
                for i in range(len(special), max(SPECIAL_LAYOUT) + 1)]
    tekken = Tekkenizer(data["vocab"], special, config["pattern"], config["default_vocab_size"],
                        config["default_num_special_tokens"], TokenizerVersion.v13, name="tekken_v13")
    return MistralTokenizer(InstructTokenizerV13(tekken), MistralRequestValidatorV13(mode=ValidationMode.test),
                            normalizer_for_tokenizer_version(TokenizerVersion.v13))


def _tool(tool: dict) -> dict:
    """A tool as mistral-common's ``Tool`` model takes it: OpenAI's ``strict`` (never rendered) left out, absent
    ``parameters`` as ``{}`` (what the renderer writes for them)."""
    function = {k: v for k, v in tool["function"].items() if k != "strict"}
    return {"type": "function", "function": {"parameters": {}, **function}}


def encode(messages: list[dict], tools: list[dict] | None, validate: bool = True) -> tuple[str, list[int]]:
    """OpenAI-shaped ``messages`` and ``tools`` as mistral-common encodes them: (text, token ids).

    ``validate``: through ``encode_chat_completion``, the request validator included. Without it the request goes
    straight to the library's normalizer and instruct encoder: its checks of a conversation's structure (a user
    message after tool results, 9-character call ids, an assistant message last) refuse requests agents send, while
    the format itself is the encoder's either way. A final assistant message is then closed with ``</s>``."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    request = ChatCompletionRequest.from_openai(messages=messages, tools=[_tool(t) for t in tools] if tools else None)
    mistral = tokenizer()
    if validate:
        tokenized = mistral.encode_chat_completion(request)
    else:
        tokenized = mistral.instruct_tokenizer.encode_instruct(
            mistral._instruct_request_normalizer.from_chat_completion_request(request))
    return tokenized.text, tokenized.tokens


def tokenize_rendered(text: str) -> list[int]:
    """A rendered prompt's ids as the server tokenizes it: each special token's string one control id, the text
    between them through the tekken BPE."""
    import re

    inner = tokenizer().instruct_tokenizer.tokenizer
    names = sorted(inner._special_tokens_reverse_vocab, key=len, reverse=True)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, names)) + ")", text):
        if piece in inner._special_tokens_reverse_vocab:
            ids.append(inner._special_tokens_reverse_vocab[piece])
        elif piece:
            ids.extend(inner.encode(piece, bos=False, eos=False))
    return ids
