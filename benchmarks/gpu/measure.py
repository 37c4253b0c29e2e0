"""What the GPU check measures, device-agnostic so the CPU tests drive the same code: engine vs HF transformers,
decode-step time against the memory-bandwidth bound, batch-1 decode with speculation, deadline-bounded throughput, the memory footprint, and the
device's copy bandwidth (the achievable ceiling next to the datasheet's)."""
from __future__ import annotations

import dataclasses
import itertools
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


# bf16 logits of the bench models (random weights: |logit| < 4) step by 1/64 or less. Where plain greedy's top two
# are this close, rounding picks the winner, and another path to the same logits (a verification's rows, a prompt
# block recomputed after a prefix-cache hit) may pick the other: a near tie, not a wrong token.
NEAR_TIE_NATS = 0.05
PROFILED_TOKENS = 64  # of the drafted run under the profiler, and of the eager plain run


def time_speculative_decode(llm, prompt_len: int, tokens: int, seed: int) -> dict[str, Any]:
    """Batch-1 decode with and without speculation on one random prompt: plain greedy, then the same request twice
    in a suffix-decoding session (the second drafts the first's reply from the session's tree, so nearly every draft
    is accepted, even on random weights). Decode time is from the first token to the last (the prefill is the
    same); a verification step runs eagerly (its rows do not fit the decode graphs), so its cost against a plain
    step is what the GPU tells here.

    Where the time goes: per engine step, the runner's host and device split (`StepProfile`: prepare, launch, wait,
    and on CUDA the device part's GPU time by events) of the plain and the drafted run; a plain run with the decode
    graphs off (the verification's eager forward with one row); a third drafted run under torch's profiler (GPU busy
    time and kernel launches per step, the costliest kernels).

    Where the tokens part: plain's top two at the first token each drafted run differs, from a rerun of plain with
    logprobs (same cache state, same path); ``tokens_agree`` holds when every such place is a near tie
    (`NEAR_TIE_NATS`) the drafted run took the other way. A plain rerun with its prompt from the prefix cache shows
    whether plain alone parts from itself by that path difference."""
    from engine import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(10_000) for _ in range(prompt_len)]
    runner, drafter = llm.engine.runner, llm.engine.scheduler.drafter
    llm.reset_prefix_cache()

    def decode(max_tokens: int = tokens, **params) -> tuple[Any, float]:
        sync()
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                                    **params))[0]
        sync()
        return out, out.metrics.finished - out.metrics.first_token

    timed = runner.time_device
    runner.time_device = runner.device.type == "cuda"
    try:
        before = dataclasses.replace(runner.profile)
        plain, plain_s = decode()
        plain_split = _split_per_step(before, runner.profile, tokens)  # the prefill's step and tokens - 1 decodes
        session = dict(speculative="suffix", speculative_session=f"gpu-check-{seed}")
        first, _ = decode(**session)  # fills the session's tree (its own drafts: prompt lookup)
        before, profile_before = dataclasses.replace(drafter.stats["suffix"]), dataclasses.replace(runner.profile)
        drafted, spec_s = decode(**session)
        stats = dataclasses.replace(drafter.stats["suffix"])  # a copy: the profiled run below counts on
        spec_split = _split_per_step(profile_before, runner.profile, stats.steps - before.steps)  # prefill's too
        eager_ms = _eager_decode_step_ms(runner, lambda n: decode(max_tokens=n)[1], PROFILED_TOKENS)
        profiled = _profile_drafted_run(lambda: decode(max_tokens=PROFILED_TOKENS, **session), drafter)
    finally:
        runner.time_device = timed
    verifications = stats.verifications - before.verifications
    drafts = stats.draft_tokens - before.draft_tokens
    accepted = stats.accepted_tokens - before.accepted_tokens
    spec_steps = max(stats.steps - before.steps - 1, 1)  # after the prefill's step, which sampled the first token
    steps = tokens - 1  # decode steps after the first token, without speculation
    plain_ids, runs = plain.token_ids, {"suffix_first": first.token_ids, "suffix_second": drafted.token_ids}
    evidence: dict[str, Any] = {}
    if any(ids != plain_ids for ids in runs.values()):
        llm.reset_prefix_cache()  # plain's cache state: the scored rerun takes plain's path
        scored = decode(logprobs=2)[0]
        again = decode()[0].token_ids  # its prompt from the prefix cache, as the drafted runs had theirs
        evidence = {"parts": {name: divergence(plain_ids, ids, scored.token_ids, scored.outputs[0].logprobs)
                              for name, ids in runs.items()},
                    "plain_cached_prompt_diverged_at": first_difference(plain_ids, again),
                    "plain_near_ties": sum(_top2_gap(t) <= NEAR_TIE_NATS for t in scored.outputs[0].logprobs)}
    return {"batch": 1, "context_len": prompt_len, "tokens": tokens, "k": drafter.num_speculative_tokens,
            "plain_step_ms": plain_s / steps * 1e3, "plain_tokens_per_s": steps / plain_s,
            "spec_step_ms": spec_s / spec_steps * 1e3, "spec_steps": spec_steps,
            "spec_tokens_per_s": steps / spec_s, "speedup": plain_s / spec_s, "verifications": verifications,
            "acceptance_rate": accepted / max(drafts, 1),
            "mean_accepted_length": (accepted + verifications) / max(verifications, 1),
            "plain_split_ms": plain_split, "spec_split_ms": spec_split, "eager_plain_step_ms": eager_ms,
            "drafted_profile": profiled,
            "identical_tokens": all(ids == plain_ids for ids in runs.values()),
            "diverged_at": first_difference(plain_ids, drafted.token_ids),
            "tokens_agree": all(part is None or part["near_tie"] for part in evidence.get("parts", {}).values()),
            **evidence}


def check_speculation_exact(model: str, device: str, prompt_len: int = 200, tokens: int = 64, seed: int = 0
                            ) -> dict[str, Any]:
    """In fp32, where rounding does not flip a greedy choice: plain greedy against the same request drafted, on a
    tiny model and the device's own kernels (Triton on CUDA: plain decode in graphs, verification eager). Drafted
    by suffix decoding (the request twice in a session: its drafts are all accepted on a random model), and by an
    oracle proposing plain's continuation with a wrong draft every third step (rejections at every position, so
    the rejected drafts' KV slots are rolled back and written again). A wrong position, KV slot or roll-back parts
    the tokens."""
    from engine import LLM, SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(5000) for _ in range(prompt_len)]
    backend = {"attention_backend": "triton"} if device == "cuda" else {}

    def drafted(method: str) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0, speculative=method,
                              speculative_session="exact")

    # its own few blocks: it runs beside the check's engine, which holds the memory budget
    with LLM(model, dtype="float32", device=device, num_kv_blocks=256, max_num_seqs=4, **backend) as llm:
        plain = llm.generate([prompt], greedy(tokens))[0].token_ids
        runs = {name: llm.generate([prompt], drafted("suffix"))[0].token_ids for name in ("suffix_1", "suffix_2")}
        drafter = llm.engine.scheduler.drafter
        drafter.propose = _oracle_drafts(prompt + plain, llm.engine.model_cfg.vocab_size)
        try:
            runs["oracle"] = llm.generate([prompt], drafted("ngram"))[0].token_ids
        finally:
            del drafter.propose  # the class's own again
        stats = {name: drafter.stats[method] for name, method in (("suffix", "suffix"), ("oracle", "ngram"))}
    parted = {name: first_difference(plain, ids) for name, ids in runs.items()}
    return {"model": model, "prompt_len": prompt_len, "tokens": tokens, "diverged_at": parted,
            **{f"{name}_drafts": {"verifications": s.verifications, "drafted": s.draft_tokens,
                                  "accepted": s.accepted_tokens} for name, s in stats.items()},
            "passed": all(at is None for at in parted.values())}


def _oracle_drafts(reference: list[int], vocab_size: int):
    """A drafter's ``propose``: the next tokens of ``reference`` where the sequence follows it, one of them wrong on
    every third call (at a position that moves with the calls)."""
    calls = itertools.count(1)

    def propose(seq_id: str, method: str, tokens: Sequence[int], k: int, session) -> list[int]:
        n = len(tokens)
        if method == "off" or k <= 0 or list(tokens) != reference[:n]:
            return []
        drafts, call = reference[n : n + k], next(calls)
        if drafts and call % 3 == 0:
            wrong = call % len(drafts)
            drafts[wrong] = (drafts[wrong] + 1) % vocab_size
        return drafts

    return propose


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _top2_gap(logprobs) -> float:
    top = logprobs.top
    return top[0][1] - top[1][1] if len(top) > 1 else float("inf")


def divergence(plain: Sequence[int], other: Sequence[int], scored: Sequence[int], logprobs: Sequence[Any]
               ) -> dict[str, Any] | None:
    """Where ``other`` first leaves ``plain`` (None: never), with plain's top two there, read from ``scored`` (a
    rerun of plain with ``logprobs`` >= 2) when that rerun took plain's path up to there. ``near_tie``: the two
    tokens are plain's top two, closer than `NEAR_TIE_NATS`."""
    at = first_difference(plain, other)
    if at is None:
        return None
    part: dict[str, Any] = {"at": at, "plain_token": plain[at], "token": other[at], "near_tie": False}
    if list(scored[: at + 1]) != list(plain[: at + 1]) or at >= len(logprobs):
        part["scored_rerun_diverged_at"] = first_difference(plain, scored)  # its top two are another context's
        return part
    top = logprobs[at].top[:2]
    gap = _top2_gap(logprobs[at])
    part.update(top2=top, top2_gap=gap,
                near_tie=gap <= NEAR_TIE_NATS and {plain[at], other[at]} == {token for token, _ in top})
    return part


def _split_per_step(before, after, steps: int) -> dict[str, float]:
    """ms per engine step between two snapshots of the runner's `StepProfile`: host (prepare, launch: the device
    part's enqueueing, syncs inside it included; wait: blocked on the results) and device (GPU time, CUDA only)."""
    return {name: (getattr(after, f"{name}_s") - getattr(before, f"{name}_s")) / max(steps, 1) * 1e3
            for name in ("prepare", "launch", "wait", "device")}


def _eager_decode_step_ms(runner, decode_seconds, steps: int) -> float | None:
    """Plain decode with the decode graphs set aside: the eager forward a verification runs, with one row. None
    where every step is eager already (CPU, enforce_eager: ``plain_step_ms`` is that figure)."""
    graphs = runner.decode_graphs
    if graphs is None:
        return None
    runner.decode_graphs = None
    try:
        return decode_seconds(steps + 1) / steps * 1e3
    finally:
        runner.decode_graphs = graphs


def _profile_drafted_run(run, drafter) -> dict[str, Any]:
    """A drafted run under torch's profiler: per engine step, GPU busy time and kernels launched (an eager step
    that launches hundreds of small kernels leaves the GPU idle between them), and the kernels that took longest.
    The profiler's own overhead inflates the host's time, not these. A profiler that fails (CUPTI) is reported,
    a failing run raises as it would unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    try:
        prof.start()
    except Exception as exc:  # noqa: BLE001 - the timings above stand without it
        return {"unavailable": f"the profiler did not start: {exc!r}"}
    before = drafter.stats["suffix"].steps
    try:
        run()
    finally:
        kernels = _device_events(prof)
    if isinstance(kernels, str):
        return {"unavailable": kernels}
    steps = max(drafter.stats["suffix"].steps - before, 1)
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"steps": steps, "gpu_busy_ms_per_step": sum(e.self_device_time_total for e in kernels) / steps / 1e3,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "top_kernels": [{"name": e.key[:80], "ms_per_step": e.self_device_time_total / steps / 1e3,
                             "calls_per_step": e.count / steps} for e in kernels[:6]]}


def _device_events(prof) -> list | str:
    """Stop ``prof``; its device-side events (kernels, copies), averaged by name, or why there are none."""
    from torch.autograd import DeviceType

    try:
        prof.stop()
        return [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    except Exception as exc:  # noqa: BLE001 - reported in the step's result
        return f"the profiler failed: {exc!r}"


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
