"""A tiny Gemma 4 vision-language checkpoint (Gemma4ForConditionalGeneration: the vision tower, the multimodal
embedder and gemma4-tiny's kind of language model: window layers and wider global ones with K = V, one global
layer in the middle so that what it does with an image's tokens reaches the output, the logit softcap,
``use_bidirectional_attention: "vision"``) written by transformers' own ``save_pretrained`` in the
released layout, with Gemma 3's real tokenizer carrying Gemma 4's media tokens at their ids, Gemma 4's official chat
template, and a preprocessor_config.json for 4 x 4-pixel patches pooled 3 x 3 into at most 70 soft tokens an image
(the released: 16 x 16 patches, 280 tokens); transformers' Gemma4Processor renders prompts the way ``generate`` is
fed them."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch

from engine.model_sources.gemma_tokenizer import rename_gemma4_media_tokens
from engine.model_sources.tiny import GEMMA4_SCALES, random_tensor
from engine.registry import resolve_model
from tests.models.checkpoints.vision_models import image_only_processor, processor_inputs

TEMPLATE = Path(__file__).parents[2] / "rendering" / "templates" / "google-gemma-4-31B-it.jinja"
TEXT = dict(vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
            attention_k_eq_v=True, max_position_embeddings=4096, sliding_window=12, final_logit_softcapping=30.0,
            layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
            use_bidirectional_attention="vision", hidden_size_per_layer_input=0, eos_token_id=1, pad_token_id=0,
            bos_token_id=2)
# two layers of 2 heads; the soft tokens standardized (std_bias / std_scale), as the released towers may be
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64, standardize=True)
# E2B / E4B's language model: per-layer inputs, the last two layers attending over earlier layers' K / V; an image's
# tokens attending causally (use_bidirectional_attention unset), so a prefill chunk may end inside an image
PER_LAYER = dict(hidden_size_per_layer_input=16, num_kv_shared_layers=2, use_bidirectional_attention=None)
PREPROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "max_soft_tokens": 70,
                "pooling_kernel_size": 3, "do_resize": True, "resample": 3, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": True}


def hf_gemma4_vlm(seed: int = 31, **text):
    """The transformers model with the tiny Gemma 4 models' weight scales (and drawn standardization buffers);
    ``text``: changes to the language model's config."""
    import transformers as tf

    model = tf.Gemma4ForConditionalGeneration(tf.Gemma4Config(
        text_config=tf.Gemma4TextConfig(**{**TEXT, **text}), vision_config=tf.Gemma4VisionConfig(**VISION), audio_config=None))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, GEMMA4_SCALES))
        tower = model.model.vision_tower
        tower.std_bias.copy_(random_tensor("std_bias", tuple(tower.std_bias.shape), seed, GEMMA4_SCALES))
        tower.std_scale.copy_(1.0 + 0.2 * random_tensor("std_scale", tuple(tower.std_scale.shape), seed,
                                                        GEMMA4_SCALES))
    return model.eval()


def write_gemma4_tokenizer(out: Path) -> None:
    """gemma3-tiny's tokenizer with Gemma 4's media tokens and Gemma 4's chat template in its config."""
    source = resolve_model("gemma3-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(source / name, out / name)
    rename_gemma4_media_tokens(out, TEMPLATE.read_text())


def write_gemma4_vlm(out: Path, **text) -> Path:
    hf_gemma4_vlm(**text).save_pretrained(out)
    write_gemma4_tokenizer(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


@functools.lru_cache(maxsize=2)
def gemma4_processor(path: str):
    """transformers' Gemma4Processor for images and text alone (no audio feature extractor, no video processor)."""
    import transformers as tf

    return image_only_processor(tf.Gemma4Processor, feature_extractor=None, video_processor=None,
                                image_processor=tf.AutoImageProcessor.from_pretrained(path),
                                tokenizer=tf.AutoTokenizer.from_pretrained(path), chat_template=TEMPLATE.read_text())


def gemma4_inputs(path: str, messages: list[dict], images: list[bytes]) -> tuple[str, dict]:
    """The template's prompt text (``<|image|>`` per image) and the processor's model inputs (transformers'
    Gemma4ForConditionalGeneration reads them through `hf_generate` and `hf_next_logprobs`)."""
    return processor_inputs(gemma4_processor(path), messages, images, add_special_tokens=False)
