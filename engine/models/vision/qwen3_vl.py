"""The vision tower of Qwen3.5 / 3.6 (``model.visual.*`` in the released checkpoints; Qwen3-VL's design).

Patches (``temporal * patch * patch`` pixels of each channel, flattened) go through a linear patch embedding (the
checkpoint's Conv3d, whose stride equals its kernel), plus a learned position table resampled bilinearly to the
image's grid; then ViT blocks (pre-LayerNorm, bidirectional attention within each image with a 2-D rotary
embedding of each patch's (row, column), a GELU(tanh) MLP); then the merger, which LayerNorms each patch, joins each
``merge × merge`` block of patches (consecutive rows: the processor emits them block by block) and projects them
to the language model's width: one embedding per placeholder token.

Parameter names are the checkpoint's, so the weights load by name (`engine.models.vision.towers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# where the released layouts keep the tower's tensors
VISION_PREFIXES = ("model.visual.", "visual.")


QWEN_VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # the released VLMs whose tower this is


@dataclass(frozen=True)
class VisionConfig:
    """The tower's sizes (config.json's ``vision_config``) and how the language model takes its output
    (``image_token_id``, the text RoPE's ``mrope_section``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @classmethod
    def from_model_config(cls, cfg: dict[str, Any]) -> "VisionConfig | None":
        """From a whole config.json; None where it has no ``vision_config`` or its tower is not this one (Gemma 3's
        is engine/models/vision/gemma3_vision.py's)."""
        vision = cfg.get("vision_config")
        if not vision or cfg.get("model_type") not in QWEN_VL_MODEL_TYPES:
            return None
        text_rope = (cfg.get("text_config") or {}).get("rope_parameters") or {}
        names = set(cls.__dataclass_fields__) - {"rope_theta", "image_token_id", "mrope_section"}
        return cls(
            **{k: vision[k] for k in names if k in vision},
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            image_token_id=cfg.get("image_token_id", cls.image_token_id),
            mrope_section=tuple(text_rope.get("mrope_section", cls.mrope_section)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # a convolution whose stride is its kernel, over one kernel's worth of input: a linear layer
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # RoPE in fp32, over the whole head
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)
                                              ).transpose(0, 1)
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


class Qwen3VisionTower(nn.Module):
    """``forward(patches, grids)``: the placeholder embeddings ``[sum of tokens, out_hidden_size]`` of several
    images, each attending within itself, in order."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def _block_order(self, grid: torch.Tensor, t: int) -> torch.Tensor:
        """``grid`` ``[h, w, ...]`` in the processor's patch order: merge blocks row by row, each block's patches
        row by row; repeated for each of ``t`` frames."""
        m = self.cfg.spatial_merge_size
        h, w = grid.shape[:2]
        blocks = grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid.shape[2:]).repeat(t, *([1] * (grid.dim() - 2)))

    def _positions(self, grids: list[tuple[int, int, int]], dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The learned positions resampled to each grid (bilinear, corners aligned), and the rotary cos / sin of
        each patch's (row, column)."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None].float()
        learned, angles = [], []
        device = table.device
        for t, h, w in grids:
            resampled = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
            learned.append(self._block_order(resampled, t))
            rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            hw = torch.stack([rows, cols], dim=-1).float()
            angles.append(self._block_order(hw, t))
        hw = torch.cat(angles)
        quarter = self.cfg.head_dim // 2  # h and w each turn half the head's frequencies, in fp32
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, quarter, 2, device=device).float() / quarter)
        freqs = torch.cat([hw[:, :1] * inv_freq, hw[:, 1:] * inv_freq], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [patches, 1 (heads), head_dim]
        return torch.cat(learned).to(dtype), freqs.cos(), freqs.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(patches)
        learned, cos, sin = self._positions(grids, x.dtype)
        x = x + learned
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)
