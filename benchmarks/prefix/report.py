"""Per-workload figures (achieved vs ideal hit rate, prefill saved, miss causes) as JSON-ready dicts and markdown."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from benchmarks.prefix.attribution import CAUSES, RequestMisses, summarize
from benchmarks.prefix.simulator import SimResult


def workload_report(
    name: str, description: str, achieved: SimResult, ideal: SimResult, misses: Sequence[RequestMisses]
) -> dict:
    """Figures of one workload; ``hit_rate`` is cached prompt tokens / prompt tokens."""
    causes = summarize(misses)
    return {
        "name": name,
        "description": description,
        "requests": len(achieved.results),
        "prompt_tokens": achieved.prompt_tokens,
        "cached_tokens": achieved.cached_tokens,
        "hit_rate": achieved.hit_rate,
        "ideal_hit_rate": ideal.hit_rate,
        "fraction_of_ideal": achieved.hit_rate / ideal.hit_rate if ideal.hit_rate else 1.0,
        "prefill_tokens_saved": achieved.cached_tokens,
        "prefill_tokens_computed": achieved.prompt_tokens - achieved.cached_tokens,
        "evictions": achieved.evictions,
        "miss_causes": causes,
        "main_miss_cause": _main_avoidable_cause(causes),
        "per_request": [
            {"request_id": m.request_id, "turn": r.turn, "session": r.session, "prompt_tokens": m.prompt_tokens,
             "cached_tokens": m.cached_tokens, "ideal_cached_tokens": m.ideal_tokens, "miss_causes": dict(m.causes)}
            for m, r in zip(misses, achieved.results_in(misses))
        ],
    }


_UNAVOIDABLE = ("new_tokens", "first_request", "block_granularity")


def _main_avoidable_cause(causes: dict[str, int]) -> str | None:
    """The largest miss cause a user could act on (not new tokens, first requests or block rounding)."""
    return next((c for c in causes if c not in _UNAVOIDABLE), None)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def workloads_markdown(reports: Sequence[dict]) -> str:
    rows = []
    for r in reports:
        top = ", ".join(f"{c} {r['miss_causes'][c] / r['prompt_tokens']:.1%}" for c in list(r["miss_causes"])[:3])
        rows.append([r["name"], r["requests"], f"{r['prompt_tokens']:,}", pct(r["hit_rate"]), pct(r["ideal_hit_rate"]),
                     pct(r["fraction_of_ideal"]), f"{r['prefill_tokens_saved']:,}", r["main_miss_cause"] or "-", top])
    table = markdown_table(
        ["workload", "requests", "prompt tokens", "hit rate", "ideal", "of ideal", "prefill saved",
         "main avoidable miss cause", "largest miss causes (share of prompt tokens)"], rows)
    legend = "\n".join(f"- `{k}`: {v}" for k, v in CAUSES.items())
    return f"{table}\n\nMiss causes:\n{legend}\n"


def sweep_markdown(field_name: str, results: Sequence[SimResult], label: str = "") -> str:
    rows = [[getattr(r.config, field_name) if getattr(r.config, field_name) is not None else "unbounded",
             pct(r.hit_rate), f"{r.cached_tokens:,}", r.evictions] for r in results]
    return (f"{label}\n\n" if label else "") + markdown_table([field_name, "hit rate", "cached tokens", "evictions"], rows)


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
