"""DeepSeek-V3.2 and GLM-5: DeepSeek-V3 whose MLA attends, per query, only to the tokens the lightning indexer picks
(`engine.models.layers.indexer`). Attention runs in MLA's absorbed form for every row, prefill and decode alike, over the
chosen slots (`ops.sparse_mla`), as DeepSeek's sparse FlashMLA does. GLM-5 (``glm_moe_dsa``) rotates the index keys
in interleaved pairs and lets "shared" layers reuse the top-k of the last layer that ran its indexer."""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.kv_cache_spec import KVCacheSpec
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.layers.indexer import Indexer
from engine.models.layers.mla import MLAAttention
from engine.parallel.state import TensorParallel
from kernels.ops import AttentionMetadata, Ops


class IndexChoice:
    """The slots the last indexed layer chose in this forward pass, read by the layers after it that share them."""

    slots: torch.Tensor | None = None


class SparseMLAAttention(MLAAttention):
    """``choice``: where an indexed layer leaves its slots; ``shared``: this layer has no indexer and reads them."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, choice: IndexChoice | None = None,
                 shared: bool = False) -> None:
        super().__init__(cfg, tp)
        mla, indexer = cfg.mla, cfg.indexer
        assert mla is not None and indexer is not None
        if mla.q_lora_rank is None:
            raise ValueError("DeepSeek-V3.2's indexer reads the q-LoRA latent: q_lora_rank must be set")
        self.choice = choice or IndexChoice()
        self.indexer = None if shared else Indexer(cfg.hidden_size, mla.q_lora_rank, mla.qk_rope_head_dim, indexer)

    def forward(
        self,
        ops: Ops,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cache, index_cache = kv_cache
        q_nope, q_rope, q_latent = self.project_and_store(ops, x, positions, cos_sin, cache, meta)
        if self.indexer is None:
            slots = self.choice.slots
            assert slots is not None, "a shared layer follows an indexed one (IndexerConfig.shared)"
        else:
            slots = self.choice.slots = self.indexer(ops, x, q_latent, positions, cos_sin, index_cache, meta)
        out_latent = ops.sparse_mla(self.absorb_query(q_nope, q_rope), cache, slots, self.scale, self.latent_dim)
        return self.o_proj(self.values_from_latent(out_latent).flatten(1))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    attention_class = SparseMLAAttention

    @functools.cached_property
    def index_choice(self) -> IndexChoice:
        """One per model: its layers run in order within a forward pass."""
        return IndexChoice()

    def make_mixer(self, layer_idx: int) -> nn.Module:
        indexer = self.cfg.indexer
        assert indexer is not None
        return SparseMLAAttention(self.cfg, self.tp, self.index_choice, shared=indexer.is_shared(layer_idx))

    def kv_cache_spec(self) -> KVCacheSpec:
        mla, indexer = self.cfg.mla, self.cfg.indexer
        assert mla is not None and indexer is not None
        return KVCacheSpec.sparse_mla(self.cfg.num_layers + (self.mtp is not None), mla.kv_lora_rank,
                                      mla.qk_rope_head_dim, indexer.head_dim)
