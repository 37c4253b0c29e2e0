"""Which model class runs a config's ``model_type``, and building it ready for weights."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.kimi_linear import KimiLinearForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from engine.models.muse_glimmer import MuseGlimmerForCausalLM
from engine.models.ministral3 import Ministral3ForCausalLM
from engine.models.qwen3_next import HybridForCausalLM
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import Ops

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,  # the Qwen3 decoder; its MoE layers come from the config
    "deepseek_v2": DeepseekV3ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV32ForCausalLM,
    "glm_moe_dsa": DeepseekV32ForCausalLM,  # GLM-5: V3.2's layers, interleaved index keys, shared top-k layers
    "deepseek_v4": DeepseekV4ForCausalLM,
    "glm4_moe_lite": DeepseekV3ForCausalLM,  # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE, one expert group
    "qwen3_next": HybridForCausalLM,
    "qwen3_5": HybridForCausalLM,  # the language model of Qwen3_5ForConditionalGeneration (Qwen3.5 / 3.6)
    "qwen3_5_moe": HybridForCausalLM,
    "qwen3_5_text": HybridForCausalLM,  # Qwen3_5ForCausalLM: the language model alone (qwen3.6-tiny)
    "qwen3_5_moe_text": HybridForCausalLM,
    "gemma3": Gemma3ForCausalLM,  # the language model of Gemma3ForConditionalGeneration (its vision tower skipped)
    "gemma3_text": Gemma3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    "ministral3": Ministral3ForCausalLM,
    "mistral3": Ministral3ForCausalLM,  # the language model of Mistral3ForConditionalGeneration (Devstral Small 2)
    "kimi_linear": KimiLinearForCausalLM,  # Kimi Linear: KDA + MLA without RoPE, DeepSeek-V3's MoE
    "gemma4": Gemma4ForCausalLM,  # the language model of Gemma4ForConditionalGeneration (its vision tower skipped)
    "gemma4_text": Gemma4ForCausalLM,
    "muse_glimmer": MuseGlimmerForCausalLM,  # the language model of MuseGlimmerForConditionalGeneration (released
    # only so: transformers has no text-only causal LM of it)
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def build_model(
    cfg: ModelConfig, ops: Ops, device: torch.device, dtype: torch.dtype, max_positions: int,
    on_meta: Callable[[nn.Module], None] | None = None, tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """The model (this rank's shard of it, under tensor parallelism) for ``cfg`` on ``device`` in ``dtype`` with
    uninitialized weights (load them next) and its RoPE table for ``max_positions``. Modules marked ``keep_fp32``
    (MoE routers) stay in fp32. ``on_meta`` may swap modules before any memory is allocated (FP8 layers are never
    allocated at full precision)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, ops, tp).to(dtype)
        for module in model.modules():
            if getattr(module, "keep_fp32", False):
                module.float()
        if on_meta is not None:
            on_meta(model)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.init_rope(max_positions, device)
    return model


def random_weights_(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the model's real shapes (norm weights 1), for ``load_format="dummy"``: benchmarks of a
    model without its checkpoint. Generated on the model's device, so a 30B model takes seconds on a GPU."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("_scales"):  # MXFP4 experts kept packed: 2^-8 a group, values up to 6 * 2^-8
                param.fill_(127 - 8)
            elif param.dtype == torch.uint8:  # their blocks: any two e2m1 codes a byte
                param.copy_(torch.randint(0, 256, param.shape, generator=gen, device=param.device, dtype=torch.uint8))
            elif not param.is_floating_point():  # DeepSeek-V4's hash routes: experts 0..k-1 for every token
                param.copy_(torch.arange(param.shape[-1]).expand_as(param))
            else:
                param.normal_(0.0, std, generator=gen)
