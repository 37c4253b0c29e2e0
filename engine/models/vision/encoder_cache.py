"""The encoder cache: an image's embeddings (the vision tower's output), kept by the image's content hash within a
memory budget, least recently used out first. An image already encoded is not encoded again: not when a later
prefill chunk needs more of its tokens, not when the prefix cache misses (a different conversation carrying the
same screenshot), not when a preempted request comes back."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    """``get(hash, encode)`` returns the cached embeddings or calls ``encode()`` and keeps its result if it fits
    (an image larger than the whole budget is encoded each time it is needed, never kept)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        value = encode()
        self.put(key, value)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if key in self._entries or size > self.budget_bytes:
            return
        while self.used_bytes + size > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.used_bytes += size
