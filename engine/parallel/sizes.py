"""Which tensor-parallel sizes a model's shape and the machine's devices take, checked before any process starts."""
from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.errors import ParallelConfigError

LARGEST_SIZE_SHOWN = 64


def _splits(count: int, size: int) -> bool:
    return count % size == 0


def shape_problems(model: ModelConfig, size: int, expert_parallel: bool) -> list[str]:
    """Why ``size`` ranks cannot share this model's layers (empty: they can)."""
    problems = []
    if not _splits(model.num_heads, size):
        problems.append(f"its {model.num_heads} attention heads do not split over {size} ranks")
    kv = model.num_kv_heads
    if model.mla is None and not (_splits(kv, size) if kv >= size else _splits(size, kv)):
        problems.append(f"its {kv} KV heads neither split over {size} ranks nor repeat evenly on them")
    if model.qk_norm_across_heads and kv < size:
        problems.append(f"its k norm spans all {kv} KV heads, which {size} ranks would repeat (MiniMax-M2 splits them)")
    lin = model.linear
    if lin is not None:
        if not _splits(lin.num_key_heads, size) or not _splits(lin.num_value_heads, size):
            problems.append(f"its {lin.num_key_heads} linear-attention key heads (and {lin.num_value_heads} value "
                            f"heads) do not split over {size} ranks")
    moe = model.moe
    has_dense = moe is None or len(moe.moe_layers) < model.num_layers
    if has_dense and not _splits(model.intermediate_size, size):
        problems.append(f"its MLP width {model.intermediate_size} does not split over {size} ranks")
    if moe is not None:
        if expert_parallel and not _splits(moe.num_experts, size):
            problems.append(f"its {moe.num_experts} experts do not split over {size} ranks")
        if not expert_parallel and not _splits(moe.intermediate_size, size):
            problems.append(f"its expert width {moe.intermediate_size} does not split over {size} ranks")
        if moe.num_shared_experts and not _splits(moe.intermediate_size * moe.num_shared_experts, size):
            problems.append(f"its shared-expert width does not split over {size} ranks")
        if moe.gated_shared_expert and not _splits(moe.gated_shared_expert, size):
            problems.append(f"its shared-expert width {moe.gated_shared_expert} does not split over {size} ranks")
    return problems


def check_sizes(model: ModelConfig, cfg: EngineConfig, num_gpus: int) -> None:
    """Raise `ParallelConfigError` saying what to choose instead when ``cfg.tensor_parallel_size`` cannot work."""
    size, ep = cfg.tensor_parallel_size, cfg.enable_expert_parallel
    if ep and model.moe is None:
        raise ParallelConfigError(f"enable_expert_parallel needs a mixture-of-experts model; this "
                                  f"{model.architecture} model has no experts")
    problems = shape_problems(model, size, ep)
    if problems:
        fitting = [n for n in range(1, LARGEST_SIZE_SHOWN + 1) if not shape_problems(model, n, ep)]
        raise ParallelConfigError(f"tensor_parallel_size {size} does not fit this {model.architecture} model: "
                                  f"{'; '.join(problems)}. Sizes that fit: {', '.join(map(str, fitting))}")
    device = cfg.device or "cpu"
    if size > 1 and device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        if first + size > num_gpus:
            raise ParallelConfigError(
                f"tensor_parallel_size {size} needs {size} GPUs (cuda:{first}..cuda:{first + size - 1}), one per "
                f"rank, but {num_gpus} {'is' if num_gpus == 1 else 'are'} visible; lower the size or make more "
                "GPUs visible (CUDA_VISIBLE_DEVICES)")


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the rank-th GPU from the configured one, or the CPU for every rank."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{int(device.partition(':')[2] or 0) + rank}"
