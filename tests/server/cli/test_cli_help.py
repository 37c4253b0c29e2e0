"""Every `kvserve` command and subcommand prints its --help (a help text argparse cannot format crashes it)."""
from __future__ import annotations

import argparse

import pytest

from server.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, prefix + [name])
    return found


COMMANDS = _commands(build_parser(), [])


def test_bench_commands_are_all_there():
    assert {"step", "throughput", "structured", "sessions"} <= {c[1] for c in COMMANDS if len(c) == 2 and c[0] == "bench"}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "kvserve")
def test_help_prints(command: list[str], capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: kvserve" in capsys.readouterr().out
