"""The SigLIP vision transformer (Gemma 3's tower: ``vision_tower.vision_model.*`` in the released checkpoints,
``vision_tower.*`` as transformers 5 saves them).

An image of a fixed size (the processor resizes it: 896 x 896 in the released Gemma 3) is cut into
``patch_size``² patches by a convolution whose stride is its kernel, plus a learned position per patch; then
pre-LayerNorm ViT blocks (every patch attends to every other, no rotary positions, a GELU(tanh) MLP) and a final
LayerNorm: one embedding per patch, row by row. No pooling head (Gemma 3 pools in its projector).

Parameter names are the checkpoint's, so the weights load by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipConfig:
    """config.json's ``vision_config`` (``siglip_vision_model``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, vision: dict[str, Any]) -> "SiglipConfig":
        return cls(**{k: vision[k] for k in cls.__dataclass_fields__ if k in vision})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels`` ``[images, channels, size, size]`` -> ``[images, patches, hidden]``."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.hidden_size, cfg.hidden_size)
                                                                for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, self.num_heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                       self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class SiglipVisionModel(nn.Module):
    """``forward(pixels)``: ``[images, patches, hidden]``, each image's patches row by row."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
