"""Gemma 4's vision side (``gemma4``: Gemma4ForConditionalGeneration; transformers' Gemma4VisionModel and
Gemma4MultimodalEmbedder): unlike Gemma 3's SigLIP on a fixed square, an image keeps its aspect ratio and yields a
number of soft tokens of its own.

- **Patches**: the processor resizes an image so that its patch grid (``patch_size`` pixels a side) fits the
  budget and divides by ``pooling_kernel_size``; each patch is projected (pixels mapped to [-1, 1] here, not by the
  processor) and gets a learned embedding of its column plus one of its row.
- **Encoder**: pre- and post-norm ViT blocks (RMSNorm with plain gains; q and k normed, v normed without a gain),
  attention across the whole image with softmax scale 1 and **2-D rotary positions**: the first half of every head
  turns by the patch's column, the second half by its row (each half rotate-half style, base ``rope_theta``).
- **Pooler**: the grid averaged over ``k x k`` cells (k = ``pooling_kernel_size``), so an image of ``h x w`` patches
  is ``h/k * w/k`` soft tokens, row by row; scaled by sqrt(width) in fp32 and, with ``standardize``, shifted and
  scaled per channel (``std_bias``, ``std_scale``).
- **Embedder**: an RMSNorm without a gain, then a projection to the language model's width.

Clipped linears (``use_clipped_linears``: each projection's input and output clamped to bounds stored in the
checkpoint) are honoured. Parameter names are the checkpoint's (under ``vision_tower.`` and ``embed_vision.``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GEMMA4_VL_MODEL_TYPES = ("gemma4",)


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """The tower's sizes, the language model's width and image token, and how the language model attends among an
    image's tokens."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rms_norm_eps: float
    rope_theta: float
    standardize: bool
    clipped_linears: bool
    text_hidden_size: int
    image_token_id: int = 258880
    mrope_section: None = None  # plain 1-D positions in the language model
    # Gemma 4's text model lets an image's tokens see each other only in its sliding-window layers (Gemma 3: all)
    image_attention_window_only: bool = True

    @classmethod
    def from_model_config(cls, cfg: dict[str, Any]) -> "Gemma4VisionConfig | None":
        vision = cfg.get("vision_config")
        if cfg.get("model_type") not in GEMMA4_VL_MODEL_TYPES or not vision:
            return None
        heads = int(vision.get("num_attention_heads", 12))
        return cls(int(vision.get("hidden_size", 768)), int(vision.get("intermediate_size", 3072)),
                   int(vision.get("num_hidden_layers", 16)), heads, int(vision.get("num_key_value_heads", heads)),
                   int(vision.get("head_dim", 64)), int(vision.get("patch_size", 16)),
                   int(vision.get("pooling_kernel_size", 3)), int(vision.get("position_embedding_size", 10240)),
                   float(vision.get("rms_norm_eps", 1e-6)),
                   float((vision.get("rope_parameters") or {}).get("rope_theta", 100.0)),
                   bool(vision.get("standardize", False)), bool(vision.get("use_clipped_linears", False)),
                   int(cfg["text_config"]["hidden_size"]), int(cfg.get("image_token_id", cls.image_token_id)))


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma 4's RMSNorm: in fp32, ``x * (mean(x^2) + eps) ** -0.5`` times a plain gain (or none)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h if weight is None else h * weight.float()).type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


class ClippableLinear(nn.Module):
    """A bias-free projection, its input and output clamped to the checkpoint's bounds where the tower clips."""

    def __init__(self, cfg: Gemma4VisionConfig, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = cfg.clipped_linears
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.tensor(float("-inf") if name.endswith("min") else float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return torch.clamp(self.linear(torch.clamp(x, self.input_min, self.input_max)), self.output_min,
                           self.output_max)


def rotate_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, heads, D]``: the first half turned by the column table, the second by the row table (``cos`` /
    ``sin`` ``[n, 2, D / 2]``), each half rotate-half style."""
    out = []
    for axis, part in enumerate(x.chunk(2, dim=-1)):
        c, s = cos[:, None, axis], sin[:, None, axis]
        a, b = part.chunk(2, dim=-1)
        out.append(part * c + torch.cat([-b, a], dim=-1) * s)
    return torch.cat(out, dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.num_heads * d)
        self.k_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.num_kv_heads * d)
        self.v_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.num_kv_heads * d)
        self.o_proj = ClippableLinear(cfg, cfg.num_heads * d, cfg.hidden_size)
        self.q_norm = Norm(d, cfg.rms_norm_eps)
        self.k_norm = Norm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d, eps = x.shape[0], self.cfg.head_dim, self.cfg.rms_norm_eps
        q = rotate_2d(self.q_norm(self.q_proj(x).view(n, -1, d)), cos, sin)
        k = rotate_2d(self.k_norm(self.k_proj(x).view(n, -1, d)), cos, sin)
        v = rms_norm(self.v_proj(x).view(n, -1, d), eps)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], scale=1.0, enable_gqa=True)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.zeros(2, cfg.position_embedding_size, cfg.hidden_size))

    def forward(self, pixels: torch.Tensor, columns: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))
        return x + self.position_embedding_table[0][columns] + self.position_embedding_table[1][rows]


class Encoder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class Gemma4VisionModel(nn.Module):
    """Patches of one image -> its pooled soft tokens ``[h/k * w/k, width]`` (fp32 until standardized)."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))
        half = cfg.head_dim // 2  # each axis turns half of a head
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2).float() / half),
                             persistent=False)

    def forward(self, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``pixels`` ``[height * width, 3 * patch^2]``, the patches row by row (the processor's order)."""
        rows = torch.arange(height, device=pixels.device).repeat_interleave(width)
        columns = torch.arange(width, device=pixels.device).repeat(height)
        x = self.patch_embedder(pixels, columns, rows)
        freqs = torch.stack([columns, rows], dim=-1)[..., None].float() * self.inv_freq  # [n, 2, D / 4]
        freqs = torch.cat([freqs, freqs], dim=-1)
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = self.cfg.pooling_kernel_size
        cells = x.float().view(height // k, k, width // k, k, -1).transpose(1, 2).reshape(-1, k * k, x.shape[-1])
        pooled = cells.sum(1) / (k * k) * self.cfg.hidden_size**0.5  # (fp32: the scale can pass fp16's range)
        if self.cfg.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)


class Gemma4MultimodalEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_norm(x, self.eps))


class Gemma4VisionTower(nn.Module):
    """``forward(pixels, grids)``: the soft-token embeddings ``[tokens, text width]`` of the images whose patches
    are concatenated in ``pixels``; ``grids`` holds each image's soft-token grid (1, h, w), its patch grid being
    ``pooling_kernel_size`` times that."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = Gemma4VisionModel(cfg)
        self.embed_vision = Gemma4MultimodalEmbedder(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        k, out, start = self.cfg.pooling_kernel_size, [], 0
        for _, h, w in grids:
            n = h * w * k * k
            out.append(self.vision_tower(pixels[start:start + n], h * k, w * k))
            start += n
        return self.embed_vision(torch.cat(out))
