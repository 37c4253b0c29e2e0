"""Rotary embedding tables: the cos/sin cache ``[max_positions, head_dim]`` (cos half, then sin half).

Every RoPE variant the supported models use differs only in its inverse frequencies (and a magnitude factor for
YaRN), so the kernels see one cache format whatever the scaling.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, smoothed, out)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor``."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolation = 1 - ramp.clamp(0, 1)
    inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    # DeepSeek's configs give mscale and mscale_all_dim: cos/sin get their ratio (1 when equal) and the softmax scale
    # the rest (see `yarn_softmax_scale`).
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if s.get("attention_factor") is not None:
        attention_factor = s["attention_factor"]
    elif mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv, attention_factor


def _rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def yarn_softmax_scale(scaling: dict[str, Any]) -> float:
    """The factor on MLA's softmax scale under YaRN with ``mscale_all_dim`` (DeepSeek-V2/V3); 1 otherwise."""
    if _rope_type(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _inv_freq(head_dim, theta)
    mscale = 1.0
    rope_type = _rope_type(scaling)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, mscale = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    elif rope_type == "proportional":  # Gemma 4's global layers: the first frequencies of the whole head turn, the
        # rest stay still (frequency 0), so the rotation spans the head as transformers' does
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = torch.cat([inv_freq[:turning], inv_freq.new_zeros(head_dim // 2 - turning)])
        inv_freq = inv_freq / scaling.get("factor", 1.0)
    elif rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported (default, linear, llama3, yarn, proportional "
                         "are)")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos() * mscale, angles.sin() * mscale), dim=-1).float()


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 inverse: bool = False) -> torch.Tensor:
    """DeepSeek-V4's RoPE: interleaved pairs ``(x0, x1), (x2, x3), ...`` of the *last* ``R`` dims of ``x``
    ``[T, ..., D]`` rotated by position (``R`` = the cache's width), in fp32; ``inverse`` rotates back (V4 undoes
    the keys' rotation on the attention output, since its values are its keys)."""
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    half = cos_sin.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (2 * half,)
    cos = cos_sin[:, :half].repeat_interleave(2, dim=-1).view(shape)
    sin = cos_sin[:, half:].repeat_interleave(2, dim=-1).view(shape)
    rope = x[..., -2 * half :].float()
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = rope * cos + swapped * (-sin if inverse else sin)
    return torch.cat([x[..., : -2 * half], rotated.to(x.dtype)], dim=-1)
