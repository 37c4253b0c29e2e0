"""Token log-probabilities in the two OpenAI shapes: chat (`{"content": [{token, logprob, bytes, top_logprobs}]}`) and
text completions (`{tokens, token_logprobs, top_logprobs, text_offset}`).

A token's text is its own bytes, which for byte-level BPE (Qwen, Llama 3, SmolLM2) can be part of a UTF-8 character:
`bytes` carries them exactly, `token` shows them decoded with replacement characters, as OpenAI does.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from engine.sampler import TokenLogprobs


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE maps each byte to a printable character; this is the inverse map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenTexts:
    """Token id -> (text, bytes), cached per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._raw_bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return cached

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        alphabet = _byte_level_alphabet()
        special = token_id in getattr(self._tokenizer, "all_special_ids", ())
        if isinstance(piece, str) and not special and all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        # Special tokens and non-byte-level vocabularies: the decoded text is the best we have.
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprobs | None], num_top: int) -> dict[str, list]:
    content = []
    for entry in entries:
        if entry is None:
            continue
        token, raw = texts.get(entry.token_id)
        top = []
        for token_id, logprob in entry.top[:num_top]:
            alt, alt_raw = texts.get(token_id)
            top.append({"token": alt, "logprob": logprob, "bytes": alt_raw})
        content.append({"token": token, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    texts: TokenTexts, entries: list[TokenLogprobs | None], num_top: int, text_offset: int
) -> dict[str, list]:
    """`text_offset` is where the first token's text starts in the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:
            continue
        token, _ = texts.get(entry.token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append({texts.get(t)[0]: lp for t, lp in entry.top[:num_top]})
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out
