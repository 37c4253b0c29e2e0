"""``kvserve bench …``: the benchmark command group.

Adding a benchmark is one call in ``_register_all``: ``add_bench_command(name, help, configure, run)``, where
``configure(parser)`` adds its options and ``run(args) -> dict`` returns its figures. Every bench command gets
``--json FILE`` (the figures are written there) and ``--out-dir DIR`` (markdown and plots).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from engine.config import EvictionPolicy, SchedulingPolicy

from benchmarks import (hostile, inspector_bench, router_bench, serve_bench, spec_bench, step_bench, structured,
                        throughput, turn_bench)
from benchmarks.prefix.report import write_json

if TYPE_CHECKING:
    from benchmarks.prefix.simulator import SimConfig


@dataclass(frozen=True)
class BenchCommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict]


_COMMANDS: list[BenchCommand] = []


def add_bench_command(
    name: str, help: str, configure: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], dict]
) -> None:
    if any(c.name == name for c in _COMMANDS):
        raise ValueError(f"bench command {name!r} is already registered")
    _COMMANDS.append(BenchCommand(name, help, configure, run))


def _invoke(command: BenchCommand, args: argparse.Namespace) -> int:
    from benchmarks.prefix.catalog import NeedsVisionModel

    try:
        figures = command.run(args)
    except NeedsVisionModel as exc:  # the user's choice of --model, not a bug: the message, no traceback
        print(f"kvserve bench {command.name}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, figures)
        print(f"figures written to {args.json}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: prefix cache (workloads, simulator, trace replay), throughput, grammar-mask cost"
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(func=lambda _args: bench.print_help() or 2)
    for command in _COMMANDS:
        # argparse %-formats help strings: a command's help is plain text ("0%, 50% and 100%")
        parser = sub.add_parser(command.name, help=command.help.replace("%", "%%"), description=command.help)
        command.configure(parser)
        parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
        parser.add_argument("--out-dir", default=f"results/{command.name}", help="markdown and plots go here")
        parser.set_defaults(func=lambda args, command=command: _invoke(command, args))


# ---- the prefix-cache commands ------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _sim_options(parser: argparse.ArgumentParser, capacity: int | None, max_num_seqs: int) -> None:
    parser.add_argument("--capacity-blocks", type=int, default=capacity,
                        help=f"cache capacity in blocks kept between requests (default: {capacity or 'unbounded'})")
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="requests admitted together per step")
    parser.add_argument("--policy", choices=[p.value for p in SchedulingPolicy], default=SchedulingPolicy.FCFS.value,
                        help="scheduling order")
    parser.add_argument("--eviction", choices=[p.value for p in EvictionPolicy], default=EvictionPolicy.LRU.value,
                        help="which unreferenced cached block goes first when the cache is full")


def _sim_config(args: argparse.Namespace, block_size: int) -> SimConfig:
    from benchmarks.prefix.simulator import SimConfig

    return SimConfig(block_size=block_size, capacity_blocks=args.capacity_blocks, max_num_seqs=args.max_num_seqs,
                     policy=args.policy, eviction_policy=args.eviction)


def _configure_prefix(p: argparse.ArgumentParser) -> None:
    from benchmarks.prefix.catalog import WORKLOADS

    p.add_argument("--model", default="qwen3-tiny", help="model whose chat template and tokenizer render the workloads")
    p.add_argument("--workload", default="all", help=f"comma-separated: {', '.join(WORKLOADS)}, or all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    _sim_options(p, capacity=4096, max_num_seqs=8)
    p.add_argument("--no-engine", action="store_true", help="simulator only (skip the engine-backed run)")
    p.add_argument("--ttft-prompt-tokens", type=int, default=4096, help="prompt length of the cold/warm TTFT probe")
    p.add_argument("--compaction-every", type=int, default=6, metavar="N",
                   help="compaction_aware / compaction_naive: requests between two compactions (default: %(default)s)")
    p.add_argument("--hybrid", action="store_true",
                   help="hybrid models (give a hybrid --model, e.g. qwen3.6-tiny): hit rate against snapshot memory "
                        "for kvserve's snapshot policy, vLLM's align mode and llama.cpp's checkpoints (simulated; "
                        "docs/HYBRID_CACHE.md)")
    p.add_argument("--hybrid-shape", default="Qwen3.6-27B", choices=["Qwen3.6-27B", "Qwen3.6-35B-A3B"],
                   help="--hybrid: whose state and K/V sizes price the snapshots")
    p.add_argument("--snapshot-slots", type=_ints, default=[4, 8, 16, 32, 64],
                   help="--hybrid: snapshot pool sizes to compare, comma-separated")
    p.add_argument("--checkpoints", type=int, default=3, help="--hybrid: llama.cpp's checkpoints per slot")
    p.add_argument("--sliding-window", action="store_true",
                   help="sliding-window models: hit rate against window memory for kvserve's window group, vLLM's "
                        "sliding-window manager and llama.cpp's SWA cache (with and without --swa-full), simulated "
                        "on the agent workloads, and the window group against a dense model in the same memory on "
                        "interleaved sessions (docs/SLIDING_WINDOW.md)")
    p.add_argument("--window-shape", default="Gemma 3 27B", choices=["Gemma 3 27B", "Gemma-4-31B", "gpt-oss-20b"],
                   help="--sliding-window: whose window and sizes price the memory (gpt-oss' 128-token window runs "
                        "beside it)")
    p.add_argument("--window-pages", type=_ints, default=[64, 256, 1024],
                   help="--sliding-window: window pages beyond the running sequence's to compare, comma-separated")
    p.add_argument("--engine-slots", type=_ints, default=[],
                   help="--hybrid: also run the workloads through the engine with these snapshot pools (besides "
                        "one running sequence's state), request for request against the simulator, e.g. 4,16")


def _run_prefix(args: argparse.Namespace) -> dict:
    from benchmarks.prefix.bench import PrefixOptions, run_prefix

    if args.hybrid:
        from benchmarks.prefix.policies.hybrid_report import HybridOptions, run_hybrid

        workloads = ("claude_code", "codex", "subagents", "tool_loop") if args.workload == "all" else tuple(
            w.strip() for w in args.workload.split(","))
        figures = run_hybrid(HybridOptions(model=args.model, workloads=workloads, shape=args.hybrid_shape,
                                           slot_counts=tuple(args.snapshot_slots), checkpoints=args.checkpoints,
                                           seed=args.seed, out_dir=args.out_dir,
                                           engine_slots=tuple(args.engine_slots)))
        print(figures["markdown"])
        return figures

    if args.sliding_window:
        from benchmarks.prefix.policies.sliding_window import SHAPES, WindowOptions, run_sliding_window

        workloads = ("claude_code", "codex", "subagents", "tool_loop") if args.workload == "all" else tuple(
            w.strip() for w in args.workload.split(","))
        windows = tuple(dict.fromkeys((SHAPES[args.window_shape].window, SHAPES["gpt-oss-20b"].window)))
        figures = run_sliding_window(WindowOptions(model=args.model, workloads=workloads, shape=args.window_shape,
                                                   windows=windows, page_counts=tuple(args.window_pages),
                                                   checkpoints=args.checkpoints, seed=args.seed,
                                                   out_dir=args.out_dir))
        print(figures["markdown"])
        return figures

    return run_prefix(PrefixOptions(
        model=args.model, workloads=tuple(w.strip() for w in args.workload.split(",")), seed=args.seed,
        sim=_sim_config(args, args.block_size), engine=not args.no_engine,
        ttft_prompt_tokens=args.ttft_prompt_tokens, out_dir=args.out_dir, compaction_every=args.compaction_every,
    ))


def _configure_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake block-hash trace or a `kvserve serve --record` file")
    _sim_options(p, capacity=None, max_num_seqs=1)
    p.add_argument("--sweep", type=_ints, default=[1000, 2000, 5000, 10000, 20000, 50000, 100000],
                   help="capacities (blocks) for the hit-rate-vs-capacity curve, comma-separated")
    p.add_argument("--block-size", type=int, default=None, help="for --record traces (default 16); Mooncake: 1 id/block")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")


def _run_simulate(args: argparse.Namespace) -> dict:
    from benchmarks.prefix.bench import run_simulate
    from benchmarks.prefix.report import pct

    figures = run_simulate(args.trace, _sim_config(args, 1), args.sweep, args.out_dir, args.block_size, args.limit)
    print(figures["markdown"])
    cap = args.capacity_blocks if args.capacity_blocks is not None else "unbounded"
    print(f"\n{figures['requests']} requests: hit rate {pct(figures['hit_rate'])} at capacity {cap}; "
          f"unbounded {pct(figures['ideal_hit_rate'])} ({figures['ideal_hit_rate']:.4f})")
    return figures


def _configure_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="a `kvserve serve --record` JSONL file")
    p.add_argument("--block-size", type=int, default=16)
    _sim_options(p, capacity=None, max_num_seqs=1)
    p.add_argument("--engine-model", default=None, help="also replay the prompts through the engine with this model")


def _run_replay(args: argparse.Namespace) -> dict:
    from benchmarks.prefix.bench import run_replay

    figures = run_replay(args.trace, _sim_config(args, args.block_size), args.out_dir, args.engine_model)
    print(figures["markdown"])
    return figures


def _configure_sessions(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-call-ttl", type=float, default=30.0, help="session hold after a tool call, seconds")
    p.add_argument("--no-engine", action="store_true", help="simulator only (skip the engine-vs-simulator run)")
    p.add_argument("--no-scale", action="store_true", help="the engine run only (skip the simulated 8B deployment)")
    p.add_argument("--model", default="qwen3-tiny",
                   help="model of the engine run (a hybrid one, e.g. qwen3.6-tiny, keeps recurrent-state snapshots; "
                        "a sliding-window one, e.g. gemma3-tiny or gpt-oss-tiny, also runs its window group in the "
                        "dense run's memory)")
    p.add_argument("--engine-blocks", type=int, default=320, help="device pool of the engine run, in blocks")
    p.add_argument("--engine-host-blocks", type=int, default=1200, help="host tier of the engine run, in blocks")
    p.add_argument("--engine-sessions", type=int, default=16,
                   help="sessions of the engine run (fewer, with --engine-turns, for a shorter run)")
    p.add_argument("--engine-turns", type=int, default=5, help="turns per session in the engine run")
    p.add_argument("--engine-snapshots", type=int, default=None,
                   help="a hybrid model's recurrent-state snapshot slots in the engine run (default: the engine's "
                        "--state-snapshot-fraction of the pool)")
    p.add_argument("--scale-pools", type=_ints, default=[6000, 12000, 24000, 36000],
                   help="device pools (16-token blocks) of the simulated 8B-class deployment, comma-separated")


def _run_sessions(args: argparse.Namespace) -> dict:
    from benchmarks.prefix.sessions_bench import ENGINE_PARAMS, SessionsOptions, run_sessions

    figures = run_sessions(SessionsOptions(
        seed=args.seed, tool_call_ttl_s=args.tool_call_ttl, engine=not args.no_engine, scale=not args.no_scale,
        model=args.model,
        engine_params=replace(ENGINE_PARAMS, sessions=args.engine_sessions, turns=args.engine_turns),
        engine_blocks=args.engine_blocks, engine_snapshots=args.engine_snapshots,
        engine_host_blocks=args.engine_host_blocks, scale_pools=tuple(args.scale_pools), out_dir=args.out_dir))
    print(open(figures["markdown"]).read())
    return figures


def _register_all() -> None:
    add_bench_command("prefix", "prefix-cache hit rates of agent workloads (simulator + engine)", _configure_prefix,
                      _run_prefix)
    add_bench_command("simulate", "hit rate of a request trace for any cache capacity, without a model",
                      _configure_simulate, _run_simulate)
    add_bench_command("replay", "replay requests recorded by `kvserve serve --record`", _configure_replay, _run_replay)
    add_bench_command("sessions", "concurrent agent sessions with tool-call gaps under memory pressure: device-only "
                      "LRU vs session retention vs a host tier vs both (simulator at scale, engine vs simulator)",
                      _configure_sessions, _run_sessions)
    add_bench_command("throughput", "offline throughput on the nano-vllm workload, side by side with HF transformers",
                      throughput.configure, throughput.run)
    add_bench_command("step", "host and device time of one engine decode step vs a bare PyTorch loop, by batch and "
                      "context", step_bench.configure, step_bench.run)
    add_bench_command("turns", "an agent conversation growing ~5k tokens a turn (10k -> 100k): per turn the host time "
                      "before the first token (render + tokenize + hash + match; now and in full), TTFT, and the floor "
                      "(SDPA over the same K/V + the new tokens' dense layers) side by side",
                      turn_bench.configure, turn_bench.run)
    add_bench_command("structured", "cost of grammar masks: decode tok/s with 0%, 50% and 100% of a batch constrained",
                      structured.configure, structured.run)
    add_bench_command("spec", "speculative decoding at batch 1: output tok/s with no speculation, prompt lookup and "
                      "suffix decoding side by side on an edit-like and an agent workload; acceptance per proposer",
                      spec_bench.configure, spec_bench.run)
    add_bench_command("hostile", "one request never hurts another: each hostile input of issues 22 and 41 sent while "
                      "bystander streams of another tenant run; their worst wait vs their baseline, and server memory",
                      hostile.configure, hostile.run)
    add_bench_command("router", "kvserve replicas behind real routers (vLLM's, SGLang's, Dynamo's KV indexer): "
                      "prefix-cache hit rate and TTFT per routing policy side by side, then a replica killed mid-run",
                      router_bench.configure, router_bench.run)
    add_bench_command("inspector", "what the cache inspector (kvserve serve --ui) costs with a full window of requests: "
                      "server memory with and without it, page load times in headless Chromium",
                      inspector_bench.configure, inspector_bench.run)
    add_bench_command("serve", "N concurrent streaming HTTP clients vs the offline LLM.generate on the same requests: "
                      "what the server's per-token work costs", serve_bench.configure, serve_bench.run)


_register_all()
