"""DeepSeek-V2 / V3 / V3.1 / R1: the Llama decoder loop with MLA attention, MoE MLPs after the first dense layers
(shared + routed experts, V3's grouped sigmoid routing), YaRN RoPE on the rotary dims, and a latent KV cache."""
from __future__ import annotations

from engine.kv_cache_spec import KVCacheSpec
from engine.models.llama import LlamaForCausalLM
from engine.models.mla import MLAAttention


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    attention_class = MLAAttention

    @property
    def rope_dim(self) -> int:
        assert self.cfg.mla is not None
        return self.cfg.mla.qk_rope_head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        mla = self.cfg.mla
        assert mla is not None
        return KVCacheSpec.mla(self.cfg.num_layers, mla.kv_lora_rank, mla.qk_rope_head_dim)
