"""What Gemma 4 and Muse-Glimmer's config.json say beyond the Llama decoder's keys, read into `ModelConfig` fields.

Both mix sliding-window layers with full-attention ones as Gemma 3 does (`engine.config.SlidingWindowConfig`), and
their full layers differ in shape from the window layers:
- Gemma 4 (``gemma4``: Gemma4ForConditionalGeneration, the released checkpoints; ``gemma4_text``: its language model
  alone): the global layers have heads of ``global_head_dim`` (512), ``num_global_key_value_heads`` KV heads whose
  values come from ``k_proj`` (``attention_k_eq_v``: no ``v_proj``), and a "proportional" RoPE that turns only the
  first quarter of the frequencies; values are RMS-normalized without a gain, the softmax scale is 1, norms are
  plain ``w`` gains, each layer's output is scaled by a learned ``layer_scalar``. E2B / E4B add per-layer inputs
  (``hidden_size_per_layer_input`` wide, from a ``vocab_size_per_layer_input``-row table; transformers' defaults
  256 and 262,144 where the keys are left out) and ``num_kv_shared_layers`` last layers that reuse the K / V of an
  earlier one (``use_double_wide_mlp``: their MLPs twice as wide).
- Muse-Glimmer (``muse_glimmer``: MuseGlimmerForConditionalGeneration): every fourth layer, counted back from the
  last, attends fully with no RoPE (``layer_rope_theta`` 0); q and k are RMS-normalized without a gain (q times
  ``qk_scale_factor``), the attention output is gated by ``sigmoid(gate_proj(x))``, embeddings are RMS-normalized,
  the logits scaled by ``output_multiplier`` before the tanh softcap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Gemma 4 variants kvserve does not run yet, by config key: the bidirectional (embedding) variant ("all"; "vision",
# an image's tokens seeing each other in the window layers, is the VLMs' and runs: engine/models/vision/)
_GEMMA4_REFUSED = {"use_bidirectional_attention": "bidirectional attention"}
_GEMMA4_ALLOWED = {"use_bidirectional_attention": "vision"}
_GEMMA4_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class Gemma4Experts:
    """Gemma 4 26B-A4B's MoE block, in every layer beside the dense MLP: ``top_k`` of ``num_experts`` experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert


@dataclass(frozen=True)
class Gemma4PerLayerInputs:
    """E2B / E4B's per-layer embeddings (`engine.models.layers.per_layer_embeddings`): a ``size``-wide input for
    every layer from a ``[vocab_size, num_layers * size]`` table and a projection of the embeddings."""

    vocab_size: int
    size: int
    pad_token_id: int = 0  # whose table row an image's tokens take


@dataclass(frozen=True)
class Gemma4Attention:
    """Each layer's attention shape (the global layers' differ from the window layers'), the MoE block, and E2B /
    E4B's per-layer inputs and shared KV layers."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    k_eq_v: bool  # the global layers' values are k_proj's output (normalized apart from the keys): no v_proj
    experts: Gemma4Experts | None = None
    per_layer_inputs: Gemma4PerLayerInputs | None = None
    # per layer, the layer whose K / V it attends over: itself, or (the last ``num_kv_shared_layers``) the last
    # unshared layer of its kind, whose pages it reads; it keeps none of its own
    kv_sources: tuple[int, ...] = ()
    double_wide_mlp: bool = False  # the shared layers' MLPs are twice as wide (E2B)

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def num_kv_layers(self) -> int:
        """The layers that keep K / V (the first ones: the shared layers come last)."""
        return sum(self.kv_source(i) == i for i in range(len(self.head_dims)))

    @property
    def global_head_dim(self) -> int:
        return self.head_dims[-1]  # the last layer is always global


@dataclass(frozen=True)
class MuseGlimmerAttention:
    """Muse-Glimmer's attention and output scalars, and which layers have no RoPE."""

    qk_scale_factor: float
    output_multiplier: float
    post_norm_eps: float  # of the sandwich norms after attention and the MLP
    nope_layers: tuple[int, ...]


def gemma4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Gemma 4 text config (a VLM's text_config already merged in), after refusing what
    kvserve does not run."""
    for key, what in _GEMMA4_REFUSED.items():
        if cfg.get(key) and cfg[key] != _GEMMA4_ALLOWED.get(key):
            raise ValueError(f"Gemma 4 with {what} ({key}) is not supported yet; the 31B layout is")
    rope = cfg.get("rope_parameters") or _GEMMA4_DEFAULT_ROPE
    full, local = dict(rope["full_attention"]), dict(rope["sliding_attention"])
    num_layers = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])
    types[-1] = "full_attention"  # as transformers: the last layer is always global
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    head_dims, kv_heads = _gemma4_layer_shapes(cfg, types, k_eq_v)
    return {
        "rope_theta": float(full.pop("rope_theta", 1_000_000.0)),
        "rope_scaling": {} if full.get("rope_type", "default") == "default" else full,
        "partial_rotary_factor": 1.0,  # proportional RoPE spans the whole head (its scaling dict says how much turns)
        "sliding_window": {"window": cfg.get("sliding_window") or 512, "layer_types": tuple(types),
                           "rope_theta": float(local.get("rope_theta", 10_000.0))},
        "gemma4": Gemma4Attention(head_dims, kv_heads, k_eq_v, Gemma4Experts(
            cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"]) if cfg.get("enable_moe_block")
            else None, _gemma4_per_layer_inputs(cfg), _gemma4_kv_sources(cfg, types),
            bool(cfg.get("use_double_wide_mlp"))),
        "qk_norm": True,
        "zero_centered_norms": False,
        "query_pre_attn_scalar": 1.0,  # the softmax scale is 1: q and k are RMS-normalized
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }


def _gemma4_per_layer_inputs(cfg: dict[str, Any]) -> Gemma4PerLayerInputs | None:
    """transformers' defaults (256 wide, a 262,144-token table) where the config leaves the keys out; 0: none."""
    size = cfg.get("hidden_size_per_layer_input", 256)
    return (Gemma4PerLayerInputs(cfg.get("vocab_size_per_layer_input", 262_144), size, cfg.get("pad_token_id") or 0)
            if size else None)


def _gemma4_kv_sources(cfg: dict[str, Any], types: list[str]) -> tuple[int, ...]:
    """Each layer's K / V source, as transformers' ``kv_sharing_modes`` reads ``num_kv_shared_layers``: the last
    ``num_kv_shared_layers`` layers reuse the last earlier layer of their kind."""
    first_shared = len(types) - (cfg.get("num_kv_shared_layers") or 0)
    last_of = {kind: i for i, kind in enumerate(types[:first_shared])}
    if first_shared < 1 or set(types) - set(last_of):
        raise ValueError(f"Gemma 4 with {cfg.get('num_kv_shared_layers')} shared KV layers of "
                         f"{len(types)} leaves a kind of layer ({sorted(set(types) - set(last_of))}) without an "
                         "unshared layer to read K / V from")
    return tuple(i if i < first_shared else last_of[kind] for i, kind in enumerate(types))


def _gemma4_layer_shapes(cfg: dict[str, Any], types: list[str],
                         k_eq_v: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's ``(head_dim, KV heads)``: the released configs give the global layers' as ``global_head_dim`` and
    ``num_global_key_value_heads`` (the latter only with ``attention_k_eq_v``, as transformers reads it);
    transformers 5.24 writes them per layer (``per_layer_config``, keyed by layer index)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": cfg.get("global_head_dim") or 512}
        if k_eq_v and cfg.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: full for i, kind in enumerate(types) if kind == "full_attention"}
    overrides = {int(key): value for key, value in overrides.items()}  # (saved as "04", "09", ... past 9 layers)
    layers = [dict(overrides.get(i) or {}) for i in range(len(types))]
    head_dims = tuple(layer.get("head_dim", head_dim) for layer in layers)
    if len({d for d, kind in zip(head_dims, types) if kind == "full_attention"}) > 1:
        raise ValueError("Gemma 4 global layers of different head sizes are not supported (their RoPE is one)")
    return head_dims, tuple(layer.get("num_key_value_heads", kv_heads) for layer in layers)


def muse_glimmer_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Muse-Glimmer text config. Its RoPE is the same in every layer that has one
    (transformers reads ``layer_rope_theta`` only as zero or not)."""
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (num_layers - 1 - i) % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    thetas = cfg.get("layer_rope_theta") or [0 if (num_layers - 1 - i) % 4 == 0 else 1 for i in range(num_layers)]
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 500_000.0)))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Muse-Glimmer with {rope['rope_type']!r} RoPE is not supported (default is)")
    return {
        "rope_theta": theta,
        "rope_scaling": {},
        "sliding_window": {"window": cfg.get("sliding_window") or 2048, "layer_types": tuple(types),
                           "rope_theta": theta},
        "muse_glimmer": MuseGlimmerAttention(
            qk_scale_factor=float(cfg.get("qk_scale_factor", 3.87)),
            output_multiplier=float(cfg.get("output_multiplier", 0.19611613513818404)),
            post_norm_eps=float(cfg.get("post_norm_eps", 1e-8)),
            nope_layers=tuple(i for i, t in enumerate(thetas[:num_layers]) if not t)),
        "qk_norm": False,  # its q/k norm has no weight (`engine.models.muse_glimmer`)
        "zero_centered_norms": True,  # the decoder layers' norms; the final norm is a plain one
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 20.0),
        "hidden_act": cfg.get("hidden_activation") or "silu",
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
    }


FAMILY_FIELDS = {"gemma4": gemma4_fields, "gemma4_text": gemma4_fields, "muse_glimmer": muse_glimmer_fields}
