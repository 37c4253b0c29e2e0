"""Grammar-constrained decoding with xgrammar: the output of a request can be made to match a JSON schema, an
xgrammar structural tag (free text with constrained tool calls, thinking before JSON...), a regex or an EBNF grammar.

`StructuredOutputs` is the engine's one object for it. Grammars are compiled once per spec (a cache keyed by the
spec, bounded in bytes): `compile` in this process (thread-safe), `compile_isolated` in a worker process with a time
limit and a cancel flag (engine/worker/grammar_compile.py: what a server uses, off the engine thread, so that the engine
then finds the grammar cached). JSON in constrained output is compact by default: one layout, the one `json.dumps`
writes and the chat templates render (`, ` and `: `, no other whitespace), so a model cannot spend its budget on
blank space; the ``json_whitespace`` option allows up to that many whitespace characters between tokens instead. Each constrained
sequence owns a matcher. A step makes three calls, in this order:

    pending = start_masks(rows, drafts)       # before the forward pass: the masks are filled in a worker thread
    apply_masks(pending, logits, seq_ids)     # after it: tokens outside each constrained row's grammar get -inf
    ends = accept(rows, token_lists)          # with the emitted tokens: advance the matchers

Rows without a constraint are never touched. A row's next mask depends on the token sampled for it in this step, so
a step with constrained rows must see its sampled tokens before the next step's `start_masks` (no overlap of two
such steps); rows without constraints impose nothing. Under speculative decoding a row verifies its drafts in the
same step: it gets a mask per draft, each from the grammar's state after the drafts before it (the matcher follows
the drafts and rolls back), and `accept` advances it by every token the step emitted.

xgrammar is imported on first use: it costs about a second, and most engines never see a constrained request.
"""
from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Container, Iterable, Protocol, Sequence

import torch

from engine.worker.grammar_compile import CompileWorkers, compile_spec
from engine.sampling_params import StructuredOutputSpec

# Special tokens that grammars may produce (and name as tokens): harmony's message markers (gpt-oss)
# Control tokens that grammars name as tokens: harmony's message markers (gpt-oss), Mistral's call markers (Devstral)
GRAMMAR_MARKERS = frozenset({"<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "[TOOL_CALLS]", "[ARGS]"})

if TYPE_CHECKING:
    import xgrammar

_CACHE_LIMIT_BYTES = 512 * 1024**2  # compiled grammars kept for reuse, least recently used dropped beyond this


class GrammarEnd(enum.Enum):
    """Why a sequence's grammar ended it after a step."""

    COMPLETE = "complete"  # the grammar accepted a stop token: the output is whole
    REJECTED = "rejected"  # the sampled token is outside the grammar (cannot happen with the mask applied)
    FAILED = "failed"  # the sequence's grammar broke (its matcher could not be made or advanced): `failure` says why


class ConstrainedRow(Protocol):
    """What the hooks need from a row; the scheduler's sequences satisfy it."""

    seq_id: str
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
    row_of: dict[str, int]  # seq id -> its (first) row


@dataclass
class _CachedGrammar:
    compiled: xgrammar.CompiledGrammar
    scopes: set[str | None] = field(default_factory=set)  # who compiled it (`compile_isolated`)
    serialized: str | None = None  # its JSON, once asked for (`serialized`) or as a compile worker sent it


class StructuredOutputs:
    """Grammar compilation and per-sequence matchers for one engine (one tokenizer, one vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], device: torch.device,
                 json_whitespace: int = 0) -> None:
        self._tokenizer = tokenizer
        self.json_whitespace = json_whitespace
        self._vocab_size = vocab_size  # the model's (padded) vocabulary: the mask covers every logit
        self._stop_token_ids = sorted(stop_token_ids)
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._info: xgrammar.TokenizerInfo | None = None
        self._compiled: OrderedDict[StructuredOutputSpec, _CachedGrammar] = OrderedDict()
        self._compiled_bytes = 0
        # Three at once: a server compiles one grammar at a time in the background (server/pipeline/optional_grammars.py),
        # so that one never leaves fewer than two to requests waiting on their grammar.
        self._workers = CompileWorkers(lambda: self._tokenizer_info().serialize_json(), max_workers=3)
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._failed: dict[str, str] = {}  # seq id -> why its grammar broke (that sequence alone ends)
        self.stats = MaskStats()

    # ---- compilation (any thread) ----------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar, from the cache or compiled here. ValueError when it cannot be compiled."""
        compiled = self._cached(spec, any_scope=True)
        if compiled is None:
            compiled = self._remember(spec, compile_spec(self._get_compiler(), (spec, self.json_whitespace)))
        return compiled

    def compile_isolated(self, spec: StructuredOutputSpec, timeout_s: float, cancelled: threading.Event | None = None,
                         scope: str | None = None) -> xgrammar.CompiledGrammar:
        """`compile`, but a grammar not cached yet compiles in a worker process: `CompileTimeout` (a ValueError)
        past ``timeout_s`` seconds, `CompileCancelled` once ``cancelled`` is set or `close` was called.

        ``scope`` (a tenant): a grammar counts as cached only for the scopes that compiled it, so that no tenant
        can tell from the time a compile takes whether another one used the same grammar; each pays its own."""
        compiled = self._cached(spec, scope)
        if compiled is None:
            import xgrammar as xgr

            serialized = self._workers.compile((spec, self.json_whitespace), timeout_s, cancelled)
            compiled = xgr.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info())
            compiled = self._remember(spec, compiled, scope, serialized)
        return compiled

    def serialized(self, spec: StructuredOutputSpec) -> str | None:
        """The cached grammar of ``spec`` as JSON (what `adopt` reads), or None when it is not cached: what a server
        sends with a request to a core process, which then need not compile it a second time."""
        with self._lock:
            entry = self._compiled.get(spec)
        if entry is None:
            return None
        if entry.serialized is None:
            entry.serialized = entry.compiled.serialize_json()
        return entry.serialized

    def adopt(self, spec: StructuredOutputSpec, serialized: str) -> None:
        """Cache ``spec``'s grammar from its JSON (`serialized` of another process's compiler for the same
        tokenizer): reading it takes milliseconds where compiling can take seconds."""
        if self._cached(spec, any_scope=True) is None:
            import xgrammar as xgr

            self._remember(spec, xgr.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info()),
                           serialized=serialized)

    def is_cached(self, spec: StructuredOutputSpec, scope: str | None) -> bool:
        """``scope`` compiled ``spec`` before (`compile_isolated`) and it is still cached: it needs no compile."""
        return self._cached(spec, scope) is not None

    def close(self) -> None:
        """Stop the compile workers (compiles in progress end with `CompileCancelled`)."""
        self._workers.close()

    def _cached(self, spec: StructuredOutputSpec, scope: str | None = None,
                any_scope: bool = False) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            entry = self._compiled.get(spec)
            if entry is None or not (any_scope or scope in entry.scopes):
                return None
            self._compiled.move_to_end(spec)
            return entry.compiled

    def _remember(self, spec: StructuredOutputSpec, compiled: xgrammar.CompiledGrammar, scope: str | None = None,
                  serialized: str | None = None) -> xgrammar.CompiledGrammar:
        with self._lock:
            entry = self._compiled.get(spec)
            if entry is None:
                entry = self._compiled[spec] = _CachedGrammar(compiled, serialized=serialized)
                self._compiled_bytes += compiled.memory_size_bytes
                while self._compiled_bytes > _CACHE_LIMIT_BYTES and len(self._compiled) > 1:
                    self._compiled_bytes -= self._compiled.popitem(last=False)[1].compiled.memory_size_bytes
            entry.scopes.add(scope)
            return entry.compiled

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        info = self._tokenizer_info()
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self) -> xgrammar.TokenizerInfo:
        with self._lock:
            if self._info is None:
                import xgrammar as xgr

                self._info = self._make_tokenizer_info(xgr)
            return self._info

    def _make_tokenizer_info(self, xgr) -> xgrammar.TokenizerInfo:
        """The vocabulary as the grammar sees it: control tokens (`<|im_start|>`, `<|endoftext|>`...) can never be
        part of matched text, only the engine's stop tokens may end it; tool-call and thinking markers
        (`<tool_call>`, `<think>`, DeepSeek's call tokens) are ordinary text, so a grammar produces them as the
        single tokens the model was trained on; so are harmony's message markers and Mistral's `[TOOL_CALLS]` /
        `[ARGS]` (`GRAMMAR_MARKERS`: gpt-oss' and Devstral's calls are framed by them, and their grammars name them as
        tokens). Ids past the tokenizer (a padded vocabulary) are never allowed."""
        detected = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
        control = {i for i, token in self._tokenizer.added_tokens_decoder.items()
                   if token.special and token.content not in GRAMMAR_MARKERS}
        encoded = [""] * self._vocab_size
        for token, i in self._tokenizer.get_vocab().items():
            if i < self._vocab_size and i not in control:
                encoded[i] = token
        return xgr.TokenizerInfo(
            encoded, detected.vocab_type, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids,
            add_prefix_space=detected.add_prefix_space,
        )

    # ---- the step hooks (engine thread) ----------------------------------------------------------------------------
    def start_masks(self, rows: Sequence[ConstrainedRow],
                    drafts: Sequence[Sequence[int]] | None = None) -> PendingMasks | None:
        """Start filling the masks of the rows about to sample; None when no row is constrained.

        ``drafts`` (speculative decoding): per row, the drafts verified after its last token. Such a row has one
        mask per position, each from the grammar's state after the drafts before it: the matcher walks the drafts
        and rolls back. A draft the grammar forbids is ruled out by the mask before it, so verification rejects it
        (greedy: it cannot be the argmax; sampled: its probability is 0) and the rows after it are never used."""
        counts = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(rows)
        constrained = [i for i, row in enumerate(rows) if row.params.structured_output is not None
                       and self._matcher(row) is not None]
        if not constrained:
            return None
        import xgrammar as xgr

        first = [0, *itertools.accumulate(counts)][:-1]
        walks = [(self._matchers[rows[i].seq_id], first[i], drafts[i]) for i in constrained if counts[i] > 1]
        single = [i for i in constrained if counts[i] == 1]
        shape = xgr.get_bitmask_shape(sum(counts), self._vocab_size)
        bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=self._device.type == "cuda")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
            self._batch = xgr.BatchGrammarMatcher()
        filled = self._pool.submit(self._fill, [self._matchers[rows[i].seq_id] for i in single], bitmask,
                                   [first[i] for i in single], walks)
        return PendingMasks(bitmask, [first[i] + j for i in constrained for j in range(counts[i])], filled,
                            {row.seq_id: first[i] for i, row in enumerate(rows)})

    def _fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int],
              walks: list[tuple[xgrammar.GrammarMatcher, int, Sequence[int]]]) -> None:
        start = time.perf_counter()
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for matcher, row, drafts in walks:
            _fill_along_drafts(matcher, bitmask, row, drafts)
        self.stats.fill_s += time.perf_counter() - start

    def apply_masks(self, pending: PendingMasks | None, logits: torch.Tensor, seq_ids: Sequence[str],
                    counts: Sequence[int] | None = None) -> None:
        """Set the logits of disallowed tokens to -inf, in place; logits rows sample for sequence ``seq_ids[j]``,
        ``counts[j]`` rows each (1 + its drafts; default 1), in the runner's order, which need not be the
        prepared rows'."""
        if pending is None:
            return
        import xgrammar as xgr

        start = time.perf_counter()
        pending.filled.result()
        waited = time.perf_counter()
        counts = counts if counts is not None else [1] * len(seq_ids)
        order = [pending.row_of[r] + j for r, n in zip(seq_ids, counts) for j in range(n)]
        constrained = set(pending.rows)
        indices = [j for j, i in enumerate(order) if i in constrained]
        bitmask = pending.bitmask if order == list(range(len(order))) else pending.bitmask[order]
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=indices)
        self.stats.steps += 1
        self.stats.wait_s += waited - start
        self.stats.apply_s += time.perf_counter() - waited

    def accept(self, rows: Sequence[ConstrainedRow], token_ids: Sequence[Sequence[int]]
               ) -> list[tuple[GrammarEnd | None, int]]:
        """Advance each constrained row's matcher by its emitted tokens (one, or a speculative step's several); per
        row, whether its grammar ended and after how many of its tokens (nothing may follow a whole output)."""
        ends: list[tuple[GrammarEnd | None, int]] = []
        for row, tokens in zip(rows, token_ids):
            if row.params.structured_output is None:
                ends.append((None, len(tokens)))
                continue
            ends.append(self._advance(row, tokens))
        return ends

    def _advance(self, row: ConstrainedRow, tokens: Sequence[int]) -> tuple[GrammarEnd | None, int]:
        matcher = self._matcher(row)
        if matcher is None:
            return GrammarEnd.FAILED, 0
        try:
            for i, token in enumerate(tokens):
                if not matcher.accept_token(token):
                    return GrammarEnd.REJECTED, i
                if matcher.is_terminated():
                    return GrammarEnd.COMPLETE, i + 1
        except Exception as exc:  # noqa: BLE001 - this sequence's grammar broke: it alone ends
            self._failed[row.seq_id] = f"its grammar failed: {exc!r}"
            return GrammarEnd.FAILED, 0
        return None, len(tokens)

    def failure(self, seq_id: str) -> str | None:
        """Why the sequence's grammar broke (`GrammarEnd.FAILED`), if it did."""
        return self._failed.get(seq_id)

    def retain(self, live: Container[str]) -> None:
        """Drop the matchers of sequences that finished or were aborted (not in ``live``)."""
        for kept in (self._matchers, self._failed):
            for seq_id in [s for s in kept if s not in live]:
                del kept[seq_id]

    @property
    def num_active(self) -> int:
        return len(self._matchers) + len(self._failed)

    def _matcher(self, row: ConstrainedRow) -> xgrammar.GrammarMatcher | None:
        """The row's matcher, made on first use; None once its grammar failed (recorded in `failure`)."""
        matcher = self._matchers.get(row.seq_id)
        if matcher is None and row.seq_id not in self._failed:
            import xgrammar as xgr

            try:
                matcher = xgr.GrammarMatcher(self.compile(row.params.structured_output))
            except Exception as exc:  # noqa: BLE001 - one sequence's grammar must not fail the step
                self._failed[row.seq_id] = f"its grammar could not be prepared: {exc}"
                return None
            self._matchers[row.seq_id] = matcher
        return matcher


def _fill_along_drafts(matcher: xgrammar.GrammarMatcher, bitmask: torch.Tensor, row: int,
                       drafts: Sequence[int]) -> None:
    """Masks ``row``, ``row + 1``, ... for a row's last token and each draft: the mask after draft i is the
    grammar's state once drafts 0..i are accepted. Stops at a draft the mask before it forbids (nothing after it can
    be accepted) or that ends the grammar; the matcher is rolled back to where it started."""
    accepted = 0
    for i in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bitmask, row + i)
        if i == len(drafts):
            break
        token = drafts[i]
        allowed = 0 <= token < bitmask.shape[1] * 32 and (int(bitmask[row + i, token >> 5]) >> (token & 31)) & 1
        if not allowed or not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.is_terminated():
            break
    if accepted:
        matcher.rollback(accepted)
