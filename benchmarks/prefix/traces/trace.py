"""The unit every prefix-cache run consumes: one request as token ids plus how it relates to earlier requests."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from engine.multimodal import ImageInput, ImagePrompt
from engine.retention import CachePin

T = TypeVar("T")


@dataclass
class TokenRequest:
    """One request as the KV manager sees it.

    ``output`` is what the reply appends to the sequence (committed to the cache after the prompt, as the engine
    caches blocks during decode). ``parent`` is the request whose context this one continues (the previous turn of
    the session, or the request a worker was forked from); the simulator runs a request only after its parent.
    ``change`` says how the context differs from the parent's (``None``: it extends the parent's prompt and reply).

    Block-hash traces (Mooncake) put one id per 512-token block into ``prompt``: ``tokens_per_id`` scales matched
    ids back to tokens, ``num_tokens`` is the true prompt length, and ``num_committed`` excludes the unique
    sentinel that keeps the "recompute the last block" rule from cutting off the last real block.

    ``images``: the prompt's images, each over its run of placeholder tokens (engine/multimodal.py), as the server
    hands them to the engine; block hashing mixes in their content hashes, as the engine's does.
    """

    request_id: str
    session: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    salt: str | None = None
    parent: str | None = None
    turn: int = 0
    change: str | None = None
    arrival: int = 0  # earliest scheduler step at which it may start (its parent must also have finished)
    tokens_per_id: int = 1
    num_tokens: int | None = None
    num_committed: int | None = None
    think_s: float = 0.0  # after its parent finished, how long until it arrives (an agent's tool-call gap)
    ends_in_tool_call: bool = False  # its reply is a tool call: the session comes back after the tool ran
    pins: tuple[CachePin, ...] = ()  # cache_control breakpoints (engine/retention.py)
    snapshot_hints: tuple[int, ...] = ()  # hybrid models: the message boundaries the server would hint
    images: tuple[ImageInput, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return self.num_tokens if self.num_tokens is not None else len(self.prompt)

    def cached_tokens(self, matched_ids: int) -> int:
        """Prompt tokens served by ``matched_ids`` cached ids."""
        return min(matched_ids * self.tokens_per_id, self.prompt_tokens)

    def engine_prompt(self) -> list[int] | ImagePrompt:
        """What the engine is sent: the ids, with the images over their placeholder runs where there are any."""
        return ImagePrompt(self.prompt, self.images) if self.images else self.prompt

    def committed_ids(self, include_output: bool) -> list[int]:
        """The ids whose K/V exist after this request ran: the prompt (less a sentinel) and, optionally, the reply."""
        prompt = self.prompt if self.num_committed is None else self.prompt[: self.num_committed]
        return prompt + self.output if include_output else list(prompt)


def read_jsonl(path: str | Path, parse: Callable[[dict], T], what: str) -> Iterator[T]:
    """``parse(row)`` for each non-empty line; a line that does not parse raises ValueError naming file and line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse(json.loads(line))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not {what} ({exc})") from None


class PromptTotals:
    """Totals over ``self.results`` (each with ``prompt_tokens`` and ``cached_tokens``): one run's hit rate."""

    results: Sequence

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.results)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.results)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
