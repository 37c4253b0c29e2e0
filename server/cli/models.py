"""`kvserve models`: list the model registry, or print (building it if needed) a model's local directory."""
from __future__ import annotations

import argparse
import sys

from engine.registry import ModelSpec, cached_model_dir, default_model_name, list_models, resolve_model


def register(subparsers: argparse._SubParsersAction) -> None:
    add_models_command(subparsers)


def add_models_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the model registry, or print a model's local directory",
        description="List the models of models.yaml (name, source, chat template family, whether already on disk), "
        "or with --path print the local directory of one model, building, converting or downloading it first.",
    )
    parser.add_argument(
        "--path", metavar="NAME", help="a registered name, HF repo id of a registered model, or local model directory"
    )
    parser.set_defaults(func=run_models)


def _origin(spec: ModelSpec) -> str:
    if spec.source == "hf":
        return f"{spec.repo_id}" + (f"@{spec.revision}" if spec.revision else "")
    if spec.source == "gguf":
        return f"{spec.build['package']}/{spec.build['file']}"
    return f"random weights, {spec.build.get('model_type')}, {spec.build.get('tokenizer')} tokenizer"


def format_model_table(specs: list[ModelSpec], default: str) -> str:
    rows = [("NAME", "SOURCE", "TEMPLATE", "ON DISK", "FROM")]
    for spec in specs:
        name = f"{spec.name} (default)" if spec.name == default else spec.name
        on_disk = "yes" if cached_model_dir(spec) is not None else "no"
        rows.append((name, spec.source, spec.template, on_disk, _origin(spec)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows
    )


def run_models(args: argparse.Namespace) -> int:
    if args.path:
        try:
            print(resolve_model(args.path))
        except (ValueError, RuntimeError) as exc:
            print(f"kvserve models: {exc}", file=sys.stderr)
            return 1
        return 0
    print(format_model_table(list_models(), default_model_name()))
    return 0
