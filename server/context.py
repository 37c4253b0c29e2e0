"""What every handler needs: the served model, its engine thread, the operator's settings, and request-independent
helpers (model-name check, sampling parameters with the max_tokens policy, request ids, and the thread that renders
and tokenizes prompts off the event loop)."""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from engine.config import EngineConfig
from engine.retention import CachePin, Retention
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputs, StructuredOutputSpec
from server.async_engine import AsyncEngine
from server.logprobs import TokenTexts
from server.metrics import Metrics
from server.named_caches import NamedCaches
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from server.recorder import Recorder
from server.rendering import Renderer

P = ParamSpec("P")
R = TypeVar("R")
# A session's blocks are held this long after its reply ends, until the server has parsed the reply: a reply that
# ends in tool calls extends the hold to --tool-call-ttl (the engine may run a step or two in between).
TOOL_CALL_GRACE_S = 2.0


@dataclass(frozen=True)
class ServerSettings:
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    allow_request_cache_salt: bool = False
    strict_max_tokens: bool = False  # max_tokens beyond the context's room: 400 instead of clamping
    max_output_tokens: int | None = None  # the operator's cap on one request's output (None: the context's room)
    max_n: int = 16
    max_body_bytes: int = 32 * 1024 * 1024
    preserve_thinking: bool = True  # keep past turns' reasoning where the template can (Qwen3.6; docs/SERVER.md)


@dataclass
class ServingContext:
    """``tokenizer`` and ``renderer`` run on the prepare thread only (`prepare`); the event loop detokenizes with
    the engine client's own tokenizer: a Rust tokenizer used from two threads at once can fail."""

    model_name: str
    family: str  # the chat template family: picks the tool-call and reasoning parsers
    renderer: Renderer
    tokenizer: Any
    max_model_len: int
    engine: AsyncEngine
    metrics: Metrics
    grammars: StructuredOutputs  # the engine's grammar compiler (thread-safe): handlers compile off the engine thread
    settings: ServerSettings = field(default_factory=ServerSettings)
    recorder: Recorder | None = None
    aliases: frozenset[str] = frozenset()  # other names clients may use for the model (its HF repo id)
    named_caches: NamedCaches = field(default_factory=NamedCaches)
    created: int = field(default_factory=lambda: int(time.time()))
    # This process's identity, new at every start (a restarted replica's cache is empty): responses carry it as
    # `system_fingerprint`, routers read it from /get_server_info.
    instance_id: str = field(default_factory=lambda: f"kvserve-{secrets.token_hex(6)}")
    token_texts: TokenTexts = field(init=False)  # token id -> text and bytes, for logprobs (event loop)
    _prepare_thread: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.engine.tokenizer)
        self._prepare_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-prepare")

    async def prepare(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn`` (rendering, tokenizing: a 40k-token agent prompt takes a while) on the prepare thread, so the
        event loop keeps streaming other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_thread, lambda: fn(*args, **kwargs))

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name and requested not in self.aliases:
            raise APIError(
                404, f"The model '{requested}' does not exist; this server serves '{self.model_name}'.",
                param="model", code="model_not_found",
            )

    def retention(self, pins: tuple[CachePin, ...], session: str | None) -> Retention | None:
        """What the engine should keep of a request: its breakpoints' pins and, for an agent session, a hold after
        it ends (extended when the reply ends in tool calls; see `TOOL_CALL_GRACE_S`)."""
        hold = TOOL_CALL_GRACE_S if session and self.engine.engine.cfg.tool_call_ttl > 0 else 0.0
        return Retention(pins, hold) if pins or hold else None

    def encode(self, text: str) -> list[int]:
        # The chat templates write BOS and friends themselves; adding special tokens would double them.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def sampling_params(
        self, req: ChatCompletionRequest | CompletionRequest, prompt_len: int, *, skip_special_tokens: bool,
        num_logprobs: int | None, structured_output: StructuredOutputSpec | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        if req.n > self.settings.max_n:
            raise APIError(400, f"n is {req.n}; this server allows at most {self.settings.max_n}", param="n")
        try:
            return SamplingParams(
                max_tokens=self._max_tokens(req.requested_max_tokens, prompt_len),
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k or 0,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=num_logprobs,
                prompt_logprobs=prompt_logprobs,
                n=req.n,
                skip_special_tokens=skip_special_tokens,
                structured_output=structured_output,
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


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def load_context(
    model: str | None, engine_config: EngineConfig, settings: ServerSettings, record_path: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> ServingContext:
    """Resolve the model (building, converting or downloading it on first use), load it into an engine and wrap it
    for serving. `progress` receives one line per loading stage."""
    from transformers import AutoTokenizer

    from engine.llm_engine import LLMEngine
    from engine.registry import default_model_name, get_model_spec, model_identity, resolve_model
    from server.rendering import renderer_for_model

    spec = get_model_spec(model or default_model_name())
    progress(f"resolving model {spec.name} ({spec.source}; first use builds or downloads it)")
    model_dir = resolve_model(model or spec.name)
    progress(f"loading {model_dir} onto {engine_config.device} ({engine_config.dtype})")
    engine = LLMEngine(model_dir, engine_config, model_id=model_identity(spec, model_dir))
    # Each thread that touches a tokenizer has its own: the prepare thread renders and encodes with one, the event loop
    # detokenizes with another, and the engine's serves grammar compilation. A Rust tokenizer shared across threads
    # can fail with "Already borrowed" when one thread encodes while another decodes.
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    output_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = renderer_for_model(spec.template, tokenizer)
    metrics = Metrics(spec.name)
    return ServingContext(
        model_name=spec.name,
        family=spec.template,
        renderer=renderer,
        tokenizer=tokenizer,
        max_model_len=engine.max_model_len,
        engine=AsyncEngine(engine, output_tokenizer, metrics),
        metrics=metrics,
        grammars=engine.structured_outputs,
        settings=settings,
        recorder=Recorder(record_path) if record_path else None,
        aliases=frozenset(name for name in (spec.repo_id,) if name),
    )
