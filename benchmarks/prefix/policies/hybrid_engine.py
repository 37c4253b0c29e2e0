"""``kvserve bench prefix --hybrid --engine``: the agent workloads through the real engine serving a hybrid model,
request for request against the simulator of benchmarks/prefix/policies/hybrid.py, with vLLM's align mode simulated on the
same requests.

The engine runs the workloads at the engine sizes of ``bench prefix`` (``ENGINE_WORKLOAD_PARAMS``) one request at a
time in arrival order, as the simulator does, each with the snapshot hints and breakpoints the server would pass
(`Retention`), generating one token: its own replies would differ from the scripted ones the next turns carry, so
only prompt blocks can be reused, and both simulations run with the replies not cached. The engine's state pool has
``slots`` snapshot slots and one running sequence's, as the simulated pool has. The engine
cuts prefill chunks at snapshot points, so a request's points are snapshotted in successive steps (the simulator
takes them all in one): with a pool too small for one request's points the two may keep different ones.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from benchmarks.prefix.policies.hybrid import HybridPolicy, StateCost, policies, run_policy
from benchmarks.prefix.traces.trace import TokenRequest


@dataclass(frozen=True)
class EngineRun:
    cached: list[int]  # per request
    ttft_s: list[float]
    wall_s: float


def run_engine(llm, requests: Sequence[TokenRequest]) -> EngineRun:
    """Each request alone, in order, with its hints and pins; one generated token."""
    from engine import SamplingParams
    from engine.retention import Retention

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cached, ttft = [], []
    start = time.perf_counter()
    for r in requests:
        retention = Retention(r.pins, 0.0, r.snapshot_hints) if r.pins or r.snapshot_hints else None
        out = llm.generate([r.engine_prompt()], params, cache_salt=[r.salt], retention=[retention], use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)
        ttft.append(out.metrics.ttft_s)
    return EngineRun(cached, ttft, time.perf_counter() - start)


def compare_with_engine(llm, name: str, requests: Sequence[TokenRequest], cost: StateCost, slots: int) -> dict:
    """One workload: the engine's hits, the simulated kvserve policy's (request for request) and vLLM align's."""
    by_name: dict[str, HybridPolicy] = {p.name: p for p in policies(cost)}
    engine = run_engine(llm, requests)
    sim = run_policy(requests, by_name["kvserve"], slots, include_output=False)
    vllm = run_policy(requests, by_name["vLLM align"], slots, include_output=False)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {
        "workload": name, "requests": len(requests), "prompt_tokens": prompt_tokens, "slots": slots,
        "engine_hit_rate": sum(engine.cached) / prompt_tokens, "simulator_hit_rate": sim.hit_rate,
        "requests_equal": sum(e == s for e, s in zip(engine.cached, sim.per_request)),
        "vllm_align_hit_rate": vllm.hit_rate, "engine_ttft_p50_s": statistics.median(engine.ttft_s),
        "engine_wall_s": engine.wall_s, "engine_cached": engine.cached, "simulator_cached": sim.per_request,
    }


def engine_markdown(model: str, rows: list[dict], shape: str) -> str:
    from benchmarks.prefix.report import markdown_table, pct

    head = (f"### Engine ({model}, engine workload sizes, one generated token per request, replies not cached; "
            f"vLLM align simulated with {shape}'s block)\n")
    return head + "\n" + markdown_table(
        ["workload", "requests", "prompt tokens", "snapshot slots", "engine hit rate", "simulator (kvserve)",
         "requests equal", "vLLM align (simulated)", "engine TTFT p50 (s)"],
        [[r["workload"], r["requests"], f"{r['prompt_tokens']:,}", r["slots"], pct(r["engine_hit_rate"]),
          pct(r["simulator_hit_rate"]), f"{r['requests_equal']}/{r['requests']}", pct(r["vllm_align_hit_rate"]),
          f"{r['engine_ttft_p50_s']:.3f}"] for r in rows])
