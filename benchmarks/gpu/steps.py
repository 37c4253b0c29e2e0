"""The GPU check's steps, in the order their numbers matter. Each step has ``run`` (on the GPU) and ``resolve``
(``--dry-run``: every input it would use, checked here without touching CUDA); both return a JSON-able dict.

A dict with ``"passed": False`` marks the step failed, one with ``"unavailable"`` says why it could not run on this
checkout (a feature another branch adds); anything raised is recorded with its traceback and the next step runs.
"""
from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable
from xml.etree import ElementTree

import torch

from benchmarks.gpu import env as gpu_env
from benchmarks.gpu.context import DENSE, GLM, GPT_OSS, HYBRID, MOE, Context, nano_vllm_workload
from benchmarks.gpu.measure import (
    NEAR_TIE_NATS,
    check_engine_against_hf,
    check_speculation_exact,
    check_tensor_parallel,
    copy_bandwidth_tbs,
    run_throughput,
    time_decode_step,
    time_speculative_decode,
)
from benchmarks.gpu.models import (QWEN3_30B_A3B, engine_weight_bytes, kv_bytes_per_token, meta_param_count,
                                   param_count, weight_bytes)
from benchmarks.gpu.wheels import wheel_status

REPO_ROOT = Path(__file__).resolve().parents[2]
# Triton vs the torch reference for every kernel, natively, and CUDA-graph decode vs eager. Only the GPU-marked
# test of the padding file: its other cases build CPU engines, which need the interpreter (off with CUDA visible).
KERNEL_TESTS = ("tests/kernels/test_triton_ops.py", "tests/kernels/test_fp8.py", "tests/kernels/test_recurrent.py",
                "tests/kernels/test_mxfp4.py",
                "tests/worker/test_decode_graph_padding.py::test_cuda_graph_decode_matches_eager")
# `python -m benchmarks X` is `kvserve bench X` where kvserve is not installed (the device runs this checkout)
STEP_BENCH = ("benchmarks", "step", "--device", "cuda")  # `kvserve bench step` (issue 9)
TURN_BENCH = ("benchmarks", "turns", "--device", "cuda")  # `kvserve bench turns` (issue 42)
SPEC_CONTEXT = 1024  # spec_decode_batch1's prompt, as decode_batch1's


def _model_summary(config: dict[str, Any]) -> dict[str, Any]:
    from engine.config import ModelConfig

    try:
        ModelConfig.from_dict(config)
        supported = None
    except ValueError as error:  # the engine names what it runs
        supported = str(error)
    params = param_count(config)
    return {"model_type": config["model_type"], "layers": config["num_hidden_layers"], "params": params,
            "active_params": param_count(config, active_only=True), "weight_gib": 2 * params / 2**30,
            "kv_bytes_per_token": kv_bytes_per_token(config, 2), "unsupported": supported}


# ----------------------------------------------------------------------------------------------------------- steps


def environment(ctx: Context) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise FatalStepError("no CUDA device is visible to torch "
                             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    versions, problems = gpu_env.package_versions()
    facts, gpu_problems = gpu_env.gpu_facts()
    wheels, wheel_problems = wheel_status(require_carried=False)
    ctx.copy_tbs = copy_bandwidth_tbs()
    problems += gpu_problems + wheel_problems
    return {**versions, **facts, "copy_tbs": ctx.copy_tbs, "datasheet_tbs": ctx.peak_bandwidth_tbs,
            "pytest_xdist": gpu_env.has_module("xdist"), "wheels": wheels, "problems": problems,
            "passed": not problems}


def resolve_environment(ctx: Context) -> dict[str, Any]:
    versions, problems = gpu_env.package_versions()
    wheels, wheel_problems = wheel_status(require_carried=True)
    return {"here": versions, "pins": {name: str(req) for name, req in gpu_env.pinned_requirements().items()},
            "run_checks": "these pins, torch.version.cuda, the driver, capability >= 8.0, Triton's NVIDIA backend",
            "wheels": wheels, "problems": problems + wheel_problems, "passed": not (problems or wheel_problems)}


def _pytest(*extra: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVSERVE_KERNEL_TEST_DEVICE"] = "cuda"
    env["COLUMNS"] = "400"  # the summary's "FAILED id - error" lines keep their message (80 columns cut it off)
    # `-o addopts=`: not the repository's `-n auto` (workers here are this step's choice, and xdist may be missing).
    return subprocess.run([sys.executable, "-m", "pytest", *KERNEL_TESTS, "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *extra],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _failure_messages(junit: Path, max_lines: int = 8) -> dict[str, str]:
    """Each failed or erroring test's message (its first lines) from pytest's JUnit XML: the output tail keeps only
    the last traceback, and the short summary only a message's first line (assert_close's numbers come after it).
    A chained exception's message is the outermost one (a Triton CompilationError: source lines only), so the root
    cause (the first ``E`` line of the traceback) follows it when the message lacks it."""
    if not junit.exists():  # pytest died before writing it
        return {}
    failures = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        for outcome in case:
            if outcome.tag not in ("failure", "error"):
                continue
            lines = (outcome.get("message") or "").strip().splitlines()[:max_lines]
            errors = [line[1:].strip() for line in (outcome.text or "").splitlines() if line.startswith("E ")]
            if errors and errors[0] not in lines:
                lines.append(f"root cause: {errors[0]}")
            failures[f"{case.get('classname')}::{case.get('name')}"] = "\n".join(lines)[-1200:]
    return failures


def kernels(ctx: Context) -> dict[str, Any]:
    parallel = ("-n", "8") if gpu_env.has_module("xdist") else ()  # compiling the variants is the slow part
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "kernels.xml"
        result = _pytest(*parallel, "--tb=short", f"--junitxml={junit}",
                         timeout=max(30.0, min(240.0, ctx.remaining() - 30)))
        failures = _failure_messages(junit)
    lines = result.stdout.strip().splitlines() or [""]
    return {"passed": result.returncode == 0, "summary": lines[-1], "seconds": time.perf_counter() - start,
            "parallel_workers": parallel[1] if parallel else 1, "failures": failures,
            "output_tail": None if result.returncode == 0 else (result.stdout[-4000:] + result.stderr[-2000:])}


def resolve_kernels(ctx: Context) -> dict[str, Any]:
    result = _pytest("--collect-only", timeout=120)
    lines = result.stdout.strip().splitlines() or [""]
    return {"tests": list(KERNEL_TESTS), "collected": lines[-1], "passed": result.returncode == 0}


def tiny_vs_hf(ctx: Context) -> dict[str, Any]:
    results = {name: check_engine_against_hf(name, ctx.device) for name in ctx.plan.tiny_models}
    gc.collect()
    torch.cuda.empty_cache()  # the small engines' pages go back before a big engine sizes its KV cache
    return {**results, "passed": all(r["passed"] for r in results.values())}


def resolve_tiny_vs_hf(ctx: Context) -> dict[str, Any]:
    """Build each tiny model as the device will: from scratch, with the tokenizer packages this run imports."""
    from engine.registry import resolve_model

    built = {}
    for name in ctx.plan.tiny_models:
        model_dir = resolve_model(name)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        built[name] = {"dir": str(model_dir), "vocab": vocab}
    return {**built, "passed": True}


def _throughput(ctx: Context, kind: str) -> dict[str, Any]:
    llm = ctx.engine(kind)
    budget = min(ctx.plan.throughput_budget_s, ctx.remaining() - 20)
    result = run_throughput(llm, nano_vllm_workload(ctx.plan.num_seqs), time.perf_counter() + budget)
    return {"engine": kind, "options": ctx.engines[kind].options, "engine_build_s": ctx.engine_builds[kind], **result}


def throughput(ctx: Context) -> dict[str, Any]:
    return _throughput(ctx, "default")


def throughput_eager(ctx: Context) -> dict[str, Any]:
    return _throughput(ctx, "eager")


def resolve_throughput(ctx: Context) -> dict[str, Any]:
    work = nano_vllm_workload(ctx.plan.num_seqs)
    model = _model_summary(ctx.models[DENSE])
    return {"model": model, "engines": {k: ctx.engines[k].options for k in ("default", "eager")},
            "sequences": len(work.prompts), "input_tokens": sum(len(p) for p in work.prompts),
            "output_tokens": work.num_output_tokens, "budget_s": ctx.plan.throughput_budget_s,
            "passed": model["unsupported"] is None}


def decode_batch1(ctx: Context) -> dict[str, Any]:
    llm = ctx.engine("default")
    timing = time_decode_step(llm, 1, 1024, ctx.plan.decode_steps, weight_bytes(ctx.model_dir(DENSE)),
                              kv_bytes_per_token(ctx.models[DENSE], 2), ctx.peak_bandwidth_tbs * 1e12, seed=1)
    measured = {"bound_ms_at_copy_rate": timing.bytes_per_step / (ctx.copy_tbs * 1e12) * 1e3} if ctx.copy_tbs else {}
    return {**asdict(timing), "peak_tbs": ctx.peak_bandwidth_tbs, **measured}


def resolve_decode_batch1(ctx: Context) -> dict[str, Any]:
    weights = 2 * param_count(ctx.models[DENSE])
    return {"batch": 1, "context_len": 1024, "steps": ctx.plan.decode_steps, "weight_bytes": weights,
            "weight_bound_ms": weights / (ctx.peak_bandwidth_tbs * 1e12) * 1e3, "passed": True}


def spec_decode_batch1(ctx: Context) -> dict[str, Any]:
    """Speculative decoding at batch 1 on the default engine (suffix drafts of a repeated request)."""
    llm = ctx.engine("default")
    result = time_speculative_decode(llm, SPEC_CONTEXT, max(ctx.plan.decode_steps, 16), seed=3)
    exact = check_speculation_exact(ctx.plan.tiny_models[0], ctx.device)
    gc.collect()
    torch.cuda.empty_cache()
    # bf16: identical tokens, or parted only at near ties of plain's top two (rounding's choice, not a wrong token);
    # fp32 on the tiny model: identical
    return {**result, "fp32_tiny": exact, "passed": result["tokens_agree"] and exact["passed"]}


def resolve_spec_decode_batch1(ctx: Context) -> dict[str, Any]:
    return {"batch": 1, "context_len": SPEC_CONTEXT, "tokens": max(ctx.plan.decode_steps, 16),
            "method": "suffix, the second of two identical requests in one session", "near_tie_nats": NEAR_TIE_NATS,
            "fp32_tiny_model": ctx.plan.tiny_models[0], "passed": True}


def _step_bench_available() -> bool:
    return subprocess.run([sys.executable, "-m", *STEP_BENCH, "--help"], cwd=REPO_ROOT,
                          capture_output=True, timeout=120).returncode == 0


STEP_BENCH_MISSING = "this checkout has no `kvserve bench step` (benchmarks/step_bench.py, issue 9)"


def _bench_command(ctx: Context, bench: tuple[str, ...], name: str, timeout_s: float) -> tuple[str, Any]:
    """Run a `kvserve bench` command in its own process (its engine sizes its KV cache from free memory, so the
    check's engine is released first); returns the command line and the figures it wrote with --json."""
    ctx.release_engine()
    out = ctx.work_dir / f"{name}.json"
    command = [sys.executable, "-m", *bench, "--json", str(out), "--out-dir", str(ctx.work_dir / name)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=max(10.0, min(timeout_s, ctx.remaining() - 10)))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return " ".join(command[1:]), json.loads(out.read_text())


def host_vs_device(ctx: Context) -> dict[str, Any]:
    if not _step_bench_available():
        return {"unavailable": STEP_BENCH_MISSING}
    command, points = _bench_command(ctx, STEP_BENCH, "step_bench", ctx.plan.step_bench_timeout_s)
    return {"command": command, "points": points}


def resolve_host_vs_device(ctx: Context) -> dict[str, Any]:
    available = _step_bench_available()
    return {"command": " ".join(["python3 -m", *STEP_BENCH, "--json", "FILE"]), "available": available,
            **({} if available else {"unavailable": STEP_BENCH_MISSING}), "passed": True}


def ttft_32k(ctx: Context) -> dict[str, Any]:
    from benchmarks.prefix.engine_run import ttft_cold_vs_warm

    llm = ctx.engine("long_context")
    rng = random.Random(2)
    prompt = [rng.randrange(10_000) for _ in range(ctx.plan.ttft_prompt_tokens)]
    ttft_cold_vs_warm(llm, prompt[:2048])  # compiles the long-prefill kernel variants off the clock
    runs = [ttft_cold_vs_warm(llm, prompt, cached_fraction=0.9).summary() for _ in range(2)]
    for run in runs:
        run.pop("output_token_ids")
    cold, warm = min(r["cold_ttft_s"] for r in runs), min(r["warm_ttft_s"] for r in runs)
    return {"prompt_tokens": len(prompt), "cold_ttft_s": cold, "warm_ttft_s": warm, "speedup": cold / warm,
            "runs": runs, "passed": all(r["outputs_identical"] for r in runs)}


def resolve_ttft_32k(ctx: Context) -> dict[str, Any]:
    max_len = ctx.models[DENSE]["max_position_embeddings"]
    fits = ctx.plan.ttft_prompt_tokens + 16 <= max_len
    return {"prompt_tokens": ctx.plan.ttft_prompt_tokens, "cached_fraction": 0.9, "max_model_len": max_len,
            "engine": ctx.engines["long_context"].options, "passed": fits}


def turn_growth(ctx: Context) -> dict[str, Any]:
    """`kvserve bench turns` on the GPU (issue 42): an agent conversation growing ~5k tokens a turn up to the plan's
    size, each cached turn's TTFT against host time + SDPA over the same K/V + the new tokens' dense layers (the
    Triton prefill over a cached context); passes at most 1.5x, the CPU's goal."""
    command, figures = _bench_command(ctx, TURN_BENCH + ("--max-tokens", str(ctx.plan.turn_max_tokens)), "turns",
                                      ctx.remaining())
    return {"command": command, **figures, "passed": figures["worst_ratio"] <= 1.5}


def resolve_turn_growth(ctx: Context) -> dict[str, Any]:
    from benchmarks.turn_bench import stretched_model_dir

    room = ctx.plan.turn_max_tokens + 2 * 5_000
    return {"command": " ".join(TURN_BENCH), "max_tokens": ctx.plan.turn_max_tokens,
            "model_dir": str(stretched_model_dir("qwen3-tiny", room)), "passed": True}


def memory(ctx: Context) -> dict[str, Any]:
    ctx.snapshot_engine()  # the live engine, after its heaviest step; released ones were measured at release
    return {**ctx.engine_memory, "engine_build_s": ctx.engine_builds,
            "passed": all(m["within_budget"] for m in ctx.engine_memory.values())}


def resolve_memory(ctx: Context) -> dict[str, Any]:
    return {"gpu_memory_utilization": ctx.gpu_memory_utilization, "engines": sorted(ctx.engines), "passed": True}


def moe_throughput(ctx: Context) -> dict[str, Any]:
    model = _model_summary(ctx.models[MOE])
    if model["unsupported"]:
        return {"unavailable": f"the engine does not run qwen3_moe yet (issue 11): {model['unsupported']}"}
    return {"model": model, **_throughput(ctx, "moe")}


def resolve_moe_throughput(ctx: Context) -> dict[str, Any]:
    model = _model_summary(ctx.models[MOE])
    return {"model": model, "of_layers": QWEN3_30B_A3B["num_hidden_layers"],
            **({"unavailable": model["unsupported"]} if model["unsupported"] else {}), "passed": True}


def _hybrid_summary(config: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.prefix.policies.hybrid import StateCost

    cost = StateCost.of(config)
    return {"model_type": config["model_type"], "layers": config["num_hidden_layers"],
            "kv_bytes_per_token": cost.kv_bytes_per_token, "state_bytes_per_sequence": cost.state_bytes}


def hybrid_moe_throughput(ctx: Context) -> dict[str, Any]:
    """The nano-vllm workload on a Qwen3.6-35B-A3B-shaped model (random bf16 weights drawn on the GPU): its
    linear-attention layers run the Triton recurrent kernels, decode under CUDA graphs."""
    return {"model": _hybrid_summary(ctx.models[HYBRID]), **_throughput(ctx, "hybrid_moe")}


def resolve_hybrid_moe_throughput(ctx: Context) -> dict[str, Any]:
    return {"model": _hybrid_summary(ctx.models[HYBRID]), "engine": ctx.engines["hybrid_moe"].options, "passed": True}


def _family_summary(config: dict[str, Any]) -> dict[str, Any]:
    """A released shape of another family: its parameters (transformers' model on the meta device) and what the
    engine's KV cache spec keeps per token (window layers counted at full length; the window group holds less)."""
    from engine.config import ModelConfig
    from engine.models.architectures import MODEL_CLASSES

    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        spec = MODEL_CLASSES[cfg.architecture](cfg, ops=None).kv_cache_spec()
    return {"model_type": config["model_type"], "layers": config["num_hidden_layers"],
            "params": meta_param_count(config), "kv_bytes_per_token": spec.bytes_per_token(torch.bfloat16)}


def _gpt_oss_summary(config: dict[str, Any]) -> dict[str, Any]:
    """`_family_summary` with the engine's weights in bf16 with the experts dequantized and kept in MXFP4."""
    dequantized, packed = engine_weight_bytes(config), engine_weight_bytes(config, packed_experts=True)
    return {**_family_summary(config), "engine_weight_gib": {"dequantized": dequantized / 2**30,
                                                             "mxfp4_experts": packed / 2**30},
            "weight_ratio": dequantized / packed}


def _expert_layer(ctx: Context) -> list[dict[str, Any]]:
    """One of the model's MoE layers, its experts packed against dequantized, side by side at 1, 32 and 512 tokens
    (benchmarks/mxfp4_moe.py; before the engine, which takes the memory)."""
    from benchmarks.mxfp4_moe import Layer, compare

    config = ctx.models[GPT_OSS]
    layer = Layer(config["num_local_experts"], config["hidden_size"], config["intermediate_size"],
                  config["num_experts_per_tok"])
    ctx.release_engine()
    backend = "triton" if ctx.device == "cuda" else "cpu"
    return compare(layer, [1, 32, 512], backend, ctx.device, getattr(torch, ctx.dtype), repeat=5)


def gpt_oss_throughput(ctx: Context) -> dict[str, Any]:
    """The nano-vllm workload on a gpt-oss-20b-shaped model (random weights drawn on the GPU, the experts packed in
    MXFP4 as released): window and full layers with sinks through the Triton attention, the biased top-4 MoE through
    the MXFP4 expert kernel (kernels/triton/mxfp4.py), decode under CUDA graphs. First one MoE layer's experts,
    packed vs dequantized (the bf16 grouped GEMM of kernels/triton/moe.py), timed side by side."""
    return {"model": _gpt_oss_summary(ctx.models[GPT_OSS]), "expert_layer": _expert_layer(ctx),
            **_throughput(ctx, "gpt_oss")}


def glm_throughput(ctx: Context) -> dict[str, Any]:
    """The nano-vllm workload on a GLM-4.7-Flash-shaped model (random bf16 weights drawn on the GPU): MLA's absorbed
    decode over the latent cache, the 64-expert MoE."""
    return {"model": _family_summary(ctx.models[GLM]), **_throughput(ctx, "glm")}


def resolve_gpt_oss_throughput(ctx: Context) -> dict[str, Any]:
    return {"model": _gpt_oss_summary(ctx.models[GPT_OSS]), "engine": ctx.engines["gpt_oss"].options, "passed": True}


def resolve_glm_throughput(ctx: Context) -> dict[str, Any]:
    return {"model": _family_summary(ctx.models[GLM]), "engine": ctx.engines["glm"].options, "passed": True}


TP_SIZE = 2
TP_MODELS = ("qwen3-tiny", "deepseek-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny")


def tensor_parallel(ctx: Context) -> dict[str, Any]:
    gpus = torch.cuda.device_count()
    if gpus < TP_SIZE:
        return {"unavailable": f"tensor parallelism needs {TP_SIZE} GPUs and this machine has {gpus} visible; "
                               "this step runs on a box with two or more"}
    ctx.release_engine()
    results = {name: check_tensor_parallel(name, ctx.device, TP_SIZE) for name in TP_MODELS}
    return {**results, "passed": all(r["passed"] for r in results.values())}


def resolve_tensor_parallel(ctx: Context) -> dict[str, Any]:
    """The tiny models split over 2 ranks (checked without CUDA), and whether this step will have its GPUs."""
    from engine.config import ModelConfig
    from engine.parallel.sizes import shape_problems
    from engine.registry import resolve_model

    fits = {name: not shape_problems(ModelConfig.from_dir(resolve_model(name)), TP_SIZE, False) for name in TP_MODELS}
    return {"tensor_parallel_size": TP_SIZE, "models_split": fits, "gpus_needed": TP_SIZE,
            "gpus_visible": torch.cuda.device_count(), "passed": all(fits.values())}


class FatalStepError(RuntimeError):
    """Nothing after this step can run (no GPU)."""


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Context], dict[str, Any]]
    resolve: Callable[[Context], dict[str, Any]]
    min_seconds: float  # skipped, with a note, when less time than this is left


STEPS = (
    Step("environment", environment, resolve_environment, 5),
    Step("kernels", kernels, resolve_kernels, 60),
    Step("tiny_vs_hf", tiny_vs_hf, resolve_tiny_vs_hf, 20),
    Step("throughput", throughput, resolve_throughput, 45),
    Step("throughput_eager", throughput_eager, resolve_throughput, 45),
    Step("decode_batch1", decode_batch1, resolve_decode_batch1, 20),
    Step("spec_decode_batch1", spec_decode_batch1, resolve_spec_decode_batch1, 20),
    Step("host_vs_device", host_vs_device, resolve_host_vs_device, 20),
    Step("ttft_32k", ttft_32k, resolve_ttft_32k, 30),
    Step("turn_growth", turn_growth, resolve_turn_growth, 90),
    Step("memory", memory, resolve_memory, 1),
    Step("moe_throughput", moe_throughput, resolve_moe_throughput, 120),
    Step("hybrid_moe_throughput", hybrid_moe_throughput, resolve_hybrid_moe_throughput, 120),
    Step("tensor_parallel", tensor_parallel, resolve_tensor_parallel, 60),
    Step("gpt_oss_throughput", gpt_oss_throughput, resolve_gpt_oss_throughput, 120),
    Step("glm_throughput", glm_throughput, resolve_glm_throughput, 120),
)
