"""`kvserve render` and `kvserve parse`: what the model sees, and what the server makes of what it says."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    render = globals().get("add_render_command")  # the rendering half of issue 3 adds it to this file
    if render is not None:
        render(subparsers)
    add_parse_command(subparsers)


def add_parse_command(subparsers) -> None:
    """`kvserve parse`: the assistant message the server would return for a raw model output read from stdin."""
    parser = subparsers.add_parser(
        "parse",
        help="parse raw model output (stdin) into an assistant message",
        description="Reads raw model output (special tokens included) from stdin and prints the parsed assistant "
        "message (content, reasoning_content, tool_calls) as JSON.",
    )
    from server.parsing import FAMILIES

    parser.add_argument("--template", required=True, choices=sorted(FAMILIES), help="template family")
    parser.add_argument("--tools", type=Path, help="JSON file: a list of tools, or a request body with 'tools'")
    parser.add_argument(
        "--tool-choice",
        default=None,
        help="'none', 'auto', 'required' or a JSON function object (default: the request body's, else auto)",
    )
    parser.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="thinking on for this request (default: the family's default)",
    )
    parser.add_argument("--id-prefix", default=None, help="tool call id prefix (default: random)")
    parser.set_defaults(func=_run_parse)


def _run_parse(args: argparse.Namespace) -> int:
    from server.parsing import default_thinking, new_id_prefix, parse_output

    tools, tool_choice = None, None
    if args.tools:
        loaded = json.loads(args.tools.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            tools, tool_choice = loaded.get("tools"), loaded.get("tool_choice")
        else:
            tools = loaded
    if args.tool_choice is not None:
        tool_choice = json.loads(args.tool_choice) if args.tool_choice.lstrip().startswith("{") else args.tool_choice
    thinking = default_thinking(args.template) if args.thinking is None else args.thinking
    try:
        message = parse_output(
            args.template,
            sys.stdin.buffer.read().decode("utf-8"),
            tools,
            tool_choice,
            reasoning=thinking,
            id_prefix=args.id_prefix if args.id_prefix is not None else new_id_prefix(),
        )
    except ValueError as exc:
        print(f"kvserve parse: {exc}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write((json.dumps(message.to_message(), ensure_ascii=False, indent=2) + "\n").encode("utf-8"))
    return 0
