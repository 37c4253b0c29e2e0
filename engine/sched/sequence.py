"""A sequence's state as it moves through the scheduler: waiting -> running (-> preempted -> running) -> finished.

Words: the caller's *request* (``request_id``) asks for ``n`` completions of one prompt; each is a *sequence*
(``seq_id``: the request id for the first, ``"<request_id>#<index>"`` for its n - 1 siblings). The scheduler, the KV
manager and the worker deal in sequences; what leaves the engine carries the request id and the sequence's index.

Owned by the scheduler alone. With async scheduling a step is scheduled before the previous step's sampled tokens
are known: ``num_output_placeholders`` counts tokens that are sampled on the device but not yet appended here.

While it runs, what changes every step (its tokens, placeholders and computed tokens) lives in the scheduler's
`StepState` (engine/sched/step_state.py), so that a steady decode step never touches the sequence; the properties below
read through to it, and the fields behind them hold the state while the sequence does not run.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

from engine.kv.block_hashing import BlockHash
from engine.multimodal import ImageInput
from engine.outputs import FinishReason, RequestTimings, SequenceInfo, TokenLogprobs
from engine.phase_budget import PhaseTracker
from engine.retention import Retention
from engine.sampling_params import SamplingParams
from engine.sched.step_state import StepState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks released; waits at the front of the queue to recompute
    FINISHED = "finished"


def _step_counter(column: str, own: str, doc: str) -> property:
    """A counter of the sequence's that lives in its step state's ``column`` while it runs, in its field ``own``
    otherwise. (A property of closures: the general path reads these often, and a descriptor class costs twice.)"""
    read_column, read_own = operator.attrgetter(column), operator.attrgetter(own)

    def get(seq: Sequence) -> int:
        state = seq.step_state
        return read_own(seq) if state is None else read_column(state).item(seq.entry)

    def set_(seq: Sequence, value: int) -> None:
        state = seq.step_state
        if state is None:
            setattr(seq, own, value)
        else:
            read_column(state)[seq.entry] = value

    return property(get, set_, doc=doc)


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: str  # this sequence's id (n > 1 siblings: "<request_id>#<index>")
    _tokens: list[int]  # prompt then output (while running, the newest may still be in the step state: `token_ids`)
    num_prompt_tokens: int
    params: SamplingParams
    cache_salt: str | None = None
    request_id: str = ""  # the caller's request id: n > 1 sequences share it
    index: int = 0  # which of the n sequences
    block_hashes: list[BlockHash] = field(default_factory=list)  # of every full block of token_ids, grown as they fill
    images: tuple[ImageInput, ...] = ()  # the prompt's (engine/multimodal.py)
    num_encoded_images: int = 0  # of ``images``, those the scheduler had encoded (engine/sched/image_encoding.py)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    _num_computed: int = 0  # `num_computed_tokens` while not running
    _num_placeholders: int = 0  # `num_output_placeholders` while not running
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache at first admission
    num_host_cached_tokens: int = 0  # of those, restored from the host tier
    num_disk_cached_tokens: int = 0  # ... and from the disk tier
    num_preemptions: int = 0
    pending_siblings: int = 0  # n > 1: siblings to queue once this sequence's prompt is scheduled
    timings: RequestTimings = field(default_factory=RequestTimings)
    max_num_tokens: int = 0  # prompt + max_tokens, capped by the context length (set by the scheduler)
    retention: Retention | None = None  # pins and hold (n > 1: the leader's; siblings share its pinned blocks)
    # `params.prompt_logprobs`: one entry per prompt token scored so far (None for the first), until delivered
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    snapshot_points: list[int] = field(default_factory=list)  # hybrid models: prompt boundaries to snapshot at
    info: SequenceInfo | None = None  # what its outputs share, made at its first output
    phase: PhaseTracker | None = None  # `params.phase_budget`: where its output is in the phase, what to force
    step_state: StepState | None = None  # while running: where its per-step state lives ...
    entry: int = -1  # ... and its entry there

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output, every token sampled so far (one list, so the hot path never concatenates)."""
        if self.step_state is not None:
            self.step_state.flush(self.entry)
        return self._tokens

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        if self.step_state is not None:
            self.step_state.num_known[self.entry] += 1

    num_computed_tokens = _step_counter("num_computed", "_num_computed", "tokens whose K/V are in blocks (or will be, "
                                       "once the scheduled step ran)")
    num_output_placeholders = _step_counter("num_placeholders", "_num_placeholders", "tokens sampled in a step whose "
                                           "output is not back yet")

    @property
    def num_known_tokens(self) -> int:
        """``len(token_ids)``, without bringing the token list up to date."""
        state = self.step_state
        return len(self._tokens) if state is None else state.num_known.item(self.entry)

    @property
    def seed(self) -> int | None:
        return None if self.params.seed is None else self.params.seed + self.index

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Generated so far, counting tokens still on their way back from the device."""
        return self.num_known_tokens - self.num_prompt_tokens + self.num_output_placeholders

    @property
    def num_tokens(self) -> int:
        """Known tokens plus placeholders: the sequence's length once the steps in flight are back."""
        state = self.step_state
        if state is None:
            return len(self._tokens) + self._num_placeholders
        return state.num_known.item(self.entry) + state.num_placeholders.item(self.entry)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
