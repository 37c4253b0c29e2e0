"""Load HF-format safetensors checkpoints into the models, fusing q/k/v and gate/up and stacking per-expert MoE
weights as they stream in.

Under tensor parallelism each rank reads only its part of every tensor (safetensors' ``get_slice``), as the
layer's `Sharding` (engine/parallel/linear.py) says: no rank ever holds the full model in memory.

FP8 block-scaled checkpoints (``engine.models.layers.quant``) load either way: after `use_fp8_layers` their quantized
linears are `Fp8Linear` and take the FP8 bytes and scales as stored; otherwise each weight is dequantized with its
``weight_scale_inv`` into the engine dtype as it is read.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine.models.gpt_oss import read_experts, read_packed_experts
from engine.models.layers.mxfp4_experts import Mxfp4Experts
from engine.models.layers.quant import SCALE_SUFFIX, Fp8Format, Fp8Linear, swap_in_fp8_linears
from kernels.ops import dequantize_fp4_blocks
from engine.parallel.linear import Sharding

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
                       "F4": torch.float4_e2m1fn_x2}

# checkpoint projection name -> (fused parameter, index of its first part, parts it covers)
_FUSED = {
    "q_proj": ("qkv_proj", 0, 1),
    "k_proj": ("qkv_proj", 1, 1),
    "v_proj": ("qkv_proj", 2, 1),
    "gate_proj": ("gate_up_proj", 0, 1),
    "up_proj": ("gate_up_proj", 1, 1),
    # Gated DeltaNet: Qwen3.5 / 3.6 (in_proj_qkv packs q, k and v) and Qwen3-Next (grouped per key head)
    "in_proj_qkv": ("in_proj", 0, 3),
    "in_proj_z": ("in_proj", 3, 1),
    "in_proj_b": ("in_proj", 4, 1),
    "in_proj_a": ("in_proj", 5, 1),
    "in_proj_qkvz": ("in_proj", 0, 1),
    "in_proj_ba": ("in_proj", 1, 1),
    # Kimi Delta Attention: one causal conv over q, k and v, stored per projection
    "q_conv1d": ("conv1d", 0, 1),
    "k_conv1d": ("conv1d", 1, 1),
    "v_conv1d": ("conv1d", 2, 1),
}
# Checkpoint prefixes that are not the language model's: a VLM's vision tower (Qwen3.5 / 3.6, Gemma 3 and Gemma 4 load
# theirs apart, engine/models/vision/, with Gemma 3's projector and Gemma 4's embedder of image features into the
# language model; Muse-Glimmer's stays on disk)
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                     "multi_modal_projector.", "model.embed_vision.", "model.vision_adapter.",
                     "model.vision_projection.")  # (the last three: Gemma 4's and Muse-Glimmer's projections)
# Gemma 4 E2B / E4B's audio encoder and its projection: never loaded (kvserve takes no audio input)
_AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
# Multi-token-prediction weights, loaded only into a model that built its MTP layer (engine/models/mtp.py): ``mtp.*``
# (Qwen3.5 / 3.6, Qwen3-Next, DeepSeek-V4) or the layers after the last decoder layer (DeepSeek-V3 / V3.2)
MTP_PREFIX = "mtp."
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


class _Checkpoint:
    """The tensors of a (possibly sharded) checkpoint by name; a weight and its scale may sit in different files."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = {path: safe_open(str(path), framework="pt") for path in files}
        self.names = {path: list(handle.keys()) for path, handle in self._handles.items()}
        self._file_of = {name: path for path, names in self.names.items() for name in names}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only its part ``index`` (read from disk without the rest)."""
        handle = self._handles[self._file_of[name]]
        return handle.get_tensor(name) if index is None else handle.get_slice(name)[index]

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype, read from the header without the data."""
        return _SAFETENSORS_DTYPES[self._handles[self._file_of[name]].get_slice(name).get_dtype()]

    def bounds(self, name: str, index: tuple[slice, ...] | None) -> tuple[slice, slice]:
        """``index`` of a 2-D tensor as explicit (rows, columns) bounds."""
        shape = self._handles[self._file_of[name]].get_slice(name).get_shape()
        index = (index or ()) + (slice(None),) * (2 - len(index or ()))
        return tuple(slice(*part.indices(size)[:2]) for part, size in zip(index, shape))


@dataclass(frozen=True)
class _Target:
    """Where checkpoint tensor ``module_path.attr`` goes: ``rows`` of the output dim of a fused projection, an
    expert's part of stacked expert weights (``(expert,)`` or ``(expert, rows)``), or all of it (None). ``source``
    is the part of the checkpoint tensor this rank reads (None: all of it); ``zero``: the rank holds zeros there
    and reads nothing (a row-parallel bias beyond rank 0); ``read``: how to read it when it is no slice of one
    checkpoint tensor (gpt-oss' experts: transposed, de-interleaved, dequantized from MXFP4 with their scales)."""

    path: str
    module: nn.Module
    attr: str
    rows: slice | tuple | None
    source: tuple[slice, ...] | None = None
    zero: bool = False
    read: Callable[[_Checkpoint, str], torch.Tensor] | None = None

    def destination(self) -> torch.Tensor:
        param = getattr(self.module, self.attr)
        return param if self.rows is None else param[self.rows]


def _shard_sizes(model: nn.Module, path: str) -> list[int]:
    """This rank's output rows of each checkpoint projection fused into the layer at ``path`` (one entry if not
    fused)."""
    module = model.get_submodule(path)
    sharding = getattr(module, "sharding", None)
    if sharding is not None and sharding.dim == 0:
        return sharding.local_sizes
    return [module.weight.shape[0]]


# DeepSeek-V4 checkpoints keep DeepSeek's own names; these renames (applied in order, as transformers' conversion
# mapping does) give transformers' module names, which the model follows.
_DEEPSEEK_V4_RENAMES = [(re.compile(pattern), repl) for pattern, repl in [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"), (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.", ".gate_proj."), (r"\.w2\.", ".down_proj."), (r"\.w3\.", ".up_proj."),  # experts, shared experts
]]
def _renames(pairs: list[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(pattern), repl) for pattern, repl in pairs]


# Mixtral-style MoE names (MiniMax-M2, Kimi Linear): the MoE as block_sparse_moe, experts w1 / w2 / w3
_BLOCK_SPARSE_MOE = [(r"\.block_sparse_moe\.", ".mlp."), (r"\.w1\.", ".gate_proj."), (r"\.w2\.", ".down_proj."),
                     (r"\.w3\.", ".up_proj.")]
# MiniMax-M2's released names: those, with the router's bias beside the gate
_MINIMAX_M2_RENAMES = _renames([
    (r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"), *_BLOCK_SPARSE_MOE])
# Kimi Linear's: those, with the forget gate's projections and bias beside the KDA layer's other weights (held by its
# forget_gate, as transformers does)
_KIMI_LINEAR_RENAMES = _renames([*_BLOCK_SPARSE_MOE,
                                 (r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias)", r".self_attn.forget_gate.\1")])
# Gemma 4 E2B / E4B's per-layer embeddings, held by their modules (engine/models/layers/per_layer_embeddings.py)
_GEMMA4_RENAMES = _renames([
    (r"^(embed_tokens_per_layer|per_layer_model_projection|per_layer_projection_norm)\.", r"per_layer_embeddings.\1."),
    (r"^(layers\.\d+)\.(per_layer_input_gate|per_layer_projection|post_per_layer_input_norm)\.",
     r"\1.per_layer_input.\2.")])
_CHECKPOINT_RENAMES = {"minimax_m2": _MINIMAX_M2_RENAMES, "kimi_linear": _KIMI_LINEAR_RENAMES,
                       "deepseek_v4": _DEEPSEEK_V4_RENAMES, "gpt_oss": [(re.compile(r"\.mlp\.router\."), ".mlp.gate.")],
                       "gemma4": _GEMMA4_RENAMES, "gemma4_text": _GEMMA4_RENAMES}


def _model_name(model: nn.Module, name: str) -> str:
    """Checkpoint tensor ``name`` under the model's module names (a VLM checkpoint's language model as the model)."""
    name = name.replace("model.language_model.", "model.", 1)
    if name.startswith("language_model."):  # the Hub's VLM layout, which transformers still saves (Gemma 3's
        # language_model.model.*), where it holds the language model as model.language_model.*
        name = name[len("language_model."):]
    if name.startswith("model."):
        name = name[len("model.") :]
    for pattern, repl in _CHECKPOINT_RENAMES.get(model.cfg.architecture, ()):
        name = pattern.sub(repl, name)
    after_last = f"layers.{model.cfg.num_layers}."
    if name.startswith(after_last) and getattr(model, "mtp", None) is not None:  # DeepSeek-V3 / V3.2's MTP layer
        name = MTP_PREFIX + name[len(after_last):]
    return name


def _is_mtp_tensor(model: nn.Module, name: str) -> bool:
    """Checkpoint tensor ``name`` belongs to a multi-token-prediction layer."""
    if name.startswith(MTP_PREFIX):
        return True
    after = _LAYER_INDEX.match(name)
    return after is not None and int(after[1]) >= model.cfg.num_layers


def _target(model: nn.Module, name: str) -> list[_Target]:
    """Where checkpoint tensor ``name`` goes (one target per part of a layer it fills); empty for tensors we do not
    use."""
    name = _model_name(model, name)
    if "rotary_emb" in name:
        return []
    parts = name.split(".")
    try:
        if model.cfg.architecture == "gpt_oss" and parts[-2:-1] == ["experts"]:
            return _gpt_oss_expert_targets(model, parts)
        stacked = _stacked_expert_targets(model, parts)
        if stacked is not None:
            return stacked
        if parts[-4:-3] == ["experts"] and parts[-3].isdigit():
            expert = _expert_target(model, parts)
            return [expert] if expert is not None else []
        return _layer_targets(model, parts)
    except (AttributeError, KeyError):  # a module this model does not have, e.g. the copies of the embedding and
        # LM head that DeepSeek-V3's MTP layer stores (it uses the model's)
        return []


def _stacked_expert_targets(model: nn.Module, parts: list[str]) -> list[_Target] | None:
    """``...mlp.experts.{gate_up,down}_proj`` stored stacked, as transformers holds them (``[E, 2I, H]`` /
    ``[E, H, I]``; Qwen3.5 / 3.6 MoE checkpoints) -> this rank's experts and slices of them; None for other names."""
    if len(parts) < 3 or parts[-2] != "experts" or parts[-1] not in ("gate_up_proj", "down_proj"):
        return None
    path = ".".join(parts[:-1])
    experts = model.get_submodule(path)
    sharding = experts.sharding
    local = sharding.local_experts
    mine = slice(local.start, local.stop)
    if parts[-1] == "down_proj":
        return [_Target(path, experts, "down_proj", None, (mine, *sharding.checkpoint_index("down_proj")))]
    full, inter = sharding.intermediate_size, experts.gate_up_proj.shape[1] // 2
    rows = sharding.checkpoint_index("gate_proj")[0]
    return [_Target(path, experts, "gate_up_proj", (slice(None), slice(h * inter, (h + 1) * inter)),
                    (mine, slice(rows.start + h * full, rows.stop + h * full))) for h in (0, 1)]


def _gpt_oss_expert_targets(model: nn.Module, parts: list[str]) -> list[_Target]:
    """gpt-oss' stacked experts (`engine.models.gpt_oss.read_experts`): one target per parameter, the rank's part of
    it read from disk. Experts kept in MXFP4 take the blocks and the scales as parameters of their own."""
    path, last = ".".join(parts[:-1]), parts[-1]
    experts = model.get_submodule(path)
    packed = isinstance(experts, Mxfp4Experts)
    reader = read_packed_experts if packed else read_experts

    def read(ckpt: _Checkpoint, name: str) -> torch.Tensor:
        prefix = name[: len(name) - len(last)]
        return reader(last, lambda tensor, index: ckpt.get(prefix + tensor, index), experts.sharding)

    if packed:
        return [_Target(path, experts, last, None, read=read)]
    if last.endswith("_scales"):  # read with its blocks
        return []
    return [_Target(path, experts, last.removesuffix("_blocks"), None, read=read)]


def _expert_target(model: nn.Module, parts: list[str]) -> _Target | None:
    """``...mlp.experts.<e>.{gate,up,down}_proj.weight`` -> its part of the stacked expert parameters (None for an
    expert another rank holds)."""
    if len(parts) < 5 or parts[-4] != "experts" or not parts[-3].isdigit() or parts[-1] != "weight":
        return None
    path = ".".join(parts[:-3])
    experts, projection = model.get_submodule(path), parts[-2]
    expert = experts.sharding.local_index(int(parts[-3]))
    if expert is None:
        return None
    source = experts.sharding.checkpoint_index(projection)
    if projection == "down_proj":
        return _Target(path, experts, "down_proj", (expert,), source)
    inter = experts.gate_up_proj.shape[1] // 2
    half = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}[projection]
    return _Target(path, experts, "gate_up_proj", (expert, half), source)


def _layer_targets(model: nn.Module, parts: list[str]) -> list[_Target]:
    """A parameter the model has under the same name (filling all its parts), or ``...{q,k,v}_proj.*`` /
    ``...{gate,up}_proj.*`` (and the other `_FUSED` names) -> its parts of the fused parameter."""
    path, attr = ".".join(parts[:-1]), parts[-1]
    try:
        module = model.get_submodule(path)
        first, count = 0, None
    except AttributeError:
        if len(parts) < 4 or parts[-2] not in _FUSED:
            raise
        fused, first, count = _FUSED[parts[-2]]
        path = ".".join(parts[:-2] + [fused])
        module = model.get_submodule(path)
    if not isinstance(getattr(module, attr, None), nn.Parameter):
        return []
    sharding = getattr(module, "sharding", None)
    if sharding is None:  # replicated: every rank reads all of it
        return [_Target(path, module, attr, None)]
    count = count or len(sharding.parts)
    targets = []
    offset = 0  # a tensor packing several parts (in_proj_qkv, a conv over q/k/v): each part's rows follow the last
    for part in range(first, first + count):
        source = sharding.checkpoint_index(attr, part)
        if source is None:
            targets.append(_Target(path, module, attr, None, zero=True))
        elif sharding.dim == 0:
            rows = slice(source[0].start + offset, source[0].stop + offset)
            targets.append(_Target(path, module, attr, sharding.local_rows(part, rows.stop - rows.start),
                                   (rows, *source[1:])))
        else:
            targets.append(_Target(path, module, attr, None, source))
        offset += sharding.full_size(part)
    return targets


def use_fp8_layers(model: nn.Module, model_dir: Path) -> int:
    """For an FP8 checkpoint, turn every linear it quantizes into an `Fp8Linear` (best on the meta device, before
    memory is allocated); returns how many. `load_weights` then fills them with the FP8 bytes and scales as stored
    instead of dequantizing them. The op set's ``fp8_linear`` must run on the model's device."""
    model_dir = Path(model_dir)
    fmt = Fp8Format.from_model_dir(model_dir)
    if fmt is None:
        return 0
    layers = {}
    for names in _Checkpoint(checkpoint_files(model_dir)).names.values():
        for name in names:
            targets = _target(model, name.removesuffix(SCALE_SUFFIX) + ".weight") if name.endswith(SCALE_SUFFIX) else []
            for target in targets:
                # MoE experts and layers with a GEMM of their own (V4's grouped o_a_proj) are dequantized on load
                if isinstance(target.module, nn.Linear) and getattr(target.module, "fp8_gemm", True):
                    layers[target.path] = _shard_sizes(model, target.path)
    swapped = swap_in_fp8_linears(model, layers, fmt, model.ops.fp8_linear)
    log.info("FP8 checkpoint: %d linear layers keep e4m3 weights with %s block scales", swapped, list(fmt.block))
    return swapped


def _read(ckpt: _Checkpoint, name: str, target: _Target, fmt: Fp8Format | None) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` as ``target`` stores it: FP8 bytes for an `Fp8Linear` (whose
    scales are loaded here too), else dequantized when the checkpoint quantized it."""
    if target.read is not None:
        return target.read(ckpt, name)
    if ckpt.dtype(name) in FP4_PACKED_DTYPES:
        return _read_fp4(ckpt, name, target)
    tensor = ckpt.get(name, target.source)
    if tensor.dtype != torch.float8_e4m3fn:
        if isinstance(target.module, Fp8Linear) and target.attr == "weight":
            raise ValueError(f"{name} has a {SCALE_SUFFIX.lstrip('.')} but is {tensor.dtype}, not float8_e4m3fn")
        return tensor
    scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
    if fmt is None or scale_name not in ckpt:
        raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no {scale_name} and no FP8 "
                         "quantization_config in config.json to read it with")
    grid, offset = fmt.covering_scales(*ckpt.bounds(name, target.source))
    scale_inv = ckpt.get(scale_name, grid)
    if isinstance(target.module, Fp8Linear):
        if offset != (0, 0):
            raise ValueError(f"{name}: this rank's part starts inside a {list(fmt.block)} FP8 block; layers kept in "
                             "FP8 need tensor-parallel parts of whole blocks (choose a tensor_parallel_size whose "
                             "parts of every projection are multiples of the block)")
        target.module.load_scales(scale_name, scale_inv, target.rows)
        return tensor
    return fmt.dequantize(scale_name, tensor, scale_inv, target.destination().dtype, offset)


FP4_PACKED_DTYPES = (torch.int8, torch.float4_e2m1fn_x2)


def _read_fp4(ckpt: _Checkpoint, name: str, target: _Target) -> torch.Tensor:
    """An FP4 weight (DeepSeek-V4's experts), dequantized whole, then this rank's part of it."""
    scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
    if scale_name not in ckpt:
        raise ValueError(f"{name} is packed FP4 ({ckpt.dtype(name)}) but the checkpoint has no {scale_name}")
    values = dequantize_fp4_blocks(ckpt.get(name), ckpt.get(scale_name))
    return values[target.source or ()].to(target.destination().dtype)


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: Path, progress: bool = True) -> None:
    """Copy every checkpoint tensor into the model; raise if a model parameter was left unfilled. Quantized FP8
    weights are dequantized into the parameter's dtype, unless `use_fp8_layers` made their layer an `Fp8Linear`."""
    model_dir = Path(model_dir)
    fmt = Fp8Format.from_model_dir(model_dir)
    files = checkpoint_files(model_dir)
    ckpt = _Checkpoint(files)
    expected = {name for name, _ in model.named_parameters()}
    if model.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")  # shares embed_tokens.weight; named_parameters lists it once anyway
    filled: set[int] = set()
    # the MTP layer is loaded where the model built one (--speculative mtp), else left on disk
    mtp = getattr(model, "mtp", None) is not None
    skipped = {prefix: 0 for prefix in _SKIPPED_PREFIXES + _AUDIO_PREFIXES}
    skipped_mtp = 0
    _zero_vocab_padding(model)
    for path in tqdm(files, desc="Loading weights", unit="file", disable=not progress or len(files) < 2):
        for name in ckpt.names[path]:
            if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                continue
            if name.endswith(SCALE_SUFFIX):  # read with its weight
                continue
            prefix = next((p for p in skipped if name.startswith(p)), None)
            if prefix is not None:
                skipped[prefix] += 1
                continue
            if not mtp and _is_mtp_tensor(model, name):
                skipped_mtp += 1
                continue
            for target in _target(model, name):
                _fill(ckpt, name, target, fmt, filled)
    if any(skipped[p] for p in _SKIPPED_PREFIXES) and progress:
        log.info("the vision tower (%d tensors) is not the language model's: it loads apart where kvserve runs it "
                 "(engine/models/vision/; not with --language-model-only)",
                 sum(skipped[p] for p in _SKIPPED_PREFIXES))
    if any(skipped[p] for p in _AUDIO_PREFIXES) and progress:
        log.info("the audio tower (%d tensors) stays on disk: kvserve takes no audio input",
                 sum(skipped[p] for p in _AUDIO_PREFIXES))
    if skipped_mtp and progress:
        log.info("left %d multi-token-prediction tensors in the checkpoint (--speculative mtp loads them)",
                 skipped_mtp)
    missing = [n for n, p in model.named_parameters() if id(p) not in filled and n in expected]
    if missing and all(n.startswith(MTP_PREFIX) for n in missing):
        raise ValueError(f"--speculative mtp: the checkpoint in {model_dir} lacks the multi-token-prediction layer "
                         f"its config.json announces ({len(missing)} tensors, e.g. {missing[:2]}); use ngram or "
                         "suffix")
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _fill(ckpt: _Checkpoint, name: str, target: _Target, fmt: Fp8Format | None, filled: set[int]) -> None:
    dst = target.destination()
    filled.add(id(getattr(target.module, target.attr)))
    if target.zero:
        dst.zero_()
        return
    tensor = _read(ckpt, name, target, fmt)
    if dst.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
    dst.copy_(tensor)
    if isinstance(target.module, Fp8Linear) and target.attr == "weight":
        filled.add(id(target.module.weight_scale_inv))


def _zero_vocab_padding(model: nn.Module) -> None:
    """The rows past the vocabulary in the last rank's embedding and head block: never read, but kept finite."""
    for module in model.modules():
        sharding = getattr(module, "sharding", None)
        if isinstance(sharding, Sharding) and sharding.pad:
            module.weight.zero_()
