"""PNG plots: hit rate per turn, hit rate vs cache capacity, first-token latency cold vs warm, per-variant bars."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hit_rate_per_turn(reports: Sequence[dict], path: str | Path) -> Path:
    """One panel per workload: each request's achieved and ideal hit rate, in arrival order."""
    cols = min(3, len(reports))
    rows = math.ceil(len(reports) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3 * rows), squeeze=False)
    for ax, rep in zip(axes.flat, reports):
        reqs = rep["per_request"]
        x = range(len(reqs))
        ax.plot(x, [r["ideal_cached_tokens"] / r["prompt_tokens"] for r in reqs], "--", color="grey", label="ideal")
        ax.plot(x, [r["cached_tokens"] / r["prompt_tokens"] for r in reqs], ".-", label="achieved")
        ax.set_title(rep["name"], fontsize=10)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("request (arrival order)")
        ax.set_ylabel("hit rate")
    for ax in list(axes.flat)[len(reports) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    return _save(fig, path)


def plot_hit_rate_vs_capacity(curves: dict[str, Sequence[tuple[int, float]]], path: str | Path, unit: str = "blocks",
                              ylabel: str | None = None) -> Path:
    """``curves``: name -> [(capacity, hit rate)] (or another y, named by ``ylabel``)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity ({unit})")
    ax.set_ylabel(ylabel or "hit rate (cached prompt tokens / prompt tokens)")
    if ylabel is None:
        ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ttft(cold_s: float, warm_s: float, cached_fraction: float, path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(4.5, 4))
    bars = ax.bar(["cold", f"warm ({cached_fraction:.0%} cached)"], [cold_s, warm_s], color=["#c44", "#4a4"])
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"same prompt: {cold_s / warm_s:.1f}x faster warm", fontsize=10)
    return _save(fig, path)


def plot_variant_bars(variants: Sequence[str], series: dict[str, Sequence[float]], ylabel: str,
                      path: str | Path) -> Path:
    """Grouped bars: one group per variant, one bar per series (e.g. simulator at scale, engine)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(variants))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(variants)), variants, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _save(fig, path)
