"""Tiny Qwen3.5 / 3.5-MoE vision-language checkpoints written by transformers' own ``save_pretrained`` in the
released layout (``model.visual.*`` beside ``model.language_model.*``), with the real Qwen3.6 tokenizer (its
``<|image_pad|>``), a preprocessor_config.json for small images, and transformers' processor to render prompts the
way ``generate`` is fed them. Weights are drawn with the tiny models' scales so that outputs are varied and depend
on the image."""
from __future__ import annotations

import atexit
import functools
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from tests.models.checkpoints.hybrid_models import _MOE, _ROPE, _TEXT, randomized, save_with_tokenizer

VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              num_position_embeddings=64, spatial_merge_size=2, temporal_patch_size=2)
# small images: at most 16 merged patches a side
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}}


def hf_vlm(kind: str, seed: int = 19):
    import transformers as tf

    text = dict(_TEXT, vocab_size=248320, eos_token_id=248046, rope_parameters=_ROPE)
    if kind == "qwen3_5":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=dict(text, intermediate_size=128), vision_config=VISION))
    else:
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=dict(text, **_MOE), vision_config=VISION))
    return randomized(model, seed)


def write_vlm_checkpoint(kind: str, out: Path) -> Path:
    """`hf_vlm` saved with the Qwen3.6 tokenizer and the image processor's config; returns ``out``."""
    save_with_tokenizer(hf_vlm(kind), out, "qwen3.6-tiny")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


@functools.lru_cache(maxsize=None)
def vlm_checkpoint(kind: str) -> str:
    """``write_vlm_checkpoint`` once per test session and kind (the model and the server tests share it)."""
    out = Path(tempfile.mkdtemp(prefix=f"kvserve-{kind}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return str(write_vlm_checkpoint(kind, out))


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB picture, PNG-encoded."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_only_processor(processor_class, **parts):
    """transformers' ``processor_class`` for images and text alone, built with the ``parts`` that are None (a
    video processor needs torchvision, which is not installed; an audio feature extractor reads no image) left
    out: the class check is skipped for those missing parts only."""
    import transformers as tf

    check = tf.ProcessorMixin.check_argument_for_proper_class

    def check_present(self, name, arg):
        return None if arg is None and name in parts else check(self, name, arg)

    tf.ProcessorMixin.check_argument_for_proper_class = check_present
    try:
        return processor_class(**parts)
    finally:
        tf.ProcessorMixin.check_argument_for_proper_class = check


@functools.lru_cache(maxsize=1)
def hf_processor(path: str):
    """transformers' Qwen3-VL processor for images alone (`image_only_processor`)."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    return image_only_processor(tf.Qwen3VLProcessor, image_processor=tf.AutoImageProcessor.from_pretrained(path),
                                tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template)


@functools.lru_cache(maxsize=1)
def hf_vlm_model(path: str):
    import transformers as tf

    return tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def user_turn(text: str, num_images: int) -> list[dict]:
    """One user message: the images first, then the text (as a pasted screenshot reads)."""
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


def hf_inputs(path: str, messages: list[dict], images: list[bytes]) -> tuple[str, dict]:
    """The prompt text (the chat template, one placeholder per image) and the processor's model inputs."""
    return processor_inputs(hf_processor(path), messages, images)


def processor_inputs(processor, messages: list[dict], images: list[bytes], **kwargs) -> tuple[str, dict]:
    """``processor``'s chat template's prompt text for ``messages`` and its model inputs with ``images``."""
    from PIL import Image

    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images] or None
    return text, processor(text=[text], images=pictures, return_tensors="pt", **kwargs)


def hf_generate(path: str, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_vlm_model(path).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_next_logprobs(path: str, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_vlm_model(path)(**inputs).logits[0, -1].float(), -1)
