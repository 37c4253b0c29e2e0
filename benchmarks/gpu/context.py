"""What the GPU check's steps share: the plan (how much each step does), the benchmark models and engines they
run, and the context that holds them (one engine at a time, built on first use and timed)."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.measure import greedy, memory_snapshot
from benchmarks.gpu.models import (GLM_47_FLASH, GPT_OSS_20B, QWEN3_0_6B, QWEN3_30B_A3B, QWEN36_35B_A3B,
                                   build_bench_model)
from benchmarks.throughput import ThroughputWorkload

DENSE, MOE = "qwen3-0.6b", "qwen3-30b-a3b"  # the benchmark models, built from their shapes on first use
HYBRID = "qwen3.6-35b-a3b"  # Gated DeltaNet + gated attention + MoE (docs/HYBRID_CACHE.md)
GPT_OSS, GLM = "gpt-oss-20b", "glm-4.7-flash"  # window + full layers with sinks; MLA + MoE (docs/MODELS.md)
# the registered tiny model whose tokenizer (same vocabulary) a benchmark model carries; Qwen's otherwise
TOKENIZER_OF = {GPT_OSS: "gpt-oss-tiny", GLM: "glm4.7-flash-tiny"}
NANO_VLLM = dict(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096)  # nano-vllm's bench settings


@dataclass(frozen=True)
class Plan:
    """How much each step does: ``FULL`` fits one 9-minute device call, ``QUICK`` 4 minutes (for a rerun)."""

    name: str
    time_budget_s: float
    tiny_models: tuple[str, ...]
    num_seqs: int  # nano-vllm workload: sequences, input and output lengths uniform in [100, 1024]
    throughput_budget_s: float  # each throughput run stops here, with partial figures
    decode_steps: int
    step_bench_timeout_s: float
    ttft_prompt_tokens: int
    moe_layers: int  # of Qwen3-30B-A3B's 48 (random weights drawn on the GPU: nothing is written to disk)
    turn_max_tokens: int  # turn_growth: the conversation grows ~5k tokens a turn from 10k to about this
    skip: tuple[str, ...] = ()


FULL = Plan("full", 510, ("qwen3-tiny", "deepseek-tiny"), 256, 100, 256, 90, 32768, 48, 100_000)
QUICK = Plan("quick", 210, ("qwen3-tiny",), 64, 25, 128, 40, 32768, 48, 40_000,
             skip=("throughput_eager", "moe_throughput", "turn_growth", "gpt_oss_throughput", "glm_throughput"))


@dataclass(frozen=True)
class EngineKind:
    model: str  # a key of Context.models
    options: dict[str, Any]


ENGINES = {
    "default": EngineKind(DENSE, NANO_VLLM),
    "eager": EngineKind(DENSE, {**NANO_VLLM, "enforce_eager": True}),
    "long_context": EngineKind(DENSE, {"max_num_batched_tokens": 16384}),  # the model's 40,960 positions
    "moe": EngineKind(MOE, {**NANO_VLLM, "load_format": "dummy"}),  # 61 GB of bf16 weights, drawn on the GPU
    "hybrid_moe": EngineKind(HYBRID, {**NANO_VLLM, "load_format": "dummy"}),  # about 70 GB, drawn on the GPU
    # 13.8 GB with the experts kept in MXFP4 as released (42 GB dequantized to bf16), drawn on the GPU
    "gpt_oss": EngineKind(GPT_OSS, {**NANO_VLLM, "load_format": "dummy", "mxfp4_experts": "packed"}),
    "glm": EngineKind(GLM, {**NANO_VLLM, "load_format": "dummy"}),  # about 60 GB, drawn on the GPU
}


@dataclass
class Context:
    """What the steps share: the plan and deadline, the built models, and one engine at a time (each sizes its KV
    cache from free memory, so two cannot coexist)."""

    plan: Plan
    deadline: float  # time.perf_counter() value
    work_dir: Path
    peak_bandwidth_tbs: float
    gpu_memory_utilization: float
    device: str = "cuda"  # the CPU tests drive the same steps on small shapes, in float32
    dtype: str = "bfloat16"
    copy_tbs: float | None = None
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> config.json; the plan's by default
    engines: dict[str, EngineKind] = field(default_factory=lambda: dict(ENGINES))
    engine_builds: dict[str, float] = field(default_factory=dict)  # kind -> seconds (load, profile, graph capture)
    engine_memory: dict[str, dict] = field(default_factory=dict)  # kind -> memory_snapshot while it was alive
    _model_dirs: dict[str, Path] = field(default_factory=dict)
    _engine: tuple[str, Any] | None = None

    def __post_init__(self) -> None:
        moe = {**QWEN3_30B_A3B, "num_hidden_layers": self.plan.moe_layers}
        self.models = {DENSE: QWEN3_0_6B, MOE: moe, HYBRID: QWEN36_35B_A3B, GPT_OSS: GPT_OSS_20B, GLM: GLM_47_FLASH,
                       **self.models}

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def model_dir(self, name: str, weights: bool = True) -> Path:
        if name not in self._model_dirs:
            self._model_dirs[name] = build_bench_model(self.work_dir / name, self.models[name],
                                                       TOKENIZER_OF.get(name, "qwen3-tiny"), self.device,
                                                       weights=weights)
        return self._model_dirs[name]

    def engine(self, kind: str):
        if self._engine and self._engine[0] == kind:
            return self._engine[1]
        from engine import LLM

        self.release_engine()
        spec = self.engines[kind]
        model_dir = self.model_dir(spec.model, weights=spec.options.get("load_format", "auto") != "dummy")
        start = time.perf_counter()
        llm = LLM(str(model_dir), device=self.device, dtype=self.dtype,
                  gpu_memory_utilization=self.gpu_memory_utilization, **spec.options)
        self.engine_builds[kind] = time.perf_counter() - start
        # Compile the eager kernels' variants off the clock: the attention tile follows the longest query of a
        # step, so each prompt runs alone (5, 12 and 300 tokens: the 16-, 32- and 64-row tiles).
        for length in (5, 12, 300):
            llm.generate([list(range(length))], greedy(4))
        self._engine = (kind, llm)
        return llm

    def snapshot_engine(self) -> None:
        if self._engine and self.device == "cuda":
            kind, llm = self._engine
            block = llm.engine.runner.kv_spec.bytes_per_block(llm.engine.cfg.block_size, torch.bfloat16)
            self.engine_memory[kind] = memory_snapshot(llm, self.gpu_memory_utilization, block)

    def release_engine(self) -> None:
        if self._engine is None:
            return
        self.snapshot_engine()
        self._engine = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def nano_vllm_workload(num_seqs: int) -> ThroughputWorkload:
    return ThroughputWorkload.random(num_seqs, 100, 1024, vocab=10_000, seed=0)
