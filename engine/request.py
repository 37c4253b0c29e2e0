"""A request's state as it moves through the engine: waiting -> running (-> preempted -> running) -> finished."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # pages released; waits at the front of the queue to recompute
    FINISHED = "finished"


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


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt then output: one list, so the hot path never concatenates
    num_prompt_tokens: int
    params: SamplingParams
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed_tokens: int = 0  # tokens whose K/V are in pages
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache at first admission
    num_preemptions: int = 0
    group_id: str = ""  # the client's request id: n > 1 sequences share it
    index: int = 0  # which of the n sequences
    pending_siblings: int = 0  # n > 1: siblings to fork from this sequence once its prompt is computed
    timings: RequestTimings = field(default_factory=RequestTimings)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
