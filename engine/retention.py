"""What a request asks the prefix cache to keep beyond LRU: breakpoint pins and a hold after it finishes.

- A `CachePin` is a breakpoint (Anthropic ``cache_control``, a named cache): the full blocks of the first
  ``num_tokens`` prompt tokens stay cached ``ttl_s`` seconds after their last use (every hit refreshes it), and
  are evicted only after every ordinary block.
- ``hold_after_finish_s`` keeps the sequence's blocks (prompt and reply) the same way after it ends, until the
  caller settles the hold (`LLMEngine.settle_hold`) and at most that long: how an agent session keeps its context
  while a tool runs. The server holds a session's request for ``--tool-call-ttl`` and, once the reply is parsed,
  keeps that hold if it ended in tool calls or releases it: an explicit word, no timing window.

The blocks one tenant retains (pins and holds together) are bounded by its share of the retention cap, so one
tenant's breakpoints and sessions cannot take the whole cap from the others.

Plain data, no torch: the server builds it, the scheduler hands it to the KV manager.
"""
from __future__ import annotations

from dataclasses import dataclass

# Anthropic's two cache lifetimes; `cache_control.ttl` takes these spellings.
TTL_CHOICES: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"


@dataclass(frozen=True)
class CachePin:
    num_tokens: int  # the breakpoint: this many leading prompt tokens (their full blocks are pinned)
    ttl_s: float

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.ttl_s < 0:
            raise ValueError(f"a cache pin needs num_tokens >= 0 and ttl_s >= 0, got {self}")


@dataclass(frozen=True)
class Retention:
    pins: tuple[CachePin, ...] = ()
    hold_after_finish_s: float = 0.0
    # Hybrid models: message boundaries (token counts) where the recurrent state is worth a snapshot, e.g. the end of
    # the system prompt and tools, the start of the last user turn (engine.kv.snapshot_policy)
    snapshot_hints: tuple[int, ...] = ()
    # Whose share of the retention cap these blocks count against (`EngineConfig.max_retained_share_per_tenant`);
    # None: the cap's alone (one tenant, or a caller that does not split it)
    tenant: str | None = None

    def __post_init__(self) -> None:
        if self.hold_after_finish_s < 0:
            raise ValueError(f"hold_after_finish_s must be >= 0, got {self.hold_after_finish_s}")

    def pin_ttl(self, block_index: int, block_size: int) -> float:
        """How long block ``block_index`` is pinned (0: not): the longest TTL of the pins that cover it whole."""
        return max((p.ttl_s for p in self.pins if (block_index + 1) * block_size <= p.num_tokens), default=0.0)

    def num_pinned_blocks(self, block_size: int) -> int:
        return max((p.num_tokens // block_size for p in self.pins), default=0)
