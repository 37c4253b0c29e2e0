"""Why each prompt token missed the cache.

Every missed token of a request (prompt - cached) gets exactly one cause, from three runs of the same request
sequence (same order and batching): the achieved run (finite cache), an unbounded run (the ideal) and an unbounded
run that ignores salts. What the ideal hits but the achieved run missed was evicted; what the salt-blind run hits
beyond the ideal was kept apart by salts. The rest is explained by comparing the prompt with its parent's context
(the parent's prompt and reply): the old context lost after a divergence is charged to the change that caused it
(tool list, compaction, template), and what lies beyond the old context is new this turn.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from benchmarks.prefix.simulator import SimResult
from benchmarks.prefix.trace import CHANGE_TEMPLATE, TokenRequest

CAUSES: dict[str, str] = {
    "first_request": "first request of a session: nothing reusable was computed before",
    "new_tokens": "new this turn (beyond the previous context): no cache can hold them",
    "block_granularity": "partial last block of the previous context, or the last block that is always recomputed",
    "evicted": "evicted: an unbounded cache would have hit",
    "different_salt": "different cache salt: the same prefix is cached for another tenant",
    "tool_list": "prefix changed by the tool list (tools are rendered at the head)",
    "compaction": "prefix changed by compaction (history replaced by a summary)",
    "template_reasoning": "prefix changed by the chat template: earlier turns' reasoning dropped (Qwen3 <think>)",
    "template": "prefix changed by the chat template (earlier turns re-rendered differently)",
    "billing_nonce": "prefix changed by Claude Code's per-request billing nonce (removed by server/normalize.py)",
    "system_hoisted": "prefix changed by a new mid-conversation system message hoisted into the head (DeepSeek "
                      "templates; rendered in place by server/normalize.py)",
}


@dataclass
class RequestMisses:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int
    causes: Counter = field(default_factory=Counter)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


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
        miss.causes["evicted"] = max(0, best - got)
        miss.causes["different_salt"] = max(0, unsalted - best)
        rest = r.prompt_tokens - max(got, best, unsalted)
        parent = by_id.get(r.parent) if r.parent else None
        if parent is None:
            miss.causes["first_request"] = rest
        else:
            context = parent.committed_ids(achieved.config.commit_outputs)
            reusable = min(len(context) * r.tokens_per_id, r.prompt_tokens)
            lost = min(rest, max(0, reusable - max(got, best, unsalted)))
            diverged = common_prefix(r.prompt, context) < min(len(context), len(r.prompt))
            miss.causes[(r.change or CHANGE_TEMPLATE) if diverged else "block_granularity"] = lost
            miss.causes["new_tokens"] = rest - lost
        miss.causes = Counter({k: v for k, v in miss.causes.items() if v > 0})
        out.append(miss)
    return out


def summarize(misses: Sequence[RequestMisses]) -> dict[str, int]:
    """Missed tokens per cause, largest first."""
    total: Counter = Counter()
    for m in misses:
        total.update(m.causes)
    return dict(total.most_common())
