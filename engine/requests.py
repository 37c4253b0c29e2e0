"""An engine request and its preparation, done before the engine core sees it: validation and the prompt's block
hashes. On the engine thread that work would stall every running stream (a 40k-token prompt hashes in
~26 ms), so the server prepares a request on its prepare thread and the offline API on the caller's; the core only
checks what it alone knows (an id in use, a grammar). `RequestPreparer` reads configuration only: any thread may use
it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.block_hashing import BlockHash, BlockHasher
from engine.kv.window_pool import WindowBudget
from engine.errors import KVCacheTooSmallError, PromptTooLongError, RequestRejected
from engine.multimodal import ImageInput, check_layout
from engine.retention import Retention
from engine.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One engine request: a prompt with its sampling parameters, cache salt and what the cache should keep."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    retention: Retention | None = None
    # Set by `RequestPreparer.prepare`: the prompt's full blocks' hashes (empty without prefix caching)
    block_hashes: list[BlockHash] | None = None
    images: tuple[ImageInput, ...] = ()  # the prompt's, in order, each over its placeholder tokens
    # The hashes of its first full blocks where they are known already (a session's previous turn with the same
    # tokens there: server/pipeline/turn_cache.py); `RequestPreparer.prepare` hashes only the blocks after them
    known_block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def prepared(self) -> bool:
        return self.block_hashes is not None


@dataclass
class RequestPreparer:
    """Validates and prepares requests for one engine (its vocabulary, context length, KV pool and block hashing)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    hasher: BlockHasher | None  # None: no prefix caching, so no hashes
    speculation_refused: str | None = None  # why this engine cannot speculate (None: it can)
    mtp: bool = False  # the model's MTP layer is loaded (--speculative mtp): a request may draft with it
    image_token_id: int | None = None  # the placeholder of an image's tokens; None: the engine reads no images
    window_budget: WindowBudget | None = None  # a sliding-window model's window pool (None: no window group)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestRejected` for a request that could never run, before it takes any state."""
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.vocab_size
        if not 0 <= min(prompt_token_ids) or not max(prompt_token_ids) < vocab:
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise RequestRejected(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            over = len(prompt_token_ids) - self.max_model_len + 1
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}, so it is "
                f"{over} token(s) too long (leaving room for one generated token)"
            )
        blocks = -(-(len(prompt_token_ids) + 1) // self.block_size)
        if blocks > self.num_blocks:
            raise KVCacheTooSmallError(
                f"the prompt needs {blocks} KV blocks but the cache has {self.num_blocks}; "
                "give the engine more KV memory (num_kv_blocks / kv_cache_memory_gb)"
            )
        if self.window_budget is not None:
            total = min(len(prompt_token_ids) + max(params.max_tokens, 1), self.max_model_len)
            if (why := self.window_budget.refusal(total)) is not None:
                raise KVCacheTooSmallError(why)
        if self.speculation_refused and params.speculative not in (None, "off"):
            raise RequestRejected(f"speculative {params.speculative!r}: {self.speculation_refused}")
        if params.speculative == "mtp" and not self.mtp:
            raise RequestRejected("speculative 'mtp' drafts with the model's MTP layer, which this server loads only "
                                  "when started with --speculative mtp (on a checkpoint that has one)")

    def validate_images(self, prompt_token_ids: list[int], images: tuple[ImageInput, ...]) -> None:
        """Raise `RequestRejected` for images this engine cannot read or that do not sit on their placeholders."""
        if not images:
            return
        if self.image_token_id is None:
            raise RequestRejected("this model reads text only (no vision tower is loaded: a text-only model, or "
                                  "--language-model-only); send the request without images")
        problem = check_layout(images, prompt_token_ids, self.image_token_id)
        if problem:
            raise RequestRejected(f"the images do not fit the prompt: {problem}")

    def prepare(self, request: EngineRequest) -> EngineRequest:
        """Validate ``request`` and fill in its block hashes, in place; returns it. (The prompt is read, never kept:
        the core copies it once into the sequence it grows.) A block holding part of an image hashes its content
        too (engine/kv/block_hashing.py)."""
        self.validate(request.prompt_token_ids, request.params)
        self.validate_images(request.prompt_token_ids, request.images)
        hashes: list[BlockHash] = []
        if self.hasher is not None:
            hashes = request.known_block_hashes[: len(request.prompt_token_ids) // self.block_size]
            self.hasher.extend(hashes, request.prompt_token_ids, request.cache_salt, request.images)
        request.block_hashes = hashes
        return request
