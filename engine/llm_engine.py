"""The engine core: a scheduler (which alone owns the KV manager and the queues) and a model runner; `step()`
advances every running sequence once and returns token-level `SequenceOutput`s.

Text (detokenization, stop strings) is not made here: an `OutputProcessor` does it off the engine thread. With
async scheduling (`EngineConfig.async_scheduling`), `step()` schedules and launches step N+1 before it collects step
N's sampled tokens, so the host's work for one step overlaps the device's work for the previous one; the tokens are
the same either way. A grammar-constrained sequence's next mask needs its last token, so a step that sampled one is
collected before the next is scheduled. Single-threaded by design: one thread drives it (see engine/engine_loop.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.errors import KVCacheTooSmallError, PromptTooLongError, RequestRejected
from engine.model_runner import ModelRunner, StepHandle
from engine.outputs import SchedulerOutput, SchedulerStats, SequenceOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.structured_output import GrammarEnd, StructuredOutputs
from engine.structured_output import GrammarEnd, StructuredOutputs


def _eos_ids(model_dir: Path, model_cfg: ModelConfig, tokenizer) -> set[int]:
    ids = set(model_cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, model_dir: Path, cfg: EngineConfig, model_id: str | None = None, tokenizer=None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = min(cfg.max_model_len or self.model_cfg.max_position_embeddings,
                                 self.model_cfg.max_position_embeddings)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(self.model_dir))
        self.eos_token_ids = _eos_ids(self.model_dir, self.model_cfg, self.tokenizer)
        self.runner = ModelRunner(self.model_dir, self.model_cfg, cfg, self.max_model_len)
        self.scheduler = Scheduler(cfg, self.runner.num_blocks, model_id or str(self.model_dir), self.max_model_len,
                                   self.eos_token_ids)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids,
                                                    self.runner.device)
        self._in_flight: StepHandle | None = None  # async scheduling: the launched step whose tokens are not back
        self._in_flight_constrained = False  # ... and whether it sampled for a grammar-constrained sequence

    # ---- requests ----------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestRejected` for a request that could never run, before it takes any state."""
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            over = len(prompt_token_ids) - self.max_model_len + 1
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}, so it is "
                f"{over} token(s) too long (leaving room for one generated token)"
            )
        blocks = self.scheduler.blocks_needed(len(prompt_token_ids) + 1)
        if blocks > self.scheduler.num_blocks:
            raise KVCacheTooSmallError(
                f"the prompt needs {blocks} KV blocks but the cache has {self.scheduler.num_blocks}; "
                "give the engine more KV memory (num_kv_blocks / kv_cache_memory_gb)"
            )
        if params.structured_output is not None:
            try:
                self.structured_outputs.compile(params.structured_output)  # cached: a server compiled it already
            except ValueError as exc:
                raise RequestRejected(str(exc)) from None
        if params.structured_output is not None:
            self.structured_outputs.compile(params.structured_output)  # cached: a server compiled it already

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        if request_id in self.scheduler.groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        self.scheduler.add_request(request_id, prompt_token_ids, params, cache_salt)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Finish every sequence of the request (or only sequence ``index``) now; its blocks are free for the next
        step."""
        self.scheduler.abort(request_id, index)
        self.structured_outputs.retain(self.scheduler.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        return self.scheduler.num_cached_tokens(token_ids, cache_salt)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        if self._in_flight is not None and self._in_flight_constrained:  # its grammars need its tokens first
            self._collect(self._in_flight)
            self._in_flight = None
        sched = self.scheduler.schedule()
        masks = self._start_masks(sched)
        handle = self.runner.execute(sched, masks)
        if self.cfg.async_scheduling:
            done, self._in_flight = self._in_flight, (handle if sched.scheduled else None)
            self._in_flight_constrained = masks is not None
        else:
            done = handle
        if done is not None:
            self._collect(done)
        return self.scheduler.take_outputs()

    def _start_masks(self, sched: SchedulerOutput):
        """Start filling the grammar masks of this step's constrained samples (beside the forward pass); returns
        what the runner calls on the logits, or None when nothing sampled here is constrained."""
        requests = self.scheduler.requests
        rows = [requests[s.req_id] for s in sched.scheduled if s.samples]
        pending = self.structured_outputs.start_masks(rows)
        if pending is None:
            return None
        return lambda logits, req_ids: self.structured_outputs.apply_masks(pending, logits, req_ids)

    def _collect(self, handle: StepHandle) -> None:
        out = handle.result()
        requests = self.scheduler.requests
        live = [(requests[r], t) for r, t in zip(out.req_ids, out.sampled_token_ids) if r in requests]
        ends = self.structured_outputs.accept([r for r, _ in live], [t for _, t in live])
        grammar_ends = {
            req.request_id: (f"token {token} is outside the grammar" if end is GrammarEnd.REJECTED else None)
            for (req, token), end in zip(live, ends) if end is not None
        }
        self.scheduler.update(out, grammar_ends)
        self.structured_outputs.retain(requests)
