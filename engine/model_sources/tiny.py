"""Deterministic tiny random models with real tokenizers, for tests that compare kvserve with HF transformers.

Random weights at the usual init scale (normal, std 0.02) give nearly uniform logits: greedy decoding then repeats
one token whatever the prompt, and output-equality tests prove nothing. The scales below make every layer matter:
sharp attention, MLP and attention outputs comparable to the residual stream, and logits spread over several units,
so greedy continuations are varied and depend on the whole context.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import GEMMA3_ARCHITECTURES, HYBRID_ARCHITECTURES, MTP_AFTER_LAST_LAYER
from engine.models.vision.qwen3_vl import VISION_PREFIXES

from .deepseek_tokenizer import write_deepseek_tokenizer
from .gemma_tokenizer import GEMMA3_MODEL, add_image_tokens, rename_gemma4_media_tokens, write_gemma3_tokenizer
from .glm_tokenizer import write_glm_tokenizer
from .harmony_tokenizer import write_harmony_tokenizer
from .hf_layout import VLM_LAYOUTS, DecoderDims, TokenizerInfo, write_model_configs
from .kimi_tokenizer import write_kimi_k3_tokenizer, write_kimi_tokenizer
from .minimax_tokenizer import write_minimax_tokenizer
from .mistral_tokenizer import write_tekken_tokenizer
from .mxfp4 import released_expert_layout
from .qwen_tokenizer import write_qwen3_tokenizer, write_qwen36_tokenizer
from .templates import load_template

# recipe `tokenizer:` -> the writer of that real tokenizer (with the entry's chat template) into a model directory
TOKENIZER_WRITERS: dict[str, Callable[[Path, str], TokenizerInfo]] = {
    "qwen3": write_qwen3_tokenizer,
    "qwen3.6": write_qwen36_tokenizer,
    "deepseek": write_deepseek_tokenizer,
    "glm": write_glm_tokenizer,  # a stand-in: Qwen3's BPE with GLM's added tokens (none on the index ships GLM's)
    "harmony": write_harmony_tokenizer,  # gpt-oss' o200k_harmony, from bpe-openai's o200k_base
    "minimax": write_minimax_tokenizer,  # a stand-in: Qwen3's BPE with MiniMax's format tokens (none on the index)
    "kimi": write_kimi_tokenizer,  # a stand-in: Qwen3's BPE with Kimi's format tokens (Kimi's is remote code)
    "kimi-k3": write_kimi_k3_tokenizer,  # the same for Kimi-K3's XTML tokens
    "tekken": write_tekken_tokenizer,  # Devstral's tekken v13, from the vocabulary mistral-common's wheel ships
}
# recipe `tokenizer:` -> the registry model whose converted tokenizer a tiny model copies: the registry resolves it
# and passes its directory to build_tiny_model (Gemma's comes from gemma3-270m's GGUF)
COPIED_TOKENIZERS: dict[str, str] = {"gemma3": GEMMA3_MODEL}
TOKENIZERS = (*TOKENIZER_WRITERS, *COPIED_TOKENIZERS)
VOCAB_ROUNDING = 128  # embedding rows are padded to a multiple of this, as real checkpoints do


@dataclass(frozen=True)
class InitScales:
    """Standard deviations of the random weights (`linear` is multiplied by 1/sqrt(fan_in))."""

    embedding: float = 0.1  # small next to the layer outputs: with tied embeddings a large one makes every
    # position predict its own input token (the residual stream is mostly that token's embedding)
    lm_head: float = 0.5
    linear: float = 2.0  # layer outputs well above the (small) embeddings
    attention_qk: float = 2.5  # larger q/k projections make attention peaked, so the context changes the output
    qk_norm: float = 2.0  # the same for Qwen3, whose q/k RMSNorm undoes any q/k projection scale
    bias: float = 0.5
    norm: float = 0.2  # norm weights are gain * (1 + N(0, norm)): positive, but not all equal
    correction_bias: float = 0.05  # DeepSeek-V3's router bias: shifts sigmoid scores in (0, 1) without ruling them
    # Gated DeltaNet: log A around -2 (A ~ 0.14): with softplus(a + dt_bias) of a few units a token's state decays
    # over several tokens, so the recurrent layers carry context instead of forgetting at once
    a_log: float = -2.0
    a_log_spread: float = 0.5
    dt_bias: float = 0.5
    final_norm_gain: float = 1.0  # the final norm's gains are this times the other norms'


# Gemma multiplies its embeddings by sqrt(hidden_size) on the way in and ties them to the LM head: drawn small, so
# that the residual stream is not the input token's own embedding (every position would predict its own token), with
# large final-norm gains, so that the logits still spread over several units.
GEMMA3_SCALES = InitScales(embedding=0.03, final_norm_gain=8.0)
# Gemma 4 and Muse-Glimmer attend with a softmax scale of 1 over normalized q and k (Muse-Glimmer: q times 3.87):
# q/k gains of 2 make the scores so peaked that fp32 rounding moves logprobs by 1e-4; gains around 1 keep them sharp
GEMMA4_SCALES = InitScales(embedding=0.03, final_norm_gain=8.0, qk_norm=1.0)
_GEMMA4_FAMILIES = ("gemma4", "gemma4_text", "muse_glimmer")


def family_scales(model_type: str) -> tuple[InitScales, bool]:
    """The weight scales of ``model_type``'s tiny models, and whether its norm weights apply as 1 + w (drawn minus
    one; Muse-Glimmer's plain final norm then gets a gain of about 7, positive all the same)."""
    zero_centered = model_type in HYBRID_ARCHITECTURES + GEMMA3_ARCHITECTURES + ("muse_glimmer",)
    if model_type in GEMMA3_ARCHITECTURES:
        return GEMMA3_SCALES, zero_centered
    return (GEMMA4_SCALES if model_type in _GEMMA4_FAMILIES else InitScales()), zero_centered
# towers whose LayerNorm weights are plain gains, beside zero-centred language models: Qwen's, Gemma 3's SigLIP
_ORDINARY_NORMS = (*VISION_PREFIXES, "vision_tower.")
_FINAL_NORMS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines a tiny model's files; models.yaml's `build:` mapping of a `source: tiny` entry."""

    model_type: str
    tokenizer: str
    seed: int
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    vocab_size: int | None = None  # None: the tokenizer's token count rounded up to VOCAB_ROUNDING
    config: dict[str, Any] = field(default_factory=dict)  # further config.json keys, as given (MoE, MLA, YaRN)
    vision: dict[str, Any] | None = None  # a vision tower's sizes: the released vision-language layout (Qwen3.5 / 3.6)

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> "TinyRecipe":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown tiny-model recipe keys {sorted(unknown)}")
        recipe = cls(**data)
        if recipe.tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown tiny-model tokenizer {recipe.tokenizer!r}; known: {TOKENIZERS}")
        if recipe.num_attention_heads % recipe.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if recipe.vision is not None and recipe.model_type not in VLM_LAYOUTS:
            raise ValueError(f"a vision tower needs a model_type of {sorted(VLM_LAYOUTS)}, not {recipe.model_type!r}")
        return recipe

    def dims(self, tokens: TokenizerInfo) -> DecoderDims:
        vocab = self.vocab_size or -(-tokens.num_tokens // VOCAB_ROUNDING) * VOCAB_ROUNDING
        return DecoderDims(
            vocab_size=vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
        )


def _parameter_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a checkpoint holds for the config.json in `model_dir`, as transformers saves
    them (MoE experts one by one, not stacked as it holds them in memory; persistent buffers such as DeepSeek-V3's
    router bias included).

    Instantiated on the meta device (no memory, no init); tied weights appear once, as in saved checkpoints.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    tensors = revert_weight_conversion(model, model.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per tensor, keyed by its name: a tensor's values do not depend on which others exist.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def random_tensor(name: str, shape: tuple[int, ...], seed: int, scales: InitScales,
                  zero_centered_norms: bool = False) -> torch.Tensor:
    """``zero_centered_norms`` (Qwen3-Next / 3.5): norm weights w apply as 1 + w, so the same gains are drawn minus
    one (the gated norm of the linear-attention layers is an ordinary one)."""
    values = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
    offset = 1.0 if zero_centered_norms and not name.endswith("linear_attn.norm.weight") else 0.0
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return scales.qk_norm * (1.0 + scales.norm * values) - offset
    if name in _FINAL_NORMS:
        return scales.final_norm_gain * (1.0 + scales.norm * values) - offset
    if name.endswith(("norm.weight", "layer_scalar")):  # (Gemma 4's layer output scale: a gain as well)
        return 1.0 + scales.norm * values - offset
    if name.endswith("A_log"):
        return scales.a_log + scales.a_log_spread * values
    if name.endswith("dt_bias"):
        return scales.dt_bias * values
    if name.endswith(".bias"):
        return scales.bias * values
    if name.endswith("e_score_correction_bias"):
        return scales.correction_bias * values
    if "embed_tokens" in name:
        return scales.embedding * values
    if name.startswith("lm_head"):
        return scales.lm_head * values
    gain = scales.attention_qk if name.endswith(("q_proj.weight", "k_proj.weight")) else scales.linear
    return gain / shape[-1] ** 0.5 * values


def hash_routes(name: str, shape: tuple[int, ...], seed: int, num_experts: int) -> torch.Tensor:
    """DeepSeek-V4's hash routing table ``[vocab, top_k]``: each token's fixed, distinct experts (int64)."""
    draws = torch.rand(shape[0], num_experts, generator=_generator(seed, name))
    return draws.argsort(dim=-1)[:, : shape[1]].contiguous()


def _mtp_shapes(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction layer the released checkpoints carry beside the model (transformers does not build
    it, so its tensors are added here, in the released layout). Qwen3.5 / 3.6: ``mtp.fc`` over [embedding, hidden],
    its two input norms, one full-attention decoder layer shaped as the model's (``mtp.layers.0.*``) and a norm.
    DeepSeek-V3 / V3.2: ``model.layers.{num_hidden_layers}.*``, a decoder layer shaped as the last one with
    ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` and the copies of the embedding and head (`_mtp_copies`)."""
    config = config.get("text_config") or config  # a VLM's layout: its language model's (the MTP layer is at the top)
    hidden = config.get("hidden_size")
    if config.get("mtp_num_hidden_layers"):
        attention = next(_LAYER.match(name).group(0) for name in sorted(shapes) if ".self_attn." in name)
        return {"mtp.fc.weight": (hidden, 2 * hidden),
                **{f"mtp.{name}.weight": (hidden,) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
                **_renamed_layer(shapes, attention, "mtp.layers.0.")}
    if config.get("model_type") in MTP_AFTER_LAST_LAYER and config.get("num_nextn_predict_layers"):
        last = config["num_hidden_layers"]
        prefix = f"model.layers.{last}."
        norms = {f"{prefix}{name}.weight": (hidden,) for name in ("enorm", "hnorm", "shared_head.norm")}
        copies = {name: shapes[source] for name, source in _mtp_copies(shapes, config).items()}
        return {f"{prefix}eh_proj.weight": (hidden, 2 * hidden), **norms, **copies,
                **_renamed_layer(shapes, f"model.layers.{last - 1}.", prefix)}
    return {}


_LAYER = re.compile(r"^(model\.(?:language_model\.)?layers\.\d+\.)")  # a decoder layer's prefix, either layout
_LANGUAGE_MODEL = "model.language_model."


def _seed_name(name: str) -> str:
    """The name a tensor's values are drawn under: a VLM's language model draws as the text-only layout does, so
    adding a vision tower leaves its language model's weights as they were."""
    return "model." + name[len(_LANGUAGE_MODEL):] if name.startswith(_LANGUAGE_MODEL) else name


def _renamed_layer(shapes: dict[str, tuple[int, ...]], prefix: str, new_prefix: str) -> dict[str, tuple[int, ...]]:
    return {new_prefix + name[len(prefix):]: shape for name, shape in shapes.items() if name.startswith(prefix)}


def _mtp_copies(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> dict[str, str]:
    """DeepSeek's MTP layer stores copies of the model's embedding and LM head: copy name -> the model's tensor."""
    if config.get("model_type") not in MTP_AFTER_LAST_LAYER or not config.get("num_nextn_predict_layers"):
        return {}
    prefix = f"model.layers.{config['num_hidden_layers']}."
    head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"  # tied: the embedding
    return {f"{prefix}embed_tokens.weight": "model.embed_tokens.weight", f"{prefix}shared_head.head.weight": head}


def build_tiny_model(recipe: TinyRecipe, template: str, out_dir: Path, scales: InitScales = InitScales(),
                     tokenizer_source: Path | None = None) -> None:
    """Write a complete HF model directory (configs, tokenizer, fp32 model.safetensors) into `out_dir`.
    ``tokenizer_source``: the directory of the model named in `COPIED_TOKENIZERS`, for the tokenizers copied from one."""
    if recipe.tokenizer in COPIED_TOKENIZERS:
        if tokenizer_source is None:
            raise ValueError(f"a tiny model with the {recipe.tokenizer!r} tokenizer copies it from "
                             f"{COPIED_TOKENIZERS[recipe.tokenizer]!r}: pass that model's directory as tokenizer_source")
        tokens = write_gemma3_tokenizer(out_dir, tokenizer_source)
        if recipe.vision is not None and recipe.model_type == "gemma4_text":  # Gemma 4's: its media tokens named,
            rename_gemma4_media_tokens(out_dir, load_template("gemma4"))  # and its template (the processor reads it)
        elif recipe.vision is not None:  # Gemma 3's vision-language tokenizer: the image soft token added
            add_image_tokens(out_dir)
    else:
        tokens = TOKENIZER_WRITERS[recipe.tokenizer](out_dir, template)
    write_model_configs(out_dir, recipe.model_type, recipe.dims(tokens), tokens, recipe.config, recipe.vision)
    write_random_weights(out_dir, recipe.seed, scales)


def _kimi_dense_mlp(name: str, dense: tuple[str, ...]) -> str:
    """Kimi Linear's released name of a dense layer's MLP (``model.layers.0.mlp.*``)."""
    return next((name.replace(layer, layer.replace("block_sparse_moe", "mlp")) for layer in dense if layer in name), name)


def write_random_weights(out_dir: Path, seed: int, scales: InitScales = InitScales()) -> None:
    """model.safetensors (fp32) for the config.json in ``out_dir``, every tensor drawn from ``seed``."""
    shapes = _parameter_shapes(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    copies = _mtp_copies(shapes, config)  # drawn under the name of the tensor they copy: the same values
    shapes.update(_mtp_shapes(shapes, config))
    num_experts = config.get("n_routed_experts")
    family, zero_centered = family_scales(config.get("model_type"))
    scales = family if scales == InitScales() else scales
    tensors = {
        name: hash_routes(name, shape, seed, num_experts) if name.endswith("tid2eid")
        else random_tensor(_seed_name(copies.get(name, name)), shape, seed, scales,
                           zero_centered and not name.startswith(_ORDINARY_NORMS))
        for name, shape in tqdm(sorted(shapes.items()), desc="random weights", disable=None)
    }
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # gpt-oss' released experts
        tensors = released_expert_layout(tensors)
    if config.get("model_type") == "kimi_linear":  # transformers names every MLP block_sparse_moe, the release not
        kinds = config.get("mlp_layer_types") or [  # transformers' default: one dense layer first
            "dense" if i < config.get("first_k_dense_replace", 1) else "sparse" for i in range(config["num_hidden_layers"])]
        dense = tuple(f".{i}.block_sparse_moe." for i, kind in enumerate(kinds) if kind == "dense")
        tensors = {_kimi_dense_mlp(name, dense): t for name, t in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
