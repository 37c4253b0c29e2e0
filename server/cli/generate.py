"""`kvserve generate`: run prompts through the offline engine and print the completions."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from server.cli.engine_args import add_engine_args, engine_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for prompts with the offline engine",
        description="Generate completions for raw-text prompts (no chat template; use `kvserve render` to see one). "
        "Example: kvserve generate --model qwen3-tiny --max-tokens 20 'Hello'",
    )
    parser.add_argument("prompts", nargs="+", help="prompt text(s), batched together")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop)
        config = engine_config_from_args(args)
        llm = LLM(args.model, **dataclasses.asdict(config))
        outputs = llm.generate(args.prompts, params)
    except ValueError as exc:
        print(f"kvserve generate: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        if len(args.prompts) > 1:
            print(f"--- {prompt!r} ({out.finish_reason}, {len(out.token_ids)} tokens)")
        print(out.text)
    return 0
