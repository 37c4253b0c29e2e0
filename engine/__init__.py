"""kvserve's engine: token ids in, token ids out. ``from engine import LLM, SamplingParams``."""
from engine.config import EngineConfig
from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
