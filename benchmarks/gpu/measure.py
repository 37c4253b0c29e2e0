"""What the GPU check measures, device-agnostic so the CPU tests drive the same code: engine vs HF transformers,
decode-step time against the memory-bandwidth bound, batch-1 decode with speculation, deadline-bounded throughput, the memory footprint, and the
device's copy bandwidth (the achievable ceiling next to the datasheet's)."""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks.throughput import ThroughputWorkload

GIB = 2**30


def sync() -> None:
    """Wait for queued GPU work so wall-clock timings cover it (no-op on CPU, where the timing code is tested)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def hf_greedy(model_dir: Path, prompts: Sequence[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:  # one at a time: no padding, so nothing but the prompt is attended
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def _mixed_rounds(block_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Round 2 extends round 1's prompts, so it runs prefill chunks over cached prefixes next to fresh prompts, a
    one-token prompt and decodes."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(5000) for _ in range(n)]  # noqa: E731 - a local shorthand
    shared = ids(3 * block_size + 5)
    round1 = [shared + ids(7), ids(2 * block_size + 1), shared[: block_size + 2]]
    round2 = [round1[0] + ids(9), round1[1] + ids(block_size), shared + ids(3), ids(1), ids(block_size - 1)]
    return round1, round2


def _run_rounds(model: str, rounds: tuple[list, list], max_tokens: int, **options) -> tuple[list[list[int]], Any]:
    """Greedy tokens of both rounds (fp32, 256 blocks), and round 2's outputs."""
    from engine import LLM

    with LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=16, **options) as llm:
        tokens = [o.token_ids for o in llm.generate(rounds[0], greedy(max_tokens))]
        results = llm.generate(rounds[1], greedy(max_tokens))
    return tokens + [o.token_ids for o in results], results


def check_engine_against_hf(
    model: str, device: str, backend: str = "triton", max_tokens: int = 16, block_size: int = 16, seed: int = 0,
) -> dict[str, Any]:
    """Greedy tokens of the engine vs HF transformers (fp32) on a mixed batch of two rounds (`_mixed_rounds`)."""
    from engine.registry import resolve_model

    rounds = _mixed_rounds(block_size, seed)
    engine_out, results = _run_rounds(model, rounds, max_tokens, attention_backend=backend, device=device,
                                      block_size=block_size)
    expected = hf_greedy(resolve_model(model), rounds[0] + rounds[1], max_tokens, device)
    mismatches = [i for i, (a, b) in enumerate(zip(engine_out, expected)) if a != b]
    return {
        "passed": not mismatches, "mismatched_prompts": mismatches, "prompts": len(expected),
        "cached_tokens_round2": sum(r.num_cached_tokens for r in results),
        "distinct_tokens": len({t for out in engine_out for t in out}),
    }


def check_tensor_parallel(model: str, device: str, size: int, backend: str = "triton", max_tokens: int = 16,
                          block_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Greedy tokens of ``size`` ranks vs one rank on the same mixed batch, and each run's wall time."""
    rounds = _mixed_rounds(block_size, seed)
    runs = {}
    for ranks in (1, size):
        start = time.perf_counter()
        runs[ranks] = _run_rounds(model, rounds, max_tokens, attention_backend=backend, device=device,
                                  block_size=block_size, tensor_parallel_size=ranks)[0]
        runs[f"seconds_tp{ranks}"] = time.perf_counter() - start
    mismatches = [i for i, (a, b) in enumerate(zip(runs[size], runs[1])) if a != b]
    return {"passed": not mismatches, "mismatched_prompts": mismatches, "prompts": len(runs[1]),
            "seconds_tp1": runs["seconds_tp1"], f"seconds_tp{size}": runs[f"seconds_tp{size}"]}


def bandwidth_fraction(bytes_per_step: float, step_seconds: float, peak_bytes_per_s: float) -> float:
    """How close a step is to the memory-bandwidth bound: 1.0 means every byte moved at peak speed."""
    return bytes_per_step / step_seconds / peak_bytes_per_s


@dataclass
class DecodeTiming:
    batch: int
    context_len: int
    step_ms: float
    tokens_per_s: float
    bytes_per_step: float
    bound_ms: float  # bytes_per_step at the peak bandwidth
    bandwidth_fraction: float


def time_decode_step(
    llm, batch: int, prompt_len: int, steps: int, bytes_weights: int, kv_per_token: int, peak_bytes_per_s: float,
    seed: int,
) -> DecodeTiming:
    """Decode-step time = (time of prefill + ``steps`` + 1 tokens - time of the same prefill + 1 token) / steps, on
    fresh random prompts each time with the prefix cache reset, so both runs prefill the same amount."""
    rng = random.Random(seed)

    def run(max_tokens: int) -> float:
        prompts = [[rng.randrange(10_000) for _ in range(prompt_len)] for _ in range(batch)]
        llm.reset_prefix_cache()
        sync()
        start = time.perf_counter()
        llm.generate(prompts, greedy(max_tokens))
        sync()
        return time.perf_counter() - start

    prefill_only = run(1)
    step_s = max(run(steps + 1) - prefill_only, 1e-9) / steps
    step_bytes = bytes_weights + kv_per_token * (prompt_len + 1 + steps / 2) * batch  # the mean context
    return DecodeTiming(
        batch=batch, context_len=prompt_len, step_ms=step_s * 1e3, tokens_per_s=batch / step_s,
        bytes_per_step=step_bytes, bound_ms=step_bytes / peak_bytes_per_s * 1e3,
        bandwidth_fraction=bandwidth_fraction(step_bytes, step_s, peak_bytes_per_s),
    )


def time_speculative_decode(llm, prompt_len: int, tokens: int, seed: int) -> dict[str, Any]:
    """Batch-1 decode with and without speculation on one random prompt: plain greedy, then the same request twice
    in a suffix-decoding session (the second drafts the first's reply from the session's tree, so nearly every draft
    is accepted, even on random weights). Decode time is from the first token to the last (the prefill is the
    same); a verification step runs eagerly (its rows do not fit the decode graphs), so its cost against a plain
    step is what the GPU tells here."""
    from engine import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(10_000) for _ in range(prompt_len)]
    drafter = llm.engine.scheduler.drafter
    llm.reset_prefix_cache()

    def decode(**speculation) -> tuple[list[int], float]:
        sync()
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0,
                                                    **speculation))[0]
        sync()
        return out.token_ids, out.metrics.finished - out.metrics.first_token

    plain, plain_s = decode()
    session = dict(speculative="suffix", speculative_session=f"gpu-check-{seed}")
    first, _ = decode(**session)  # fills the session's tree (its own drafts: prompt lookup)
    before = dataclasses.replace(drafter.stats["suffix"])
    drafted, spec_s = decode(**session)
    stats = drafter.stats["suffix"]
    verifications = stats.verifications - before.verifications
    drafts = stats.draft_tokens - before.draft_tokens
    accepted = stats.accepted_tokens - before.accepted_tokens
    spec_steps = max(stats.steps - before.steps - 1, 1)  # after the prefill's step, which sampled the first token
    steps = tokens - 1  # decode steps after the first token, without speculation
    return {"batch": 1, "context_len": prompt_len, "tokens": tokens, "k": drafter.num_speculative_tokens,
            "plain_step_ms": plain_s / steps * 1e3, "plain_tokens_per_s": steps / plain_s,
            "spec_step_ms": spec_s / spec_steps * 1e3, "spec_steps": spec_steps,
            "spec_tokens_per_s": steps / spec_s, "speedup": plain_s / spec_s, "verifications": verifications,
            "acceptance_rate": accepted / max(drafts, 1),
            "mean_accepted_length": (accepted + verifications) / max(verifications, 1),
            "identical_tokens": plain == first == drafted,
            # bf16: a verification (eager, prefill kernel) need not round as a graph-replayed decode step does,
            # so a near-tie of a random model may flip; where the drafted run first left the plain one
            "diverged_at": next((i for i, (a, b) in enumerate(zip(plain, drafted)) if a != b), None)}


def run_throughput(llm, work: ThroughputWorkload, deadline: float) -> dict[str, Any]:
    """The workload through the engine's step loop, stopped at ``deadline`` (then the figures are partial)."""
    from engine import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), None)
    generated, finished = 0, 0
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        for out in engine.step():
            generated += len(out.new_token_ids)
            finished += bool(out.finished)
    sync()
    elapsed = time.perf_counter() - start
    complete = not engine.has_unfinished_requests()
    if not complete:  # leave the engine clean for whatever runs next
        for i in range(len(work.prompts)):
            engine.abort_request(f"bench-{i}")
    return {
        "complete": complete, "sequences": len(work.prompts), "finished": finished,
        "input_tokens": sum(len(p) for p in work.prompts), "output_tokens": generated,
        "target_output_tokens": work.num_output_tokens, "seconds": elapsed,
        "output_tokens_per_s": generated / max(elapsed, 1e-9),
    }


def memory_snapshot(llm, utilization: float, kv_bytes_per_block: int) -> dict[str, Any]:
    """The device's memory now (CUDA context, weights, KV blocks, graph pools, allocator cache: everything this
    process holds) against the engine's budget, ``total * gpu_memory_utilization``."""
    free, total = torch.cuda.mem_get_info()
    used, budget = total - free, total * utilization
    blocks = llm.engine.scheduler.num_blocks
    return {
        "total_gib": total / GIB, "budget_gib": budget / GIB, "used_gib": used / GIB, "within_budget": used <= budget,
        "torch_peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "torch_reserved_gib": torch.cuda.memory_reserved() / GIB,
        "kv_blocks": blocks, "kv_gib": blocks * kv_bytes_per_block / GIB,
    }


def copy_bandwidth_tbs(gib: int = 4, repeats: int = 10) -> float:
    """Device-to-device copy rate in TB/s, counting bytes read and written: the achievable HBM ceiling."""
    src = torch.empty(gib * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * GIB * repeats / seconds / 1e12
