"""What every handler needs: the served model, its engine thread, the operator's settings, and request-independent
helpers (model-name check, sampling parameters with the max_tokens policy, request ids), and the work that prepares
a request off the event loop: rendering and tokenizing on two lanes of threads (a request whose body is larger than
`SMALL_LANE_BYTES` takes the second lane, so small requests never wait behind a large one; each lane takes the
tenants' jobs in turn), and grammar
compilation in worker processes, with a time limit, cancelled when its request goes away (an optional grammar is
never waited for: server/pipeline/optional_grammars.py compiles it in the background)."""
from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Any, ParamSpec, TypeVar

from fastapi import Depends, Request

from engine.config import EngineConfig
from engine.core.client import start_core
from engine.models.vision.preprocess import ImagePreprocessor
from engine.retention import CachePin, Retention
from engine.phase_budget import PhaseBudget
from engine.sampling_params import SamplingParams, StructuredOutputSpec
from engine.worker.structured_output import StructuredOutputs
from server.pipeline.async_engine import AsyncEngine
from server.cache.cache_salt import effective_salt, salt_tenant, tenant_salt
from server.inspector.hook import inspect_finished
from server.inspector.store import DEFAULT_MAX_REQUESTS, Inspector
from server.http.limits import RequestLimits
from server.pipeline.fair_lane import FairLane
from server.pipeline.images import ImageFetch, ImageReader
from server.cache.tenant_budget import TenantLimits, TenantSlots, sequences_per_tenant
from server.pipeline.logprobs import TokenTexts
from server.http.metrics import Metrics
from server.cache.named_caches import NamedCaches
from server.pipeline.optional_grammars import OptionalGrammars
from server.api.protocol import APIError
from server.pipeline.recorder import Recorder
from server.rendering import Renderer, serving_template_kwargs
from server.pipeline.turn import Sampling
from server.pipeline.turn_cache import TurnCache, TurnTokens

P = ParamSpec("P")
R = TypeVar("R")
LARGE_REQUEST_BYTES = 256 * 1024  # bodies above this are parsed off the event loop
# Bodies above this are prepared on the large lane: a small request waits at most for one job of this size on its
# lane (~0.15 s of tokenizing; a 250 KB prompt took 0.55 s, and 20 of them held the small lane's newcomer 3-5 s).
SMALL_LANE_BYTES = 64 * 1024
# The size of the request being handled (set when its body is read): which lane prepares it.
body_bytes: ContextVar[int] = ContextVar("body_bytes", default=0)
# The tenant of the request being handled (set with its size): a lane takes each tenant's preparations in turn.
prepare_tenant: ContextVar[str | None] = ContextVar("prepare_tenant", default=None)


@dataclass(frozen=True)
class ServerSettings:
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    allow_request_cache_salt: bool = False
    strict_max_tokens: bool = False  # max_tokens beyond the context's room: 400 instead of clamping
    max_output_tokens: int | None = None  # the operator's cap on one request's output (None: the context's room)
    max_n: int = 16
    preserve_thinking: bool = True  # keep past turns' reasoning where the template can (Qwen3.6; docs/SERVER.md)
    limits: RequestLimits = RequestLimits()
    tenant_limits: TenantLimits = TenantLimits()  # per-tenant budgets (server/cache/tenant_budget.py)
    openapi: str = "key"  # GET /openapi.json: "key" (behind the API key), "public" or "off" (server/http/openapi.py)
    operator_keys: tuple[str, ...] = ()  # API keys that see every tenant in the cache inspector
    ui: bool = False  # serve the cache inspector (/ui; docs/INSPECTOR.md)
    ui_max_requests: int = DEFAULT_MAX_REQUESTS  # the inspector keeps this many finished requests
    compaction_key: str | None = None  # seals `compaction` items (server/api/compaction.py); None: a random key
    image_fetch: ImageFetch = ImageFetch()  # whether image URLs are fetched (--allow-image-urls; off)
    reasoning_budget: int | None = None  # thinking tokens at most unless a request says (--reasoning-budget; None: no bound)


@dataclass
class PrepareTools:
    """What one prepare thread renders and tokenizes with: a Rust tokenizer used from two threads at once can fail
    ("Already borrowed"), so each lane has its own."""

    tokenizer: Any
    renderer: Renderer


class _Lane:
    """One thread and its own tokenizer and renderer, taking each tenant's jobs in turn (server/pipeline/fair_lane.py)."""

    def __init__(self, name: str, tools: PrepareTools, current: threading.local) -> None:
        self.tools = tools
        self.executor = FairLane(name, initializer=lambda: setattr(current, "tools", tools))


@dataclass
class ServingContext:
    """``tokenizer`` and ``renderer`` are the current prepare lane's (`prepare`); elsewhere (the event loop)
    ``tokenizer`` is the engine client's own, which detokenizes there. ``large_lane``: the tools of the lane that
    prepares large requests (None: they share the one lane)."""

    model_name: str
    family: str  # the chat template family: picks the tool-call and reasoning parsers
    lane_tools: PrepareTools
    max_model_len: int
    engine: AsyncEngine
    metrics: Metrics
    grammars: StructuredOutputs  # the engine's grammar compiler (thread-safe): handlers compile off the engine thread
    settings: ServerSettings = field(default_factory=ServerSettings)
    recorder: Recorder | None = None
    aliases: frozenset[str] = frozenset()  # other names clients may use for the model (its HF repo id)
    named_caches: NamedCaches = field(default_factory=NamedCaches)
    inspector: Inspector | None = None  # the cache inspector (`--ui`)
    # Called where a request finishes (`server.pipeline.generation.record`) with (context, endpoint, prompts, session, turn):
    # the inspector's hook with `--ui`. The pipeline calls it and knows nothing of what listens.
    on_finished: Callable[..., None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # This process's identity, new at every start (a restarted replica's cache is empty): responses carry it as
    # `system_fingerprint`, routers read it from /get_server_info.
    instance_id: str = field(default_factory=lambda: f"kvserve-{secrets.token_hex(6)}")
    large_lane: PrepareTools | None = None
    max_num_seqs: int = 64  # the engine's running slots (EngineConfig.max_num_seqs): the tenants' default share
    images: ImageReader | None = None  # a vision-language model's image reading (None: it reads text only)
    token_texts: TokenTexts = field(init=False)  # token id -> text and bytes, for logprobs (event loop)
    tenant_slots: TenantSlots = field(init=False)  # each tenant's sequences in the engine
    optional_grammars: OptionalGrammars = field(init=False)  # tool_choice auto's grammars, compiled in the background
    _current: threading.local = field(init=False, repr=False)
    _lanes: tuple[_Lane, _Lane] = field(init=False, repr=False)
    _compile_waits: ThreadPoolExecutor = field(init=False, repr=False)
    _max_token_bytes: int = field(init=False, repr=False)  # the longest token's bytes (`encode_prompt`)
    # each agent session's last turn: what the next one need not tokenize and hash again (`encode_turn`)
    turns: TurnCache = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.engine.tokenizer)
        self.tenant_slots = TenantSlots(sequences_per_tenant(
            self.settings.tenant_limits, len(self.settings.api_keys) + len(self.settings.operator_keys),
            self.max_num_seqs))
        self._max_token_bytes = max_token_bytes(self.lane_tools.tokenizer)
        tools = self.lane_tools
        self.turns = TurnCache.for_template(
            tools.tokenizer, lambda messages: tools.renderer.render(messages, None, True, **serving_template_kwargs(
                tools.renderer, self.settings.preserve_thinking)), self.engine.facts.block_size)
        self.optional_grammars = OptionalGrammars(self.grammars)
        self._current = threading.local()
        small = _Lane("kvserve-prepare", self.lane_tools, self._current)
        self._lanes = (small, _Lane("kvserve-prepare-large", self.large_lane, self._current)
                       if self.large_lane is not None else small)
        # Threads that only wait for compile workers (a compile takes no thread of the lanes).
        self._compile_waits = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvserve-compile-wait")

    @property
    def tokenizer(self) -> Any:
        tools = getattr(self._current, "tools", None)
        return self.engine.tokenizer if tools is None else tools.tokenizer

    @property
    def renderer(self) -> Renderer:
        tools = getattr(self._current, "tools", None)
        if tools is None:
            raise RuntimeError("rendering runs on a prepare lane only (ServingContext.prepare)")
        return tools.renderer

    async def prepare(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn`` (rendering, tokenizing: a 40k-token agent prompt takes a while) on a prepare lane, so the event
        loop keeps streaming other requests meanwhile: the large lane for a request whose body is over
        `SMALL_LANE_BYTES`, else the small one; on either, each tenant's preparations take turns with the other
        tenants'. Cancelled before it starts, it never runs."""
        lane = self._lanes[body_bytes.get() > SMALL_LANE_BYTES]
        return await asyncio.wrap_future(lane.executor.submit(prepare_tenant.get(), lambda: fn(*args, **kwargs)))

    async def compile_grammar(self, spec: StructuredOutputSpec, tenant: str | None) -> None:
        """Compile ``spec`` (unless ``tenant`` compiled it before) in a compile worker, within the operator's time
        limit, so that the engine finds it cached. ValueError (`CompileTimeout` too) when it cannot be compiled; a
        cancelled caller stops the compile (its worker is killed)."""
        cancelled = threading.Event()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._compile_waits, self.grammars.compile_isolated, spec,
                                       self.settings.limits.compile_timeout_s, cancelled, tenant)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def optional_grammar_missing(self, spec: StructuredOutputSpec, tenant: str | None) -> str | None:
        """None when ``tenant`` has the optional grammar ``spec`` compiled; else why its request runs without it (its
        compile goes on in the background, within the operator's background limit)."""
        return self.optional_grammars.missing(spec, tenant, self.settings.limits.background_compile_timeout_s)

    def close(self) -> None:
        """Stop preparing: compiles end at once (in the background too); queued preparations are dropped."""
        self.optional_grammars.close()
        self.grammars.close()
        for lane in set(self._lanes):
            lane.executor.shutdown()
        self._compile_waits.shutdown(wait=False, cancel_futures=True)

    def salt_for(self, request: Request, requested: str | None) -> str | None:
        """The cache salt of an authenticated request: its tenant's, with the request's own where the operator allows
        it (server/cache/cache_salt.py)."""
        return effective_salt(tenant_salt(request.state.api_key), requested, self.settings.allow_request_cache_salt)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name and requested not in self.aliases:
            raise APIError(
                404, f"The model '{requested}' does not exist; this server serves '{self.model_name}'.",
                param="model", code="model_not_found",
            )

    @property
    def recurrent_state(self) -> bool:
        """The model is a hybrid whose prefix hits need state snapshots (requests carry message-boundary hints)."""
        return self.engine.facts.is_hybrid

    def retention(self, pins: tuple[CachePin, ...], session: str | None, cache_salt: str | None,
                  snapshot_hints: tuple[int, ...] = ()) -> Retention | None:
        """What the engine should keep of a request: its breakpoints' pins, for an agent session a hold after it
        ends (kept if the reply ends in tool calls, else released: `RequestStream.hold`), and for a hybrid model
        where to snapshot its recurrent state. With two or more keys, what it retains counts against its tenant's
        share of the retention cap (--max-retained-share-per-tenant)."""
        hold = self.engine.facts.tool_call_ttl if session else 0.0
        if not (pins or hold or snapshot_hints):
            return None
        return Retention(pins, hold, snapshot_hints, self.retention_tenant(cache_salt))

    def retention_tenant(self, cache_salt: str | None) -> str | None:
        """The tenant whose share of the retention cap a request's pins and holds count against: its API key's,
        when the server has several (with one, the cap is that tenant's alone)."""
        several = len(self.settings.api_keys) + len(self.settings.operator_keys) >= 2
        return salt_tenant(cache_salt) if several else None

    def encode(self, text: str) -> list[int]:
        # The chat templates write BOS and friends themselves; adding special tokens would double them.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def named_cache_budget(self) -> tuple[int, int]:
        """(caches, pinned tokens) one tenant's named caches may hold (server/cache/tenant_budget.py)."""
        limits, facts = self.settings.tenant_limits, self.engine.facts
        return limits.named_caches, int(limits.named_cache_share * facts.num_blocks * facts.block_size)

    def encode_prompt(self, text: str, param: str | None = None) -> list[int]:
        """A prompt's token ids, refusing (400) before tokenizing a text that cannot fit the context whatever its
        tokens: more bytes than the context's tokens times the longest token's bytes (tokenizing a too-long prompt
        held a prepare lane for its whole length before the engine said so)."""
        self._check_prompt_size(text, param)
        return self.encode(text)

    def encode_turn(self, text: str, session: Hashable | None) -> TurnTokens:
        """A chat turn's prompt as `encode_prompt` makes it, reusing what ``session`` (tenant salt, session id; None:
        none) tokenized and hashed on its last turn (server/pipeline/turn_cache.py)."""
        self._check_prompt_size(text, "messages")
        return self.turns.encode(session, text, self.encode)

    def _check_prompt_size(self, text: str, param: str | None) -> None:
        limit = self.max_model_len * self._max_token_bytes
        size = len(text.encode("utf-8", "surrogatepass")) if len(text) * 4 > limit else 0
        if size > limit:
            raise APIError(400, f"the prompt is {size} bytes: too long for the context of {self.max_model_len} tokens "
                           f"(no token of this model is longer than {self._max_token_bytes} bytes)", param=param,
                           code="context_length_exceeded")

    def sampling_params(
        self, req: Sampling, prompt_len: int, *, skip_special_tokens: bool,
        num_logprobs: int | None, structured_output: StructuredOutputSpec | None = None,
        prompt_logprobs: int | None = None, session: str | None = None, phase_budget: PhaseBudget | None = None,
    ) -> SamplingParams:
        """``session``: the agent session (server/cache/session.py), whose earlier text the suffix proposer drafts from."""
        if req.n > self.settings.max_n:
            raise APIError(400, f"n is {req.n}; this server allows at most {self.settings.max_n}", param="n")
        try:
            return SamplingParams(
                max_tokens=self._max_tokens(req.max_tokens, prompt_len),
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k or 0,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                stop=list(req.stop),
                stop_token_ids=list(req.stop_token_ids),
                ignore_eos=req.ignore_eos,
                logprobs=num_logprobs,
                prompt_logprobs=prompt_logprobs,
                n=req.n,
                skip_special_tokens=skip_special_tokens,
                structured_output=structured_output,
                speculative=req.speculative,
                speculative_session=session,
                phase_budget=phase_budget,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """Agents send large defaults (OpenCode: 32000), so by default a request asking for more than the context has
        room for gets the room and ends with finish_reason "length"; `strict_max_tokens` refuses it instead."""
        room = self.max_model_len - prompt_len
        if room < 1:
            return 1  # the engine rejects the prompt with how much too long it is
        cap = min(room, self.settings.max_output_tokens or room)
        if requested is None:
            return cap
        if requested > room and self.settings.strict_max_tokens:
            raise APIError(
                400,
                f"max_tokens is {requested}, but the prompt has {prompt_len} tokens and the context holds "
                f"{self.max_model_len}: at most {room} can be generated",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return min(requested, cap)


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the bytes one token decodes to: its vocabulary's longest entry in UTF-8 (a byte-level BPE
    entry writes each byte as one character, a sentencepiece one its space as three bytes and a byte as six)."""
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=1)


def served(request: Request) -> ServingContext:
    """The served model's context, from the app that took the request (server/http/app.py: create_app)."""
    return request.app.state.ctx


# Handlers take the context as a dependency, never from a closure: FastAPI caches every endpoint function for the
# process's life, so a closure over the context would keep each stopped server's model and KV cache alive (tests,
# benchmarks and notebooks start many servers in one process).
Served = Annotated[ServingContext, Depends(served)]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def load_context(
    model: str | None, engine_config: EngineConfig, settings: ServerSettings, record_path: str | None = None,
    progress: Callable[[str], None] = lambda message: None, engine_process: bool = False,
    engine_process_timeout_s: float | None = None,
) -> ServingContext:
    """Resolve the model (building, converting or downloading it on first use), load it into an engine and wrap it
    for serving. `progress` receives one line per loading stage. ``engine_process``: the engine core runs in a
    process of its own (engine/core/process.py; `CoreStartError` if it cannot start within
    ``engine_process_timeout_s``), else in a thread of this one."""
    from engine.registry import default_model_name, get_model_spec, model_identity, resolve_model
    from engine.text.tokenizer_load import load_tokenizer
    from server.rendering import renderer_for_model

    spec = get_model_spec(model or default_model_name())
    progress(f"resolving model {spec.name} ({spec.source}; first use builds or downloads it)")
    model_dir = resolve_model(model or spec.name)
    where = " in a process of its own" if engine_process else ""
    progress(f"loading {model_dir} onto {engine_config.device} ({engine_config.dtype}){where}")
    core = start_core(model_dir, engine_config, model_identity(spec, model_dir), engine_process,
                      engine_process_timeout_s, progress)
    facts = core.facts
    # Each thread that touches a tokenizer has its own: each prepare lane renders and encodes with one, the event loop
    # detokenizes with another, and the engine's serves grammar compilation. A Rust tokenizer shared across threads
    # can fail with "Already borrowed" when one thread encodes while another decodes. The files are read once
    # (load_tokenizer: the others are copies).
    def lane_tools() -> PrepareTools:
        tokenizer = load_tokenizer(model_dir)
        return PrepareTools(tokenizer, renderer_for_model(spec.template, tokenizer))

    output_tokenizer = load_tokenizer(model_dir)
    metrics = Metrics(spec.name)
    inspector = None
    if settings.ui:  # its hook runs on the event loop: it decodes with the event loop's tokenizer
        inspector = Inspector(facts.block_hasher, spec.name, settings.ui_max_requests,
                              lambda ids: output_tokenizer.decode(ids, skip_special_tokens=False))
    return ServingContext(
        model_name=spec.name,
        family=spec.template,
        lane_tools=lane_tools(),
        large_lane=lane_tools(),
        max_model_len=facts.max_model_len,
        max_num_seqs=engine_config.max_num_seqs,
        engine=AsyncEngine(core, output_tokenizer, metrics),
        metrics=metrics,
        grammars=core.grammars,
        settings=settings,
        recorder=Recorder(record_path) if record_path else None,
        aliases=frozenset(name for name in (spec.repo_id,) if name),
        inspector=inspector,
        on_finished=inspect_finished if inspector is not None else None,
        images=None if facts.image_token_id is None else ImageReader(
            ImagePreprocessor.from_model_dir(model_dir), facts.image_token_id, settings.limits.images,
            settings.image_fetch),
    )
