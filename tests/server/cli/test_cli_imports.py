"""A `kvserve` command imports its own module alone (server/cli/__init__.py): `kvserve render` and `kvserve parse`
start without torch, transformers or the HTTP server (3 CPU s of every call before)."""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import SUBCOMMAND_MODULES, build_parser

REPO = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers", "fastapi")


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def test_each_module_adds_the_commands_it_is_listed_with() -> None:
    for module, commands in SUBCOMMAND_MODULES.items():
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(subparsers)
        assert tuple(subparsers.choices) == commands, module


def test_a_command_builds_its_own_parser_and_anything_else_all_of_them() -> None:
    everything = _commands(build_parser())
    assert {"models", "generate", "render", "parse", "serve", "inspect", "bench"} <= everything
    assert _commands(build_parser("render")) == {"render", "parse"}
    assert _commands(build_parser("bench")) == {"bench"}
    for other in (None, "--help", "no-such-command"):
        assert _commands(build_parser(other)) == everything


@pytest.mark.parametrize("args", [["render", "--template", "qwen3", "--request", "BODY"], ["render", "--help"],
                                  ["parse", "--template", "qwen3"]], ids=["render", "render-help", "parse"])
def test_render_and_parse_start_without_torch(args: list[str], tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "server.cli",
                          *[str(body) if arg == "BODY" else arg for arg in args]],
                         cwd=REPO, input=b"<think>\nok\n</think>\n\nHello", capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout  # the prompt, the help or the parsed message
    imported = {line.split("|")[-1].strip() for line in run.stderr.decode().splitlines() if "|" in line}
    assert not [name for name in imported if name.split(".")[0] in HEAVY]
