"""The multi-token-prediction (MTP) layers that checkpoints carry beside the model, run as draft models for
speculative decoding (`engine/spec/mtp.py` drives them): Qwen3.5 / 3.6 and Qwen3-Next (``mtp.*``) and DeepSeek-V3 /
V3.2 (one decoder layer after the last, ``model.layers.{num_hidden_layers}.*``; V3.2's attention with its indexer).

Both are the same computation under different names. At position i the layer reads the target model's last hidden
state there (after the final norm, as the model hands it to its head) and the embedding of token i + 1, and
predicts token i + 2: ``x = proj([norm_e(embed(t_{i+1})), norm_h(hidden_i)])``, then one decoder layer (the model's
attention, with K/V pages of its own, and its MLP or MoE), then a norm and the model's own LM head. Chained, the
layer's output state stands in for the target's at the next position, so one layer drafts several tokens. Where
the state is taken differs, as each family was trained: Qwen chains the state after its final ``norm``; DeepSeek
chains the block's output before ``shared_head.norm`` (its norm belongs to the head), as vLLM and SGLang run it.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import DecoderLayer, RMSNorm
from engine.parallel.state import TensorParallel
from kernels.ops import AttentionMetadata, Ops


class MTPHead(nn.Module):
    """The MTP computation; subclasses hold the parts under their checkpoint's names (`parts`) and say where the
    chained state is taken (`finish`) and how it reaches the LM head (`head_input`)."""

    def parts(self) -> tuple[RMSNorm, RMSNorm, nn.Linear, DecoderLayer]:
        """The embedding's norm, the hidden state's norm, the projection over both, and the decoder layer."""
        raise NotImplementedError

    def finish(self, ops: Ops, mlp_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The decoder layer's MLP output and residual -> the state the next draft step chains."""
        raise NotImplementedError

    def head_input(self, ops: Ops, state: torch.Tensor) -> torch.Tensor:
        """A chained state -> the LM head's input."""
        raise NotImplementedError

    def forward(self, ops: Ops, tp: TensorParallel, embeddings: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata) -> torch.Tensor:
        """``embeddings`` of the next tokens and the ``hidden`` states ``[T, H]`` at ``positions`` -> the states
        ``[T, H]`` the next draft step chains (`head_input` turns them into the LM head's input). Under tensor
        parallelism the projection is replicated and the decoder layer split as the model's (its partial sums
        reduced here, as the model's loop does)."""
        embedding_norm, hidden_norm, proj, layer = self.parts()
        x = proj(torch.cat([embedding_norm(ops, embeddings), hidden_norm(ops, hidden)], -1))
        h = layer.input_layernorm(ops, x)
        h = tp.all_reduce(layer.mixer(ops, h, positions, cos_sin, kv_cache, meta))
        h, residual = layer.post_attention_layernorm(ops, h, x)
        return self.finish(ops, tp.all_reduce(layer.mlp(ops, h)), residual)


class QwenMTPHead(MTPHead):
    """``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.0.*`` and ``mtp.norm``, under those names.
    The embedding and the head are the model's (the checkpoints store none of their own)."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, cfg.zero_centered_norms)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, cfg.zero_centered_norms)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # its MLP is the kind every layer of these models has (MoE in the MoE ones): layer 0's
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, attention, tp)])
        self.norm = RMSNorm(hidden, eps, cfg.zero_centered_norms)

    def parts(self) -> tuple[RMSNorm, RMSNorm, nn.Linear, DecoderLayer]:
        return self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc, self.layers[0]

    def finish(self, ops: Ops, mlp_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out, _ = self.norm(ops, mlp_out, residual)
        return out

    def head_input(self, ops: Ops, state: torch.Tensor) -> torch.Tensor:
        return state


class SharedHead(nn.Module):
    """DeepSeek's ``shared_head``: the norm before the LM head (its ``head``, a copy of the model's, is not loaded)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekMTPHead(MTPHead, DecoderLayer):
    """DeepSeek-V3's / V3.2's ``model.layers.{num_hidden_layers}.*`` (the loader names it ``mtp.``): a decoder layer
    (``self_attn``, ``mlp``, its two norms) with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``. The
    checkpoint also stores ``embed_tokens`` and ``shared_head.head``, copies of the model's embedding and LM head
    (the paper's MTP modules share them): the model's own are used and the copies left on disk."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module, tp: TensorParallel) -> None:
        # its MLP is the kind the last decoder layer has (MoE in V3), as the released layer's experts show
        DecoderLayer.__init__(self, cfg, cfg.num_layers - 1, attention, tp)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(cfg)

    def parts(self) -> tuple[RMSNorm, RMSNorm, nn.Linear, DecoderLayer]:
        return self.enorm, self.hnorm, self.eh_proj, self

    def finish(self, ops: Ops, mlp_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return mlp_out + residual

    def head_input(self, ops: Ops, state: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(ops, state)
