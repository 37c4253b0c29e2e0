"""The GPU check's MoE step: decode throughput of a Qwen3-30B-A3B-shaped model (Qwen3-Coder-30B-A3B's architecture:
48 layers, 128 experts of 768, top-8) with random bf16 weights, no checkpoint needed.

`run_qwen3_moe_step` is self-contained so the GPU check can call it as one step: it writes the real config.json
(plus a tokenizer) into a temporary directory, starts an engine with ``load_format="dummy"`` (random weights of the
real shapes, generated on the GPU in seconds), and times pure decode steps at several batch sizes. Each timing
prefills the batch first and then measures only steps in which every sequence decodes one token, so the figure is
the steady-state decode step, not an average that includes prefill.
"""
from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Qwen/Qwen3-30B-A3B config.json (Qwen3-Coder-30B-A3B-Instruct differs only in context length and RoPE theta).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_config_only_model(out_dir: Path, config: dict[str, Any], tokenizer_from: str = "qwen3-moe-tiny") -> Path:
    """A model directory with ``config`` and the tokenizer of a registered model, and no weights."""
    from engine.registry import resolve_model

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    source = resolve_model(tokenizer_from)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, out_dir / name)
    return out_dir


def active_weight_bytes(config: dict[str, Any], batch: int, dtype_bytes: int = 2) -> float:
    """Weight bytes one decode step of ``batch`` tokens reads: everything but the experts, plus the experts the
    batch is expected to touch under uniform routing (``E * (1 - (1 - k/E)^batch)`` per layer)."""
    hidden, layers, experts, top_k = (config[k] for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                          "num_experts_per_tok"))
    expert = 3 * hidden * config["moe_intermediate_size"]
    attention = hidden * config["head_dim"] * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    touched = experts * (1 - (1 - top_k / experts) ** batch)
    per_layer = attention + hidden * experts + touched * expert  # router included
    return (layers * per_layer + 2 * config["vocab_size"] * hidden) * dtype_bytes


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_decode_steps(llm, batch: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """Seconds per decode step with ``batch`` sequences of about ``prompt_len`` context, prefill excluded."""
    from engine import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0)
    ids = [f"moe-{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(10_000) for _ in range(prompt_len)], params, None)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked as the scheduler likes) until every sequence has its first token
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():  # the last token each; leaves the engine empty
        engine.step()
    return elapsed / steps


def run_qwen3_moe_step(
    batches: tuple[int, ...] = (1, 32, 256), prompt_len: int = 512, steps: int = 32, device: str = "cuda",
    config: dict[str, Any] | None = None, peak_bandwidth_tbs: float = 4.8, **engine_options: Any,
) -> dict[str, Any]:
    """Decode tokens/s of the Qwen3-30B-A3B shape (or ``config``) at each batch size, with the fraction of the
    HBM bound (expected weight bytes read per step / step time / peak). The engine is gone when this returns, so
    the next step gets the GPU's memory back."""
    from engine import LLM

    config = config or QWEN3_30B_A3B
    options = dict(device=device, dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
                   max_model_len=prompt_len + steps + 8, **engine_options)
    with tempfile.TemporaryDirectory(prefix="kvserve-qwen3-30b-a3b-") as tmp:
        model_dir = write_config_only_model(Path(tmp), config)
        load_start = time.perf_counter()
        llm = LLM(str(model_dir), **options)
        result: dict[str, Any] = {"load_seconds": time.perf_counter() - load_start,
                                  "kv_bytes_per_token": llm.engine.runner.kv_spec.bytes_per_token(torch.bfloat16)}
        llm.generate([[1, 2, 3]], None)  # compiles the kernels outside the timings
        for batch in batches:
            step_s = time_decode_steps(llm, batch, prompt_len, steps, seed=batch)
            weights = active_weight_bytes(config, batch)
            result[f"batch_{batch}"] = {
                "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s, "weight_bytes_per_step": weights,
                "bandwidth_fraction": weights / step_s / (peak_bandwidth_tbs * 1e12),
            }
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result
