"""Mixture-of-experts MLP layers: a router picks each token's top-k experts, `ops.fused_moe` runs them.

One module serves Qwen3-MoE (softmax top-k, optionally renormalized), DeepSeek-V2/V3 (shared experts; V3's
sigmoid scores with a correction bias, group-limited top-k and a routed scaling factor), DeepSeek-V4 (sqrt-softplus
scores, hash-routed first layers, clamped SwiGLU) and gpt-oss (a router and experts with biases, the top-k logits
softmaxed, its own clamped SwiGLU). The routing variants are
configuration (`engine.config.MoEConfig`), not subclasses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import MoEConfig, ModelConfig
from engine.models.layers.mlp import MLP
from engine.parallel.linear import ExpertSharding
from engine.parallel.state import TensorParallel
from kernels.ops import Ops


def select_experts(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] fp32, ids [T, K])`` from router logits ``[T, E]`` (fp32), as the HF implementations do."""
    if moe.scoring == "topk_softmax":  # gpt-oss: the k best logits, softmaxed among themselves
        best, ids = logits.topk(moe.top_k, dim=-1)
        return best.softmax(-1), ids
    scores = expert_scores(logits, moe)
    choice = scores if correction_bias is None else scores + correction_bias  # the bias steers only the choice
    if moe.n_group > 1:
        grouped = choice.view(choice.shape[0], moe.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if moe.group_score == "top2_sum" else grouped.amax(-1)
        best_groups = group_scores.topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    return weigh_experts(scores, choice.topk(moe.top_k, dim=-1).indices, moe)


def expert_scores(logits: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    if moe.scoring == "softmax":
        return logits.softmax(-1)
    if moe.scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.sigmoid()


def weigh_experts(scores: torch.Tensor, ids: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts' scores, renormalized where the config says, times the routed scaling factor."""
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Module):
    """The ``gate`` of an MoE layer. Routing is decided in fp32 whatever the model dtype (the runner keeps modules
    with ``keep_fp32`` in fp32): DeepSeek's correction biases differ in digits bf16 does not hold."""

    keep_fp32 = True

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.correction_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(F.linear(x.float(), self.weight, self.bias), self.e_score_correction_bias, self.moe)


class HashRouter(nn.Module):
    """DeepSeek-V4's first layers: each token id's experts are fixed (``tid2eid`` ``[vocab, top_k]``, from the
    checkpoint); the learned gate only weighs them."""

    keep_fp32 = True

    def __init__(self, hidden_size: int, vocab_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.tid2eid = nn.Parameter(torch.empty(vocab_size, moe.top_k, dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = expert_scores(F.linear(x.float(), self.weight), self.moe)
        return weigh_experts(scores, self.tid2eid[input_ids], self.moe)


class Experts(nn.Module):
    """Every routed expert's weights stacked: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up) and ``down_proj``
    ``[E, H, I]``, as transformers holds them; checkpoints store them per expert (weights.py stacks them). Under
    tensor parallelism the stack holds this rank's experts or slices of them (`ExpertSharding`). gpt-oss adds a bias
    to each projection (``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj_bias`` ``[E, H]``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.sharding = ExpertSharding(tp, moe.num_experts, moe.intermediate_size)
        experts, inter = len(self.sharding.local_experts), self.sharding.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter)) if moe.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden_size)) if moe.expert_bias else None

    def forward(self, ops: Ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extra) -> torch.Tensor:
        """The routed experts' weighted sum (``ops.fused_moe``; ``extra``: its activation and bias arguments)."""
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, **extra)


class SharedExpertGate(nn.Module):
    """Qwen3-Next / 3.5: the shared expert's output is scaled per token by ``sigmoid(x @ weight.T)`` (one logit).
    Replicated on every rank: the scale multiplies the rank's partial sum of the shared expert."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoE(nn.Module):
    """Routed experts plus, for DeepSeek, always-on shared experts (one MLP of ``n_shared x`` the expert width), or,
    for Qwen3-Next / 3.5, one ``shared_expert`` behind a sigmoid ``shared_expert_gate``.

    Every rank routes every token (the router is replicated) and returns its partial sum: its experts' (or expert
    slices') contributions plus its slice of the shared experts."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallel, hash_vocab: int | None = None) -> None:
        super().__init__()
        self.gate = Router(hidden_size, moe) if hash_vocab is None else HashRouter(hidden_size, hash_vocab, moe)
        self.experts = Experts(hidden_size, moe, tp)
        self.swiglu_limit, self.swiglu_alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.shared_experts = (
            MLP(hidden_size, moe.intermediate_size * moe.num_shared_experts, tp, moe.swiglu_limit)
            if moe.num_shared_experts else None
        )
        if moe.gated_shared_expert:
            self.shared_expert = MLP(hidden_size, moe.gated_shared_expert, tp)
            self.shared_expert_gate = SharedExpertGate(hidden_size)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, ops: Ops, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x) if isinstance(self.gate, Router) else self.gate(x, input_ids)
        ids = self.experts.sharding.localize(ids)
        experts = self.experts
        extra = {} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}
        if self.swiglu_alpha is not None:  # gpt-oss
            extra.update(gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
                         swiglu_alpha=self.swiglu_alpha)
        out = experts(ops, x, weights, ids, **extra)  # `Experts`, or gpt-oss' kept in MXFP4 (mxfp4_experts.py)
        if self.shared_experts is not None:
            out = out + self.shared_experts(ops, x)
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(x) * self.shared_expert(ops, x)
        return out


def make_mlp(cfg: ModelConfig, layer_idx: int, tp: TensorParallel) -> MLP | SparseMoE:
    """Layer ``layer_idx``'s MLP: the MoE where the config puts one, else the dense MLP."""
    if cfg.moe is not None and layer_idx in cfg.moe.moe_layers:
        return SparseMoE(cfg.hidden_size, cfg.moe, tp, cfg.vocab_size if layer_idx in cfg.moe.hash_layers else None)
    return MLP(cfg.hidden_size, cfg.intermediate_size, tp, activation=cfg.hidden_act)
