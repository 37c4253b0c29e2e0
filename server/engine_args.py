"""Engine flags shared by every command that starts an engine (`serve`, `generate`), mapped onto EngineConfig."""
from __future__ import annotations

import argparse

from engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="registry name (see `kvserve models`), HF repo id or model directory "
                   "(default: the registry's default, smollm2-135m)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when a GPU is visible, else cpu)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="KV page dtype: auto (the model dtype) or fp8 (e4m3, scale 1.0): twice the tokens of bf16 pages "
                   "in the same memory, with a small logprob drift (docs/FP8.md)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV page (power of two; default 16)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages to allocate (default: from the memory budget)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache budget on CPU in GiB (default 1)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + activations + KV cache (default 0.9)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences batched together at most (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step (default 2048)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--scheduling-policy", choices=("fcfs", "longest_prefix"), default="fcfs",
                   help="order of admitting waiting requests: arrival (default) or longest cached prefix first")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode batches eagerly, without CUDA graphs")
    g.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="kernels: triton (default on CUDA) or torch (default on CPU)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        scheduling_policy=args.scheduling_policy,
        device=device,
        dtype=dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
