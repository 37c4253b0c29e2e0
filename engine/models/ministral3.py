"""Ministral 3 / Devstral Small 2 (``ministral3``, and ``mistral3``: the released VLM checkpoint, whose language model
kvserve serves, text only): the Llama decoder (Mistral's: GQA, SiLU MLP, no biases) with YaRN RoPE and Llama 4's
attention temperature: every query is scaled by ``1 + beta * log(1 + floor(position / L))`` after RoPE (``beta`` =
``llama_4_scaling_beta``, ``L`` = the YaRN ``original_max_position_embeddings``), so positions past each multiple of
the trained length attend a little sharper; below ``L`` the scale is 1.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.models.llama import Attention, LlamaForCausalLM
from engine.parallel.state import TensorParallel
from kernels.ops import Ops


class Ministral3Attention(Attention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        self.query_scale_beta = cfg.query_scale_beta or 0.0
        self.query_scale_length = cfg.query_scale_length

    def rotate(self, ops: Ops, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().rotate(ops, positions, q, k, cos_sin)
        scale = 1 + self.query_scale_beta * torch.log1p(torch.floor(positions.float() / self.query_scale_length))
        return q * scale[:, None, None].to(q.dtype), k


class Ministral3ForCausalLM(LlamaForCausalLM):
    attention_class = Ministral3Attention
