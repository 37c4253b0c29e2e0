"""The prepared GPU check: one run that says whether kvserve is correct and how fast it is on a CUDA machine.

Steps, in order (the last one is cut short, not the run, when the time budget runs out):
1. the kernel tests, natively on the GPU (``tests/test_kernels.py`` without the interpreter);
2. engine correctness: greedy tokens of ``LLM(..., attention_backend="triton")`` equal HF transformers' on a mixed
   batch whose second round hits the prefix cache (the small registered model, fp32);
3. MoE decode throughput of a Qwen3-30B-A3B-shaped model with random bf16 weights (``benchmarks.moe_check``);
4. decode-step timing at batch 1 and 256 with Qwen3-0.6B-shaped random weights (bf16), as tokens/s and as the
   fraction of the HBM-bandwidth bound (weight bytes + KV bytes read per step / step time / peak bandwidth);
5. offline throughput on the nano-vllm workload (256 sequences, input and output lengths uniform in [100, 1024],
   random token ids, ``ignore_eos``).

Usage: ``bash benchmarks/gpu_check.sh [--out results.json] [--peak-bandwidth-tbs 4.8] ...`` (``--help`` for all).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from benchmarks.moe_check import run_qwen3_moe_step

REPO_ROOT = Path(__file__).resolve().parent.parent

# Qwen3-0.6B's config.json shape (tied embeddings, 28 layers, GQA 16/8, head_dim 128).
QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# What a tokenizer directory contributes to a model directory (never weights or config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "generation_config.json")


# ------------------------------------------------------------------------------------------------- model building


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> list[str]:
    copied = [name for name in TOKENIZER_FILES if (src_dir / name).is_file()]
    if "tokenizer.json" not in copied and "vocab.json" not in copied:
        raise FileNotFoundError(f"{src_dir} holds no tokenizer files")
    for name in copied:
        shutil.copyfile(src_dir / name, dst_dir / name)
    return copied


def build_random_model(
    out_dir: Path,
    tokenizer_from: str,
    overrides: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> Path:
    """An HF-format Qwen3 directory with random weights (Qwen3-0.6B's shape unless ``overrides``) and the tokenizer
    of the registered model ``tokenizer_from``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine.registry import resolve_model

    config = Qwen3Config(**{**QWEN3_0_6B, **(overrides or {})})
    torch.manual_seed(seed)
    with torch.device(device):  # initializing on the GPU takes seconds, not a minute of CPU time
        model = Qwen3ForCausalLM(config).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    copy_tokenizer(resolve_model(tokenizer_from), out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------- workloads, bounds


def nano_vllm_workload(
    num_seqs: int, min_len: int = 100, max_len: int = 1024, vocab_limit: int = 10_000, seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """Random prompts and output lengths, both uniform in ``[min_len, max_len]`` (nano-vllm's bench.py)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_limit) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, output_lens


def weight_bytes(model_dir: Path) -> int:
    """Bytes a forward pass reads from the weights: the safetensors payload (tied embeddings are stored once)."""
    return sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes


def bandwidth_fraction(bytes_per_step: float, step_seconds: float, peak_bytes_per_s: float) -> float:
    """How close a step is to the memory-bandwidth bound: 1.0 means every byte moved at peak speed."""
    return bytes_per_step / step_seconds / peak_bytes_per_s


# --------------------------------------------------------------------------------------------------------- steps


def _sync() -> None:
    """Wait for queued GPU work so wall-clock timings cover it (no-op on CPU, where the timing helpers are tested)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_kernel_tests(timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVSERVE_KERNEL_TEST_DEVICE"] = "cuda"
    start = time.perf_counter()
    result = subprocess.run(
        # The kernels natively, and the CUDA-graph decode path against eager (its GPU-only test).
        [sys.executable, "-m", "pytest", "tests/test_kernels.py", "tests/engine/test_decode_graph_padding.py", "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    summary = (result.stdout.strip().splitlines() or [""])[-1]
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-3000:], sep="\n")
    return {"passed": result.returncode == 0, "summary": summary, "seconds": time.perf_counter() - start}


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


def check_engine_against_hf(
    model: str, device: str, backend: str = "triton", max_tokens: int = 16, block_size: int = 16, seed: int = 0,
) -> dict[str, Any]:
    """Greedy tokens of the engine vs HF transformers (fp32) on a mixed batch; round 2 extends round 1's prompts,
    so it runs prefill chunks over cached prefixes next to fresh prompts, a one-token prompt and decodes."""
    from engine import LLM
    from engine.registry import resolve_model

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(5000) for _ in range(n)]  # noqa: E731 - a local shorthand
    shared = ids(3 * block_size + 5)
    round1 = [shared + ids(7), ids(2 * block_size + 1), shared[: block_size + 2]]
    round2 = [round1[0] + ids(9), round1[1] + ids(block_size), shared + ids(3), ids(1), ids(block_size - 1)]
    llm = LLM(model, attention_backend=backend, device=device, dtype="float32", num_kv_blocks=256,
              block_size=block_size, max_num_seqs=16)
    engine_out = [o.token_ids for o in llm.generate(round1, greedy(max_tokens))]
    results = llm.generate(round2, greedy(max_tokens))
    engine_out += [o.token_ids for o in results]
    expected = hf_greedy(resolve_model(model), round1 + round2, max_tokens, device)
    mismatches = [i for i, (a, b) in enumerate(zip(engine_out, expected)) if a != b]
    return {
        "match": not mismatches, "mismatched_prompts": mismatches, "prompts": len(expected),
        "cached_tokens_round2": sum(r.num_cached_tokens for r in results),
        "distinct_tokens": len({t for out in engine_out for t in out}),
    }


@dataclass
class DecodeTiming:
    batch: int
    context_len: int
    step_ms: float
    tokens_per_s: float
    bytes_per_step: float
    bandwidth_fraction: float
    weight_bound_ms: float


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
        _sync()
        start = time.perf_counter()
        llm.generate(prompts, greedy(max_tokens))
        _sync()
        return time.perf_counter() - start

    prefill_only = run(1)
    step_s = max(run(steps + 1) - prefill_only, 1e-9) / steps
    mean_context = prompt_len + 1 + steps / 2
    step_bytes = bytes_weights + kv_per_token * mean_context * batch
    return DecodeTiming(
        batch=batch, context_len=prompt_len, step_ms=step_s * 1e3, tokens_per_s=batch / step_s,
        bytes_per_step=step_bytes, bandwidth_fraction=bandwidth_fraction(step_bytes, step_s, peak_bytes_per_s),
        weight_bound_ms=bytes_weights / peak_bytes_per_s * 1e3,
    )


def run_throughput(llm, prompts: list[list[int]], output_lens: list[int], deadline: float) -> dict[str, Any]:
    """The nano-vllm workload through the engine's step loop, stopped at ``deadline`` (then partial)."""
    from engine import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), None)
    generated, finished = 0, 0
    _sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        for out in engine.step():
            generated += len(out.new_token_ids)
            finished += bool(out.finished)
    _sync()
    elapsed = time.perf_counter() - start
    complete = not engine.has_unfinished_requests()
    if not complete:  # leave the engine clean for whatever runs next
        for i in range(len(prompts)):
            engine.abort_request(f"bench-{i}")
    return {
        "complete": complete, "sequences": len(prompts), "finished": finished, "output_tokens": generated,
        "target_output_tokens": sum(output_lens), "seconds": elapsed, "output_tokens_per_s": generated / max(elapsed, 1e-9),
    }


def _bench_engine(model_dir: Path, args: argparse.Namespace):
    """The benchmark engine (Triton backend, bf16, KV pages from the memory budget), its kernels compiled."""
    from engine import LLM

    llm = LLM(str(model_dir), attention_backend="triton", device="cuda", dtype="bfloat16", num_kv_blocks=None,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(256, args.num_seqs),
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096)
    # Compile every eager kernel variant before timing (decode steps replay CUDA graphs, whose kernels were compiled
    # when they were captured). The attention tile follows the longest query of a step, so each prompt runs alone:
    # 5 and 12 tokens give the 16- and 32-row prefill tiles, 300 the 64-row one.
    for length in (5, 12, 300):
        llm.generate([list(range(length))], greedy(4))
    return llm


# ----------------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="kvserve GPU check: kernel tests, engine correctness, decode "
                                                 "timing and nano-vllm throughput (must finish in < 8 minutes).")
    parser.add_argument("--tokenizer-from", default="qwen3-tiny",
                        help="registered model whose tokenizer files go into the random model dir")
    parser.add_argument("--correctness-model", default="qwen3-tiny",
                        help="model checked token-for-token against HF transformers")
    parser.add_argument("--peak-bandwidth-tbs", type=float, default=4.8, help="HBM peak in TB/s (H200: 4.8)")
    parser.add_argument("--num-seqs", type=int, default=256, help="sequences in the throughput workload")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--decode-prompt-len", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--time-budget-s", type=float, default=450.0,
                        help="the throughput step stops (reporting partial numbers) when this much time has passed")
    parser.add_argument("--skip-kernel-tests", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-moe", action="store_true", help="skip the Qwen3-30B-A3B-shaped MoE decode step")
    parser.add_argument("--model-dir", type=Path, help="reuse this random model dir instead of building one")
    parser.add_argument("--out", type=Path, help="write all results here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    deadline = started + args.time_budget_s
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "peak_bandwidth_tbs": args.peak_bandwidth_tbs,
    }
    failures: list[str] = []

    def log(step: str, value: Any) -> None:
        report[step] = value
        print(f"[{time.perf_counter() - started:6.1f}s] {step}: {json.dumps(value, default=str)}", flush=True)
        if args.out:  # rewritten after every step, so a crash later keeps what was measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2, default=str))

    def attempt(
        step: str, fn: Callable[[], Any], passed: Callable[[Any], bool] = lambda _: True,
        summary: Callable[[Any], Any] = lambda value: value,
    ) -> Any:
        """Run one step; a failure is recorded (with its traceback) and the remaining steps still run."""
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - the report must say what broke, whatever it was
            traceback.print_exc()
            failures.append(step)
            log(step, {"error": traceback.format_exc(limit=8)})
            return None
        if not passed(value):
            failures.append(step)
        log(step, summary(value))
        return value

    if not args.skip_kernel_tests:
        attempt("kernel_tests", lambda: run_kernel_tests(timeout_s=240), lambda r: r["passed"])
    if not args.skip_correctness:
        attempt("engine_vs_hf", lambda: check_engine_against_hf(args.correctness_model, "cuda"), lambda r: r["match"])
        gc.collect()  # the small engine's pages go back before the big one sizes its KV cache from free memory
        torch.cuda.empty_cache()
    if not args.skip_moe:
        attempt("qwen3_30b_a3b_decode", lambda: run_qwen3_moe_step(peak_bandwidth_tbs=args.peak_bandwidth_tbs))
        gc.collect()
        torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory(prefix="kvserve-qwen3-0.6b-") as tmp:
        model_dir = args.model_dir or attempt(
            "model", lambda: build_random_model(Path(tmp), args.tokenizer_from, device="cuda"),
            summary=lambda path: {"dir": str(path), "weight_bytes": weight_bytes(path)})
        llm = None
        if model_dir is not None:
            llm = attempt("engine", lambda: _bench_engine(model_dir, args), summary=lambda _: "ready (kernels warm)")
        if llm is not None:
            bytes_w = weight_bytes(model_dir)
            kv_token = kv_bytes_per_token(QWEN3_0_6B, 2)
            for batch in args.decode_batches:
                attempt(f"decode_batch_{batch}", lambda: asdict(time_decode_step(
                    llm, batch, args.decode_prompt_len, args.decode_steps, bytes_w, kv_token,
                    args.peak_bandwidth_tbs * 1e12, seed=batch)))
            prompts, output_lens = nano_vllm_workload(args.num_seqs, args.min_len, args.max_len)
            attempt("throughput", lambda: run_throughput(llm, prompts, output_lens, deadline))

    report["failed_steps"] = failures
    log("total_seconds", time.perf_counter() - started)
    print(f"done; {'all steps passed' if not failures else 'FAILED: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
