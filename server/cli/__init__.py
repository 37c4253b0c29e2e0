"""The `kvserve` command. Each subcommand lives in the module that owns its job and registers itself here.

Subcommands from outside the product (the benchmarks' `bench`) plug in through the `kvserve.commands` entry-point
group declared in pyproject.toml, so the product never imports them."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# Each subcommand module exposes `register(subparsers)`, which adds its parser(s) and sets `func` (called with the
# parsed args, returning an exit code).
SUBCOMMAND_MODULES = [
    "server.cli.models",  # models
    "server.cli.generate",  # generate
    "server.cli.chat",  # render, parse
    "server.cli.serve",  # serve
    "server.cli.inspect",  # inspect
]
ENTRY_POINT_GROUP = "kvserve.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="Local LLM inference with a paged KV cache and a radix prefix cache, for coding agents.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry_point.load()(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
