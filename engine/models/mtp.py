"""The multi-token-prediction (MTP) layer that Qwen3.5 / 3.6 and Qwen3-Next checkpoints carry (``mtp.*``), run as a
draft model for speculative decoding (`engine/spec/mtp.py` drives it).

At position i it reads the target model's last hidden state there (after the final norm, as the model hands it to its
head) and the embedding of token i + 1, and predicts token i + 2:
``h = fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(hidden_i)])``, one full-attention decoder layer
(gated attention and the model's MLP or MoE) with K/V pages of its own, ``norm``, and the model's own LM head. The
embedding and the head are the model's (the checkpoints store none of their own). Chained, its output hidden state
stands in for the target's at the next position, so one layer drafts several tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import DecoderLayer, RMSNorm
from engine.parallel.state import TensorParallel
from kernels.ops import AttentionMetadata, Ops


class MTPHead(nn.Module):
    """``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.0.*`` and ``mtp.norm``, under those names."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, cfg.zero_centered_norms)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, cfg.zero_centered_norms)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # its MLP is the kind every layer of these models has (MoE in the MoE ones): layer 0's
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, attention, tp)])
        self.norm = RMSNorm(hidden, eps, cfg.zero_centered_norms)

    def forward(self, ops: Ops, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """``embeddings`` of the next tokens and the ``hidden`` states ``[T, H]`` at ``positions`` -> the hidden
        states ``[T, H]`` after ``norm`` (the LM head's input, and the next draft step's ``hidden``)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(ops, embeddings), self.pre_fc_norm_hidden(ops, hidden)], -1))
        layer = self.layers[0]
        h = layer.input_layernorm(ops, x)
        h = layer.mixer(ops, h, positions, cos_sin, kv_cache, meta)
        h, residual = layer.post_attention_layernorm(ops, h, x)
        out, _ = self.norm(ops, layer.mlp(ops, h), residual)
        return out
