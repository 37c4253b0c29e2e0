"""What crosses the engine's internal boundaries, as plain data (no torch): scheduler -> runner
(`SchedulerOutput`), runner -> scheduler (`ModelRunnerOutput`), engine core -> its clients (one `StepOutputs` per
step; each client reads it as one `SequenceOutput` per sequence), and the scheduler's `SchedulerStats` snapshot.
Keeping them here lets the scheduler depend on nothing below it.
"""
from __future__ import annotations

import enum
import time
from collections import abc
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from engine.multimodal import ImageInput
from engine.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens, the context length, or (with an error) the KV pool
    ABORT = "abort"  # the caller went away
    ERROR = "error"  # this request alone failed inside a step (its `SequenceOutput.error` says why)


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N alternatives (token id, logprob), best first
    rank: int | None = None  # the token's rank in the distribution (1: the most likely); prompt tokens only


@dataclass
class RequestTimings:
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # first admission
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


# ---- scheduler -> model runner -------------------------------------------------------------------------------------
@dataclass
class NewSequence:
    """A sequence the runner has not seen: everything it needs to keep its own state for it."""

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None  # this sequence's sampling seed (n > 1 siblings get seed + index)
    images: tuple[ImageInput, ...] = ()  # the prompt's (engine/multimodal.py)


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's share of a step, read out of a `SchedulerOutput`'s columns (for observers and tests; the step
    itself never builds one)."""

    seq_id: str
    num_new_tokens: int
    num_computed_tokens: int
    new_block_ids: list[int]
    samples: bool
    resumed: bool
    state_row: int
    draft_token_ids: list[int] | None


class TransferKind(enum.Enum):
    OFFLOAD = "offload"  # device block -> host block (the block leaves the device pool)
    RESTORE = "restore"  # host block -> device block (a host hit)
    DISK_WRITE = "disk_write"  # host block -> the block's file (written through when a block reaches the host)
    DISK_READ = "disk_read"  # the block's file -> device block (a disk hit)
    DISK_DELETE = "disk_delete"  # the disk tier dropped the block
    DISK_CLEAR = "disk_clear"  # every block file (a prefix-cache reset)
    OFFLOAD_STATE = "offload_state"  # device state row (or window pages) -> host state row (a snapshot or window leaves)
    RESTORE_STATE = "restore_state"  # host state row -> device state row (or window pages): a sequence resumes there


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """One copy between KV tiers. The runner performs a step's transfers in order, before its forward (and before
    the step's state restores): an offload of a block or a snapshot always precedes any write into it, and a restore
    precedes every read of it. A disk read with ``block_id`` -1 reads only the file's snapshot."""

    kind: TransferKind
    block_id: int = -1  # device block
    host_block: int = -1  # the block's row in the host pool
    block_hash: bytes = b""  # disk: the file's name
    parent_hash: bytes | None = None  # disk writes: recorded in the file, so a restart can rebuild the chain
    token_ids: tuple[int, ...] = ()
    # Hybrid models' snapshots ride with their block: the device state row (state copies; a disk read's target,
    # -1: pages only) and the host state row (state copies; a disk write's snapshot, -1: the block has none)
    state_row: int = -1
    host_state_row: int = -1
    # Sliding-window models' retained windows ride the same way, a host state row holding the window's pages: the
    # device window pages, oldest block first (state copies and disk reads in place of ``state_row``)
    window_pages: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy one recurrent-state row into another (every recurrent layer's conv and delta-rule state): a snapshot
    into a running sequence's row at admission (before the step's forward), or a running row into a new snapshot
    (after the step's forward, which brought it to a block boundary)."""

    src: int
    dst: int


@dataclass
class SchedulerOutput:
    """One step's work as deltas against what the runner already holds.

    The scheduled sequences are columns, one entry per sequence (no object per sequence per step): compute
    ``num_new_tokens[i]`` tokens of ``seq_ids[i]`` from ``num_computed_tokens[i]`` on; ``samples[i]``: the chunk ends
    at the sequence's last token, so this step samples its next one. What changes the runner's copy of a sequence is
    sparse: ``new_block_ids`` are appended to its block table, or replace it for a sequence in ``resumed``
    (re-admitted after a preemption); ``state_rows``: hybrid models, at (re)admission, the recurrent-state row the
    sequence runs in; ``drafts``: speculative decoding, tokens proposed after the sequence's last one, computed in this
    step after it (counted in ``num_new_tokens``) and verified by its sampling; they join the sequence only as far
    as they are accepted. A steady decode appears in the columns only."""

    new_sequences: list[NewSequence] = field(default_factory=list)
    seq_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # sliding-window models: the window pages appended to each sequence's window table, or (resumed) the whole of it
    new_window_block_ids: dict[str, list[int]] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)
    state_rows: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    finished_seq_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step: forget them
    # Blocks released, state kept for resumption. (The runner needs no action: a sequence not scheduled leaves
    # the batch anyway; the list is there for observers.)
    preempted_seq_ids: list[str] = field(default_factory=list)
    kv_transfers: list[KVTransfer] = field(default_factory=list)  # before the forward, in order
    state_restores: list[StateCopy] = field(default_factory=list)  # hybrid models: before the forward
    state_snapshots: list[StateCopy] = field(default_factory=list)  # hybrid models: after the forward
    # vision-language models: images the tower encodes into the encoder cache before the forward, spread over steps
    # within the token budget (engine/sched/image_encoding.py)
    encode_images: list[ImageInput] = field(default_factory=list)

    @property
    def num_scheduled(self) -> int:
        return len(self.seq_ids)

    def add(self, seq_id: str, num_new_tokens: int, num_computed_tokens: int, samples: bool,
            new_block_ids: list[int], resumed: bool = False, state_row: int = -1,
            drafts: list[int] | None = None) -> None:
        """Schedule ``num_new_tokens`` tokens of ``seq_id`` (and its ``drafts`` after them)."""
        self.seq_ids.append(seq_id)
        self.num_new_tokens.append(num_new_tokens + len(drafts or ()))
        self.num_computed_tokens.append(num_computed_tokens)
        self.samples.append(samples)
        if new_block_ids or resumed:
            self.new_block_ids[seq_id] = new_block_ids
        if resumed:
            self.resumed.add(seq_id)
        if state_row >= 0:
            self.state_rows[seq_id] = state_row
        if drafts:
            self.drafts[seq_id] = drafts

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        """The columns as one `ScheduledSequence` per sequence (observers and tests)."""
        return [ScheduledSequence(seq_id, n, start, self.new_block_ids.get(seq_id, []), samples,
                                  seq_id in self.resumed, self.state_rows.get(seq_id, -1), self.drafts.get(seq_id))
                for seq_id, n, start, samples in zip(self.seq_ids, self.num_new_tokens, self.num_computed_tokens,
                                                     self.samples)]


# ---- model runner -> scheduler -------------------------------------------------------------------------------------
@dataclass
class ModelRunnerOutput:
    """The tokens one step sampled, per sequence whose scheduled chunk reached its last known token."""

    seq_ids: list[str]
    sampled_token_ids: abc.Sequence[int]  # from the runner, an int64 array
    logprobs: list[TokenLogprobs | None] | None = None  # None when no sequence asked for logprobs
    # Prompt logprobs computed by this step: (seq id, index of the first prompt token scored, one entry per token).
    prompt_logprobs: list[tuple[str, int, list[TokenLogprobs]]] = field(default_factory=list)
    # Speculative decoding: per sequence every token the step emits (its accepted drafts, then the target's own);
    # None when no sequence drafted. `sampled_token_ids[i]` is `emitted_token_ids[i][0]`.
    emitted_token_ids: list[list[int]] | None = None
    # The MTP proposer (engine/spec/mtp.py): per sequence the drafts for its next step (None: no MTP layer)
    draft_token_ids: list[list[int]] | None = None

    def emitted(self) -> list[list[int]]:
        """Per sequence every token the step emitted (one, or its accepted drafts and the target's own)."""
        if self.emitted_token_ids is not None:
            return self.emitted_token_ids
        return [[token] for token in np.asarray(self.sampled_token_ids).tolist()]


@dataclass
class DraftStats:
    """Speculative decoding's counters (a request's, or a proposer's over all requests): a verification is one
    sequence's step that carried drafts."""

    steps: int = 0  # sequence-steps that sampled, with drafts or not
    tokens: int = 0  # tokens they emitted
    verifications: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token."""
        return (self.accepted_tokens + self.verifications) / self.verifications if self.verifications else 0.0

    def record(self, drafted: int, emitted: int) -> None:
        """One sequence-step: ``drafted`` drafts verified, ``emitted`` tokens appended (accepted drafts + 1)."""
        self.steps += 1
        self.tokens += emitted
        if drafted:
            self.verifications += 1
            self.draft_tokens += drafted
            self.accepted_tokens += emitted - 1

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "tokens": self.tokens, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4),
                "tokens_per_step": round(self.tokens_per_step, 4)}


# ---- engine core -> clients ---------------------------------------------------------------------------------------
@dataclass(slots=True, eq=False)
class SequenceInfo:
    """What every output of one sequence shares, made once at its first output: its prompt's length, what the
    prefix cache served of it at admission, and its timings (which the engine fills in as it runs). One object per
    sequence, compared by identity (``None in infos`` then runs at C speed)."""

    num_prompt_tokens: int
    num_cached_tokens: int  # of the prompt, from the prefix cache: the device pool, host and disk tiers together
    num_host_cached_tokens: int  # of num_cached_tokens, restored from the host tier
    num_disk_cached_tokens: int  # ... and from the disk tier
    timings: RequestTimings
    # leading prompt tokens its breakpoints (`Retention.pins`) really retain: to the end of its last pin, or to the
    # first block the retention cap or its tenant's share refused (`KVCacheManager.num_pinned_tokens`)
    num_pinned_tokens: int = 0


class StepOutputs:
    """What one engine step produced, as columns (the engine core emits one per step, and a client routes its rows to
    their streams in one hop): row ``i`` is sequence ``indices[i]`` of request ``request_ids[i]``, which gained
    ``tokens(i)`` (one token, several with speculative decoding, none when it ended without one). The new tokens are
    arrays: ``token_ids``, every row's one after another, and ``num_tokens`` per row, so that a steady decode's rows
    come in one `extend` and cross a process boundary as bytes. What few rows carry is sparse, by row: a finish
    reason, an error, logprobs, prompt logprobs, speculation counters."""

    def __init__(self, request_ids: list[str] | None = None, indices: list[int] | None = None,
                 token_ids: np.ndarray | None = None, num_tokens: np.ndarray | None = None,
                 infos: list[SequenceInfo] | None = None) -> None:
        self.request_ids: list[str] = request_ids if request_ids is not None else []
        self.indices: list[int] = indices if indices is not None else []
        self.infos: list[SequenceInfo] = infos if infos is not None else []
        self.finish_reasons: dict[int, FinishReason] = {}
        self.errors: dict[int, str] = {}  # why a sequence ended abnormally (e.g. out of KV blocks)
        self.logprobs: dict[int, list[TokenLogprobs | None]] = {}  # one per new token
        self.prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}  # one per prompt token
        self.speculation: dict[int, DraftStats] = {}  # on a speculating sequence's last row
        # The token columns as chunks in row order, joined when read: arrays (`extend`, or given), then the rows
        # `add`ed one at a time since (lists)
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = [] if token_ids is None else [(token_ids, num_tokens)]
        self._added_ids: list[int] = []
        self._added_counts: list[int] = []
        self._starts: np.ndarray | None = None  # each row's first token in ``token_ids`` (None: not made yet)

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(self, request_id: str, index: int, new_token_ids: list[int], info: SequenceInfo,
            finish_reason: FinishReason | None = None) -> int:
        """Append a row; returns it (for the sparse columns)."""
        row = len(self.request_ids)
        self.request_ids.append(request_id)
        self.indices.append(index)
        self._added_ids += new_token_ids
        self._added_counts.append(len(new_token_ids))
        self.infos.append(info)
        if finish_reason is not None:
            self.finish_reasons[row] = finish_reason
        self._starts = None
        return row

    def extend(self, request_ids: list[str], indices: list[int], token_ids: np.ndarray,
               infos: list[SequenceInfo | None]) -> int:
        """Append rows that gained one token each (``token_ids``, one per row); returns the first of them."""
        row = len(self.request_ids)
        self._join_added()
        self.request_ids += request_ids
        self.indices += indices
        self.infos += infos
        self._chunks.append((token_ids, np.ones(len(token_ids), dtype=np.int64)))
        self._starts = None
        return row

    def _join_added(self) -> None:
        if self._added_counts:
            self._chunks.append((np.array(self._added_ids, dtype=np.int64),
                                 np.array(self._added_counts, dtype=np.int64)))
            self._added_ids, self._added_counts = [], []

    def _columns(self) -> tuple[np.ndarray, np.ndarray]:
        self._join_added()
        if len(self._chunks) != 1:
            chunks = self._chunks or [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))]
            self._chunks = [(np.concatenate([ids for ids, _ in chunks]),
                             np.concatenate([counts for _, counts in chunks]))]
        return self._chunks[0]

    @property
    def token_ids(self) -> np.ndarray:
        """Every row's new tokens, one row after another."""
        return self._columns()[0]

    @property
    def num_tokens(self) -> np.ndarray:
        """Per row, how many new tokens it has in ``token_ids``."""
        return self._columns()[1]

    def tokens(self, row: int) -> list[int]:
        """Row ``row``'s new tokens."""
        token_ids, num_tokens = self._columns()
        if self._starts is None:
            self._starts = np.cumsum(num_tokens) - num_tokens
        start = self._starts.item(row)
        return token_ids[start : start + num_tokens.item(row)].tolist()

    def output(self, row: int) -> SequenceOutput:
        """Row ``row`` as one sequence's output (the client side's view)."""
        info, tokens = self.infos[row], self.tokens(row)
        logprobs = self.logprobs.get(row)
        return SequenceOutput(self.request_ids[row], self.indices[row], tokens,
                              [None] * len(tokens) if logprobs is None else logprobs, self.finish_reasons.get(row),
                              info.num_prompt_tokens, info.num_cached_tokens, info.timings,
                              error=self.errors.get(row), prompt_logprobs=self.prompt_logprobs.get(row),
                              num_host_cached_tokens=info.num_host_cached_tokens,
                              num_disk_cached_tokens=info.num_disk_cached_tokens,
                              speculation=self.speculation.get(row), num_pinned_tokens=info.num_pinned_tokens)

    def __iter__(self) -> Iterator[SequenceOutput]:
        if self.logprobs or self.prompt_logprobs or self.errors or self.speculation:
            return map(self.output, range(len(self.request_ids)))
        return iter(self._plain_outputs())

    def _plain_outputs(self) -> list[SequenceOutput]:
        """Every row at once, for a step whose rows carry tokens and finish reasons only (a decode step): one
        ``tolist`` for all tokens instead of two numpy reads per row (`output` costs ~4 us a row, this ~1)."""
        token_ids, num_tokens = self._columns()
        flat = token_ids.tolist()
        if len(flat) == len(self.request_ids):  # one token a row
            tokens = [[t] for t in flat]
        else:
            ends = np.cumsum(num_tokens).tolist()
            tokens = [flat[end - n : end] for end, n in zip(ends, num_tokens.tolist())]
        reasons = self.finish_reasons
        return [SequenceOutput(request_id, index, new, [None] * len(new), reasons.get(row) if reasons else None,
                               info.num_prompt_tokens, info.num_cached_tokens, info.timings,
                               num_host_cached_tokens=info.num_host_cached_tokens,
                               num_disk_cached_tokens=info.num_disk_cached_tokens,
                               num_pinned_tokens=info.num_pinned_tokens)
                for row, (request_id, index, new, info) in enumerate(zip(self.request_ids, self.indices, tokens,
                                                                          self.infos))]

    def select(self, rows: list[int]) -> "StepOutputs":
        """These rows only, in this order (a client's share of a step that several clients' requests ran in)."""
        token_ids, num_tokens = self._columns()
        index = np.asarray(rows, dtype=np.int64)
        counts = num_tokens[index]
        starts = np.cumsum(num_tokens) - num_tokens
        # each picked row's tokens: its start plus 0, 1, ... up to its count
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        picked = StepOutputs([self.request_ids[r] for r in rows], [self.indices[r] for r in rows],
                             token_ids[np.repeat(starts[index], counts) + offsets], counts,
                             [self.infos[r] for r in rows])
        for column in ("finish_reasons", "errors", "logprobs", "prompt_logprobs", "speculation"):
            sparse = getattr(self, column)
            if sparse:
                getattr(picked, column).update({new: sparse[old] for new, old in enumerate(rows) if old in sparse})
        return picked


@dataclass(slots=True)
class SequenceOutput:
    """One sequence's progress in one step (deltas): a client's view of one `StepOutputs` row. An output processor,
    on the client's side, fills ``new_text`` (and may finish the sequence early on a stop string)."""

    request_id: str  # the caller's request id; n > 1 siblings share it
    index: int  # which of the n sequences
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # of the prompt, from the prefix cache: the device pool, host and disk tiers together
    timings: RequestTimings
    new_text: str = ""
    error: str | None = None  # why a sequence ended abnormally (e.g. out of KV blocks)
    # `SamplingParams.prompt_logprobs`: one entry per prompt token (None for the first), on index 0's first output
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_host_cached_tokens: int = 0  # of num_cached_tokens, restored from the host tier
    num_disk_cached_tokens: int = 0  # ... and from the disk tier
    speculation: DraftStats | None = None  # speculative decoding: the sequence's counters, on its last output
    stop_str: str | None = None  # the stop string that ended it (set by the output processor, which matches them)
    num_pinned_tokens: int = 0  # leading prompt tokens its breakpoints really retain (`SequenceInfo`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The engine's counters and gauges at one instant (for /metrics, benchmarks and tests)."""

    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    prefix_cache_preempted_queries_tokens: int = 0
    prefix_cache_preempted_hits_tokens: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_retained_evictions: int = 0  # of the evictions, pinned or held blocks
    prefix_cache_reset_evictions: int = 0  # of the evictions, by a prefix-cache reset
    prefix_cache_host_hits_tokens: int = 0  # of the hits (first admissions and re-admissions), restored from host
    prefix_cache_disk_hits_tokens: int = 0  # ... and from disk
    state_snapshots_cached: int = 0  # hybrid models: recurrent-state snapshots in the prefix tree
    state_snapshot_evictions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # an allocation can take them: never-used blocks plus cached blocks nobody holds
    kv_blocks_cached: int = 0
    kv_blocks_retained: int = 0  # pinned (breakpoints, named caches) or held for a session, not expired
    kv_retention_refused_blocks: int = 0  # retention refused at --max-retained-fraction
    kv_host_blocks_total: int = 0
    kv_host_blocks_cached: int = 0
    kv_disk_blocks_total: int = 0
    kv_disk_blocks_cached: int = 0
    kv_host_dropped_blocks: int = 0  # given up by the full host tier
    kv_disk_dropped_blocks: int = 0  # given up by the full disk tier
    kv_offload_bytes: int = 0  # device -> host
    kv_restore_bytes: int = 0  # host -> device
    kv_disk_write_bytes: int = 0
    kv_disk_read_bytes: int = 0
    kv_restore_seconds: float = 0.0  # the runner's time copying hits back (host and disk)
    requests_running: int = 0
    requests_waiting: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens: int = 0
    preemptions: int = 0
    spec_verifications: int = 0  # speculative decoding: sequence-steps that verified drafts
    spec_draft_tokens: int = 0  # drafts proposed (and verified)
    spec_accepted_tokens: int = 0  # drafts accepted
    decode_steps: int = 0  # sequence-steps that sampled a token (with or without drafts): tokens per step is
    # generation_tokens / decode_steps
    grammar_mask_steps: int = 0  # steps that applied a grammar's token masks (structured output, tool choice)
    grammar_mask_wait_seconds: float = 0.0  # of those steps' time, waiting for masks after the forward pass
