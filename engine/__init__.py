"""kvserve's engine: token ids in, token ids out. ``from engine import LLM, SamplingParams``.

The names below load on first use, so importing a torch-free module (``engine.sched.scheduler``) loads no torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "CompletionOutput": "engine.text.output_processor",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM, RequestOutput
    from engine.text.output_processor import CompletionOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
