"""Engine flags shared by every command that starts an engine (`serve`, `generate`), generated from the fields of
`EngineConfig` (their types, defaults and ``metadata["help"]``), so a default lives in exactly one place."""
from __future__ import annotations

import argparse
import enum
import typing
from dataclasses import MISSING, Field, fields

from engine.config import EngineConfig


def _flag(f: Field) -> str:
    return "--" + f.metadata.get("flag", f.name.replace("_", "-"))


def _dest(f: Field) -> str:
    return f.metadata.get("dest", f.name)  # a field whose name a command uses for something else names its own


def _add_field(group: argparse._ArgumentGroup, f: Field, annotation: typing.Any) -> None:
    help_text = f.metadata.get("help", "")
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = kinds[0]
    if kind is bool:
        if f.default is None:  # tri-state: unset means "the config decides"
            group.add_argument(_flag(f), dest=_dest(f), action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif f.default:  # on by default: the flag turns it off (e.g. --no-prefix-cache)
            group.add_argument(_flag(f), dest=_dest(f), action="store_false", help=f"do not {help_text}")
        else:
            group.add_argument(_flag(f), dest=_dest(f), action="store_true", help=help_text)
        return
    default = f.default if f.default is not MISSING else None
    choices = f.metadata.get("choices")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        choices = [m.value for m in kind]
        default = default.value if isinstance(default, enum.Enum) else default
        kind = str
    shown = f" (default: {default})" if default is not None and "default" not in help_text else ""
    group.add_argument(_flag(f), dest=_dest(f), type=kind, default=default, choices=choices, help=help_text + shown)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="registry name (see `kvserve models`), HF repo id or model "
                       "directory (default: the registry's default, smollm2-135m)")
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        _add_field(group, f, hints[f.name])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, _dest(f)) for f in fields(EngineConfig)})
