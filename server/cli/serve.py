"""`kvserve serve`: the OpenAI-compatible HTTP server for one model."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import fields

from server.http.connections import ConnectionLimits
from server.cli.engine_args import add_engine_args, engine_config_from_args
from server.inspector.store import DEFAULT_MAX_REQUESTS
from server.http.limits import RequestLimits
from server.pipeline.images import ImageFetch
from server.cache.tenant_budget import TenantLimits
from server.http.openapi import OPENAPI_MODES

_EPILOG = """\
examples:
  kvserve serve                                   # smollm2-135m on http://127.0.0.1:8000/v1
  kvserve serve --model qwen3-0.6b --port 8080 --api-key sk-team-a --api-key sk-team-b
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

  kvserve serve --model qwen3-8b --tensor-parallel-size 2    # one process per GPU, cuda:0 and cuda:1
  kvserve serve --ui --api-key sk-team-a --operator-key sk-ops   # + the cache inspector at http://127.0.0.1:8000/ui

Each --api-key is a tenant with its own prefix-cache salt (see server/cache/cache_salt.py for the timing side channel this
closes). KVSERVE_API_KEY adds a key from the environment, so it does not show in the process list.

If the engine dies (a tensor-parallel worker crashed), /health answers 503 and the server exits with status 1 a
moment later: a supervisor restarts it, and nothing hangs.
"""
# After the engine died: how long /health answers 503 (load balancers, clients in flight see why) before exiting.
UNHEALTHY_EXIT_DELAY_S = 1.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics) and Anthropic's Messages API "
        "(/v1/messages, /v1/messages/count_tokens), with a paged KV cache and a prefix cache shared across requests.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    net.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one "
                     "(default: %(default)s)")
    net.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY'); repeat for several tenants")
    net.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                     help="on SIGTERM/SIGINT, seconds to let running requests finish; what still runs a moment "
                     "before then ends with a 503 (a stream with its API's error event) (default: %(default)s)")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    api = parser.add_argument_group("API behaviour")
    api.add_argument("--allow-request-cache-salt", action="store_true",
                     help="honor a request's 'cache_salt' (scoped inside its tenant); refused with 400 otherwise")
    api.add_argument("--allow-image-urls", action="store_true",
                     help="fetch http(s) image URLs a request names (off: images come as data URLs, a URL is a 400; "
                     "docs/IMAGES.md)")
    api.add_argument("--image-url-hosts", nargs="+", default=[], metavar="HOST",
                     help="with --allow-image-urls, fetch images from these hosts only (default: any)")
    api.add_argument("--strict-max-tokens", action="store_true",
                     help="answer max_tokens beyond the context's room with 400 instead of clamping it")
    api.add_argument("--max-output-tokens", type=int, metavar="N",
                     help="the most tokens one request may generate: larger requests and agents' large defaults "
                     "are clamped to it (default: the room left in the context)")
    api.add_argument("--max-n", type=int, default=16, help="largest n (choices per request) (default: %(default)s)")
    api.add_argument("--reasoning-budget", type=int, metavar="N",
                     help="thinking tokens at most for a request that thinks and names no budget or effort of its own; "
                     "after them the engine forces a closing phrase and the model's </think> (default: no bound; "
                     "docs/SERVER.md, thinking budgets)")
    api.add_argument("--no-preserve-thinking", action="store_true",
                     help="Qwen3.6: drop the reasoning of turns before the last user message, as the template does "
                     "by default (kvserve keeps it, so each agent turn extends the cached prompt; docs/SERVER.md)")
    api.add_argument("--record", metavar="FILE.jsonl",
                     help="append every request (body, token ids, cached tokens, timings) for `kvserve bench replay`; "
                     "a path with {salt} writes one file per tenant (cache salt)")
    api.add_argument("--compaction-key", metavar="KEY",
                     help="the secret that seals Responses `compaction` items (remote compaction, docs/SERVER.md), "
                     "so that items made before a restart still open; KVSERVE_COMPACTION_KEY sets it from the "
                     "environment, out of the process list (default: a random key: items die with the process)")
    api.add_argument("--openapi", choices=OPENAPI_MODES, default="key",
                     help="GET /openapi.json: behind the API key like every endpoint (key), to anyone who can "
                     "connect (public), or not served (off) (default: %(default)s)")

    _add_limit_flags(parser.add_argument_group("request limits", "checked before any work on a request "
                                               "(docs/SERVER.md)"), RequestLimits, "limit")
    _add_limit_flags(parser.add_argument_group("connection limits", "checked in the HTTP protocol, before a request "
                                               "reaches the app"), ConnectionLimits, "connection")
    _add_limit_flags(parser.add_argument_group("tenant budgets", "per API key, so that no tenant starves another"),
                     TenantLimits, "tenant")

    ui = parser.add_argument_group("cache inspector (docs/INSPECTOR.md)")
    ui.add_argument("--ui", action="store_true",
                    help="serve the cache inspector at /ui (sessions, each request's prompt coloured by what the "
                    "cache served, why a turn missed, the cache over time); `kvserve inspect` reads the same")
    ui.add_argument("--ui-max-requests", type=int, default=DEFAULT_MAX_REQUESTS, metavar="N",
                    help="the inspector keeps the last N finished requests (default: %(default)s)")
    ui.add_argument("--operator-key", action="append", default=[], metavar="KEY",
                    help="an API key that sees every tenant's sessions in the inspector (a tenant's key sees its "
                    "own); it is accepted like an --api-key everywhere. KVSERVE_OPERATOR_KEY adds one from the "
                    "environment")

    core = parser.add_argument_group("engine core")
    core.add_argument("--engine-process", choices=("on", "off"), default="on",
                      help="run the engine core in a process of its own, so that HTTP, rendering, detokenizing and "
                      "parsing never share a GIL with the step; off: in a thread of the server's process (less "
                      "memory, a faster start; slower under many streams: docs/SERVER.md) (default: %(default)s)")
    core.add_argument("--engine-process-timeout", type=float, default=None, metavar="S",
                      help="seconds the engine core process may take to load the model before the server gives up "
                      "and shows the end of its stderr (default: half an hour)")
    add_engine_args(parser)  # --model and the engine flags, shared with `kvserve generate`
    parser.set_defaults(func=run_serve)


def _add_limit_flags(group: argparse._ArgumentGroup, limits: type, prefix: str) -> None:
    """One flag per field of the dataclass ``limits`` (its metadata names the flag and its help)."""
    for f in fields(limits):
        kind = f.metadata.get("type", type(f.default))
        group.add_argument(f.metadata["flag"], dest=f"{prefix}_{f.name}", type=kind, default=f.default,
                           metavar="S" if kind is float else "N",
                           help=f"{f.metadata['help']}{'' if f.default is None else ' (default: %(default)s)'}")


def _limits_from_args(args: argparse.Namespace, limits: type, prefix: str):
    return limits(**{f.name: getattr(args, f"{prefix}_{f.name}") for f in fields(limits)})


def _say(message: str) -> None:
    print(f"kvserve: {message}", file=sys.stderr, flush=True)


def _say_gpu_requirement(model: str | None, tensor_parallel_size: int) -> None:
    """Before a large model downloads or loads: how many GPUs it takes, when the run asks for fewer."""
    from engine.registry import default_model_name, get_model_spec

    spec = get_model_spec(model or default_model_name())
    requirement = spec.gpu_requirement()
    if requirement and tensor_parallel_size < (spec.gpus or 0):
        _say(requirement)


def run_serve(args: argparse.Namespace) -> int:
    from server.api.compaction import KEY_ENV as COMPACTION_KEY_ENV
    from server.http.app import create_app
    from server.pipeline.context import ServerSettings, load_context
    from server.http.graceful import GracefulServer

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    keys = tuple(args.api_key) + ((os.environ["KVSERVE_API_KEY"],) if os.environ.get("KVSERVE_API_KEY") else ())
    operators = tuple(args.operator_key) + ((os.environ["KVSERVE_OPERATOR_KEY"],)
                                            if os.environ.get("KVSERVE_OPERATOR_KEY") else ())
    if args.ui_max_requests < 1:
        _say(f"cannot serve: --ui-max-requests must be at least 1, not {args.ui_max_requests}")
        return 2
    if args.reasoning_budget is not None and args.reasoning_budget < 0:
        _say(f"cannot serve: --reasoning-budget must be at least 0, not {args.reasoning_budget}")
        return 2
    try:  # a limit out of range is said before the model loads
        limits, tenant_limits, connection_limits = (_limits_from_args(args, RequestLimits, "limit"),
                                                    _limits_from_args(args, TenantLimits, "tenant"),
                                                    _limits_from_args(args, ConnectionLimits, "connection"))
    except ValueError as exc:
        _say(f"cannot serve: {exc}")
        return 2
    settings = ServerSettings(
        api_keys=keys, allow_request_cache_salt=args.allow_request_cache_salt,
        strict_max_tokens=args.strict_max_tokens, max_output_tokens=args.max_output_tokens, max_n=args.max_n,
        preserve_thinking=not args.no_preserve_thinking, limits=limits, tenant_limits=tenant_limits,
        reasoning_budget=args.reasoning_budget,
        openapi=args.openapi,
        operator_keys=operators, ui=args.ui, ui_max_requests=args.ui_max_requests,
        compaction_key=args.compaction_key or os.environ.get(COMPACTION_KEY_ENV) or None,
        image_fetch=ImageFetch(allow_urls=args.allow_image_urls, hosts=tuple(args.image_url_hosts)),
    )
    started = time.perf_counter()
    try:
        config = engine_config_from_args(args)
        _say_gpu_requirement(args.model, config.tensor_parallel_size)
        ctx = load_context(args.model, config, settings, args.record, progress=_say,
                           engine_process=args.engine_process == "on",
                           engine_process_timeout_s=args.engine_process_timeout)
    except (ValueError, RuntimeError, OSError) as exc:
        _say(f"cannot serve: {exc}")
        return 1
    facts = ctx.engine.facts
    blocks, ranks = facts.num_blocks, config.tensor_parallel_size
    _say(f"loaded {ctx.model_name} in {time.perf_counter() - started:.1f}s: context {ctx.max_model_len} tokens, "
         f"{blocks} KV blocks of {facts.block_size} tokens{'' if config.block_size else ' (the model default)'} = "
         f"{blocks * facts.block_size:,} tokens fit "
         f"({facts.kv_cache_kind} cache, {facts.kv_bytes_per_token:,} KV bytes per token{' on each rank' if ranks > 1 else ''}), "
         f"prefix cache {'on' if config.enable_prefix_caching else 'off'}")
    if ranks > 1:
        for memory in facts.rank_memory:
            _say(f"tensor parallel {memory}")
    try:
        sock = socket.create_server((args.host, args.port))  # bound here, so the banner shows the real port
    except OSError as exc:
        _say(f"cannot listen on {args.host}:{args.port}: {exc}")
        ctx.engine.shutdown()
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    auth = f"{len(keys)} API key(s)" if keys else "no API key: anyone who can connect may use it"
    if operators:
        auth += f", {len(operators)} operator key(s)"
    _say(f"serving {ctx.model_name} at http://{shown}:{port}/v1 ({auth}). Ctrl-C or SIGTERM stops it")
    if args.ui:
        who = "each key sees its own sessions" if keys or operators else "anyone who can connect sees every prompt"
        _say(f"cache inspector at http://{shown}:{port}/ui (the last {args.ui_max_requests} requests; {who})")
    server = GracefulServer(create_app(ctx), connection_limits=connection_limits,
                            log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    ctx.engine.on_death(lambda error: _exit_soon(server, error))
    # uvicorn handles SIGINT/SIGTERM itself (stop accepting, drain, shut down), then re-raises the signal to whatever
    # handler was there before; with nothing left to interrupt by then, that handler just lets serve return (exit 0).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if ctx.engine.error is not None:
        _say(f"stopped: the engine died: {ctx.engine.error}")
        return 1
    _say("stopped")
    return 0


def _exit_soon(server, error: BaseException) -> None:
    _say(f"the engine died ({error}); /health answers 503, exiting in {UNHEALTHY_EXIT_DELAY_S:g}s")
    timer = threading.Timer(UNHEALTHY_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))
    timer.daemon = True
    timer.start()
