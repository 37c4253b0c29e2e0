"""Chat templates stored in the repo, so that building a model never reads anything outside the installed package.

Each `<family>.jinja` is a verbatim copy of that family's official template (the `chat_template` of its
tokenizer_config.json): qwen3 = Qwen/Qwen3-0.6B, qwen3-coder = Qwen/Qwen3-Coder-30B-A3B-Instruct (Aug 2025),
deepseek-v3.1 = deepseek-ai/DeepSeek-V3.1.
"""
from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent


def stored_template_families() -> list[str]:
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def load_template(family: str) -> str:
    path = TEMPLATE_DIR / f"{family}.jinja"
    if not path.is_file():
        raise ValueError(f"no stored chat template for {family!r}; stored: {stored_template_families()}")
    return path.read_text(encoding="utf-8")
