"""A tiny Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration: a SigLIP tower, the multimodal
projector and the language model) written by transformers' own ``save_pretrained`` in the released layout, with
the real Gemma 3 tokenizer (the gemma3-270m GGUF's, plus ``<image_soft_token>`` at 262144 as the released 4B-27B
tokenizers add it), Gemma 3's official chat template, and a preprocessor_config.json for 64 x 64 images
(16 soft tokens each); transformers' Gemma3Processor renders prompts the way ``generate`` is fed them."""
from __future__ import annotations

import functools
import io
import json
import shutil
from pathlib import Path

import torch

from engine.model_sources.gemma_tokenizer import add_image_tokens
from engine.registry import resolve_model
from engine.model_sources.tiny import GEMMA3_SCALES, random_tensor

TEMPLATE = Path(__file__).parents[2] / "rendering" / "templates" / "google-gemma-3-it.jinja"
VOCAB = 262208  # the released 4B-27B text vocabulary: 262,144 pieces, the image soft token and spare rows
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=4096,
            sliding_window=12, eos_token_id=1, pad_token_id=0, bos_token_id=2)
# 64 x 64 pixels in 8 x 8 patches, pooled 2 x 2 into 16 soft tokens
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
              patch_size=8, vision_use_head=False)
PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 64, "width": 64},
                "do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
                "do_pan_and_scan": False}


def hf_gemma3_vlm(seed: int = 29):
    """The transformers model with the tiny Gemma models' weight scales."""
    import transformers as tf

    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=tf.Gemma3TextConfig(**TEXT), vision_config=tf.SiglipVisionConfig(**VISION),
        mm_tokens_per_image=16))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, GEMMA3_SCALES,
                                      zero_centered_norms="vision_tower" not in name))
    return model.eval()


def write_gemma3_tokenizer(out: Path) -> None:
    """gemma3-tiny's tokenizer with the image soft token added (as the registry's gemma3-vision-tiny has it) and
    the chat template in its config (as the released -it tokenizers hold it)."""
    source = resolve_model("gemma3-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(source / name, out / name)
    add_image_tokens(out, TEMPLATE.read_text())


def write_gemma3_vlm(out: Path) -> Path:
    hf_gemma3_vlm().save_pretrained(out)
    write_gemma3_tokenizer(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


@functools.lru_cache(maxsize=1)
def gemma3_processor(path: str):
    import transformers as tf

    return tf.Gemma3Processor(image_processor=tf.AutoImageProcessor.from_pretrained(path),
                              tokenizer=tf.AutoTokenizer.from_pretrained(path), image_seq_length=16,
                              chat_template=TEMPLATE.read_text())


@functools.lru_cache(maxsize=1)
def gemma3_hf_model(path: str):
    import transformers as tf

    return tf.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def gemma3_inputs(path: str, messages: list[dict], images: list[bytes]) -> tuple[str, dict]:
    """The template's prompt text (``<start_of_image>`` per image) and the processor's model inputs."""
    from PIL import Image

    processor = gemma3_processor(path)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images] or None
    return text, processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)


def gemma3_generate(path: str, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = gemma3_hf_model(path).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
