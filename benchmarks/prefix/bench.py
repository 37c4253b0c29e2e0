"""The three prefix-cache benchmarks behind ``kvserve bench prefix | simulate | replay``: each returns its JSON
figures and writes a markdown report and PNG plots into ``out_dir``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

from benchmarks.prefix import plots
from benchmarks.prefix.attribution import attribute
from benchmarks.prefix.report import markdown_table, pct, sweep_markdown, workload_report, workloads_markdown
from benchmarks.prefix.simulator import SimConfig, SimResult, simulate, sweep
from benchmarks.prefix.traces.trace import TokenRequest
from benchmarks.prefix.workloads import WorkloadParams
from engine.config import EvictionPolicy, SchedulingPolicy

# Workload sizes for the engine-backed run: a tiny model prefills a few hundred tokens per second on a CPU.
ENGINE_WORKLOAD_PARAMS = WorkloadParams(
    head_words=250, tasks=2, steps_per_task=2, result_words=(10, 80), reasoning_words=(5, 20), compaction_words=400,
    forked_workers=1, fresh_workers=1, worker_steps=1, sessions=3, session_steps=2, groups=2, questions=3,
    shared_prefix_words=200, question_words=15, num_prefixes=2, repetitions=3, repeated_prefix_words=150,
)


def analyze(name: str, description: str, requests: Sequence[TokenRequest], cfg: SimConfig) -> tuple[dict, SimResult]:
    """Achieved run, ideal (unbounded) run, salt-blind ideal run, miss attribution: one workload's report."""
    achieved = simulate(requests, cfg)
    ideal = simulate(requests, replace(cfg, capacity_blocks=None))
    no_salt = simulate(requests, replace(cfg, capacity_blocks=None, ignore_salts=True))
    return workload_report(name, description, achieved, ideal, attribute(requests, achieved, ideal, no_salt)), ideal


def capacity_points(ideal: SimResult, num: int = 8) -> list[int]:
    """Capacities from 1/64 of what an unbounded run keeps up to all of it, log-spaced."""
    top = max(ideal.peak_cached_blocks, 1)
    return sorted({max(1, round(top * 2 ** (-k * 6 / (num - 1)))) for k in range(num)})


# ---- kvserve bench prefix ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixOptions:
    model: str = "qwen3-tiny"
    workloads: tuple[str, ...] = ("all",)
    seed: int = 0
    sim: SimConfig = SimConfig(capacity_blocks=4096)
    block_sizes: tuple[int, ...] = (8, 16, 32, 64)
    engine: bool = True
    ttft_prompt_tokens: int = 4096
    cached_fraction: float = 0.9
    out_dir: str = "results/prefix"
    compaction_every: int = 6  # the compaction_aware / compaction_naive workloads: requests between compactions


def run_prefix(opts: PrefixOptions) -> dict:
    from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
    from benchmarks.prefix.catalog import build_workloads

    mt = load_model_text(opts.model)
    sim = replace(opts.sim, model_id=opts.model)
    reports, curves = [], {}
    for wl in build_workloads(list(opts.workloads), WorkloadParams(seed=opts.seed,
                                                                    compaction_every=opts.compaction_every)):
        requests = tokenize_workload(wl, mt)
        rep, ideal = analyze(wl.name, wl.description, requests, sim)
        caps = sweep(requests, sim, "capacity_blocks", capacity_points(ideal), progress=False)
        sizes = sweep(requests, replace(sim, capacity_blocks=None), "block_size", opts.block_sizes, progress=False)
        policies = sweep(requests, sim, "policy", list(SchedulingPolicy), progress=False)
        tight = capacity_points(ideal)[len(capacity_points(ideal)) // 2]  # a capacity where eviction order matters
        evictions = sweep(requests, replace(sim, capacity_blocks=tight), "eviction_policy",
                          list(EvictionPolicy), progress=False)
        rep["sweeps"] = {
            "capacity_blocks": [{"capacity_blocks": r.config.capacity_blocks, "hit_rate": r.hit_rate} for r in caps],
            "block_size_unbounded": [{"block_size": r.config.block_size, "hit_rate": r.hit_rate} for r in sizes],
            "policy": [{"policy": r.config.policy, "hit_rate": r.hit_rate} for r in policies],
            "eviction_policy": [{"eviction_policy": r.config.eviction_policy, "capacity_blocks": tight,
                                 "hit_rate": r.hit_rate} for r in evictions],
        }
        curves[wl.name] = [(r.config.capacity_blocks, r.hit_rate) for r in caps]
        reports.append(rep)
        print(f"{wl.name:18s} hit {pct(rep['hit_rate']):>6s}  ideal {pct(rep['ideal_hit_rate']):>6s}  "
              f"main avoidable miss cause: {rep['main_miss_cause']}", flush=True)
    out = Path(opts.out_dir)
    figures = {
        "model": opts.model,
        "simulator": asdict(sim),
        "hit_rate": sum(r["cached_tokens"] for r in reports) / max(1, sum(r["prompt_tokens"] for r in reports)),
        "workloads": reports,
        "plots": {
            "hit_rate_per_turn": str(plots.plot_hit_rate_per_turn(reports, out / "prefix_hit_rate_per_turn.png")),
            "hit_rate_vs_capacity": str(plots.plot_hit_rate_vs_capacity(curves, out / "prefix_hit_rate_vs_capacity.png")),
        },
    }
    md = [f"## Prefix cache: agent workloads ({opts.model}, simulator: block {sim.block_size}, "
          f"capacity {sim.capacity_blocks} blocks, {sim.max_num_seqs} seqs/step, {sim.policy})\n",
          workloads_markdown(reports)]
    md.append(markdown_table(
        ["workload"] + [f"block {b} (unbounded)" for b in opts.block_sizes] + [p.value for p in SchedulingPolicy]
        + ["tight capacity (blocks)"] + [f"evict {p}" for p in list(EvictionPolicy)],
        [[r["name"], *(pct(s["hit_rate"]) for s in r["sweeps"]["block_size_unbounded"]),
          *(pct(s["hit_rate"]) for s in r["sweeps"]["policy"]),
          str(r["sweeps"]["eviction_policy"][0]["capacity_blocks"]),
          *(pct(s["hit_rate"]) for s in r["sweeps"]["eviction_policy"])] for r in reports]))
    if opts.engine:
        figures["engine"] = _engine_part(opts, mt, out)
        md.append(_engine_markdown(figures["engine"]))
    (out / "prefix.md").write_text("\n\n".join(md) + "\n")
    figures["markdown"] = str(out / "prefix.md")
    return figures


def _engine_part(opts: PrefixOptions, mt, out: Path) -> dict:
    from benchmarks.prefix.engine_run import EngineSettings, make_llm, run_workload, ttft_cold_vs_warm
    from benchmarks.prefix.traces.render import tokenize_workload
    from benchmarks.prefix.catalog import build_workloads
    from benchmarks.prefix.workloads import tool_loop

    settings = EngineSettings(model=opts.model, block_size=opts.sim.block_size, max_num_seqs=opts.sim.max_num_seqs,
                              scheduling_policy=opts.sim.policy)
    llm = make_llm(settings)
    # The TTFT probe: a real agent prompt (the tool loop's last request), cut to the probe length.
    probe = tokenize_workload(tool_loop(WorkloadParams(seed=opts.seed)), mt)[-1].prompt[: opts.ttft_prompt_tokens]
    ttft = ttft_cold_vs_warm(llm, probe, opts.cached_fraction)
    print(f"TTFT cold {ttft.cold_ttft_s:.3f}s  warm ({ttft.cached_tokens}/{ttft.prompt_tokens} cached) "
          f"{ttft.warm_ttft_s:.3f}s  speedup {ttft.speedup:.1f}x  outputs identical: {ttft.outputs_identical}", flush=True)
    plot = plots.plot_ttft(ttft.cold_ttft_s, ttft.warm_ttft_s, ttft.cached_tokens / ttft.prompt_tokens,
                           out / "prefix_ttft_cold_vs_warm.png")
    runs = []
    for wl in build_workloads(list(opts.workloads), replace(ENGINE_WORKLOAD_PARAMS, seed=opts.seed,
                                                            compaction_every=opts.compaction_every)):
        requests = tokenize_workload(wl, mt)
        run = run_workload(llm, wl.name, requests, settings).summary()
        # What the simulator predicts for the same sends: the engine's outputs differ from the scripted replies,
        # so only prompt blocks can be reused across turns.
        predicted = simulate(requests, SimConfig(block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
                                                 commit_outputs=False, model_id=opts.model))
        run["simulated_hit_rate"] = predicted.hit_rate
        runs.append(run)
        print(f"engine {wl.name:18s} hit {pct(run['hit_rate']):>6s} (simulator {pct(predicted.hit_rate)})  "
              f"computed {run['prefill_tokens_computed']:,} of {run['prompt_tokens']:,} prompt tokens  "
              f"TTFT p50 {run['ttft_p50_s']:.3f}s", flush=True)
    return {"settings": asdict(settings), "ttft": {**ttft.summary(), "plot": str(plot)}, "workloads": runs}


def _engine_markdown(engine: dict) -> str:
    t = engine["ttft"]
    head = (f"### Engine ({engine['settings']['model']})\n\nTime to first token, same {t['prompt_tokens']}-token prompt: "
            f"cold {t['cold_ttft_s']:.3f} s, warm with {t['cached_tokens']} tokens cached {t['warm_ttft_s']:.3f} s: "
            f"**{t['speedup']:.1f}x** faster; outputs identical: {t['outputs_identical']}.\n")
    rows = [[w["workload"], w["requests"], f"{w['prompt_tokens']:,}", f"{w['prefill_tokens_computed']:,}",
             pct(w["hit_rate"]), pct(w["simulated_hit_rate"]), f"{w['ttft_p50_s']:.3f}",
             f"{w['prompt_tokens_per_s']:,.0f}"] for w in engine["workloads"]]
    table = head + "\n" + markdown_table(
        ["workload (engine sizes)", "requests", "prompt tokens", "prefill computed", "hit rate", "simulator",
         "TTFT p50 (s)", "prompt tok/s"], rows)
    compaction = compaction_markdown(engine["workloads"])
    return table + ("\n\n" + compaction if compaction else "")


def compaction_markdown(runs: list[dict]) -> str:
    """Cache-aware against naive compaction, measured in the same run (both workloads present; else "")."""
    by_name = {r["workload"]: r for r in runs}
    aware, naive = by_name.get("compaction_aware"), by_name.get("compaction_naive")
    if aware is None or naive is None:
        return ""
    mean = lambda r: sum(q["ttft_s"] for q in r["per_request"]) / len(r["per_request"])  # noqa: E731
    rows = [[name, f"{r['prompt_tokens']:,}", f"{r['prefill_tokens_computed']:,}", pct(r["hit_rate"]),
             f"{r['ttft_p50_s']:.3f}", f"{mean(r):.3f}"] for name, r in (("cache-aware", aware), ("naive", naive))]
    rows.append(["naive / cache-aware", "", f"{naive['prefill_tokens_computed'] / aware['prefill_tokens_computed']:.2f}x",
                 "", f"{naive['ttft_p50_s'] / aware['ttft_p50_s']:.2f}x", f"{mean(naive) / mean(aware):.2f}x"])
    return "### Compaction: cache-aware vs naive\n\n" + markdown_table(
        ["compaction", "prompt tokens", "prefill computed", "hit rate", "TTFT p50 (s)", "TTFT mean (s)"], rows)


# ---- kvserve bench simulate ---------------------------------------------------------------------------------------
def load_trace(path: str, block_size: int | None, limit: int | None = None) -> tuple[list[TokenRequest], int, str]:
    """Mooncake block-hash trace or ``--record`` trace, told apart by the first line; returns the block size to use."""
    from benchmarks.prefix.traces.mooncake import mooncake_requests, read_mooncake
    from benchmarks.prefix.traces.replay import read_records, records_to_requests

    with open(path) as f:
        first = json.loads(next(line for line in f if line.strip()))
    if "hash_ids" in first:
        return mooncake_requests(read_mooncake(path, limit)), 1, "mooncake"
    records = read_records(path)[:limit]
    block_size = block_size or 16
    return records_to_requests(records, block_size), block_size, "record"


def run_simulate(
    trace: str, sim: SimConfig, capacities: Sequence[int], out_dir: str, block_size: int | None = None,
    limit: int | None = None,
) -> dict:
    """``block_size`` applies to ``--record`` traces (default 16); Mooncake traces always use one id per block."""
    requests, block_size, kind = load_trace(trace, block_size, limit)
    sim = replace(sim, block_size=block_size)
    ideal = simulate(requests, replace(sim, capacity_blocks=None), progress=True)
    achieved = simulate(requests, sim, progress=True) if sim.capacity_blocks is not None else ideal
    curve = sweep(requests, sim, "capacity_blocks", sorted(set(capacities)))
    by_eviction = sweep(requests, sim, "eviction_policy", list(EvictionPolicy)) if sim.capacity_blocks else []
    name = Path(trace).stem
    plot = plots.plot_hit_rate_vs_capacity(
        {name: [(r.config.capacity_blocks, r.hit_rate) for r in curve]},
        Path(out_dir) / f"simulate_{name}_hit_rate_vs_capacity.png",
        unit="512-token blocks" if kind == "mooncake" else f"{block_size}-token blocks",
    )
    md = sweep_markdown("capacity_blocks", [*curve, ideal], f"Hit rate vs capacity, {name} ({kind} trace)")
    if by_eviction:
        md += "\n\n" + sweep_markdown("eviction_policy", by_eviction,
                                      f"Eviction policy at {sim.capacity_blocks} blocks, {name}")
    Path(out_dir, f"simulate_{name}.md").write_text(md + "\n")
    return {
        "trace": trace, "kind": kind, "requests": len(requests),
        "hit_rate": achieved.hit_rate, "ideal_hit_rate": ideal.hit_rate,
        "achieved": achieved.summary(), "ideal": ideal.summary(),
        "capacity_curve": [{"capacity_blocks": r.config.capacity_blocks, "hit_rate": r.hit_rate,
                            "evictions": r.evictions} for r in curve],
        "eviction_policy": [{"eviction_policy": r.config.eviction_policy, "capacity_blocks": sim.capacity_blocks,
                             "hit_rate": r.hit_rate} for r in by_eviction],
        "plot": str(plot), "markdown": md,
    }


# ---- kvserve bench replay -----------------------------------------------------------------------------------------
def run_replay(trace: str, sim: SimConfig, out_dir: str, engine_model: str | None = None) -> dict:
    from benchmarks.prefix.traces.replay import read_records, records_to_requests

    records = read_records(trace)
    requests = records_to_requests(records, sim.block_size)
    report, _ = analyze(Path(trace).stem, f"replay of {trace}", requests, sim)
    recorded = sum(r.cached_tokens for r in records)
    report["recorded_cached_tokens"] = recorded
    report["recorded_hit_rate"] = recorded / max(1, report["prompt_tokens"])
    out = Path(out_dir)
    report["plots"] = {"hit_rate_per_turn": str(plots.plot_hit_rate_per_turn([report], out / "replay_hit_rate_per_turn.png"))}
    if engine_model:
        from benchmarks.prefix.engine_run import EngineSettings, make_llm, run_workload

        settings = EngineSettings(model=engine_model, block_size=sim.block_size, max_num_seqs=sim.max_num_seqs)
        report["engine"] = run_workload(make_llm(settings), report["name"], requests, settings).summary()
    md = workloads_markdown([report]) + f"\nRecorded by the server: {pct(report['recorded_hit_rate'])} hit rate.\n"
    (out / "replay.md").write_text(md)
    report["markdown"] = md
    return report
