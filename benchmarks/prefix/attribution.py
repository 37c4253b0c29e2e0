"""Why each prompt token missed the cache, over a whole workload.

Three runs of the same request sequence (same order and batching) give each request's cached tokens in the achieved
run (finite cache), in an unbounded run (the ideal) and in an unbounded run that ignores salts; the causes and the
rules that charge each missed token to one of them live in the product (server/cache/miss_causes.py), shared with the
live cache inspector.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from benchmarks.prefix.simulator import SimResult
from benchmarks.prefix.traces.trace import TokenRequest
from server.cache.miss_causes import CAUSES, CHANGE_TEMPLATE, common_prefix, miss_causes

__all__ = ["CAUSES", "RequestMisses", "attribute", "summarize"]


@dataclass
class RequestMisses:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int
    causes: Counter = field(default_factory=Counter)


def attribute(
    requests: Sequence[TokenRequest], achieved: SimResult, ideal: SimResult, ideal_no_salt: SimResult
) -> list[RequestMisses]:
    by_id = {r.request_id: r for r in requests}
    out = []
    for r in requests:
        got = achieved.by_id[r.request_id].cached_tokens
        best = ideal.by_id[r.request_id].cached_tokens
        unsalted = ideal_no_salt.by_id[r.request_id].cached_tokens
        miss = RequestMisses(r.request_id, r.prompt_tokens, got, best)
        parent = by_id.get(r.parent) if r.parent else None
        context_tokens, change = None, None
        if parent is not None:
            context = parent.committed_ids(achieved.config.commit_outputs)
            context_tokens = min(len(context) * r.tokens_per_id, r.prompt_tokens)
            if common_prefix(r.prompt, context) < min(len(context), len(r.prompt)):
                change = r.change or CHANGE_TEMPLATE
        miss.causes = miss_causes(r.prompt_tokens, got, best, unsalted, context_tokens, change)
        out.append(miss)
    return out


def summarize(misses: Sequence[RequestMisses]) -> dict[str, int]:
    """Missed tokens per cause, largest first."""
    total: Counter = Counter()
    for m in misses:
        total.update(m.causes)
    return dict(total.most_common())
