"""The cost of grammar masks: decode throughput with 0%, 50% and 100% of a batch constrained, in one run.

Every row decodes exactly `--max-tokens` tokens (`ignore_eos`), so the three runs do the same model work and differ
only in the masks. A constrained row follows a JSON schema that cannot end within the budget (an array of at least
`--max-tokens` short strings), so it stays constrained to the last token, mostly inside strings, as a tool call's
arguments are. Prompts are short random ids: the time is decode, not prefill. The grammar is compiled before the
clock starts (a server compiles it once per schema). The fractions take turns `--repeats` times and each one's fastest
run counts, which filters out the noise of a shared machine. The mask columns say how long filling the masks took
per step (in a worker thread, beside the forward pass), how much of it the step still waited for, and how long
applying them took.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.prefix.report import markdown_table

FRACTIONS = (0.0, 0.5, 1.0)


def _schema(min_items: int) -> dict:
    item = {"type": "string", "maxLength": 24}
    return {"type": "object", "properties": {"notes": {"type": "array", "items": item, "minItems": min_items}},
            "required": ["notes"], "additionalProperties": False}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-tiny", help="registry model (default: qwen3-tiny)")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoded together (default: 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each sequence decodes (default: 64)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length (default: 16)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per fraction; the fastest counts (default: 3)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams
    from engine.worker.structured_output import MaskStats, StructuredOutputSpec

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
              num_kv_blocks=args.batch * (args.prompt_tokens + args.max_tokens) // 16 + args.batch, block_size=16)
    spec = StructuredOutputSpec("json_schema", json.dumps(_schema(args.max_tokens)))
    rng = random.Random(args.seed)
    vocab = min(llm.engine.model_cfg.vocab_size, 50_000)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_output=spec))  # compile + warm up, unclocked

    params = {fraction: [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                                        structured_output=spec if i < round(fraction * args.batch) else None)
                         for i in range(args.batch)] for fraction in FRACTIONS}
    best = {fraction: float("inf") for fraction in FRACTIONS}
    masks = {fraction: MaskStats() for fraction in FRACTIONS}
    stats = llm.engine.structured_outputs.stats
    for _ in range(args.repeats):  # the fractions take turns, so a slow spell of the machine hits them alike
        for fraction in FRACTIONS:
            before = MaskStats(**vars(stats))
            elapsed, tokens = _timed(llm, prompts, params[fraction])
            assert tokens == args.batch * args.max_tokens, "a sequence ended early: the run would not be comparable"
            best[fraction] = min(best[fraction], elapsed)
            for name, value in vars(stats).items():
                setattr(masks[fraction], name, getattr(masks[fraction], name) + value - getattr(before, name))

    rows, figures = [], {"model": args.model, "batch": args.batch, "max_tokens": args.max_tokens, "runs": []}
    baseline = args.batch * args.max_tokens / best[0.0]
    for fraction in FRACTIONS:
        constrained, rate = round(fraction * args.batch), args.batch * args.max_tokens / best[fraction]
        steps = max(masks[fraction].steps, 1)
        per_step = {name: 1000 * getattr(masks[fraction], name) / steps for name in ("fill_s", "wait_s", "apply_s")}
        figures["runs"].append({"constrained_fraction": fraction, "constrained_rows": constrained,
                                "seconds": best[fraction], "tokens_per_s": rate, "mask_ms_per_step": per_step})
        shown = " / ".join(f"{per_step[name]:.1f}" for name in ("fill_s", "wait_s", "apply_s")) if constrained else "-"
        rows.append([f"{fraction:.0%} ({constrained}/{args.batch})", f"{best[fraction]:.2f}", f"{rate:.1f}",
                     f"{rate / baseline:.2f}x", shown])
    figures["markdown"] = markdown_table(
        ["constrained rows", "time (s)", "decode tok/s", "vs 0%", "mask ms/step: fill / waited / apply"], rows
    )
    print(figures["markdown"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.md").write_text(figures["markdown"] + "\n")
    return figures


def _timed(llm, prompts: list[list[int]], params: list) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)
