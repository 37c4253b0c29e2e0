"""Grammar-constrained decoding with xgrammar: the output of a request can be made to match a JSON schema, an
xgrammar structural tag (free text with constrained tool calls, thinking before JSON...), a regex or an EBNF grammar.

`StructuredOutputs` is the engine's one object for it. Grammars are compiled once per spec and tokenizer (xgrammar's
compiler cache; compiling is thread-safe, so a server can compile off the engine thread first). Each constrained
sequence owns a matcher. A step makes three calls, in this order:

    pending = start_masks(rows)               # before the forward pass: the masks are filled in a worker thread
    apply_masks(pending, logits, req_ids)     # after it: tokens outside each constrained row's grammar get -inf
    ends = accept(rows, token_ids)            # with the sampled tokens: advance the matchers

Rows without a constraint are never touched. A row's next mask depends on the token sampled for it in this step, so
a step with constrained rows must see its sampled tokens before the next step's `start_masks` (no overlap of two
such steps); rows without constraints impose nothing.

xgrammar is imported on first use: it costs about a second, and most engines never see a constrained request.
"""
from __future__ import annotations

import enum
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Container, Iterable, Protocol, Sequence

import torch

from engine.json_schema_support import clean_error, enforceable_schema
from engine.sampling_params import StructuredOutputSpec

if TYPE_CHECKING:
    import xgrammar

_CACHE_LIMIT_BYTES = 512 * 1024**2  # compiled grammars kept for reuse (xgrammar evicts beyond this)


class GrammarEnd(enum.Enum):
    """Why a sequence's grammar ended it after a step."""

    COMPLETE = "complete"  # the grammar accepted a stop token: the output is whole
    REJECTED = "rejected"  # the sampled token is outside the grammar (cannot happen with the mask applied)


class ConstrainedRow(Protocol):
    """What the hooks need from a row; the engine's requests satisfy it."""

    request_id: str
    params: Any  # SamplingParams (its `structured_output`)


@dataclass
class MaskStats:
    """Where grammar time goes (seconds, summed over steps): filling masks runs beside the forward pass; the step
    waits only for what is left of it, then applies them."""

    steps: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


@dataclass
class PendingMasks:
    """Token masks being filled for the constrained rows of one step."""

    bitmask: torch.Tensor  # int32 [rows, ceil(vocab / 32)], one bit per token; unconstrained rows stay all ones
    rows: list[int]  # the constrained rows
    filled: Future
    row_of: dict[str, int]  # request id -> its row


class StructuredOutputs:
    """Grammar compilation and per-sequence matchers for one engine (one tokenizer, one vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], device: torch.device) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's (padded) vocabulary: the mask covers every logit
        self._stop_token_ids = sorted(stop_token_ids)
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self.stats = MaskStats()

    # ---- compilation (any thread) ----------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached by xgrammar per spec). ValueError when it cannot be compiled."""
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_schema":
                schema = json.dumps(enforceable_schema(_json(spec.value)))
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.value)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            return compiler.compile_grammar(spec.value)
        except RuntimeError as exc:  # xgrammar reports every grammar error as a RuntimeError subclass
            raise ValueError(f"the {spec.kind.replace('_', ' ')} cannot be enforced: {clean_error(exc)}") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(
                    self._tokenizer_info(xgr), max_threads=4, cache_limit_bytes=_CACHE_LIMIT_BYTES
                )
            return self._compiler

    def _tokenizer_info(self, xgr) -> xgrammar.TokenizerInfo:
        """The vocabulary as the grammar sees it: control tokens (`<|im_start|>`, `<|endoftext|>`...) can never be
        part of matched text, only the engine's stop tokens may end it; tool-call and thinking markers
        (`<tool_call>`, `<think>`, DeepSeek's call tokens) are ordinary text, so a grammar produces them as the
        single tokens the model was trained on. Ids past the tokenizer (a padded vocabulary) are never allowed."""
        detected = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
        control = {i for i, token in self._tokenizer.added_tokens_decoder.items() if token.special}
        encoded = [""] * self._vocab_size
        for token, i in self._tokenizer.get_vocab().items():
            if i < self._vocab_size and i not in control:
                encoded[i] = token
        return xgr.TokenizerInfo(
            encoded, detected.vocab_type, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids,
            add_prefix_space=detected.add_prefix_space,
        )

    # ---- the step hooks (engine thread) ----------------------------------------------------------------------------
    def start_masks(self, rows: Sequence[ConstrainedRow]) -> PendingMasks | None:
        """Start filling the masks of the rows about to sample; None when no row is constrained."""
        constrained = [i for i, row in enumerate(rows) if row.params.structured_output is not None]
        if not constrained:
            return None
        import xgrammar as xgr

        matchers = [self._matcher(rows[i]) for i in constrained]
        shape = xgr.get_bitmask_shape(len(rows), self._vocab_size)
        bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=self._device.type == "cuda")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
            self._batch = xgr.BatchGrammarMatcher()
        filled = self._pool.submit(self._fill, matchers, bitmask, constrained)
        return PendingMasks(bitmask, constrained, filled, {row.request_id: i for i, row in enumerate(rows)})

    def _fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        start = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        self.stats.fill_s += time.perf_counter() - start

    def apply_masks(self, pending: PendingMasks | None, logits: torch.Tensor, req_ids: Sequence[str]) -> None:
        """Set the logits of disallowed tokens to -inf, in place; logits row j samples for request ``req_ids[j]``
        (the runner's order, which need not be the prepared rows')."""
        if pending is None:
            return
        import xgrammar as xgr

        start = time.perf_counter()
        pending.filled.result()
        waited = time.perf_counter()
        row_of = [pending.row_of[r] for r in req_ids]
        constrained = set(pending.rows)
        indices = [j for j, i in enumerate(row_of) if i in constrained]
        bitmask = pending.bitmask if list(row_of) == list(range(len(row_of))) else pending.bitmask[list(row_of)]
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=indices)
        self.stats.steps += 1
        self.stats.wait_s += waited - start
        self.stats.apply_s += time.perf_counter() - waited

    def accept(self, rows: Sequence[ConstrainedRow], token_ids: Sequence[int]) -> list[GrammarEnd | None]:
        """Advance each constrained row's matcher by its sampled token; per row, whether its grammar ended."""
        ends: list[GrammarEnd | None] = []
        for row, token in zip(rows, token_ids):
            if row.params.structured_output is None:
                ends.append(None)
                continue
            matcher = self._matcher(row)
            if not matcher.accept_token(token):
                ends.append(GrammarEnd.REJECTED)
            else:
                ends.append(GrammarEnd.COMPLETE if matcher.is_terminated() else None)
        return ends

    def retain(self, live: Container[str]) -> None:
        """Drop the matchers of sequences that finished or were aborted (not in ``live``)."""
        for request_id in [r for r in self._matchers if r not in live]:
            del self._matchers[request_id]

    @property
    def num_active(self) -> int:
        return len(self._matchers)

    def _matcher(self, row: ConstrainedRow) -> xgrammar.GrammarMatcher:
        matcher = self._matchers.get(row.request_id)
        if matcher is None:
            import xgrammar as xgr

            matcher = self._matchers[row.request_id] = xgr.GrammarMatcher(self.compile(row.params.structured_output))
        return matcher


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the json schema is not valid JSON: {exc}") from None
