"""Gemma 4 E2B / E4B's per-layer embeddings (PLE), as transformers' Gemma4TextModel computes them.

Beside the main embedding, every token gets a small input for each decoder layer (``size`` = 256 wide in the
released models): a row of the ``[vocab_size, num_layers * size]`` table, scaled by sqrt(size), plus a projection
of the (scaled) main embedding, times hidden_size ** -0.5 and RMS-normed per layer; the two summed times 2 ** -0.5.
After its MLP, each layer gates the stream into that width (GELU), multiplies by its input, projects back, norms
and adds the result to the stream (`PerLayerInput`).

Under tensor parallelism the table is split by vocabulary rows as the main embedding is (a rank looks up its rows,
zeros elsewhere; one all-reduce of ``[T, num_layers * size]`` a step assembles it); the projection, the norms and the
layers' gates are replicated (a layer's gate and projection are ``2 * hidden * size`` weights, about 5% of E2B's
MLP), so no layer needs a collective of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.family_config import Gemma4PerLayerInputs
from engine.models.llama import RMSNorm
from engine.parallel.linear import VocabParallelEmbedding
from engine.parallel.state import TensorParallel
from kernels.ops import Ops


class PerLayerEmbeddings(nn.Module):
    """The model's half: each token's input to every layer, ``[T, num_layers, size]``."""

    def __init__(self, cfg: Gemma4PerLayerInputs, hidden_size: int, num_layers: int, eps: float,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.num_layers, self.size, self.tp = num_layers, cfg.size, tp
        self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.vocab_size, num_layers * cfg.size, tp)
        self.per_layer_model_projection = nn.Linear(hidden_size, num_layers * cfg.size, bias=False)
        self.per_layer_projection_norm = RMSNorm(cfg.size, eps)

    def forward(self, ops: Ops, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds``: the main embeddings as they enter the first layer (scaled by sqrt(hidden_size))."""
        table = self.tp.all_reduce(self.embed_tokens_per_layer(input_ids))
        table = table * torch.tensor(self.size**0.5, dtype=table.dtype)  # rounded to the dtype, as transformers does
        shape = (-1, self.num_layers, self.size)
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(ops, projected.view(shape))
        return (projected + table.view(shape)) * 2.0**-0.5


class PerLayerInput(nn.Module):
    """A decoder layer's half: after the MLP, ``stream + norm(project(gelu(gate(stream)) * input))``."""

    def __init__(self, hidden_size: int, size: int, eps: float) -> None:
        super().__init__()
        self.per_layer_input_gate = nn.Linear(hidden_size, size, bias=False)
        self.per_layer_projection = nn.Linear(size, hidden_size, bias=False)
        self.post_per_layer_input_norm = RMSNorm(hidden_size, eps)

    def forward(self, ops: Ops, stream: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        gated = F.gelu(self.per_layer_input_gate(stream), approximate="tanh") * layer_input
        return stream + self.post_per_layer_input_norm(ops, self.per_layer_projection(gated))
