"""`kvserve render` and `kvserve parse`: what the model sees, and what the server makes of what it says."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    add_render_command(subparsers)
    add_parse_command(subparsers)


def add_render_command(subparsers) -> None:
    """`kvserve render`: the exact prompt text (and with a model, its token ids) for an OpenAI chat request body."""
    from server.rendering import FAMILIES

    parser = subparsers.add_parser(
        "render",
        help="print the exact prompt a chat request renders to",
        description="Renders an OpenAI chat-completions request body (messages, tools, chat_template_kwargs, "
        "add_generation_prompt) into the exact prompt text the model sees, printed without an added newline. "
        "Template kwargs the server sets by default (Qwen3.6: preserve_thinking) are set here too.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--template", choices=FAMILIES, help="a native chat template family")
    source.add_argument("--model", metavar="NAME", help="a model of models.yaml (or a local model directory)")
    parser.add_argument("--request", required=True, help="JSON file with the request body ('-' reads stdin)")
    parser.add_argument(
        "--tokens",
        action="store_true",
        help="with --model: print one JSON object {prompt, num_tokens, token_ids} instead of the bare text",
    )
    parser.add_argument(
        "--no-preserve-thinking",
        action="store_true",
        help="as `kvserve serve --no-preserve-thinking`: do not keep past turns' reasoning (Qwen3.6)",
    )
    parser.set_defaults(func=_run_render)


def _run_render(args: argparse.Namespace) -> int:
    from server.rendering import get_renderer, render_request, serving_template_kwargs

    if args.tokens and not args.model:
        print("kvserve render: --tokens needs --model (token ids come from the model's tokenizer)", file=sys.stderr)
        return 2
    try:
        raw = sys.stdin.buffer.read() if args.request == "-" else Path(args.request).read_bytes()
        body = json.loads(raw.decode("utf-8"))
        tokenizer = None
        if args.model:
            renderer, tokenizer = _model_renderer(args.model)
        else:
            renderer = get_renderer(args.template)
        prompt = render_request(renderer, body, serving_template_kwargs(renderer, not args.no_preserve_thinking))
    except (OSError, ValueError, RuntimeError) as exc:  # unreadable file, invalid JSON/request, unknown model
        print(f"kvserve render: {exc}", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(encoding="utf-8")  # the prompt's bytes must not depend on the terminal's locale
    if tokenizer is None or not args.tokens:
        sys.stdout.write(prompt)
        return 0
    # The templates emit BOS themselves: adding special tokens again would double it.
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    result = {"prompt": prompt, "num_tokens": len(ids), "token_ids": ids}
    sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
    return 0


def _model_renderer(name: str):
    """(renderer, HF tokenizer) for a registered model; the model directory is built or fetched on first use."""
    from transformers import AutoTokenizer

    from engine.registry import get_model_spec, resolve_model
    from server.rendering import renderer_for_model

    template = get_model_spec(name).template
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(name)))
    return renderer_for_model(template, tokenizer), tokenizer


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
    parser.add_argument(
        "--stream",
        action="store_true",
        help="the message a client assembles from a streamed response (a call the output cuts off keeps its "
        "arguments, closed into valid JSON) instead of the non-streamed one (such a call stays content)",
    )
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
            streaming=args.stream,
        )
    except ValueError as exc:
        print(f"kvserve parse: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(message.to_message(), ensure_ascii=False, indent=2)
    sys.stdout.buffer.write(f"{text}\n".encode("utf-8"))
    return 0
