"""Load HF-format safetensors checkpoints into the models, fusing q/k/v and gate/up and stacking per-expert MoE
weights as they stream in."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

# checkpoint projection name -> (fused parameter, index of the shard within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


def _expert_target(model: nn.Module, parts: list[str]) -> tuple[torch.Tensor, tuple] | None:
    """``...mlp.experts.<e>.{gate,up,down}_proj.weight`` -> its slice of the stacked expert parameters."""
    if len(parts) < 5 or parts[-4] != "experts" or not parts[-3].isdigit() or parts[-1] != "weight":
        return None
    experts, expert = model.get_submodule(".".join(parts[:-3])), int(parts[-3])
    if parts[-2] == "down_proj":
        return experts.down_proj, (expert,)
    inter = experts.gate_up_proj.shape[1] // 2
    half = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}[parts[-2]]
    return experts.gate_up_proj, (expert, half)


def _fused_target(model: nn.Module, parts: list[str]) -> tuple[torch.Tensor, slice] | None:
    """``...{q,k,v}_proj.*`` / ``...{gate,up}_proj.*`` -> its rows of the fused ``qkv_proj`` / ``gate_up_proj``."""
    if len(parts) < 4 or parts[-2] not in _FUSED:
        return None
    fused, shard = _FUSED[parts[-2]]
    module = model.get_submodule(".".join(parts[:-2] + [fused]))
    param = getattr(module, parts[-1])
    if fused == "qkv_proj":
        attn = model.get_submodule(".".join(parts[:-2]))
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
    else:
        sizes = [param.shape[0] // 2] * 2
    start = sum(sizes[:shard])
    return param, slice(start, start + sizes[shard])


def _target(model: nn.Module, name: str) -> tuple[torch.Tensor, slice | tuple | None] | None:
    """The parameter (and the part of it) that checkpoint tensor ``name`` fills; None for tensors we do not use."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None
    try:
        return model.get_parameter(name), None
    except AttributeError:
        pass
    parts = name.split(".")
    try:
        return _expert_target(model, parts) or _fused_target(model, parts)
    except (AttributeError, KeyError):  # a module this model does not have, e.g. DeepSeek-V3's extra MTP layer
        return None


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: Path, progress: bool = True) -> None:
    """Copy every checkpoint tensor into the model; raise if a model parameter was left unfilled."""
    expected = {name for name, _ in model.named_parameters()}
    if model.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")  # shares embed_tokens.weight; named_parameters lists it once anyway
    filled: set[int] = set()
    files = checkpoint_files(Path(model_dir))
    for path in tqdm(files, desc="Loading weights", unit="file", disable=not progress or len(files) < 2):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                target = _target(model, name)
                if target is None:
                    continue
                param, rows = target
                tensor = f.get_tensor(name)
                dst = param if rows is None else param[rows]
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
                dst.copy_(tensor)
                filled.add(id(param))
    missing = [n for n, p in model.named_parameters() if id(p) not in filled and n in expected]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
