"""The engine core's boundary: what a client (the server, the offline API) may ask of a running engine core, and the
facts about the engine it learns once, at startup. Two cores implement it: `engine.core.loop.EngineLoop` (a
thread of this process) and `engine.core.process.CoreProcess` (a process of its own, over ZMQ). Everything crosses
as plain data (requests, named queries, `StepOutputs`), never as code, so either core serves the same client.

A leaf of the core's modules: the cores and the wire (engine/core/wire.py) import it and it imports none of them, so
the core never imports its client. `engine.core.client.start_core` picks a core and builds it.
"""
from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv.block_hashing import BlockHash, BlockHasher
from engine.kv.blocks import CachedPrefix
from engine.kv.window_pool import WindowBudget
from engine.outputs import SchedulerStats, StepOutputs
from engine.multimodal import ImageInput
from engine.requests import EngineRequest, RequestPreparer

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.worker.structured_output import StructuredOutputs


class OutputSink(Protocol):
    """Where the outputs of the requests submitted with it go, from the core's receiving thread: once per step,
    that step's outputs of all of them, or once the error that ended the core. Must not block."""

    def put(self, item: StepOutputs | BaseException) -> None: ...


StatsListener = Callable[[SchedulerStats], None]


@dataclass(frozen=True)
class EngineFacts:
    """What a client needs to know about the engine and its model, fixed once the engine is built: enough to
    validate and hash requests on its own side (`preparer`), size usage and retention, and log the startup."""

    model_id: str  # the block hashes' model identity
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    prefix_caching: bool
    is_hybrid: bool  # prefix hits need recurrent-state snapshots
    tool_call_ttl: float
    speculation_refused: str | None  # why this engine cannot speculate (None: it can)
    mtp: bool  # the model's MTP layer is loaded
    eos_token_ids: tuple[int, ...]
    kv_cache_kind: str
    kv_bytes_per_token: int
    rank_memory: tuple[str, ...]  # one line per tensor-parallel rank: its weights and KV blocks
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_topic: str
    image_token_id: int | None = None  # the placeholder of image tokens where a vision tower is loaded (else None)
    window_budget: WindowBudget | None = None  # a sliding-window model's window pool, as one sequence may use it

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        cfg, runner = engine.cfg, engine.runner
        return cls(
            model_id=engine.hasher.model_id, vocab_size=engine.model_cfg.vocab_size,
            max_model_len=engine.max_model_len, block_size=cfg.block_size, num_blocks=runner.num_blocks,
            prefix_caching=cfg.enable_prefix_caching, is_hybrid=engine.model_cfg.is_hybrid,
            tool_call_ttl=cfg.tool_call_ttl, speculation_refused=engine.speculation_refused,
            mtp=engine.model_cfg.num_mtp_layers > 0, eos_token_ids=tuple(engine.eos_token_ids),
            kv_cache_kind=runner.kv_spec.kind,
            kv_bytes_per_token=runner.kv_spec.bytes_per_token(cfg.kv_cache_torch_dtype, cfg.block_size),
            rank_memory=tuple(memory.describe() for memory in engine.rank_memory),
            kv_events_endpoint=cfg.kv_events_endpoint, kv_events_replay_endpoint=cfg.kv_events_replay_endpoint,
            kv_events_topic=cfg.kv_events_topic, image_token_id=engine.image_token_id,
            window_budget=engine.window_budget,
        )

    @property
    def block_hasher(self) -> BlockHasher:
        return BlockHasher(self.block_size, self.model_id)

    def preparer(self) -> RequestPreparer:
        """Validates requests and makes their block hashes as the engine would (any thread)."""
        return RequestPreparer(self.vocab_size, self.max_model_len, self.block_size, self.num_blocks,
                               self.block_hasher if self.prefix_caching else None, self.speculation_refused, self.mtp,
                               self.image_token_id, self.window_budget)


class EngineCoreClient(ABC):
    """A running engine core, seen from its clients. The contract:

    - Every method may be called from any thread and never blocks on the engine's work: what answers returns a
      `concurrent.futures.Future`, resolved from the core's side between steps (a consistent view of its state).
    - Commands apply in the order they were sent: an `abort` after a `submit` finds its request.
    - `submit` admits requests together (no step between them) that arrive prepared (`RequestPreparer`: validated,
      block hashes made), and hands each step's outputs of all requests submitted with one sink to it in one `put`.
    - When the core dies (a fault in a step, a dead tensor-parallel worker, a dead core process), `alive` turns
      false at once, `error` says why, every sink gets the error once, pending futures fail with
      `EngineDeadError`, and ``on_death`` (if set) is called once, from whichever thread saw it.
    """

    facts: EngineFacts
    # The grammar compiler the client compiles structured-output grammars with (thread-safe), so that the core finds
    # them compiled: the engine's own in-process; beside a core process, the client's, whose grammars travel with
    # their requests.
    grammars: StructuredOutputs
    on_death: Callable[[BaseException], None] | None
    on_stats: StatsListener | None  # the engine's counters after every step (/metrics), before its outputs leave

    @abstractmethod
    def start(self) -> None:
        """Start stepping (idempotent)."""

    @abstractmethod
    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs, stop the core and release what outlives it (workers, the disk tier's writes)."""

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @property
    @abstractmethod
    def error(self) -> BaseException | None: ...

    @abstractmethod
    def submit(self, requests: list[EngineRequest], sink: OutputSink) -> concurrent.futures.Future[None]:
        """Queue prepared requests; resolves once all are accepted, or fails with `RequestRejected` (none runs)."""

    @abstractmethod
    def abort(self, request_id: str, index: int | None = None) -> None:
        """Finish the request (or its sequence ``index``) and free its blocks before the next step."""

    @abstractmethod
    def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None,
                          images: tuple[ImageInput, ...] = ()) -> concurrent.futures.Future[int]:
        """How many leading tokens of a prompt (``images``: its images, hashed into their blocks) the prefix cache
        holds now."""

    @abstractmethod
    def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: float) -> concurrent.futures.Future[int]:
        """Pin a prompt's cached blocks for ``ttl_s`` seconds (0: unpin); resolves to the blocks the device holds."""

    @abstractmethod
    def settle_hold(self, request_id: str, keep_s: float) -> concurrent.futures.Future[int]:
        """End the hold of a finished request submitted with one: keep its blocks ``keep_s`` more seconds (its reply
        ended in tool calls), or 0: release them now (`LLMEngine.settle_hold`)."""

    @abstractmethod
    def stats(self) -> concurrent.futures.Future[SchedulerStats]: ...

    @abstractmethod
    def reset_prefix_cache(self) -> concurrent.futures.Future[None]:
        """Drop every cached block no sequence holds, in every tier (between benchmark runs, tests)."""

    @abstractmethod
    def blocks_now(self, block_hashes: list[BlockHash]) -> concurrent.futures.Future[tuple[list[str | None],
                                                                                          list[int]]]:
        """Where each block of a chain is cached now ("retained", "device", "host", "disk" or None), and where a
        hybrid model could resume it (token counts): the inspector's view of one request."""

    @abstractmethod
    def largest_prefixes(self, limit: int) -> concurrent.futures.Future[tuple[list[CachedPrefix], float]]:
        """The ``limit`` longest cached prefixes of the device tree, and the KV cache's clock now."""


# The named queries, as a core in another process receives them by name (each answers with a future).
QUERIES = ("num_cached_tokens", "pin", "settle_hold", "stats", "reset_prefix_cache", "blocks_now",
           "largest_prefixes")
