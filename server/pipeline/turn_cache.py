"""A session's last turn, kept so that its next turn tokenizes and hashes only what changed (issue 42, item 3).

An agent's turn is its previous turn plus a reply and a tool result: 30-150k tokens of which a few thousand are new.
Rendering stays whole (string joins: milliseconds); tokenizing the whole text and hashing every block do not.

- Tokenizing: the rendered text is cut before each of the tokenizer's added tokens (the templates' message
  markers, ``<|im_start|>`` and the like). A tokenizer splits those out before anything else, so the ids of the whole
  text are the ids of its pieces joined; a piece the session's last turn had keeps its ids, only new pieces are
  tokenized. `TurnCache.for_template` takes the markers a sample conversation renders with, checks that property on it
  and on probes, and cuts nothing where it fails.
- Hashing: the pieces before the first one that differs from the last turn's hold the same tokens at the same
  positions, so the full blocks among them have the last turn's hashes (same session, hence the same cache salt);
  only the blocks after are hashed (`EngineRequest.known_block_hashes`, extended by `RequestPreparer.prepare` on the
  prepare lane, off the engine thread).

The fall-back is built in: a template that rewrites earlier turns, thinking dropped from past replies, a compaction
or an edited system prompt changes some piece, which is tokenized anew, and hashing restarts at the first block that
piece touches. Nothing is reused that is not equal. A session is its tenant's cache salt and the session id the
client sent (server/cache/session.py); requests without a session id are tokenized whole.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from engine.kv.block_hashing import BlockHash
from engine.requests import EngineRequest

Encode = Callable[[str], list[int]]
# A probe of what the templates write around their markers: text before the first, newlines and spaces on both sides,
# a marker right after another, words that a tokenizer would merge across a cut.
# What the templates write for an agent's turns: the markers they use are the ones found here.
SAMPLE = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
              "name": "read_file", "arguments": '{"path": "a.py"}'}}]},
          {"role": "tool", "tool_call_id": "call_0", "content": "def f():\n    return 1\n"},
          {"role": "assistant", "content": "Fixed.", "reasoning_content": "It returns 1."},
          {"role": "user", "content": "Thanks. Add a test."}]
_PROBE = ("Hello world {m}system\nYou are  helpful.{m}\n{m}user\n  indented\ttab {m}{m}assistant\n"
          "<think>\n\n</think>\n\nok.{m} trailing")


@dataclass
class TurnTokens:
    """A turn's prompt ids, and the hashes of its first full blocks as the session's last turn computed them."""

    token_ids: list[int]
    known_block_hashes: list[BlockHash] = field(default_factory=list)
    turn: _LastTurn | None = None  # what the session keeps of it (None: not kept)

    def remember(self, request: EngineRequest) -> None:
        """``request`` carries these ids: the session's next turn reuses its block hashes once it is prepared (not
        with images, whose blocks hash their content too)."""
        if self.turn is not None and not request.images and len(request.prompt_token_ids) == self.turn.num_tokens:
            self.turn.request = request


@dataclass
class _LastTurn:
    pieces: list[str]
    piece_ids: dict[str, list[int]]
    starts: list[int]  # each piece's first token index (and one past the last)
    request: EngineRequest | None = None  # its request (`TurnTokens.remember`): block hashes once prepared

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]


class TurnCache:
    """Each session's last turn (the most recently used ``max_tokens`` tokens' worth of sessions); thread-safe (the
    prepare lanes share it)."""

    def __init__(self, markers: tuple[str, ...], block_size: int, max_tokens: int = 4_000_000) -> None:
        # the markers matched, not a lookahead split: a zero-width match is tried at every position (250x slower)
        self._cut = re.compile("|".join(map(re.escape, markers))) if markers else None
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._turns: OrderedDict[Hashable, _LastTurn] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @classmethod
    def for_template(cls, tokenizer: Any, render: Callable[[list[dict]], str], block_size: int,
                     max_tokens: int = 4_000_000) -> TurnCache:
        """Cut before the tokenizer's added tokens (taking no neighbouring whitespace) that the template writes in
        a sample conversation (``render``), if cutting there leaves the sample's ids and a probe's unchanged; else
        cut nothing (every turn is tokenized whole)."""
        try:
            sample = render(SAMPLE)
        except Exception:  # noqa: BLE001 - a template that refuses the sample: no cuts, every turn whole
            return cls((), block_size, max_tokens)
        added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                 if t.content.strip() == t.content and t.content and not (t.lstrip or t.rstrip or t.single_word)}
        markers = tuple(sorted((m for m in added if m in sample), key=len, reverse=True))
        cache = cls(markers, block_size, max_tokens)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        probes = [sample, *(_PROBE.format(m=m) for m in markers)]
        if markers and any(cache._pieces_ids(text, encode) != encode(text) for text in probes):
            return cls((), block_size, max_tokens)
        return cache

    @property
    def cuts(self) -> bool:
        return self._cut is not None

    def _split(self, text: str) -> list[str]:
        """``text`` cut before each marker (no empty pieces)."""
        if self._cut is None:
            return [text]
        cuts = [0, *(m.start() for m in self._cut.finditer(text)), len(text)]
        return [text[i:j] for i, j in zip(cuts, cuts[1:]) if j > i]

    def _pieces_ids(self, text: str, encode: Encode) -> list[int]:
        return [t for piece in self._split(text) for t in encode(piece)]

    def encode(self, session: Hashable | None, text: str, encode: Encode) -> TurnTokens:
        """``text``'s ids (equal to ``encode(text)``), reusing what ``session``'s last turn tokenized and hashed; the
        turn becomes the session's last (`TurnTokens.remember` adds its request)."""
        if session is None or self._cut is None:
            return TurnTokens(encode(text))
        pieces = self._split(text)
        with self._lock:
            last = self._turns.get(session)
        known = last.piece_ids if last is not None else {}
        piece_ids: dict[str, list[int]] = {}
        ids: list[int] = []
        starts = [0]
        for piece in pieces:
            got = piece_ids.get(piece)
            if got is None:
                got = known.get(piece)
                piece_ids[piece] = got if got is not None else encode(piece)
                got = piece_ids[piece]
            ids.extend(got)
            starts.append(len(ids))
        turn = _LastTurn(pieces, piece_ids, starts)
        hashes = self._known_hashes(last, pieces)
        with self._lock:
            old = self._turns.pop(session, None)
            self._tokens += turn.num_tokens - (old.num_tokens if old is not None else 0)
            self._turns[session] = turn
            while self._tokens > self.max_tokens and len(self._turns) > 1:
                self._tokens -= self._turns.popitem(last=False)[1].num_tokens
        return TurnTokens(ids, hashes, turn)

    def _known_hashes(self, last: _LastTurn | None, pieces: list[str]) -> list[BlockHash]:
        """The last turn's hashes of the full blocks before the first piece that differs."""
        if last is None or last.request is None or not last.request.block_hashes or last.request.images:
            return []
        same = 0
        for new, old in zip(pieces, last.pieces):
            if new != old:
                break
            same += 1
        return last.request.block_hashes[: last.starts[same] // self.block_size]
