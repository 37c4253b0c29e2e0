"""DeepSeek-V2 / V3 / V3.1 / R1: the Llama decoder loop with MLA attention, MoE MLPs after the first dense layers
(shared + routed experts, V3's grouped sigmoid routing), YaRN RoPE on the rotary dims, and a latent KV cache."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.kv_cache_spec import KVCacheSpec
from engine.models.llama import LlamaForCausalLM
from engine.models.layers.mla import MLAAttention
from engine.models.mtp import DeepseekMTPHead
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import Ops


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """With ``cfg.num_mtp_layers`` (``num_nextn_predict_layers``), the checkpoint's MTP layer as ``mtp`` (a draft
    model, `engine.models.mtp`; V3.2's attends with its own indexer)."""

    attention_class = MLAAttention

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, ops, tp)
        self.mtp = DeepseekMTPHead(cfg, self.attention_class(cfg, tp), tp) if cfg.num_mtp_layers else None

    @property
    def rope_dim(self) -> int:
        assert self.cfg.mla is not None
        return self.cfg.mla.qk_rope_head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        mla = self.cfg.mla
        assert mla is not None
        # the MTP layer's latent pages come last, under the same block ids
        return KVCacheSpec.mla(self.cfg.num_layers + (self.mtp is not None), mla.kv_lora_rank, mla.qk_rope_head_dim)
