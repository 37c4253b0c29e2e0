"""``kvserve bench step``: what one engine decode step costs on top of the model, side by side with a bare PyTorch
decode loop of the same model in the same run.

The model is Qwen3-shaped but negligible (2 layers, hidden 64, vocab 2048), so the step's host work shows. For each
batch size and context length, every sequence shares one prompt prefix (admitted once, then hit by the others, so
setup is quick). The bare loop runs the same weights and ops with a contiguous per-sequence cache, no scheduler, no
paging, argmax sampling. Engine and bare loop take turns, one decode step each, ``--steps`` times, so that a change in
the machine's speed during the run touches both alike (with async scheduling, see `measure_point`); every figure is
the median over those steps.

The engine runs as the offline API runs it (`EngineLoop.run_here` with `LLM.generate`'s sink), so a step is one
iteration of its loop: the engine step, then its outputs handed off and turned into each request's text.

Per point: ``engine_ms`` (wall time per loop iteration), ``bare_ms``, of the engine's time ``step_ms`` (the engine
step) and ``text_ms`` (the hand-off and text), ``host_ms`` (the engine's own host time per step: scheduling, input
preparation, launches, outputs and bookkeeping; on CPU the step minus its compute, on CUDA the step minus the time
blocked on the device), ``device_ms`` (compute on CPU; kernel time by CUDA events on a GPU).

On CPU the same figures are also taken in CPU time of the threads that did the work (``*_cpu_ms``), with torch on one
thread (``--threads``): on a shared machine, wall time also counts the time other processes held the cores, CPU time
does not, so the CPU-time ratio is the one that compares the engine's work with the bare loop's.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

VOCAB = 2048
RECIPE = {"model_type": "qwen3", "tokenizer": "qwen3", "seed": 11, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 40960}


@dataclass
class StepPoint:
    batch: int
    context: int
    engine_ms: float  # the loop's whole iteration: the engine step, its outputs' hand-off and text
    bare_ms: float
    host_ms: float
    device_ms: float
    step_ms: float  # of engine_ms, the engine step alone
    text_ms: float  # ... and the outputs' hand-off to the offline API's sink, detokenized into each result
    engine_cpu_ms: float | None = None
    bare_cpu_ms: float | None = None
    host_cpu_ms: float | None = None
    text_cpu_ms: float | None = None

    @property
    def ratio(self) -> float:
        return self.engine_ms / self.bare_ms

    @property
    def cpu_ratio(self) -> float | None:
        return None if self.engine_cpu_ms is None else self.engine_cpu_ms / self.bare_cpu_ms


def _build_bench_model(out: Path) -> None:
    """A qwen3-tiny-shaped model whose vocabulary is only the first VOCAB token ids (so the LM head is negligible
    too); the Qwen3 tokenizer files are there for loading, the benchmark feeds token ids."""
    from dataclasses import replace

    from engine.model_sources.hf_layout import write_model_configs
    from engine.model_sources.qwen_tokenizer import write_qwen3_tokenizer
    from engine.model_sources.tiny import TinyRecipe, write_random_weights

    recipe = TinyRecipe.from_mapping(RECIPE)
    tokens = replace(write_qwen3_tokenizer(out, "qwen3"), num_tokens=VOCAB, bos_token_id=None,
                     eos_token_ids=(VOCAB - 1,), pad_token_id=None)
    write_model_configs(out, recipe.model_type, replace(recipe.dims(tokens), vocab_size=VOCAB), tokens)
    write_random_weights(out, recipe.seed)


def bench_model_dir() -> Path:
    """The negligible Qwen3-shaped model, built once into the model cache."""
    import hashlib
    import json

    from engine.model_sources.cache import build_once, cache_root

    fingerprint = hashlib.sha256(json.dumps([RECIPE, VOCAB], sort_keys=True).encode()).hexdigest()
    return build_once(cache_root() / "bench-step-qwen3", fingerprint, _build_bench_model)


def _engine(model_dir: Path, device: str, max_batch: int, max_context: int, async_scheduling: bool | None):
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    block_size = 16
    blocks = max_context // block_size + max_batch * 4 + 64  # the shared prefix once, a few private blocks each
    # Each sequence recomputes its last block (the cache serves at most len - 1 tokens): a budget for all of them
    # admits the batch in one step, so that it decodes in lockstep, all lengths equal, as the bare loop does.
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=blocks, max_num_seqs=max_batch,
                       max_num_batched_tokens=max(2048, max_batch * block_size), max_model_len=max_context + 256,
                       device=device, dtype="float32" if device == "cpu" else "bfloat16",
                       async_scheduling=async_scheduling)
    engine = LLMEngine(model_dir, cfg, model_id="bench-step")
    engine.runner.time_device = True
    return engine


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _point_requests(engine, batch: int, context: int, max_tokens: int) -> list:
    """``batch`` requests sharing a ``context``-token prefix, which is computed (and cached) here first, so that
    admitting them hits it."""
    from engine.requests import EngineRequest
    from engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(context)
    prefix = torch.randint(1, VOCAB, (context - 1,), generator=gen).tolist()
    engine.reset_prefix_cache()
    engine.add_request("prefix", prefix + [0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [engine.prepare(EngineRequest(f"s{i}", prefix + [1 + i % (VOCAB - 1)], params)) for i in range(batch)]


def _drain(engine) -> None:
    """Whatever a point left running ends, and a step still in flight (async scheduling) is collected: nothing of
    the engine runs after this."""
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()


class _TimedSink:
    """The offline API's sink (`TextCollector`: the outputs' text, incrementally detokenized, into each request's
    result), timing each step's hand-off to it."""

    def __init__(self, collector) -> None:
        self.collector = collector
        self.wall = self.cpu = 0.0

    def put(self, item) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        self.collector.put(item)
        self.wall += time.perf_counter() - start
        self.cpu += time.thread_time() - start_cpu


class _Ticks:
    """`EngineLoop.run_here`'s ``until``, called between loop iterations: times each iteration (commands, the
    engine step, the outputs' delivery and text: what a step costs the offline API, `LLM.generate`), and once the
    batch decodes in lockstep and ``warmup`` steps passed, runs one bare step between engine steps (timed apart)."""

    def __init__(self, engine, sink: _TimedSink, bare: "BareDecoder", steps: int, warmup: int,
                 flush: torch.Tensor | None) -> None:
        self.engine, self.sink, self.bare, self.flush = engine, sink, bare, flush
        self.steps, self.warmup = steps, warmup
        self.interleave = not engine.cfg.async_scheduling  # overlapped steps: timed back to back, see measure_point
        self.engine_steps: list[dict[str, float]] = []
        self.bare_steps: list[tuple[float, float]] = []
        self._lockstep = False
        self._before: dict[str, float] | None = None
        self._start = self._start_cpu = 0.0

    def __call__(self) -> bool:
        _sync(self.engine.cfg.device)  # a step's device work counts in its own time, as the bare loop's does
        end, end_cpu = time.perf_counter(), time.thread_time()
        if self._before is not None:
            profile = asdict(self.engine.runner.profile)
            self.engine_steps.append({"wall": end - self._start, "cpu": end_cpu - self._start_cpu,
                                      "text_wall": self.sink.wall, "text_cpu": self.sink.cpu,
                                      **{k: v - self._before[k] for k, v in profile.items()}})
        elif not self._lockstep:
            self._lockstep = self._check_lockstep()
        elif self.warmup:
            self.warmup -= 1
        if len(self.engine_steps) == self.steps:
            return True
        if self._lockstep and not self.warmup:
            if self.interleave:
                self.bare_steps.append(_timed_bare_step(self.bare))
            if self.flush is not None:
                self.flush.fill_(1.0)
            self._before = asdict(self.engine.runner.profile)
            self.sink.wall = self.sink.cpu = 0.0
        self._start, self._start_cpu = time.perf_counter(), time.thread_time()
        return False

    def _check_lockstep(self) -> bool:
        """Every sequence admitted and given its first token; then their lengths must be equal, as the bare loop's."""
        sequences = self.engine.scheduler.sequences.values()
        if not sequences or any(r.num_output_tokens == 0 for r in sequences):
            return False
        lengths = {r.num_tokens for r in sequences}
        assert len(lengths) == 1, f"the batch does not decode in lockstep (lengths {sorted(lengths)})"
        return True


def _engine_figures(engine, step: dict[str, float]) -> dict[str, float]:
    """A step's engine_ms (the loop's whole iteration), step_ms (the engine step alone), text_ms (the outputs' hand-off
    and text), host_ms, device_ms and, on CPU, their CPU times."""
    wall = step["wall"]
    text = {"step_ms": (wall - step["text_wall"]) * 1e3, "text_ms": step["text_wall"] * 1e3}
    if engine.cfg.device.startswith("cuda"):
        return {"engine_ms": wall * 1e3, "host_ms": (wall - step["wait_s"]) * 1e3, "device_ms": step["device_s"] * 1e3,
                **text}
    on_device_thread = engine.cfg.async_scheduling  # else the main thread ran the device part too
    host_cpu = step["cpu"] if on_device_thread else step["cpu"] - step["launch_cpu_s"]
    waited = step["wait_s"] if on_device_thread else step["launch_s"]
    return {"engine_ms": wall * 1e3, "host_ms": (wall - waited) * 1e3, "device_ms": step["launch_s"] * 1e3,
            "engine_cpu_ms": (host_cpu + step["launch_cpu_s"]) * 1e3, "host_cpu_ms": host_cpu * 1e3,
            "text_cpu_ms": step["text_cpu"] * 1e3, **text}


class BareDecoder:
    """The same weights and ops as the engine's model, decoding ``batch`` sequences with no scheduler and no paging:
    each layer's K and V live in one preallocated contiguous cache ``[batch, Hkv, context + max_steps, D]``; a step
    writes each new K/V in place at its position and attends over a slice of the cache (no concatenation, no copy).
    That is the floor for any engine on the machine. Every row's prefix holds the same random K/V (filled once)."""

    def __init__(self, model, batch: int, context: int, max_steps: int) -> None:
        cfg = model.cfg
        self.model, self.batch, self.context, self.cfg = model, batch, context, cfg
        device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        shape = (batch, cfg.num_kv_heads, context + max_steps, cfg.head_dim)
        self.caches = []
        for _ in model.layers:
            k, v = torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)
            prefix = (cfg.num_kv_heads, context, cfg.head_dim)
            k[:, :, :context] = torch.randn(prefix, device=device, dtype=dtype)
            v[:, :, :context] = torch.randn(prefix, device=device, dtype=dtype)
            self.caches.append((k, v))
        self.tokens = torch.ones(batch, dtype=torch.long, device=device)
        self.pos = context
        self.device = device

    @torch.inference_mode()
    def step(self) -> list[int]:
        from kernels import reference as ops

        model, cfg, batch, pos = self.model, self.cfg, self.batch, self.pos
        positions = torch.full((batch,), pos, dtype=torch.long, device=self.device)
        x = model.embed_tokens(self.tokens)
        residual = None
        for layer, (k_cache, v_cache) in zip(model.layers, self.caches):
            norm = layer.input_layernorm
            if residual is None:
                residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
            else:
                h, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
            attn = layer.self_attn
            q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k, v = (t.view(batch, -1, cfg.head_dim) for t in (q, k, v))
            if attn.q_norm is not None:
                q = ops.rms_norm(q, attn.q_norm.weight, attn.q_norm.eps)
                k = ops.rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
            q, k = ops.rotary_embedding(positions, q, k, model.cos_sin_cache)
            k_cache[:, :, pos] = k
            v_cache[:, :, pos] = v
            # GQA: each KV head's query group attends as that head's queries (no mask: all see the whole context)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.view(batch, cfg.num_kv_heads, -1, cfg.head_dim), k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1],
                scale=cfg.head_dim**-0.5)
            h = attn.o_proj(o.reshape(batch, attn.q_size))
            h, residual = ops.rms_norm(h, layer.post_attention_layernorm.weight,
                                       layer.post_attention_layernorm.eps, residual)
            x = layer.mlp(ops, h)
        out, _ = ops.rms_norm(x, model.norm.weight, model.norm.eps, residual)
        self.tokens = model.compute_logits(out).argmax(-1)
        self.pos += 1
        return self.tokens.tolist()  # the sampled ids reach the host every step, as any serving loop needs them


def _timed_bare_step(bare: BareDecoder) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.thread_time()
    bare.step()
    return time.perf_counter() - start, time.thread_time() - start_cpu


def measure_point(engine, batch: int, context: int, steps: int, warmup: int, flush_mb: int = 0) -> StepPoint:
    """Per decode step of ``batch`` sequences at ``context`` tokens, the medians over ``steps`` steps.

    The engine runs as the offline API runs it on a CPU (`EngineLoop.run_here` with `LLM.generate`'s sink): a step
    is one iteration of the loop, outputs delivered and detokenized included. Without overlap, engine and bare steps
    are taken in turn (one of each), so that a change in the machine's speed during the run touches both alike. With
    async scheduling an engine step leaves the next one running (on the GPU, or on the CPU's device thread), which a
    bare step in between would wait for or compete with: the engine's steps are then timed back to back, and the
    bare loop's after the engine has nothing left in flight.

    ``flush_mb``: before each engine step, stream that many MB through the CPU caches (not timed), as a long-context
    forward does on a CPU: the host's own work at a short context, with caches as cold as at a long one."""
    from engine.core.loop import EngineLoop
    from engine.llm import RequestOutput, TextCollector
    from engine.text.output_processor import CompletionOutput, OutputProcessor

    requests = _point_requests(engine, batch, context, max_tokens=steps + warmup + 8)
    bare = BareDecoder(engine.runner.model, batch, context, steps + warmup)
    flush = torch.empty(flush_mb * 2**18) if flush_mb else None  # float32: 2**18 per MB
    loop, processor = EngineLoop(engine), OutputProcessor(engine.tokenizer, final_text_only=True)  # as LLM.generate
    results = {r.request_id: RequestOutput(r.request_id, r.prompt_token_ids, [CompletionOutput()]) for r in requests}
    for r in requests:
        processor.add_request(r.request_id, r.prompt_token_ids, r.params)
    with tqdm(total=batch, disable=True) as bar:
        sink = _TimedSink(TextCollector(loop, processor, results, bar))
        ticks = _Ticks(engine, sink, bare, steps, warmup, flush)
        if ticks.interleave:
            for _ in range(warmup):
                bare.step()
        loop.run_here(requests, sink, until=ticks)
    _drain(engine)
    engine_steps, bare_steps = [_engine_figures(engine, step) for step in ticks.engine_steps], ticks.bare_steps
    if not ticks.interleave:
        for _ in range(warmup):
            bare.step()
        bare_steps = [_timed_bare_step(bare) for _ in range(steps)]
    figures = {k: statistics.median(step[k] for step in engine_steps) for k in engine_steps[0]}
    on_cpu = not engine.cfg.device.startswith("cuda")
    if engine.cfg.async_scheduling and on_cpu:
        # The device thread counts a step's compute when it finishes, often inside the next step: use the mean.
        figures["device_ms"] = statistics.fmean(step["device_ms"] for step in engine_steps)
    return StepPoint(batch, context, bare_ms=statistics.median(w for w, _ in bare_steps) * 1e3,
                     bare_cpu_ms=statistics.median(c for _, c in bare_steps) * 1e3 if on_cpu else None, **figures)


def run_step_bench(device: str, batches: list[int], contexts: list[int], steps: int, warmup: int,
                   async_scheduling: bool | None, flush_mb: int = 0) -> list[StepPoint]:
    engine = _engine(bench_model_dir(), device, max(batches), max(contexts), async_scheduling)
    grid = [(b, c) for c in contexts for b in batches]
    return [measure_point(engine, batch, context, steps, warmup, flush_mb)
            for batch, context in tqdm(grid, desc="bench step", unit="point")]


def markdown(points: list[StepPoint]) -> str:
    rows = ["| batch | context | engine ms | bare ms | engine / bare | of it: step ms | text ms | host ms | "
            "device ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {p.batch} | {p.context} | {p.engine_ms:.2f} | {p.bare_ms:.2f} | {p.ratio:.2f} | {p.step_ms:.2f} | "
             f"{p.text_ms:.2f} | {p.host_ms:.2f} | {p.device_ms:.2f} |" for p in points]
    if all(p.engine_cpu_ms is not None for p in points):
        rows += ["", "CPU time (ms of the threads that did the work):", "",
                 "| batch | context | engine CPU ms | bare CPU ms | engine / bare | text CPU ms | host CPU ms |",
                 "|---:|---:|---:|---:|---:|---:|---:|"]
        rows += [f"| {p.batch} | {p.context} | {p.engine_cpu_ms:.2f} | {p.bare_cpu_ms:.2f} | {p.cpu_ratio:.2f} | "
                 f"{p.text_cpu_ms:.2f} | {p.host_cpu_ms:.2f} |" for p in points]
    return "\n".join(rows)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batches", default="1,64,256", help="batch sizes, comma-separated")
    parser.add_argument("--contexts", default="128,8192,32768", help="context lengths, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per point (figures are medians)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per point")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap host and device (default: the engine's: on for CUDA, off for CPU)")
    parser.add_argument("--flush-mb", type=int, default=0,
                        help="CPU experiment: stream this many MB through the caches before each engine step (not "
                             "timed), as a long-context forward does, to see host time with cold caches at a short "
                             "context (engine/bare ratios are not comparable with it)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU: torch threads (default 1, so CPU time counts all of the work)")


def run(args: argparse.Namespace) -> dict:
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    ints = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    points = run_step_bench(args.device, ints, contexts, args.steps, args.warmup, args.async_scheduling,
                            args.flush_mb)
    table = markdown(points)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.md").write_text(table + "\n")
    by_context = {c: [p for p in points if p.context == c] for c in contexts}
    host_spread = {b: max(p.host_ms for p in points if p.batch == b) / min(p.host_ms for p in points if p.batch == b)
                   for b in ints}
    return {"device": args.device, "points": [{**asdict(p), "ratio": p.ratio, "cpu_ratio": p.cpu_ratio} for p in points],
            "host_ms_max_over_min_by_batch": host_spread, "contexts": list(by_context)}
