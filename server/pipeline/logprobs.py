"""Token log-probabilities in the two OpenAI shapes: chat (`{"content": [{token, logprob, bytes, top_logprobs}]}`) and
text completions (`{tokens, token_logprobs, top_logprobs, text_offset}`).

A token's text is its own bytes, which for byte-level BPE (Qwen, Llama 3, SmolLM2) can be part of a UTF-8 character:
`bytes` carries them exactly, `token` shows them decoded with replacement characters, as OpenAI does.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache
from typing import Any

from engine.outputs import TokenLogprobs


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
        # once: transformers builds the list on every read (it made each new token's text cost ~70 us, seconds on
        # the event loop for a long prompt's prompt_logprobs)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._raw_bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return cached

    def prime(self, token_ids: Iterable[int]) -> None:
        """Cache the texts of many tokens at once (one call into the tokenizer for their pieces: a long prompt's
        prompt logprobs name tens of thousands of tokens)."""
        missing = sorted(set(token_ids).difference(self._cache))
        for token_id, piece in zip(missing, self._tokenizer.convert_ids_to_tokens(missing)):
            raw = self._raw_bytes(token_id, piece)
            self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))

    def _raw_bytes(self, token_id: int, piece: str | None = None) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id) if piece is None else piece
        alphabet = _byte_level_alphabet()
        special = token_id in self._special
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
        if entry is not None:
            text_offset = _add_token(out, texts, entry.token_id, entry, num_top, text_offset)
    return out


def echoed_logprobs(texts: TokenTexts, prompt_ids: list[int], prompt: list[TokenLogprobs | None],
                    completion: list[TokenLogprobs | None], num_top: int, completion_offset: int) -> dict[str, list]:
    """`echo` with `logprobs`: the prompt's tokens first (the first one has no logprob: null, as OpenAI and vLLM
    send), then the completion's, whose text starts at `completion_offset`."""
    texts.prime([*prompt_ids, *_named_tokens(prompt, num_top)])
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, entry in zip(prompt_ids, prompt):
        offset = _add_token(out, texts, token_id, entry, num_top, offset)
    rest = completion_logprobs(texts, completion, num_top, completion_offset)
    return {key: out[key] + rest[key] for key in out}


def _add_token(out: dict[str, list], texts: TokenTexts, token_id: int, entry: TokenLogprobs | None, num_top: int,
               offset: int) -> int:
    token, _ = texts.get(token_id)
    out["tokens"].append(token)
    out["token_logprobs"].append(None if entry is None else entry.logprob)
    out["top_logprobs"].append(None if entry is None else {texts.get(t)[0]: lp for t, lp in entry.top[:num_top]})
    out["text_offset"].append(offset)
    return offset + len(token)


def vllm_prompt_logprobs(texts: TokenTexts, entries: list[TokenLogprobs | None],
                         num_top: int) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` shape: per prompt token, null for the first, else {token id: {logprob, rank,
    decoded_token}} for the prompt token and its position's `num_top` most likely tokens."""
    texts.prime(_named_tokens(entries, num_top))
    out: list[dict[str, dict] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {str(t): {"logprob": lp, "rank": rank, "decoded_token": texts.get(t)[0]}
                    for rank, (t, lp) in enumerate(entry.top[:num_top], start=1)}
        position[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                         "decoded_token": texts.get(entry.token_id)[0]}
        out.append(position)
    return out


def _named_tokens(entries: Iterable[TokenLogprobs | None], num_top: int) -> Iterator[int]:
    """Every token the entries name: each scored token and its ``num_top`` alternatives."""
    for entry in entries:
        if entry is not None:
            yield entry.token_id
            yield from (token_id for token_id, _ in entry.top[:num_top])
