"""Gemma 3's vision side (``gemma3``: Gemma3ForConditionalGeneration, the 4B / 12B / 27B checkpoints): the SigLIP
tower (`engine.models.vision.siglip`) and the multimodal projector, which average-pools the tower's patch grid down
to ``mm_tokens_per_image`` soft tokens (256 in the released models: 64 x 64 patches pooled 4 x 4), RMS-normalises
them with Gemma's (1 + w) gain (``mm_soft_emb_norm``) and projects them to the language model's width
(``mm_input_projection_weight``). One image is always the same number of tokens at plain 1-D positions; the
language model attends among one image's tokens both ways (engine/models/vision/image_spans.py).

Parameter names are the checkpoint's (under ``vision_tower.`` and ``multi_modal_projector.``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.vision.siglip import SiglipConfig, SiglipVisionModel

GEMMA3_VL_MODEL_TYPES = ("gemma3",)


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The tower's sizes, the soft tokens per image and the language model's width and placeholder token."""

    siglip: SiglipConfig
    tokens_per_image: int
    text_hidden_size: int
    image_token_id: int = 262144
    mrope_section: None = None  # plain 1-D positions: no multimodal RoPE
    image_attention_window_only: bool = False  # an image's tokens see each other in every layer

    @classmethod
    def from_model_config(cls, cfg: dict[str, Any]) -> "Gemma3VisionConfig | None":
        if cfg.get("model_type") not in GEMMA3_VL_MODEL_TYPES or not cfg.get("vision_config"):
            return None
        return cls(SiglipConfig.from_dict(cfg["vision_config"]), int(cfg.get("mm_tokens_per_image", 256)),
                   int(cfg["text_config"]["hidden_size"]),
                   int(cfg.get("image_token_index", cfg.get("image_token_id", cls.image_token_id))))

    @property
    def tokens_per_side(self) -> int:
        return int(self.tokens_per_image ** 0.5)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, cfg: Gemma3VisionConfig) -> None:
        super().__init__()
        width = cfg.siglip.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, cfg.text_hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(width))
        self.eps = cfg.siglip.layer_norm_eps
        self.side = cfg.siglip.patches_per_side
        self.kernel = self.side // cfg.tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[images, patches, width]`` -> ``[images * tokens_per_image, text width]``."""
        n, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(n, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()  # Gemma's RMSNorm: fp32, the gain applied as (1 + w)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (x * (1.0 + self.mm_soft_emb_norm.weight.float())).to(pooled.dtype)
        return torch.matmul(x, self.mm_input_projection_weight).reshape(-1, self.mm_input_projection_weight.shape[1])


class Gemma3VisionTower(nn.Module):
    """``forward(pixels, grids)``: the soft-token embeddings ``[images * tokens_per_image, text width]`` of the
    images whose processed pixels ``[channels, size, size]`` are stacked (or concatenated along channels) in
    ``pixels``; ``grids`` only says how many there are."""

    def __init__(self, cfg: Gemma3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = SiglipVisionModel(cfg.siglip)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        size = self.cfg.siglip.image_size
        images = pixels.reshape(len(grids), self.cfg.siglip.num_channels, size, size)
        return self.multi_modal_projector(self.vision_tower(images))
