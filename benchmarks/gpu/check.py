"""The prepared GPU check: one device call that says whether kvserve is correct on a CUDA machine and how fast it is.

Steps (``benchmarks/gpu/steps.py``), most valuable first, each written to the JSON report as soon as it ends:
environment; kernel tests and CUDA graphs vs eager; tiny models vs HF transformers; nano-vllm throughput with the
engine's defaults, then with ``enforce_eager``; batch-1 decode vs the weight-read bound; host vs device ms per
step (``kvserve bench step``); TTFT cold vs 90% cached on a 32k-token prompt; memory vs budget; Qwen3-30B-A3B-shaped
MoE throughput; tensor parallelism 2 vs 1 (only where two GPUs are visible; else it says so). A step that would not
fit the time left is skipped with a note; one that fails is recorded with its error and the next one runs.

Usage (``bash benchmarks/gpu_check.sh`` wraps this; docs/bench/GPU.md has the device call):
  --prepare   here: download the wheels the device lacks into .whl/
  --dry-run   here: resolve every step's inputs without CUDA
  (default)   on the GPU: the full check (9 minutes); --quick: the 4-minute rerun
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from benchmarks.gpu.context import FULL, QUICK, Context, Plan
from benchmarks.gpu.steps import STEPS, FatalStepError, Step
from benchmarks.gpu.wheels import prepare


REPO_ROOT = Path(__file__).resolve().parents[2]


class Report:
    """The JSON report, rewritten (atomically) after every step, so a run cut short keeps what it measured."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "steps": {}}
        self.started = time.perf_counter()

    def add(self, name: str, result: dict[str, Any]) -> None:
        self.data["steps"][name] = result
        print(f"[{time.perf_counter() - self.started:6.1f}s] {name}: {json.dumps(result, default=str)}", flush=True)
        self.write()

    def failed(self) -> list[str]:
        return [name for name, result in self.data["steps"].items() if result["status"] == "failed"]

    def write(self) -> None:
        self.data["failed_steps"] = self.failed()
        self.data["total_seconds"] = time.perf_counter() - self.started
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(partial, self.path)


def _status(result: dict[str, Any]) -> str:
    if "unavailable" in result:
        return "unavailable"
    return "failed" if result.get("passed") is False else "ok"


def run_step(step: Step, ctx: Context, dry_run: bool) -> tuple[dict[str, Any], bool]:
    """One step's result with its status and seconds, and whether the run must stop here."""
    start = time.perf_counter()
    try:
        result = (step.resolve if dry_run else step.run)(ctx)
        result = {"status": _status(result), **result}
    except Exception as error:  # noqa: BLE001 - the report must say what broke, whatever it was
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc(limit=8)}
        if isinstance(error, FatalStepError):
            return {**result, "seconds": time.perf_counter() - start}, True
    return {**result, "seconds": time.perf_counter() - start}, False


def run_steps(steps: Sequence[Step], ctx: Context, report: Report, dry_run: bool) -> None:
    for i, step in enumerate(steps):
        if not dry_run and ctx.remaining() < step.min_seconds:
            report.add(step.name, {"status": "skipped", "reason": f"{ctx.remaining():.0f} s left of the "
                                   f"{ctx.plan.time_budget_s:.0f} s budget; it needs {step.min_seconds:.0f} s"})
            continue
        result, fatal = run_step(step, ctx, dry_run)
        report.add(step.name, result)
        if fatal:
            for later in steps[i + 1:]:
                report.add(later.name, {"status": "skipped", "reason": f"{step.name} failed: {result['error']}"})
            return


def select_steps(plan: Plan, names: str | None) -> list[Step]:
    if names is None:
        return [step for step in STEPS if step.name not in plan.skip]
    wanted = names.split(",")
    unknown = set(wanted) - {step.name for step in STEPS}
    if unknown:
        raise SystemExit(f"unknown step(s) {sorted(unknown)}; the steps are {', '.join(s.name for s in STEPS)}")
    return [step for step in STEPS if step.name in wanted]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check.sh", description="kvserve's GPU check: correctness and speed on one CUDA device, each step "
        "written to a JSON report as it ends (docs/bench/GPU.md).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="here: download the wheels the device lacks into .whl/")
    mode.add_argument("--dry-run", action="store_true", help="resolve every step's inputs (wheels, model shapes, "
                      "tokenizers, tests) without touching CUDA")
    mode.add_argument("--quick", action="store_true", help=f"the {QUICK.time_budget_s:.0f}-second plan, for a rerun "
                      f"(fewer sequences; skips {', '.join(QUICK.skip)})")
    parser.add_argument("--steps", metavar="A,B", help=f"only these steps ({', '.join(s.name for s in STEPS)})")
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check.json"), help="the JSON report")
    parser.add_argument("--peak-bandwidth-tbs", type=float, default=4.8, help="HBM datasheet peak (H200: 4.8)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="the engines' memory budget")
    parser.add_argument("--moe-layers", type=int, help=f"Qwen3-30B-A3B layers to build (default {FULL.moe_layers})")
    parser.add_argument("--time-budget-s", type=float, help="override the plan's total time budget")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare:
        return prepare()
    started = time.perf_counter()
    plan = QUICK if args.quick else FULL
    plan = replace(plan, moe_layers=args.moe_layers or plan.moe_layers,
                   time_budget_s=args.time_budget_s or plan.time_budget_s)
    steps = select_steps(plan, args.steps)
    mode = "dry-run" if args.dry_run else plan.name
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-check-") as tmp:
        work_dir = Path(tmp)
        if args.dry_run:  # CUDA stays untouched, and the tiny models build from scratch as on the device
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            os.environ["KVSERVE_CACHE_DIR"] = str(work_dir / "cache")
        ctx = Context(plan, started + plan.time_budget_s, work_dir, args.peak_bandwidth_tbs,
                      args.gpu_memory_utilization)
        report = Report(args.out, {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "mode": mode,
            "command": " ".join(["bash benchmarks/gpu_check.sh", *(argv if argv is not None else sys.argv[1:])]),
            "commit": _git_commit(), "host": platform.node(), "plan": asdict(plan), "steps": [s.name for s in steps]})
        run_steps(steps, ctx, report, args.dry_run)
        if not args.dry_run:
            ctx.release_engine()  # before the temporary model directories go
    failed = report.failed()
    print(f"{mode} done in {time.perf_counter() - started:.0f} s; report: {args.out}; "
          f"{'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
