"""gpt-oss (``gpt_oss``: GptOssForCausalLM, gpt-oss-20b / 120b): the Llama decoder with

- sliding-window (128) and full attention layers alternating (``layer_types``; the even layers by default), both
  with YaRN RoPE, learned attention sinks per head (``self_attn.sinks``) and biases on every attention projection,
  ``o_proj`` included (`engine.models.llama.Attention` takes them from the config);
- an MoE MLP in every layer (`engine.models.layers.moe`): a router with a bias whose top-4 logits are softmaxed among
  themselves, experts with biases and a clamped SwiGLU ``(up + 1) * gate * sigmoid(1.702 * gate)``.

The checkpoint's experts are stacked tensors in transformers' layout: ``gate_up_proj`` ``[E, H, 2I]`` with gate and up
columns interleaved, ``down_proj`` ``[E, I, H]``, or, as released, MXFP4: ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]``
(two e2m1 values a byte, low nibble first) with ``gate_up_proj_scales`` ``[E, 2I, H/32]`` (UE8M0 exponents, one per 32
values), ``down_proj_blocks`` / ``_scales`` likewise. `read_experts` turns either into the engine's layout (gate rows
then up rows, ``[E, 2I, H]``; ``[E, H, I]``), dequantized on load; `read_packed_experts` keeps the MXFP4 bytes and
scales in that layout for experts kept packed (`engine.models.layers.mxfp4_experts`: on the Triton backend).

Under tensor parallelism the sinks split with the query heads (`Attention`), ``o_proj``'s bias is held by the first
rank (row parallel), the router is replicated, and `read_experts` reads only the rank's share of each expert tensor.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import Attention, LlamaForCausalLM
from engine.parallel.linear import ExpertSharding
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import Ops, dequantize_mxfp4

MXFP4_BLOCK = 32  # values per UE8M0 scale
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        assert cfg.sliding is not None and cfg.attention_sinks, "a gpt-oss config has its window layers and sinks"
        super().__init__(cfg, ops, tp)

    def make_mixer(self, layer_idx: int) -> nn.Module:
        return Attention(self.cfg, self.tp, window=self.cfg.layer_window(layer_idx))


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up interleaved along ``dim`` (gate at even indices) -> the gate half, then the up half."""
    index = torch.arange(t.shape[dim], device=t.device)
    return torch.cat([t.index_select(dim, index[0::2]), t.index_select(dim, index[1::2])], dim=dim)


def _intermediate(sharding: ExpertSharding) -> slice:
    """The rank's columns of every expert's intermediate dim: all of them, or 1/size under tensor parallelism."""
    units = range(sharding.intermediate_size) if sharding.tp.expert_parallel else sharding.tp.units(
        sharding.intermediate_size)
    return slice(units.start, units.stop)


def read_experts(name: str, get: Callable[[str, tuple[slice, ...]], torch.Tensor],
                 sharding: ExpertSharding) -> torch.Tensor:
    """This rank's value of the expert parameter that checkpoint tensor ``name`` (the last part of
    ``...mlp.experts.<name>``: one of `EXPERT_TENSORS`, or ``<weight>_blocks``) fills, in the engine's layout; ``get``
    reads a part of a tensor of the same experts by its last part (an MXFP4 weight's ``_scales`` too). Only the rank's
    experts are read and, under tensor parallelism, their slice of the intermediate dim (interleaved, a slice's
    gate and up rows are one run); the down projection's bias then goes to the first rank only (zeros elsewhere), so
    the ranks' partial sums add it once."""
    base = name.removesuffix("_blocks")
    if base not in EXPERT_TENSORS:
        raise ValueError(f"unknown gpt-oss expert tensor {name!r}")
    local, inter = sharding.local_experts, _intermediate(sharding)
    experts = slice(local.start, local.stop)
    if base == "down_proj_bias":
        bias = get(name, (experts,))
        split = inter.stop - inter.start < sharding.intermediate_size
        return torch.zeros_like(bias) if split and not sharding.tp.is_first else bias
    if base.startswith("gate_up_proj"):
        rows = slice(2 * inter.start, 2 * inter.stop)
        if name.endswith("_blocks"):  # [E, 2I, H / 32, 16]: already the engine's orientation
            weight = dequantize_mxfp4(get(name, (experts, rows)).flatten(-2), get(base + "_scales", (experts, rows)))
        elif base == "gate_up_proj":  # transformers' [E, H, 2I]
            weight = get(name, (experts, slice(None), rows)).transpose(1, 2)
        else:  # the bias [E, 2I]
            weight = get(name, (experts, rows))
        return _deinterleave(weight, 1)
    if not name.endswith("_blocks"):  # transformers' [E, I, H]
        return get(name, (experts, inter)).transpose(1, 2)
    # [E, H, I / 32, 16]: the whole scale groups the slice touches, then the slice of their values
    first, end = inter.start // MXFP4_BLOCK, -(-inter.stop // MXFP4_BLOCK)
    groups = (experts, slice(None), slice(first, end))
    weight = dequantize_mxfp4(get(name, groups).flatten(-2), get(base + "_scales", groups))
    return weight[..., inter.start - first * MXFP4_BLOCK:inter.stop - first * MXFP4_BLOCK]


def read_packed_experts(name: str, get: Callable[[str, tuple[slice, ...]], torch.Tensor],
                        sharding: ExpertSharding) -> torch.Tensor:
    """This rank's value of a parameter of experts kept in MXFP4: ``<weight>_blocks`` as ``[E, rows, cols / 2]``
    uint8 and ``<weight>_scales`` as ``[E, rows, cols / 32]``, gate rows then up rows as `read_experts` orders them;
    the biases as `read_experts` reads them. A rank's slice of the intermediate dim must be whole groups of 32
    (`engine.models.layers.mxfp4_experts.Mxfp4Experts` checks it when it is built)."""
    base = name.removesuffix("_blocks").removesuffix("_scales")
    if base == name:
        return read_experts(name, get, sharding)
    if base not in EXPERT_TENSORS:
        raise ValueError(f"unknown gpt-oss expert tensor {name!r}")
    local, inter = sharding.local_experts, _intermediate(sharding)
    experts = slice(local.start, local.stop)
    if base == "gate_up_proj":  # [E, 2I, H / 32, (16)]: the rank's interleaved rows, de-interleaved
        return _deinterleave(get(name, (experts, slice(2 * inter.start, 2 * inter.stop))).flatten(2), 1)
    if inter.start % MXFP4_BLOCK or inter.stop % MXFP4_BLOCK:
        raise ValueError(f"{name}: this rank's intermediate columns {inter.start}:{inter.stop} cut a group of "
                         f"{MXFP4_BLOCK} MXFP4 values; packed experts need whole groups")
    groups = slice(inter.start // MXFP4_BLOCK, inter.stop // MXFP4_BLOCK)
    return get(name, (experts, slice(None), groups)).flatten(2)  # [E, H, I / 32, (16)]
