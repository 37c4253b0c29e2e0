"""`kvserve bench prefix --hybrid`: the hybrid policies' table (hybrid.py, simulated) and, with engine snapshot pools
given, the same requests through the real engine beside it (hybrid_engine.py); written to results/prefix/hybrid.md."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.prefix.bench import ENGINE_WORKLOAD_PARAMS
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.policies.hybrid import HYBRID_SHAPES, MIB, StateCost, compare
from benchmarks.prefix.policies.hybrid_engine import compare_with_engine, engine_markdown
from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
from benchmarks.prefix.report import markdown_table, pct
from benchmarks.prefix.workloads import WorkloadParams


@dataclass(frozen=True)
class HybridOptions:
    model: str = "qwen3.6-tiny"  # its template and tokenizer render the workloads
    workloads: tuple[str, ...] = ("claude_code", "codex", "subagents", "tool_loop")
    shape: str = "Qwen3.6-27B"  # whose state and K/V sizes price the snapshots
    slot_counts: tuple[int, ...] = (4, 8, 16, 32, 64)
    checkpoints: int = 3
    seed: int = 0
    out_dir: str = "results/prefix"
    engine_slots: tuple[int, ...] = ()  # also run the engine with these snapshot pools (hybrid_engine.py)


def run_hybrid(opts: HybridOptions) -> dict:
    """The comparison table: per workload, policy and snapshot pool, the hit rate and the snapshot memory."""
    mt = load_model_text(opts.model)
    costs = {name: StateCost.of(config) for name, config in HYBRID_SHAPES.items()}
    cost = costs[opts.shape]
    rows, figures = [], []
    for workload in build_workloads(list(opts.workloads), WorkloadParams(seed=opts.seed)):
        requests = tokenize_workload(workload, mt)
        for run in compare(requests, cost, opts.slot_counts, opts.checkpoints):
            gib = run.peak_snapshots * cost.state_bytes / 2**30
            figures.append({"workload": workload.name, "policy": run.policy, "slots": run.slots,
                            "hit_rate": run.hit_rate, "peak_snapshots": run.peak_snapshots, "snapshot_gib": gib})
            rows.append([workload.name, run.policy, run.slots or "per session", pct(run.hit_rate),
                         run.peak_snapshots, f"{gib:.1f}"])
    memory = markdown_table(
        ["model", "K/V per token", "state per sequence (one snapshot)", "= tokens of K/V", "vLLM align block"],
        [[name, f"{c.kv_bytes_per_token / 1024:.0f} KiB", f"{c.state_bytes / MIB:.1f} MiB",
          f"{c.tokens_per_state:,.0f}", c.vllm_align_block] for name, c in costs.items()])
    table = markdown_table(["workload", "policy", "snapshot slots", "hit rate", "peak snapshots",
                            f"snapshot GiB ({opts.shape})"], rows)
    markdown = f"{memory}\n\n{table}\n"
    engine_rows = _engine_part(opts, mt, cost) if opts.engine_slots else []
    if engine_rows:
        markdown += "\n" + engine_markdown(opts.model, engine_rows, opts.shape) + "\n"
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid.md").write_text(markdown)
    return {"model": opts.model, "shape": opts.shape, "runs": figures, "engine": engine_rows, "markdown": markdown,
            "costs": {name: vars(c) for name, c in costs.items()}}


def _engine_part(opts: HybridOptions, mt, cost: StateCost) -> list[dict]:
    from engine import LLM  # loads torch and the models: only when the engine runs

    workloads = [(w.name, tokenize_workload(w, mt))
                 for w in build_workloads(list(opts.workloads), replace(ENGINE_WORKLOAD_PARAMS, seed=opts.seed))]
    blocks = max(sum(len(r.prompt) for r in requests) for _, requests in workloads) // 16 + 64
    rows = []
    for slots in opts.engine_slots:
        llm = LLM(opts.model, block_size=16, num_kv_blocks=blocks, max_num_seqs=1, num_state_snapshots=slots,
                  max_num_batched_tokens=2048)
        try:
            for name, requests in workloads:
                row = compare_with_engine(llm, name, requests, cost, slots)
                rows.append(row)
                print(f"engine {name:12s} {slots:3d} slots  hit {pct(row['engine_hit_rate']):>6s} (simulator "
                      f"{pct(row['simulator_hit_rate'])}, {row['requests_equal']}/{row['requests']} requests equal; "
                      f"vLLM align {pct(row['vllm_align_hit_rate'])})  TTFT p50 {row['engine_ttft_p50_s']:.3f}s",
                      flush=True)
        finally:
            llm.close()
    return rows
