"""``kvserve bench turns``: an agent conversation that grows by about ``--new-tokens`` tokens a turn (a tool call and
its result), from ``--start-tokens`` to ``--max-tokens``, each turn served by the server's own pipeline in this
process (the thread core): the turn is planned on a prepare lane (render + tokenize), prepared (block hashes),
matched against the prefix cache and prefilled up to its first token.

Per turn, side by side in the same run:
- ``host_s``: render + tokenize + hash + match as the server does it now (a session's last turn reused,
  server/pipeline/turn_cache.py), and ``full_host_s``: the same work from scratch (render, tokenize and hash the
  whole conversation; today's path before the turn cache). Their token ids must be equal (the bench fails if not).
- ``ttft_s``: from the turn's messages to its first token (``host_s`` included).
- the floor: ``attention_s``, torch SDPA over the same shapes with the K/V contiguous (the turn's new tokens as
  queries over its whole context, every layer, GQA, non-causal: an upper bound of the causal work), plus
  ``dense_s``, the model's other layers over the new tokens (embedding, norms, projections, MLP; the LM head on the
  last row), in transformers on the same weights. ``ratio`` = ttft / (host + attention + dense).

The model is qwen3-tiny (the real Qwen3 tokenizer and template; its math is nearly free, so what the engine adds
shows), with its context stretched to hold the conversation (RoPE works at any position; weights unchanged).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.prefix.text import TextGen

TOKENS_PER_WORD = 1.1  # the Qwen3 tokenizer on TextGen's prose (80k tokens for 72k words)
SESSION = "bench-turns"


@dataclass
class TurnPoint:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    host_s: float
    full_host_s: float
    ttft_s: float
    attention_s: float
    dense_s: float

    @property
    def floor_s(self) -> float:
        return self.host_s + self.attention_s + self.dense_s

    @property
    def ratio(self) -> float:
        return self.ttft_s / self.floor_s

    @property
    def host_share(self) -> float:
        return self.host_s / self.full_host_s


def stretched_model_dir(name: str, max_positions: int) -> Path:
    """The registered model's directory with ``max_position_embeddings`` raised to ``max_positions`` (a copy made
    once into the model cache: weights, tokenizer and template unchanged)."""
    from engine.model_sources.cache import build_once, cache_root
    from engine.registry import resolve_model

    source = resolve_model(name)

    def build(out: Path) -> None:
        for item in source.iterdir():
            if item.is_file():
                shutil.copy2(item, out / item.name)
        config = json.loads((out / "config.json").read_text())
        config["max_position_embeddings"] = max_positions
        (out / "config.json").write_text(json.dumps(config, indent=2))

    fingerprint = f"{source.resolve()}:{(source / 'config.json').stat().st_mtime_ns}:{max_positions}"
    return build_once(cache_root() / f"bench-turns-{name}-{max_positions}", fingerprint, build)


def conversation(first_tokens: int, new_tokens: int, turns: int, seed: int = 0) -> list[list[dict]]:
    """Each turn's messages: a task, then per turn a tool call and a result of about ``new_tokens`` tokens (the
    first result about ``first_tokens``)."""
    gen = TextGen(seed)
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent. Read files, then fix the bug."},
                            {"role": "user", "content": "The cache loses blocks under load; find out why."}]
    out = []
    for turn in range(turns):
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{turn}.py"})}}
        words = int((first_tokens if turn == 0 else new_tokens) / TOKENS_PER_WORD)
        messages = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": gen.prose(words)}]
        out.append(messages)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def attention_floor(config: dict, new_tokens: int, context: int, dtype: torch.dtype, device: str = "cpu") -> float:
    """Seconds of SDPA over contiguous K/V: ``new_tokens`` queries over ``context`` keys, every layer."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    q = torch.randn(1, heads, new_tokens, head_dim, dtype=dtype, device=device)
    k = torch.randn(1, kv_heads, context, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    F.scaled_dot_product_attention(q[:, :, :1], k, v, enable_gqa=True)  # the kernel's first call off the clock
    _sync(device)
    start = time.perf_counter()
    for _ in range(config["num_hidden_layers"]):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def dense_floor(model, token_ids: list[int]) -> float:
    """Seconds of a Llama-family model's layers other than attention and RoPE over ``token_ids`` (transformers'
    modules): each layer's norms, q/k/v/o projections (o over a tensor of the attention output's shape) and MLP, the
    final norm and the LM head on the last row."""
    body = model.model
    device = str(body.embed_tokens.weight.device)
    ids = torch.tensor([token_ids], device=device)
    _sync(device)
    start = time.perf_counter()
    x = body.embed_tokens(ids)
    for layer in body.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h)
        attn.k_proj(h)
        attn.v_proj(h)
        x = x + attn.o_proj(q)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    model.lm_head(body.norm(x[:, -1:]))
    _sync(device)
    return time.perf_counter() - start


async def _serve_turn(ctx, messages: list[dict], salt: str | None) -> tuple[list[int], float, float, float, int]:
    """(prompt ids, host seconds, match seconds, seconds to the first token, tokens the cache served) of one turn
    as served. The match is the tree walk admission does, timed on the engine thread (reached by a call between
    steps, whose round trip counts in the host time)."""
    from server.pipeline.plan import plan_turn
    from server.pipeline.turn import Sampling, Turn

    turn = Turn(messages=messages, sampling=Sampling(max_tokens=1, temperature=0.0), session=SESSION)
    start = time.perf_counter()
    plan = await ctx.prepare(plan_turn, ctx, turn, {}, salt, int(time.time()))
    request = plan.generation.request
    await ctx.prepare(ctx.engine.prepare, [request])
    hashes, num_tokens = request.block_hashes, len(request.prompt_token_ids)
    match_s, cached = await asyncio.wrap_future(ctx.engine.core.call(lambda engine: _timed_match(engine, hashes,
                                                                                                 num_tokens)))
    host = time.perf_counter() - start
    stream = await ctx.engine.submit([request])
    async for _ in stream:
        break
    ttft = time.perf_counter() - start
    async for _ in stream:  # max_tokens=1: it has ended
        pass
    return request.prompt_token_ids, host, match_s, ttft, cached


def _timed_match(engine, hashes, num_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    cached = engine.scheduler.kv.num_cached_tokens(hashes, num_tokens)
    return time.perf_counter() - start, cached


def _full_host(ctx, messages: list[dict], salt: str | None, match_s: float) -> tuple[list[int], float]:
    """Render, tokenize and hash the whole conversation from scratch (on a prepare lane), plus the same match."""
    from server.pipeline.plan import render_turn
    from server.pipeline.turn import Turn

    start = time.perf_counter()
    text = render_turn(ctx, Turn(messages=messages))
    ids = ctx.encode_prompt(text, "messages")
    ctx.engine.core.facts.block_hasher.hashes(ids, salt)
    return ids, time.perf_counter() - start + match_s


def run_turns(args: argparse.Namespace) -> list[TurnPoint]:
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from server.pipeline.context import ServerSettings, load_context

    torch.set_num_threads(args.threads)
    turns = 1 + max(0, -(-(args.max_tokens - args.start_tokens) // args.new_tokens))
    room = args.max_tokens + 2 * args.new_tokens
    model_dir = stretched_model_dir(args.model, room)
    config = json.loads((model_dir / "config.json").read_text())
    block_size = 16
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    engine_config = EngineConfig(block_size=block_size, num_kv_blocks=room // block_size + 256, max_model_len=room,
                                 device=args.device, dtype=str(dtype).removeprefix("torch."))
    ctx = load_context(str(model_dir), engine_config, ServerSettings())
    ctx.engine.start()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval().to(args.device)
    try:
        return asyncio.run(_run_all(ctx, hf, config, args, turns))
    finally:
        ctx.close()
        ctx.engine.shutdown()


async def _run_all(ctx, hf, config: dict, args: argparse.Namespace, turns: int) -> list[TurnPoint]:
    await _serve_turn(ctx, conversation(200, 200, 1, seed=99)[0], "warmup")  # builds kernels, warms up
    points: list[TurnPoint] = []
    for turn, messages in enumerate(conversation(args.start_tokens, args.new_tokens, turns), start=1):
        ids, host, match_s, ttft, cached = await _serve_turn(ctx, messages, None)
        full_ids, full_host = await ctx.prepare(_full_host, ctx, messages, None, match_s)
        if full_ids != ids:
            raise AssertionError(f"turn {turn}: the served prompt's tokens differ from a full render + tokenize")
        new = len(ids) - cached
        attention = attention_floor(config, new, len(ids), hf.dtype, args.device)
        dense = dense_floor(hf, ids[cached:])
        point = TurnPoint(turn, len(ids), cached, new, host, full_host, ttft, attention, dense)
        points.append(point)
        _print_point(point)
    return points


HEADER = ("| turn | prompt | cached | new | host today (s) | host (s) | host share | TTFT (s) | attention floor (s) "
          "| dense (s) | TTFT / (host + floor) |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _row(p: TurnPoint) -> str:
    return (f"| {p.turn} | {p.prompt_tokens:,} | {p.cached_tokens:,} | {p.new_tokens:,} | {p.full_host_s:.3f} | "
            f"{p.host_s:.3f} | {p.host_share:.1%} | {p.ttft_s:.2f} | {p.attention_s:.2f} | {p.dense_s:.2f} | "
            f"{p.ratio:.2f}x |")


def _print_point(point: TurnPoint) -> None:
    if point.turn == 1:
        print(HEADER)
    print(_row(point), flush=True)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-tiny", help="a registered Llama-family model")
    parser.add_argument("--start-tokens", type=int, default=10_000, help="the first turn's prompt, about")
    parser.add_argument("--max-tokens", type=int, default=100_000,
                        help="grow the conversation to about this many tokens (lower it to stop earlier)")
    parser.add_argument("--new-tokens", type=int, default=5_000, help="tokens each turn adds, about")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu (fp32), or cuda (bf16; the floors timed there too)")


def run(args: argparse.Namespace) -> dict:
    points = run_turns(args)
    warm = points[1:] or points
    figures = {
        "turns": [asdict(p) | {"ratio": p.ratio, "host_share": p.host_share} for p in points],
        "worst_ratio": max(p.ratio for p in warm),
        "median_ratio": statistics.median(p.ratio for p in warm),
        "worst_host_share": max(p.host_share for p in warm),
    }
    print(f"cached turns: TTFT / (host + floor) worst {figures['worst_ratio']:.2f}x, median "
          f"{figures['median_ratio']:.2f}x; host time vs a full render + tokenize + hash: worst "
          f"{figures['worst_host_share']:.1%}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "turns.md").write_text(HEADER + "\n" + "\n".join(_row(p) for p in points) + "\n")
    return figures
