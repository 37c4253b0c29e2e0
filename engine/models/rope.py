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


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolation = 1 - ramp.clamp(0, 1)
    inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _inv_freq(head_dim, theta)
    mscale = 1.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, mscale = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    elif rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported (default, linear, llama3, yarn are)")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos() * mscale, angles.sin() * mscale), dim=-1).float()
