"""``python -m benchmarks NAME ...``: the ``kvserve bench`` commands from a checkout where kvserve is not installed
(its ``kvserve.commands`` entry point is then absent), e.g. the GPU check's device: ``python -m benchmarks turns``
is ``kvserve bench turns``. Only the benchmarks' own imports load, not the server's HTTP stack."""
from __future__ import annotations

import argparse
import sys

from benchmarks.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
