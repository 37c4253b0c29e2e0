"""`kvserve bench throughput` (kvserve vs HF transformers in one run) at a series of commits, as a table.

    python -m benchmarks.bisect_throughput --out docs/bench/THROUGHPUT_BISECT.md    # the default points
    python -m benchmarks.bisect_throughput --commits 8ff549c HEAD                  # any others

Each commit is checked out into a temporary git worktree and benchmarked from there (``python -m server.cli bench
throughput``, so the commit's own code runs, on this machine's installed packages), one commit after the other. The
ratio kvserve / HF comes from one run, so a machine that drifts between points moves both sides; the load average
beside each point says how quiet the machine was.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# main's first-parent history since the throughput benchmark existed, at the changes that touched the decode path
DEFAULT_COMMITS = [
    "8ff549c",  # first README throughput figures
    "e48dbfa",  # end of the first wave
    "9126bd7",  # step pipeline: SchedulerOutput deltas, persistent input batch
    "41becb9",  # bench step; CPU async scheduling on a device thread (off by default)
    "51e4603",  # LLM: the engine thread lives for one generate call
    "099e52c",  # Qwen3-MoE and DeepSeek-V2/V3 merged
    "d85e76f",  # tensor and expert parallelism
    "ebc86e2",  # LLM.generate on a CPU steps the engine on the calling thread
    "2bed766",  # reference attention: decode plan built once per step
    "3489e0f",  # reference attention: every decode row through the batched path
    "a83df28",  # reference attention: scratch buffers for the decode gathers
    "3220fb6",  # the second wave's last commit
    "36f7131",  # native CPU decode attention (kernels/cpu/attention.c)
]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def measure(commit: str, bench_args: list[str], work: Path) -> dict:
    tree = work / commit
    git("worktree", "add", "--detach", "--force", str(tree), commit)
    try:
        out = work / f"{commit}.json"
        before = load_average()
        run = subprocess.run([sys.executable, "-m", "server.cli", "bench", "throughput", "--json", str(out),
                              "--out-dir", str(work / f"{commit}-md"), *bench_args], cwd=tree, text=True)
        result = json.loads(out.read_text()) if run.returncode == 0 and out.exists() else {"error": run.returncode}
    finally:
        git("worktree", "remove", "--force", str(tree))
    result.update(commit=commit, subject=git("log", "-1", "--format=%s", commit)[:80],
                  date=git("log", "-1", "--format=%ad", "--date=format:%m-%d %H:%M", commit),
                  load=f"{before} -> {load_average()}")
    return result


def table(rows: list[dict]) -> str:
    lines = ["| commit | date | change | kvserve tok/s | HF tok/s | kvserve / HF | load 1/5/15 min (before -> after) |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        figures = ("failed", "", "") if "error" in r else (
            f"{r['kvserve_tokens_per_s']:.1f}", f"{r['hf_tokens_per_s']:.1f}", f"**{r['ratio']:.2f}x**")
        lines.append(f"| {r['commit']} | {r['date']} | {r['subject']} | {' | '.join(figures)} | {r['load']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", nargs="+", default=DEFAULT_COMMITS, help="commits to measure, in order")
    parser.add_argument("--out", type=Path, help="write the markdown table here (and the JSON beside it)")
    args, bench_args = parser.parse_known_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bisect-") as tmp:
        for commit in args.commits:
            rows.append(measure(git("rev-parse", "--short", commit), bench_args, Path(tmp)))
            print(table(rows), flush=True)
    if args.out:
        args.out.write_text(table(rows))
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
