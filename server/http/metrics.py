"""`GET /metrics`: the engine's state in the Prometheus text exposition format (version 0.0.4).

The engine thread writes the engine's counters and gauges (a `SchedulerStats` snapshot) after every step; request
streams record finished sequences' latencies; HTTP handlers only render. One lock makes each rendering a
consistent cut.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, fields

from engine.outputs import SchedulerStats

# Seconds; spans CPU test models (tens of ms per token) to long agent prefills on a GPU.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# name suffix, type, help; the `SchedulerStats` field of the same name holds the value.
_SNAPSHOT_METRICS: dict[str, tuple[str, str]] = {
    "prefix_cache_queries_tokens": ("counter", "Prompt tokens looked up in the prefix cache at first admission."),
    "prefix_cache_hits_tokens": ("counter", "Of those, tokens served from cached KV blocks."),
    "prefix_cache_preempted_queries_tokens": (
        "counter", "Tokens looked up when a preempted sequence was re-admitted (not counted as queries)."),
    "prefix_cache_preempted_hits_tokens": ("counter", "Of those, tokens served from cached KV blocks."),
    "prefix_cache_evictions": ("counter", "Cached KV blocks evicted from the device pool (every cause)."),
    "prefix_cache_retained_evictions": (
        "counter", "Of those, pinned or session-held blocks (taken only when no ordinary block was left)."),
    "prefix_cache_reset_evictions": ("counter", "Of those, blocks dropped by a prefix-cache reset."),
    "prefix_cache_host_hits_tokens": ("counter", "Cached tokens restored from the host tier instead of recomputed."),
    "prefix_cache_disk_hits_tokens": ("counter", "Cached tokens restored from the disk tier instead of recomputed."),
    "state_snapshots_cached": ("gauge", "Hybrid models: recurrent-state snapshots a prefix hit can resume from."),
    "state_snapshot_evictions": ("counter", "Hybrid models: state snapshots dropped to make room."),
    "kv_blocks_total": ("gauge", "KV cache blocks in the pool."),
    "kv_blocks_free": ("gauge", "KV blocks an allocation can take (free, or cached and held by no request)."),
    "kv_blocks_cached": ("gauge", "KV blocks holding a cached prefix block (held or not)."),
    "kv_blocks_retained": ("gauge", "Cached KV blocks pinned (cache_control, named caches) or held for a session."),
    "kv_retention_refused_blocks": ("counter", "KV blocks whose pin or hold was refused at --max-retained-fraction or "
                                    "--max-retained-share-per-tenant."),
    "kv_host_blocks_total": ("gauge", "Blocks the host KV tier (--kv-offload-gb) holds at most."),
    "kv_host_blocks_cached": ("gauge", "Blocks in the host KV tier."),
    "kv_disk_blocks_total": ("gauge", "Blocks the disk KV tier (--kv-disk-dir) holds at most."),
    "kv_disk_blocks_cached": ("gauge", "Blocks in the disk KV tier."),
    "kv_host_dropped_blocks": ("counter", "Blocks the full host KV tier gave up (least recently used first)."),
    "kv_disk_dropped_blocks": ("counter", "Blocks the full disk KV tier gave up (least recently used first)."),
    "kv_offload_bytes": ("counter", "Bytes of KV blocks copied from the device pool to the host tier."),
    "kv_restore_bytes": ("counter", "Bytes of KV blocks copied back from the host tier to the device pool."),
    "kv_disk_write_bytes": ("counter", "Bytes of KV blocks written to the disk tier."),
    "kv_disk_read_bytes": ("counter", "Bytes of KV blocks read back from the disk tier."),
    "kv_restore_seconds": ("counter", "Time spent copying cached KV blocks back from the host and disk tiers."),
    "requests_running": ("gauge", "Sequences being computed."),
    "requests_waiting": ("gauge", "Sequences queued for admission."),
    "prompt_tokens": ("counter", "Prompt tokens prefilled (cache hits excluded)."),
    "generation_tokens": ("counter", "Tokens generated."),
    "preemptions": ("counter", "Sequences preempted for lack of KV blocks (recomputed later)."),
    "spec_verifications": ("counter", "Speculative decoding: sequence-steps that verified drafts."),
    "spec_draft_tokens": ("counter", "Speculative decoding: draft tokens verified (acceptance rate: accepted / drafts)."),
    "spec_accepted_tokens": ("counter", "Speculative decoding: draft tokens accepted (mean accepted length: "
                                        "(accepted + verifications) / verifications)."),
    "decode_steps": ("counter", "Sequence-steps that produced tokens (tokens per step: generation_tokens / this)."),
    "grammar_mask_steps": ("counter", "Steps that applied a grammar's token masks (structured output, tool choice)."),
    "grammar_mask_wait_seconds": ("counter", "Time steps waited for grammar masks after the forward pass."),
}
assert set(_SNAPSHOT_METRICS) == {f.name for f in fields(SchedulerStats)}


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, cumulative = [], 0
        for bound, n in zip([*map(_num, self.buckets), "+Inf"], self.counts, strict=True):
            cumulative += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}')
        braces = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{braces} {_num(self.total)}", f"{name}_count{braces} {self.count}"]
        return out


def _num(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value)) + ".0"


class Metrics:
    """What `/metrics` shows. Written by the engine thread, rendered by request handlers."""

    def __init__(self, model_name: str, prefix: str = "kvserve") -> None:
        self.model_name = model_name
        self.prefix = prefix
        self._lock = threading.Lock()
        self._snapshot = SchedulerStats()
        self._ttft = Histogram()
        self._e2e = Histogram()
        self._finished: dict[str, int] = {}  # finish reason -> sequences

    def update(self, snapshot: SchedulerStats) -> None:
        with self._lock:
            self._snapshot = snapshot

    def snapshot(self) -> SchedulerStats:
        """The engine's counters and gauges after its last step."""
        with self._lock:
            return self._snapshot

    def observe_finished(self, finish_reason: str, ttft_s: float | None, e2e_s: float | None) -> None:
        with self._lock:
            self._finished[finish_reason] = self._finished.get(finish_reason, 0) + 1
            if ttft_s is not None:
                self._ttft.observe(ttft_s)
            if e2e_s is not None:
                self._e2e.observe(e2e_s)

    def render(self) -> str:
        p, model = self.prefix, _label_value(self.model_name)
        label = f'model="{model}"'
        lines: list[str] = []
        with self._lock:
            for key, (kind, help_text) in _SNAPSHOT_METRICS.items():
                name = f"{p}_{key}_total" if kind == "counter" else f"{p}_{key}"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                lines.append(f"{name}{{{label}}} {getattr(self._snapshot, key)}")
            name = f"{p}_requests_finished_total"
            lines += [f"# HELP {name} Sequences finished, by finish reason.", f"# TYPE {name} counter"]
            for reason, n in sorted(self._finished.items()):
                lines.append(f'{name}{{{label},finish_reason="{_label_value(reason)}"}} {n}')
            for key, hist, help_text in (
                ("time_to_first_token_seconds", self._ttft, "Arrival to first generated token, per sequence."),
                ("e2e_request_latency_seconds", self._e2e, "Arrival to finish, per sequence."),
            ):
                name = f"{p}_{key}"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *hist.lines(name, label)]
        return "\n".join(lines) + "\n"


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
