"""The offline API: ``LLM(model, **engine_config).generate(prompts, params)``.

During `generate` on an accelerator the engine runs in its own thread (`EngineLoop`, as under the server) and the
calling thread turns its token outputs into text with an `OutputProcessor`, so detokenization and stop strings never
hold up a step; on a CPU, whose cores are the device, the calling thread steps the same loop and makes the text in
turn. Between calls no thread runs, and the engine can be inspected directly.
"""
from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.core.loop import EngineLoop
from engine.errors import EngineDeadError, RequestRejected
from engine.kv.blocks import CacheStats
from engine.multimodal import ImagePrompt, expand_placeholders
from engine.core.engine import LLMEngine
from engine.text.output_processor import CompletionOutput, OutputProcessor
from engine.outputs import RequestTimings, SchedulerStats, SequenceOutput, StepOutputs
from engine.requests import EngineRequest
from engine.retention import Retention
from engine.sampling_params import SamplingParams

PromptInput = str | list[int] | ImagePrompt  # text (tokenized without special tokens), token ids, ids with images


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

    def add(self, out: SequenceOutput) -> None:
        self.outputs[out.index].add(out)
        if out.index == 0:  # siblings (n > 1) report their own admission; the prompt's is the leader's
            self.num_cached_tokens = out.num_cached_tokens
        if out.finished and self.metrics is None:
            self.metrics = out.timings


class TextCollector:
    """Turns a generate call's token outputs into its results (text, stop strings), wherever the engine runs (the
    sink `kvserve bench step` times each step's outputs through, too)."""

    def __init__(self, loop: EngineLoop, processor: OutputProcessor, results: dict[str, RequestOutput],
                 bar: tqdm) -> None:
        self.loop, self.processor, self.results, self.bar = loop, processor, results, bar
        self.remaining = bar.total
        self.error: BaseException | None = None

    def put(self, item: StepOutputs | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
            return
        delivered, stopped = self.processor.process(list(item))
        for request_id, index in stopped:
            self.loop.abort(request_id, index)
        for out in delivered:
            self.results[out.request_id].add(out)
            if out.finished:
                self.remaining -= 1
                self.bar.update(1)

    def done(self) -> bool:
        return self.remaining == 0 or self.error is not None


class LLM:
    """An engine plus its tokenizer, for batch generation in-process."""

    def __init__(self, model: str | None = None, clock: Callable[[], float] | None = None, tokenizer=None,
                 **engine_config) -> None:
        """``tokenizer``: a loaded tokenizer of this model to use instead of loading the directory's again (several
        engines of one model: a Qwen tokenizer takes seconds to load; without one, `load_tokenizer` copies this
        process's earlier load of the same files, if any)."""
        from engine.registry import default_model_name, get_model_spec, model_identity, resolve_model

        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_config) - known
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; valid: {sorted(known)}")
        name = model or default_model_name()
        spec = get_model_spec(name)
        self.model_name = spec.name
        model_dir = resolve_model(name)
        self.engine = LLMEngine(model_dir, EngineConfig(**engine_config), model_id=model_identity(spec, model_dir),
                                tokenizer=tokenizer, clock=clock or time.monotonic)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop what outlives a `generate` call: tensor-parallel workers, the KV event publisher, the disk tier's
        writer (``with LLM(...) as llm:`` does it on leaving)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def cache_stats(self) -> CacheStats:
        """Prefix-cache counters: queries and hits in tokens (preempted re-admissions apart), evictions."""
        return self.engine.cache_stats

    @property
    def stats(self) -> SchedulerStats:
        """Every engine counter and gauge (the numbers /metrics shows)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds, in every KV tier."""
        self.engine.reset_prefix_cache()

    def encode(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, ImagePrompt):
            return list(prompt.token_ids)
        return list(prompt)

    def image_prompt(self, prompt: str | list[int], images: Sequence[bytes]) -> ImagePrompt:
        """A prompt with one image placeholder per image (``<|image_pad|>`` for Qwen3.5 / 3.6, ``<start_of_image>``
        for Gemma 3, as the chat templates render them) and the encoded images (PNG, JPEG, ...), preprocessed by the
        model's own image processor; each placeholder becomes the image's run of tokens. `RequestRejected` for an
        unreadable image or a model without a vision tower."""
        image_token_id = self.engine.image_token_id
        if image_token_id is None:
            raise RequestRejected("this model reads text only (no vision tower is loaded)")
        preprocessor = self.engine.image_preprocessor
        inputs = [preprocessor.preprocess(data) for data in images]
        if isinstance(prompt, str):  # Gemma 3: <start_of_image> stands for the text the processor puts there
            prompt = preprocessor.prompt_text(prompt)
        try:
            return expand_placeholders(self.encode(prompt), inputs, image_token_id)
        except ValueError as e:
            raise RequestRejected(str(e)) from None

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None | Sequence[str | None] = None,
        use_tqdm: bool = False,
        retention: Retention | None | Sequence[Retention | None] = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion, batched by the scheduler; results come back in prompt order.
        ``retention``: breakpoint pins and a hold after the request ends (engine/retention.py), per prompt or for all.

        Every prompt is validated before any is queued, so a bad one raises `RequestRejected` (a ValueError) and
        leaves the engine clean.
        """
        if isinstance(prompts, (str, ImagePrompt)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.encode(p) for p in prompts]
        params_list = _broadcast(params or SamplingParams(), len(token_lists), "params")
        salts = _broadcast(cache_salt, len(token_lists), "cache_salt")
        retentions = _broadcast(retention, len(token_lists), "retention")
        # Prepared here, on the caller's thread (validated, hashed), all before any is queued.
        images = [p.images if isinstance(p, ImagePrompt) else () for p in prompts]
        requests = [self.engine.prepare(EngineRequest(f"gen-{next(self._ids)}", ids, p, salt, kept, images=pics))
                    for ids, p, salt, kept, pics in zip(token_lists, params_list, salts, retentions, images)]
        processor = OutputProcessor(self.tokenizer, final_text_only=True)  # results are read once they finished
        results: dict[str, RequestOutput] = {}
        for r in requests:
            results[r.request_id] = RequestOutput(r.request_id, r.prompt_token_ids,
                                                  [CompletionOutput(i) for i in range(r.params.n)])
            processor.add_request(r.request_id, r.prompt_token_ids, r.params)
        loop = EngineLoop(self.engine)
        with tqdm(total=sum(p.n for p in params_list), desc="Generating", unit="seq", disable=not use_tqdm) as bar:
            collector = TextCollector(loop, processor, results, bar)
            if self._engine_thread_pays():
                self._run_threaded(loop, requests, collector)
            else:
                loop.run_here(requests, collector, until=collector.done)
        if collector.error is not None:
            raise EngineDeadError(str(collector.error)) from collector.error
        return list(results.values())

    def _engine_thread_pays(self) -> bool:
        """Whether the engine gets a thread of its own, so that making text overlaps the steps: on an accelerator.
        On a CPU the device is the host's cores, and a second busy Python thread only takes the GIL from the steps
        (measured: 10% slower offline throughput), so there the calling thread does both in turn (`run_here`)."""
        return self.engine.runner.device.type != "cpu"

    @staticmethod
    def _run_threaded(loop: EngineLoop, requests: list[EngineRequest], collector: TextCollector) -> None:
        """The engine steps in its own thread while this one makes the text."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()  # an OutputSink as it is: put never blocks
        loop.start()
        try:
            loop.submit(requests, outputs).result()
            while not collector.done():
                collector.put(outputs.get())
        finally:
            loop.shutdown()  # an interrupted call (or a dead engine) leaves nothing running: the loop aborts it


def _broadcast(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (str, SamplingParams, Retention)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value
