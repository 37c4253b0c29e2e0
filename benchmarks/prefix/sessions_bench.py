"""``kvserve bench sessions``: concurrent agent sessions with tool-call gaps under memory pressure
(benchmarks/prefix/agent_sessions.py), four ways in one run: device-only LRU, + session retention across tool calls,
+ a host tier, + both.

1. At scale, simulator only: an 8B-class model's block size in bytes, a GPU-like cost model, dozens of sessions,
   device pools from very tight to roomy.
2. Through the engine (a tiny model on this machine): each variant is simulated first, then the engine replays the
   simulated schedule (same steps, its KV clock at each step's simulated time) and must report the same cached
   tokens for every request; TTFT is measured (engine) and modeled (simulator, with the engine's measured prefill
   rate). A hybrid model (``--model qwen3.6-tiny``) resumes a prefix only where a recurrent-state snapshot exists,
   so against the simulator's dense cache each request may read up to one block less ("within a block"). A
   sliding-window model (``--model gemma3-tiny``, ``gpt-oss-tiny``) replays as a dense model first (every layer
   full: the simulator's cache), then with its window group in the same device and host memory
   (docs/SLIDING_WINDOW.md): cached tokens, hit rate and KV bytes side by side.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.prefix import plots
from benchmarks.prefix.agent_sessions import SessionsParams, agent_sessions
from benchmarks.prefix.report import markdown_table, pct
from benchmarks.prefix.simulator import CostModel, SimConfig, SimResult, simulate

if TYPE_CHECKING:
    from benchmarks.prefix.engine_run import EngineSettings

# An 8B-class model (Qwen3-8B: 36 layers, 8 KV heads of 128, bf16) in 16-token blocks; an H100-class GPU.
SCALE_COSTS = CostModel(prefill_tokens_per_s=12_000, decode_step_s=0.025, bytes_per_block=2 * 36 * 16 * 8 * 128 * 2)
SCALE_PARAMS = SessionsParams(sessions=48, turns=12, shared_tokens=8000, task_tokens=1000, result_tokens=(200, 3000),
                              reply_tokens=(50, 400), tool_gap_median_s=10.0, start_window_s=120.0)
ENGINE_PARAMS = SessionsParams(sessions=16, turns=5, shared_tokens=600, task_tokens=150, result_tokens=(50, 300),
                               reply_tokens=(20, 60), tool_gap_median_s=8.0, start_window_s=60.0)


@dataclass(frozen=True)
class Variant:
    name: str
    retention: bool
    host: bool


VARIANTS = (Variant("device-only LRU", False, False), Variant("+ session retention", True, False),
            Variant("+ host tier", False, True), Variant("+ both", True, True))


@dataclass(frozen=True)
class SessionsOptions:
    scale_params: SessionsParams = SCALE_PARAMS
    scale_sim: SimConfig = SimConfig(block_size=16, max_num_seqs=16, host_blocks=60_000, engine_max_tokens=200,
                                     commit_outputs=False, costs=SCALE_COSTS)
    scale_pools: tuple[int, ...] = (6_000, 12_000, 24_000, 36_000)  # device pools, in blocks
    scale: bool = True
    engine: bool = True
    variants: tuple[Variant, ...] = VARIANTS  # of the engine run
    engine_costs: CostModel | None = None  # the simulator's for the engine run (None: measured on its first engine)
    model: str = "qwen3-tiny"
    engine_params: SessionsParams = ENGINE_PARAMS
    engine_blocks: int = 320  # the device pool in the engine run
    engine_host_blocks: int = 1200
    engine_snapshots: int | None = None  # hybrid models: the snapshot pool (None: the engine's default fraction)
    max_num_seqs: int = 4
    max_tokens: int = 4  # generated per request in the engine run
    tool_call_ttl_s: float = 30.0
    out_dir: str = "results/sessions"
    seed: int = 0


def variant_config(base: SimConfig, variant: Variant, ttl: float, host_blocks: int) -> SimConfig:
    return replace(base, tool_call_ttl_s=ttl if variant.retention else 0.0,
                   host_blocks=host_blocks if variant.host else 0)


def _row(result: SimResult) -> dict:
    ttfts = sorted(r.ttft_s for r in result.results)
    return {"hit_rate": result.hit_rate, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "evictions": result.evictions,
            "host_restored_blocks": sum(r.restored_blocks[0] for r in result.results)}


def run_scale(opts: SessionsOptions) -> list[dict]:
    requests = agent_sessions(replace(opts.scale_params, seed=opts.seed))
    rows = []
    for pool in opts.scale_pools:
        for variant in VARIANTS:
            base = replace(opts.scale_sim, num_kv_blocks=pool)
            result = simulate(requests, variant_config(base, variant, opts.tool_call_ttl_s, base.host_blocks))
            rows.append({"variant": variant.name, "num_kv_blocks": pool, **_row(result)})
            print(f"scale {pool:6d} blocks  {variant.name:20s} hit {pct(rows[-1]['hit_rate']):>6s}  "
                  f"TTFT p50 {rows[-1]['ttft_p50_s']:.2f}s", flush=True)
    return rows


def bytes_per_block(llm) -> int:
    """One block's K/V over every attention layer (a hybrid model's recurrent states are not blocks)."""
    from engine.worker.kv_offload import flat_caches, row_bytes

    runner = llm.engine.runner
    return row_bytes(flat_caches(runner.kv_spec.block_layers(runner.kv_caches)))


def measure_costs(llm, sizes: tuple[int, int] = (128, 1024), decode_tokens: int = 16) -> CostModel:
    """The engine's own prefill cost (a fixed part and a per-token part, from cold prompts of two sizes, the median
    of three each) and decode step time (host copies: plain memcpy)."""
    import random

    from engine import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    timings = {}
    for n in (sizes[0], *sizes):  # the first run warms up
        runs = []
        for _ in range(3):
            llm.reset_prefix_cache()
            runs.append(llm.generate([[rng.randrange(100, 150_000) for _ in range(n)]], params)[0].metrics)
        timings[n] = runs
    llm.reset_prefix_cache()
    (small, large), ttft = sizes, {n: statistics.median(m.ttft_s for m in timings[n]) for n in sizes}
    per_token = max((ttft[large] - ttft[small]) / (large - small), 1e-9)
    decode = statistics.median((m.e2e_s - m.ttft_s) / (decode_tokens - 1) for m in timings[large])
    return CostModel(prefill_tokens_per_s=1 / per_token, decode_step_s=decode, bytes_per_block=bytes_per_block(llm),
                     host_bytes_per_s=10e9, prefill_overhead_s=max(ttft[small] - small * per_token, 0.0))


def kv_bytes(llm) -> int:
    """The engine's KV memory on the device: every cache tensor (a window model's full-attention blocks and window
    pages alike)."""
    from engine.worker.kv_offload import flat_caches

    return sum(t.numel() * t.element_size() for t in flat_caches(llm.engine.runner.kv_caches))


def run_engine(opts: SessionsOptions) -> list[dict]:
    from benchmarks.prefix.engine_run import EngineSettings, VirtualClock, make_llm, replay_schedule

    requests = agent_sessions(replace(opts.engine_params, seed=opts.seed))
    rows: list[dict] = []
    costs = opts.engine_costs  # else measured once, on the first (device-only) engine
    tokenizer = None  # loaded once, by the first engine
    for variant in opts.variants:
        clock = VirtualClock()
        host_gb = (opts.engine_host_blocks + 0.5) * costs.bytes_per_block / 2**30 if variant.host and costs else 0.0
        # every layer full: a sliding-window model's cache as a dense model keeps it, the simulator's
        settings = EngineSettings(model=opts.model, num_kv_blocks=opts.engine_blocks, max_num_seqs=opts.max_num_seqs,
                                  max_num_batched_tokens=16_384, max_tokens=opts.max_tokens, kv_offload_gb=host_gb,
                                  num_state_snapshots=opts.engine_snapshots, sliding_window_cache=False)
        llm = make_llm(settings, clock=clock, tokenizer=tokenizer)
        tokenizer = llm.tokenizer
        try:
            costs = costs or measure_costs(llm)
            base = SimConfig(block_size=settings.block_size, max_num_seqs=opts.max_num_seqs,
                             num_kv_blocks=opts.engine_blocks, engine_max_tokens=opts.max_tokens, commit_outputs=False,
                             costs=costs, model_id=opts.model)
            sim = simulate(requests, variant_config(base, variant, opts.tool_call_ttl_s,
                                                    llm.stats.kv_host_blocks_total))
            run = replay_schedule(llm, clock, requests, sim, opts.max_tokens)
            engine_cached = {r.request_id: r.cached_tokens for r in run.results}
            matched = sum(r.cached_tokens == engine_cached[r.request_id] for r in sim.results)
            # a hybrid model resumes only at snapshots (the prompt end's last full block): at most a block less
            within_block = sum(0 <= r.cached_tokens - engine_cached[r.request_id] <= settings.block_size
                               for r in sim.results)
            stats, memory, window = llm.stats, kv_bytes(llm), llm.engine.runner.kv_spec.window > 0
        finally:
            llm.close()
        if window:  # the window group in the same memory, on the same schedule
            rows_window = _window_twin(settings, memory, requests, sim, opts, tokenizer)
        rows.append({
            "variant": variant.name, "requests": len(requests), "simulator_hit_rate": sim.hit_rate,
            "engine_hit_rate": run.hit_rate, "requests_matching": matched, "requests_within_block": within_block,
            "simulator_prefill_ttft_p50_s": statistics.median(r.prefill_s for r in sim.results),
            "engine_ttft_p50_s": statistics.median(r.ttft_s for r in run.results),
            "engine_host_hit_tokens": stats.prefix_cache_host_hits_tokens, "engine_preemptions": stats.preemptions,
            "engine_evictions": stats.prefix_cache_evictions,
            "prefill_tokens_per_s": costs.prefill_tokens_per_s, "engine_cached_tokens": run.cached_tokens,
            "engine_prompt_tokens": run.prompt_tokens, "engine_kv_bytes": memory,
            **(rows_window if window else {}),
        })
        print(f"engine {variant.name:20s} hit {pct(run.hit_rate):>6s} (simulator {pct(sim.hit_rate)}, "
              f"{matched}/{len(requests)} requests equal, {within_block} within a block)  "
              f"TTFT p50 {rows[-1]['engine_ttft_p50_s']:.3f}s", flush=True)
        if window:
            print(f"  window group, same memory: hit {pct(rows[-1]['window_hit_rate']):>6s}, cached tokens "
                  f"{rows[-1]['window_cached_tokens']:,} against {run.cached_tokens:,} "
                  f"({rows[-1]['window_cached_tokens'] / max(run.cached_tokens, 1):.2f}x)", flush=True)
    return rows


# A window model's engine steps in the window run: the running sequences' windows and a step's chunk come out of the
# KV memory first (docs/SLIDING_WINDOW.md), and a 16k-token step's window pages would take all of a small pool (1,024
# tokens' took 380 of a 72-block pool's 432 layer-blocks on gemma3-tiny)
WINDOW_STEP_TOKENS = 256


def _window_twin(dense: EngineSettings, memory: int, requests: list, sim: SimResult, opts: SessionsOptions,
                 tokenizer) -> dict:
    """The schedule ``sim`` replayed through the model with its window group in ``memory`` bytes of device KV (and
    the dense run's host tier): its cached tokens, hit rate and how it split the memory."""
    from benchmarks.prefix.engine_run import VirtualClock, make_llm, replay_schedule

    clock = VirtualClock()
    settings = replace(dense, sliding_window_cache=True, kv_cache_memory_gb=memory / 2**30,
                       max_num_batched_tokens=WINDOW_STEP_TOKENS)
    llm = make_llm(settings, clock=clock, tokenizer=tokenizer)
    try:
        run = replay_schedule(llm, clock, requests, sim, opts.max_tokens)
        stats, kv = llm.stats, llm.engine.runner
        return {"window_hit_rate": run.hit_rate, "window_cached_tokens": run.cached_tokens,
                "window_kv_bytes": kv_bytes(llm), "window_full_blocks": kv.num_blocks,
                "window_pages": kv.num_window_blocks, "window_host_hit_tokens": stats.prefix_cache_host_hits_tokens,
                "window_preemptions": stats.preemptions}
    finally:
        llm.close()


def run_sessions(opts: SessionsOptions) -> dict:
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict = {"plots": {}}
    md = []
    if opts.scale:
        scale = run_scale(opts)
        figures["scale"] = {"params": asdict(opts.scale_params), "sim": asdict(opts.scale_sim), "variants": scale}
        md.append(_scale_markdown(figures["scale"], opts))
        figures["plots"]["scale"] = {
            what: str(plots.plot_hit_rate_vs_capacity(
                {v.name: [(r["num_kv_blocks"], r[key]) for r in scale if r["variant"] == v.name] for v in VARIANTS},
                out / f"sessions_scale_{what}.png", unit="16-token blocks in the device pool", ylabel=label))
            for what, key, label in (("hit_rate", "hit_rate", "hit rate"), ("ttft", "ttft_p50_s", "TTFT p50 (s)"))}
    if opts.engine:
        engine = run_engine(opts)
        figures["engine"] = {"params": asdict(opts.engine_params), "blocks": opts.engine_blocks,
                             "host_blocks": opts.engine_host_blocks, "variants": engine}
        md.append(_engine_markdown(figures["engine"], opts))
        names = [v.name for v in opts.variants]
        figures["plots"]["engine"] = {
            "hit_rate": str(plots.plot_variant_bars(names, {
                "engine": [v["engine_hit_rate"] for v in engine],
                "simulator": [v["simulator_hit_rate"] for v in engine]},
                "hit rate", out / "sessions_engine_hit_rate.png")),
            "ttft": str(plots.plot_variant_bars(names, {
                "engine (measured)": [v["engine_ttft_p50_s"] * 1e3 for v in engine],
                "simulator (modeled)": [v["simulator_prefill_ttft_p50_s"] * 1e3 for v in engine]},
                "TTFT p50 (ms)", out / "sessions_engine_ttft.png")),
        }
    (out / "sessions.md").write_text("\n\n".join(md) + "\n")
    figures["markdown"] = str(out / "sessions.md")
    return figures


def _scale_markdown(scale: dict, opts: SessionsOptions) -> str:
    p, sim = opts.scale_params, opts.scale_sim
    head = (f"### At scale (simulator): {p.sessions} sessions x {p.turns} turns, shared prefix {p.shared_tokens} "
            f"tokens, tool gaps log-normal (median {p.tool_gap_median_s:.0f} s), {pct(p.human_turn_fraction)} of "
            f"replies wait on a human (median {p.human_gap_median_s:.0f} s), host tier {sim.host_blocks:,} blocks, "
            f"tool-call TTL {opts.tool_call_ttl_s:.0f} s\n")
    rows = [[f"{v['num_kv_blocks']:,}", v["variant"], pct(v["hit_rate"]), f"{v['ttft_p50_s']:.2f}",
             f"{v['ttft_p90_s']:.2f}", f"{v['evictions']:,}", f"{v['host_restored_blocks']:,}"]
            for v in scale["variants"]]
    return head + "\n" + markdown_table(["device pool (blocks)", "variant", "hit rate", "TTFT p50 (s)", "TTFT p90 (s)",
                                         "evictions", "blocks restored from host"], rows)


def _engine_markdown(engine: dict, opts: SessionsOptions) -> str:
    p = opts.engine_params
    head = (f"### Engine vs simulator ({opts.model}, CPU): {p.sessions} sessions x {p.turns} turns, device pool "
            f"{engine['blocks']} blocks, host tier {engine['host_blocks']} blocks\n")
    rows = [[v["variant"], pct(v["engine_hit_rate"]), pct(v["simulator_hit_rate"]),
             f"{v['requests_matching']}/{v['requests']}", f"{v['requests_within_block']}/{v['requests']}",
             f"{v['engine_ttft_p50_s'] * 1e3:.1f}",
             f"{v['simulator_prefill_ttft_p50_s'] * 1e3:.1f}", v["engine_preemptions"]] for v in engine["variants"]]
    table = head + "\n" + markdown_table(
        ["variant", "engine hit rate", "simulator", "requests equal", "within a block", "engine TTFT p50 (ms)",
         "simulator TTFT p50 (ms)", "preemptions"], rows)
    if "window_hit_rate" not in engine["variants"][0]:
        return table
    rows = [[v["variant"], f"{v['engine_kv_bytes'] / 2**20:.2f}", f"{v['window_kv_bytes'] / 2**20:.2f}",
             f"{v['window_full_blocks']:,} + {v['window_pages']:,}", f"{v['engine_cached_tokens']:,}",
             f"{v['window_cached_tokens']:,}", pct(v["engine_hit_rate"]), pct(v["window_hit_rate"]),
             f"{v['window_cached_tokens'] / max(v['engine_cached_tokens'], 1):.2f}"] for v in engine["variants"]]
    return table + (f"\n\n### The window group against every layer full in the same memory ({opts.model}; the window "
                    f"run in {WINDOW_STEP_TOKENS:,}-token steps)\n\n") + markdown_table(
        ["variant", "dense KV (MiB)", "window KV (MiB)", "window: full blocks + pages", "dense cached tokens",
         "window cached tokens", "dense hit rate", "window hit rate", "cached tokens, window / dense"], rows)
