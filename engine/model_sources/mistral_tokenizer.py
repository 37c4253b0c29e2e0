"""Devstral Small 2's tokenizer, tekken v13, built offline for transformers / tokenizers: the tekken ranks that the
`mistral-common` wheel ships (``data/tekken_240911.json``: 150,000 byte-level BPE ranks of which the first 130,072
are used, behind 1,000 control tokens: 131,072 ids) with the v13 control-token layout (the 20 classic ones, ``[ARGS]``
32, ``[CALL_ID]`` 33, ``[THINK]`` / ``[/THINK]`` 34 / 35, the rest ``<SPECIAL_n>``) and tekken's pre-tokenizer
pattern. Written as an HF ``tokenizer.json`` (merges read back from the ranks by transformers' own
``TikTokenConverter``, every id shifted past the control tokens); nothing is downloaded. The Devstral family renders
natively (server/rendering/native/devstral.py): no Jinja template is stored.
"""
from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

from .hf_layout import TokenizerInfo, write_json

CLASSIC = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
           "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")
V13 = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}
NUM_SPECIAL = 1000
NUM_TOKENS = 131_072
BOS, EOS, PAD = 1, 2, 11


def control_tokens() -> list[str]:
    """The 1,000 control tokens by id."""
    return [CLASSIC[i] if i < len(CLASSIC) else V13.get(i, f"<SPECIAL_{i}>") for i in range(NUM_SPECIAL)]


def tekken_file() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `mistral-common` package is not installed (pip install mistral-common): it holds "
                           "the tekken vocabulary")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "tekken_240911.json"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the mistral-common package")
    return path


def write_tekken_tokenizer(out_dir: Path, template: str = "devstral") -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json of tekken v13 in ``out_dir`` (``template``: the registry's family)."""
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = json.loads(tekken_file().read_text())
    used = NUM_TOKENS - NUM_SPECIAL
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / "tekken.tiktoken"
        # tiktoken's file format, every rank shifted past the control tokens (merges keep their order)
        ranks.write_text("".join(f"{t['token_bytes']} {t['rank'] + NUM_SPECIAL}\n" for t in data["vocab"][:used]))
        converted = json.loads(TikTokenConverter(vocab_file=str(ranks), pattern=data["config"]["pattern"])
                               .converted().to_str())
    vocab = converted["model"]["vocab"]
    specials = control_tokens()
    assert min(vocab.values()) == NUM_SPECIAL and len(vocab) == used
    vocab.update({token: i for i, token in enumerate(specials)})
    converted["added_tokens"] = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                                  "normalized": False, "special": True} for i, token in enumerate(specials)]
    tokenizer = Tokenizer.from_str(json.dumps(converted))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 393216,
              "clean_up_tokenization_spaces": False, "add_bos_token": False}
    write_json(out_dir / "tokenizer_config.json", config)
    return TokenizerInfo(num_tokens=NUM_TOKENS, bos_token_id=BOS, eos_token_ids=(EOS,), pad_token_id=PAD)

