"""The `kvserve` command. Each subcommand lives in the module that owns its job and registers itself here.

Subcommands from outside the product (the benchmarks' `bench`) plug in through the `kvserve.commands` entry-point
group declared in pyproject.toml, so the product never imports them."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# Each subcommand module exposes `register(subparsers)`, which adds its parser(s) and sets `func` (called with the
# parsed args, returning an exit code); here with the commands it adds, so that a command imports its own module
# alone (`kvserve render` then needs neither torch nor the server: about 3 CPU s of every call). An entry point's
# name is the command it adds.
SUBCOMMAND_MODULES = {
    "server.cli.models": ("models",),
    "server.cli.generate": ("generate",),
    "server.cli.chat": ("render", "parse"),
    "server.cli.serve": ("serve",),
    "server.cli.inspect": ("inspect",),
}
ENTRY_POINT_GROUP = "kvserve.commands"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `kvserve` parser with every command, or with ``command`` alone when it names one."""
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="Local LLM inference with a paged KV cache and a radix prefix cache, for coding agents.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    known = {name for commands in SUBCOMMAND_MODULES.values() for name in commands} | set(entry_points.names)
    alone = command if command in known else None
    for name, commands in SUBCOMMAND_MODULES.items():
        if alone is None or alone in commands:
            importlib.import_module(name).register(subparsers)
    for entry_point in entry_points:
        if alone is None or entry_point.name == alone:
            entry_point.load()(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
