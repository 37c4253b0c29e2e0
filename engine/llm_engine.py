"""The engine: owns requests, scheduler, KV manager, model runner and sampler; `step()` advances every request once.

Single-threaded by design: the server drives it from one background thread (see server/async_engine.py).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus, RequestTimings
from engine.sampler import TokenLogprobs, make_generator, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.structured_output import GrammarEnd, StructuredOutputs


@dataclass
class SequenceOutput:
    """One sequence's progress in one step (deltas), as the server streams it."""

    request_id: str  # the client's request id; n > 1 siblings share it
    index: int  # which of the n choices
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    timings: RequestTimings
    error: str | None = None


@dataclass
class _TextState:
    """Per-sequence text: incremental detokenizer plus stop-string matcher (which holds back possible stop starts)."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None


@dataclass
class _Group:
    """The n sequences of one client request."""

    params: SamplingParams
    seqs: dict[int, Request] = field(default_factory=dict)  # index -> sequence


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
        self.kv = KVCacheManager(
            self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching, model_id or str(self.model_dir)
        )
        self.scheduler = Scheduler(cfg, self.kv)
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids, self.runner.device
        )
        self.groups: dict[str, _Group] = {}
        self.text: dict[str, _TextState] = {}  # by sequence id
        self.num_prompt_tokens = 0  # counters for /metrics
        self.num_generation_tokens = 0

    # ---- requests ----------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that could never run, before it takes any state."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            over = len(prompt_token_ids) - self.max_model_len + 1
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}, so it is "
                f"{over} token(s) too long (leaving room for one generated token)"
            )
        pages = self.kv.pages_needed(len(prompt_token_ids) + 1)
        if pages > self.kv.num_pages:
            raise ValueError(
                f"the prompt needs {pages} KV pages but the cache has {self.kv.num_pages}; "
                "give the engine more KV memory (num_kv_blocks / kv_cache_memory_gb)"
            )
        if params.structured_output is not None:
            self.structured_outputs.compile(params.structured_output)  # cached: a server compiled it already

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        group = _Group(params)
        leader = self._new_sequence(request_id, 0, list(prompt_token_ids), params, cache_salt)
        leader.pending_siblings = params.n - 1
        group.seqs[0] = leader
        self.groups[request_id] = group
        self.scheduler.add(leader)

    def _new_sequence(
        self, request_id: str, index: int, prompt: list[int], params: SamplingParams, cache_salt: str | None
    ) -> Request:
        seq_id = request_id if index == 0 else f"{request_id}#{index}"
        seed = None if params.seed is None else params.seed + index
        req = Request(
            request_id=seq_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=params,
            cache_salt=cache_salt,
            generator=None if seed is None else make_generator(seed, self.runner.device),
            group_id=request_id,
            index=index,
        )
        stops = StopStringMatcher(params.stop) if params.stop else None
        self.text[seq_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, prompt, skip_special_tokens=params.skip_special_tokens), stops
        )
        return req

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request now and free its pages (a client went away)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for req in group.seqs.values():
            if not req.finished:
                self.scheduler.finish(req)
                req.status = RequestStatus.FINISHED
                req.finish_reason = "abort"
            self.text.pop(req.request_id, None)
            self.structured_outputs.release(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        sched = self.scheduler.schedule()
        outputs = [self._finish(req, "length", error="out of KV pages") for req in sched.out_of_pages]
        batch = sched.batch
        if not batch.requests:
            return outputs
        block_tables = [self.kv.block_table(r.request_id) for r in batch.requests]
        samples = batch.sampling_mask()
        masks = self.structured_outputs.start_masks([r for r, s in zip(batch.requests, samples) if s])
        logits = self.runner.execute(batch, block_tables)
        self.num_prompt_tokens += sum(
            min(n, max(0, r.num_prompt_tokens - r.num_computed_tokens)) for r, n in zip(batch.requests, batch.num_new_tokens)
        )
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)

        rows = [r for r, s in zip(batch.requests, samples) if s]
        row_logits = list(range(len(rows)))
        for i, req in enumerate(list(rows)):  # n > 1: siblings sample their first token from the leader's logits
            for sibling in self._fork_siblings(req):
                rows.append(sibling)
                row_logits.append(i)
        if row_logits != list(range(len(row_logits))):
            logits = logits[torch.tensor(row_logits, device=logits.device)]
        self.structured_outputs.apply_masks(masks, logits, row_logits)
        sampled = sample(logits, rows)
        ends = self.structured_outputs.accept(rows, sampled.token_ids)
        now = time.perf_counter()
        for req, token, logprob, end in zip(rows, sampled.token_ids, sampled.logprobs, ends):
            outputs.append(self._append_token(req, token, logprob, now, end))
        return outputs

    def _fork_siblings(self, leader: Request) -> list[Request]:
        """Start the leader's n-1 siblings on its freshly computed prompt pages (shared blocks, copied tail)."""
        if not leader.pending_siblings:
            return []
        group = self.groups[leader.group_id]
        forked = []
        for index in range(1, leader.pending_siblings + 1):
            sib = self._new_sequence(leader.group_id, index, leader.prompt_token_ids, leader.params, leader.cache_salt)
            group.seqs[index] = sib
            copies = self.kv.fork(leader.request_id, sib.request_id)
            if copies is None or len(self.scheduler.running) >= self.cfg.max_num_seqs:
                if copies is not None:
                    self.kv.free(sib.request_id)
                self.scheduler.add(sib)  # no room to fork now: it queues and will hit the prompt's cached blocks
                continue
            self.runner.copy_pages(copies)
            sib.status = RequestStatus.RUNNING
            sib.num_computed_tokens = leader.num_computed_tokens
            sib.num_cached_tokens = leader.num_cached_tokens
            sib.timings.scheduled = leader.timings.scheduled
            self.scheduler.running.append(sib)
            forked.append(sib)
        leader.pending_siblings = 0
        return forked

    def _append_token(
        self, req: Request, token: int, logprob: TokenLogprobs | None, now: float, grammar_end: GrammarEnd | None
    ) -> SequenceOutput:
        params = req.params
        if req.timings.first_token is None:
            req.timings.first_token = now
        req.token_ids.append(token)
        req.logprobs.append(logprob)
        self.num_generation_tokens += 1
        state = self.text[req.request_id]
        # A grammar ends on a stop token it accepted (even with ignore_eos: nothing may follow a whole output).
        is_stop_token = (
            (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
            or grammar_end is not None
        )
        text, reason = "", None
        if is_stop_token:
            reason = "stop"
        else:
            text = state.detok.add(token)
            if state.stops is not None:
                text, hit = state.stops.feed(text)
                reason = "stop" if hit else None
        if reason is None and (req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None:
            return self._output(req, [token], text, [logprob])
        if reason == "length" or is_stop_token:  # release text held back for a possible stop string / partial char
            tail = state.detok.flush()
            if state.stops is not None:
                held, hit = state.stops.feed(tail)
                text += held + ("" if hit else state.stops.flush())
            else:
                text += tail
        rejected = grammar_end is GrammarEnd.REJECTED
        out = self._finish(req, reason, error=f"token {token} is outside the grammar" if rejected else None)
        out.new_token_ids, out.new_text, out.new_logprobs = [token], text, [logprob]
        return out

    def _finish(self, req: Request, reason: str, error: str | None = None) -> SequenceOutput:
        self.scheduler.finish(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.timings.finished = time.perf_counter()
        self.text.pop(req.request_id, None)
        self.structured_outputs.release(req.request_id)
        group = self.groups[req.group_id]
        if all(s.finished for s in group.seqs.values()) and len(group.seqs) == group.params.n:
            del self.groups[req.group_id]
        out = self._output(req, [], "", [])
        out.error = error
        return out

    def _output(self, req: Request, tokens: list[int], text: str, logprobs: list) -> SequenceOutput:
        return SequenceOutput(
            request_id=req.group_id,
            index=req.index,
            new_token_ids=tokens,
            new_text=text,
            new_logprobs=logprobs,
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            timings=req.timings,
        )

    def sequence(self, request_id: str, index: int = 0) -> Request:
        return self.groups[request_id].seqs[index]

