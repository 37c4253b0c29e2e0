"""The offline API: ``LLM(model, **engine_config).generate(prompts, params)``."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.kv_cache import CacheStats
from engine.llm_engine import LLMEngine
from engine.request import RequestTimings
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    metrics: RequestTimings | None = None

    # The first (for n == 1, the only) completion, for convenience.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """An engine plus its tokenizer, for batch generation in-process."""

    def __init__(self, model: str | None = None, **engine_config) -> None:
        from engine.registry import default_model_name, get_model_spec, resolve_model

        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_config) - known
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; valid: {sorted(known)}")
        name = model or default_model_name()
        spec = get_model_spec(name)
        self.model_name = spec.name
        model_dir = resolve_model(name)
        model_id = str(model_dir) if spec.source == "local" else spec.name  # what block 0's hash is salted with
        self.engine = LLMEngine(model_dir, EngineConfig(**engine_config), model_id=model_id)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def cache_stats(self) -> CacheStats:
        return self.engine.kv.stats

    def reset_prefix_cache(self) -> None:
        self.engine.kv.reset_prefix_cache()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None | Sequence[str | None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run the prompts to completion, batched by the scheduler; results come back in prompt order.

        Every prompt is validated before any is queued, so a bad one raises ValueError and leaves the engine clean.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.encode(p) for p in prompts]
        params_list = _broadcast(params or SamplingParams(), len(token_lists), "params")
        salts = _broadcast(cache_salt, len(token_lists), "cache_salt")
        for ids, p in zip(token_lists, params_list):
            self.engine.validate(ids, p)
        results: dict[str, RequestOutput] = {}
        for ids, p, salt in zip(token_lists, params_list, salts):
            rid = f"gen-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, salt)
            results[rid] = RequestOutput(rid, ids, [CompletionOutput(i) for i in range(p.n)])
        total = sum(p.n for p in params_list)
        with tqdm(total=total, desc="Generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results[out.request_id]
                    completion = result.outputs[out.index]
                    completion.token_ids.extend(out.new_token_ids)
                    completion.text += out.new_text
                    completion.logprobs.extend(out.new_logprobs)
                    result.num_cached_tokens = out.num_cached_tokens if out.index == 0 else result.num_cached_tokens
                    if out.finished:
                        completion.finish_reason = out.finish_reason
                        result.metrics = result.metrics or out.timings
                        bar.update(1)
        return list(results.values())


def _broadcast(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (str, SamplingParams)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value
