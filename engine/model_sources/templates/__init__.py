"""Chat templates stored in the repo, so that building a model never reads anything outside the installed package.

Each `<family>.jinja` is a verbatim copy of that family's official template (the `chat_template` of its
tokenizer_config.json): qwen3 = Qwen/Qwen3-0.6B, qwen3-coder = Qwen/Qwen3-Coder-30B-A3B-Instruct (Aug 2025),
qwen3.6 = Qwen/Qwen3.6-27B, deepseek-v3.1 = deepseek-ai/DeepSeek-V3.1,
glm-4.7 = zai-org/GLM-4.7-Flash (its chat_template.jinja), gemma3 = google/gemma-3-*-it (as transformers'
convert_gemma3_weights.py writes it into the released tokenizers),
minimax-m2 = MiniMaxAI/MiniMax-M2 (its chat_template.jinja), kimi-k2 = moonshotai/Kimi-K2-Thinking (llama.cpp's copy
of its chat_template.jinja, tests/rendering/make_goldens.py), kimi-k3 = llama.cpp's Jinja port of moonshotai/Kimi-K3's
encoding_k3.py (the release has no template, tests/rendering/make_goldens.py).
"""
from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent


def stored_template_families() -> list[str]:
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


# Families whose models ship a Python encoder instead of a chat template (DeepSeek-V3.2 / V4): kvserve renders them
# natively (server/rendering/native/deepseek_dsml.py) and writes no chat_template for them.
ENCODER_FAMILIES = ("deepseek-v3.2", "deepseek-v4")
# A checkpoint of these architectures is rendered by that family even without a chat template.
FAMILY_OF_MODEL_TYPE = {"deepseek_v32": "deepseek-v3.2", "deepseek_v4": "deepseek-v4"}


def load_template(family: str) -> str:
    path = TEMPLATE_DIR / f"{family}.jinja"
    if not path.is_file():
        raise ValueError(f"no stored chat template for {family!r}; stored: {stored_template_families()}")
    return path.read_text(encoding="utf-8")
