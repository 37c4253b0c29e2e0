"""Workloads through the real engine: prefill tokens computed, time to first token, throughput, the
cold-versus-warm first-token experiment (same prompt, first 90% cached or not, identical outputs required), and the
replay of a simulated schedule (same steps, same simulated time) to check the simulator request for request."""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tqdm import tqdm

from engine.config import SchedulingPolicy

from benchmarks.prefix.simulator import ReadyQueue, SimConfig, SimResult
from benchmarks.prefix.traces.trace import PromptTotals, TokenRequest


@dataclass(frozen=True)
class EngineSettings:
    model: str = "qwen3-tiny"
    block_size: int = 16
    num_kv_blocks: int = 4096
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 8
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_tokens: int = 4  # generated tokens per request: prefill is what this benchmark measures
    kv_offload_gb: float = 0.0
    num_state_snapshots: int | None = None  # hybrid models: None sizes the snapshot pool by the engine's fraction
    sliding_window_cache: bool = True  # sliding-window models: False keeps every layer full (a dense model's cache)
    kv_cache_memory_gb: float | None = None  # the KV memory instead of num_kv_blocks (a window model splits it)


class VirtualClock:
    """The engine's KV clock in a replay: set to each step's simulated start, so pins and holds expire as they did
    in the simulation."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def make_llm(settings: EngineSettings, enable_prefix_caching: bool = True, clock: VirtualClock | None = None,
             tokenizer=None):
    """``tokenizer``: one this model's previous engine loaded (a 262k-token vocabulary takes seconds to load)."""
    from engine import LLM  # imported here: the simulator and the trace tools must not need the model stack

    memory = settings.kv_cache_memory_gb
    return LLM(
        settings.model, clock=clock, tokenizer=tokenizer, block_size=settings.block_size,
        **({"kv_cache_memory_gb": memory} if memory is not None else {"num_kv_blocks": settings.num_kv_blocks}),
        max_num_batched_tokens=settings.max_num_batched_tokens, max_num_seqs=settings.max_num_seqs,
        enable_prefix_caching=enable_prefix_caching, scheduling_policy=settings.scheduling_policy,
        kv_offload_gb=settings.kv_offload_gb, num_state_snapshots=settings.num_state_snapshots,
        sliding_window_cache=settings.sliding_window_cache,
    )


@dataclass
class EngineRequestResult:
    request_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class EngineRunResult(PromptTotals):
    workload: str
    results: list[EngineRequestResult]
    wall_s: float
    generated_tokens: int

    def summary(self) -> dict:
        ttfts = [r.ttft_s for r in self.results]
        return {
            "workload": self.workload,
            "requests": len(self.results),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens_computed": self.prompt_tokens - self.cached_tokens,
            "hit_rate": self.hit_rate,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "wall_s": self.wall_s,
            "prompt_tokens_per_s": self.prompt_tokens / self.wall_s if self.wall_s else None,
            "generated_tokens": self.generated_tokens,
            "per_request": [asdict(r) for r in self.results],
        }


def run_workload(llm, name: str, requests: Sequence[TokenRequest], settings: EngineSettings) -> EngineRunResult:
    """Send the requests in the simulator's batches (a request waits for its parent); the engine's own outputs are
    not fed back: later turns carry the workload's scripted replies, as a replayed conversation does."""
    from engine import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
    queue = ReadyQueue(requests)
    cfg = SimConfig(block_size=settings.block_size, max_num_seqs=settings.max_num_seqs)
    results: list[EngineRequestResult] = []
    generated, step = 0, 0.0
    start = time.perf_counter()
    with tqdm(total=len(requests), desc=f"engine {name}", unit="req", leave=False) as bar:
        while queue:
            step = queue.advance(step)
            batch = queue.take(cfg)
            outs = llm.generate([r.engine_prompt() for r in batch], params, cache_salt=[r.salt for r in batch])
            for r, out in zip(batch, outs):
                results.append(EngineRequestResult(r.request_id, r.turn, len(r.prompt), out.num_cached_tokens,
                                                   out.metrics.ttft_s))
                generated += len(out.token_ids)
                queue.finished(r, step + 1)
            step += 1
            bar.update(len(batch))
    return EngineRunResult(name, results, time.perf_counter() - start, generated)


def replay_schedule(llm, clock: VirtualClock, requests: Sequence[TokenRequest], schedule: SimResult,
                    max_tokens: int) -> EngineRunResult:
    """Send the simulator's steps to the engine as they ran in the simulation: the same batches in the same order,
    the engine's KV clock at each step's simulated start, the same holds (a reply that ends in tool calls holds its
    session from the end of its step for ``tool_call_ttl_s``) and pins. The engine generates ``max_tokens`` tokens
    per request (the simulator's ``engine_max_tokens``); later turns carry the workload's scripted replies."""
    from engine import SamplingParams
    from engine.retention import Retention

    by_id = {r.request_id: r for r in requests}
    ttl = schedule.config.tool_call_ttl_s
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results: list[EngineRequestResult] = []
    generated = 0
    start = time.perf_counter()
    for _, step in itertools.groupby(schedule.results, key=lambda res: res.step):
        step = list(step)
        batch = [by_id[res.request_id] for res in step]
        clock.now = step[0].start
        holds = [ttl + res.step_s if r.ends_in_tool_call and ttl else 0.0 for r, res in zip(batch, step)]
        retention = [Retention(r.pins, hold, r.snapshot_hints) if r.pins or hold or r.snapshot_hints else None
                     for r, hold in zip(batch, holds)]
        outs = llm.generate([r.engine_prompt() for r in batch], params, cache_salt=[r.salt for r in batch],
                            retention=retention)
        for r, out in zip(batch, outs):
            results.append(EngineRequestResult(r.request_id, r.turn, len(r.prompt), out.num_cached_tokens,
                                               out.metrics.ttft_s))
            generated += len(out.token_ids)
    return EngineRunResult("replay", results, time.perf_counter() - start, generated)


@dataclass
class TTFTResult:
    prompt_tokens: int
    cached_tokens: int
    cold_ttft_s: float
    warm_ttft_s: float
    outputs_identical: bool
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.cold_ttft_s / self.warm_ttft_s

    def summary(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def ttft_cold_vs_warm(llm, prompt: Sequence[int], cached_fraction: float = 0.9, max_tokens: int = 16) -> TTFTResult:
    """First-token latency of ``prompt`` cold, then again after a request that shares its first ``cached_fraction``.

    Greedy decoding, so the two outputs must match token for token: a cache hit may change speed, never results.
    """
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = list(prompt)
    llm.reset_prefix_cache()
    cold = llm.generate([prompt], params)[0]
    llm.reset_prefix_cache()
    llm.generate([prompt[: int(len(prompt) * cached_fraction)]], SamplingParams(max_tokens=1, temperature=0.0))
    warm = llm.generate([prompt], params)[0]
    return TTFTResult(
        prompt_tokens=len(prompt),
        cached_tokens=warm.num_cached_tokens,
        cold_ttft_s=cold.metrics.ttft_s,
        warm_ttft_s=warm.metrics.ttft_s,
        outputs_identical=cold.token_ids == warm.token_ids,
        output_token_ids=list(warm.token_ids),
    )
