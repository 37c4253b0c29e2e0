"""Which vision tower a checkpoint has, and its weights: Qwen3.5 / 3.6's (`engine.models.vision.qwen3_vl`),
Gemma 3's (`engine.models.vision.gemma3_vision`) or Gemma 4's (`engine.models.vision.gemma4_vision`), chosen by
config.json, loaded by the checkpoint's own names."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open

from engine.models.vision.gemma3_vision import Gemma3VisionConfig, Gemma3VisionTower
from engine.models.vision.gemma4_vision import Gemma4VisionConfig, Gemma4VisionTower
from engine.models.vision.qwen3_vl import VISION_PREFIXES, Qwen3VisionTower, VisionConfig
from engine.weights import checkpoint_files

VisionTower = Union[Qwen3VisionTower, Gemma3VisionTower, Gemma4VisionTower]
TowerConfig = Union[VisionConfig, Gemma3VisionConfig, Gemma4VisionConfig]


def tower_config(cfg: dict[str, Any]) -> TowerConfig | None:
    """The tower a whole config.json describes (None: none kvserve runs)."""
    return (VisionConfig.from_model_config(cfg) or Gemma3VisionConfig.from_model_config(cfg)
            or Gemma4VisionConfig.from_model_config(cfg))


def _qwen_name(name: str) -> str | None:
    prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
    return None if prefix is None else name[len(prefix):]


def _gemma3_name(name: str) -> str | None:
    """The released names (``vision_tower.vision_model.*``), transformers 5's saved ones (``vision_tower.*``) and
    its in-memory ones (``model.vision_tower.*``), all as `Gemma3VisionTower`'s; None for the rest, and for a
    SigLIP pooling head (``vision_use_head``), which Gemma 3 never reads."""
    name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.", 1)
    if not name.startswith(("vision_tower.", "multi_modal_projector.")) or name.startswith("vision_tower.head."):
        return None
    return name


def _gemma4_name(name: str) -> str | None:
    """transformers 5's saved names (``model.vision_tower.*``, ``model.embed_vision.*``) as `Gemma4VisionTower`'s;
    None for the rest (the language model, the audio tower)."""
    name = name.removeprefix("model.")
    return name if name.startswith(("vision_tower.", "embed_vision.")) else None


_TOWERS = {VisionConfig: (Qwen3VisionTower, _qwen_name), Gemma3VisionConfig: (Gemma3VisionTower, _gemma3_name),
           Gemma4VisionConfig: (Gemma4VisionTower, _gemma4_name)}


def load_vision_tower(model_dir: Path, device: torch.device, dtype: torch.dtype) -> VisionTower | None:
    """The tower of the checkpoint in ``model_dir`` with its weights, or None where its config.json has none."""
    cfg = tower_config(json.loads((Path(model_dir) / "config.json").read_text()))
    if cfg is None:
        return None
    tower_class, rename = _TOWERS[type(cfg)]
    tower = tower_class(cfg)
    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                own = rename(name)
                if own is not None:
                    state[own] = f.get_tensor(name)
    if not state:
        raise ValueError(f"config.json in {model_dir} announces a vision tower but its checkpoint holds none; "
                         "serve it with --language-model-only")
    tower.load_state_dict(state, strict=True)
    return tower.to(device=device, dtype=dtype).eval()
