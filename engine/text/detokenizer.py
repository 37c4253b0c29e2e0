"""Incremental detokenization and stop-string matching for streamed output.

Decoding token by token is not ``decode([token])`` per token: byte-level BPE tokens can hold part of a UTF-8
character, and SentencePiece-style decoders drop or add a leading space depending on what precedes a token. So each
step decodes a short window of recent tokens twice, once without the new token (the *prefix* part, up to the read
offset) and once with it, and emits the difference; the window start only moves once the text up to the read offset
is final.
"""
from __future__ import annotations

import functools
from typing import Callable, Protocol

import tokenizers

# Tokens of prompt context decoded before the first output token: enough for a SentencePiece decoder to see that
# the first output token is not at the start of the text, and for a byte-level character split over up to 4 tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class SupportsDecode(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _decoder(tokenizer: SupportsDecode, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The fastest faithful decode: a transformers fast tokenizer's Rust backend unless it post-processes text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        tokenizer = backend
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)  # no Python frame a call


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas that never split a character.

    The concatenation of all ``add`` results plus ``flush()`` equals the text the output tokens decode to in the
    context of the prompt.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        token_texts: dict[int, str] | None = None,
    ) -> None:
        """``token_texts``: single tokens' texts (as this tokenizer decodes them with this ``skip_special_tokens``),
        filled as they are met and shared by every sequence of one output processor: after each emit the window
        usually restarts at the one token just emitted, whose text is then looked up instead of decoded."""
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._token_texts: dict[int, str] = {} if token_texts is None else token_texts
        self._ids: list[int] = list(prompt_token_ids or [])
        self._read_offset = len(self._ids)  # tokens before this are already emitted as text
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)  # window start
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._parts)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        ids = self._ids
        ids.append(token_id)
        window_text = self._decode(ids[self._prefix_offset :])
        # A trailing U+FFFD is (almost always) an incomplete UTF-8 sequence the next token will finish.
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text)

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens without making their text yet: the next `add` or `flush` emits it (one decode for all)."""
        self._ids += token_ids

    def flush(self) -> str:
        """Release whatever is held back at the end of the stream, even an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids[self._prefix_offset :]))

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        window = self._ids[self._prefix_offset : self._read_offset]
        if len(window) == 1:
            text = self._token_texts.get(window[0])
            if text is None:
                text = self._token_texts[window[0]] = self._decode(window)
            self._prefix_text = text
        else:
            self._prefix_text = self._decode(window)
        self._parts.append(delta)
        return delta


class StopStringMatcher:
    """Cuts a text stream at the first stop string, holding back any tail that may still grow into one.

    "First" means the stop string that is complete earliest in the text (ties: the one starting earliest), which is
    where generation would halt. The result is the same however the stream is split into deltas: emitted text never
    contains the start of a stop string, so no match can begin in text that was already released.
    """

    def __init__(self, stops: list[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(stops)
        self._max_hold = max((len(stop) for stop in stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit); after a hit, nothing more is emitted."""
        if self.stopped:
            return "", True
        pending = self._held + text_delta
        cut = self._first_stop(pending)
        if cut is not None:
            self._held, self.stopped = "", True
            return pending[:cut], True
        hold = self._partial_stop_suffix(pending)
        self._held = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens without making their text yet: the next `add` or `flush` emits it (one decode for all)."""
        self._ids += token_ids

    def flush(self) -> str:
        """At the end of the stream: the held-back text, which turned out not to be a stop string."""
        released, self._held = self._held, ""
        return "" if self.stopped else released

    def _first_stop(self, text: str) -> int | None:
        """Start index of the stop string that ends earliest in text (remembered in `matched`), or None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)  # the first occurrence of a string also ends first
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        self.matched = best[2]
        return best[1]

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_hold), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
