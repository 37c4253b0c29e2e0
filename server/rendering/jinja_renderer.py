"""A renderer for any model's own Jinja ``chat_template``, with the semantics of transformers' ``apply_chat_template``.

transformers compiles templates in an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
the ``loopcontrols`` extension and its ``{% generation %}`` tag, and replaces ``tojson`` by
``json.dumps(ensure_ascii=False)`` (Jinja's own escapes ``<>&'``). It adds the globals ``raise_exception`` and
``strftime_now`` and a ``namespace`` that refuses underscore attributes, drops ``None``-valued message keys, copies
``reasoning_content`` to ``thinking``, and passes the tokenizer's special tokens and any extra kwargs as template
variables. The tests compare this class with transformers itself.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.rendering.base import Prepared, Renderer
from server.rendering.generic_tools import ToolSupport, with_generic_tools
from server.rendering.messages import MessagePolicy


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that cannot hold dunder/underscore attributes (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's, so `namespace(self=1)` works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict, namespace=_Namespace)
    return env


@lru_cache(maxsize=32)
def compile_template(chat_template: str) -> jinja2.Template:
    return _environment().from_string(chat_template)


def _template_view(message: dict) -> dict:
    # apply_chat_template drops None-valued keys (templates handle a missing key better than None) and exposes the
    # reasoning under `thinking` too (gpt-oss style templates read that name).
    view = {key: value for key, value in message.items() if value is not None}
    if "reasoning_content" in view:
        view = {"thinking": view["reasoning_content"], **view}
    return view


class JinjaRenderer(Renderer):
    """Renders with a model's own chat template. Errors raised by the template become ``ValueError``. What a template
    cannot show of tools (it never reads `tools`, or messages' `tool_calls`) is rendered the generic way
    (server/rendering/generic_tools.py) rather than dropped.

    ``policy`` defaults to the transformers convention of tool-call arguments as objects (what vLLM passes); a
    template that concatenates arguments as text (the official DeepSeek ones) needs ``MessagePolicy("string")``.
    """

    family = "jinja"

    def __init__(
        self,
        chat_template: str,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: dict[str, Any] | None = None,
        policy: MessagePolicy = MessagePolicy(arguments="object", lenient_object_arguments=True),
    ) -> None:
        self.policy = policy
        try:
            self.template = compile_template(chat_template)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"invalid chat template: {exc}") from None
        self.tool_support = ToolSupport.of(_environment(), chat_template)
        if self.tool_support.none:  # calls render as text: their arguments keep the bytes the model wrote
            self.policy = dataclasses.replace(policy, arguments="as_given")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        prepared = with_generic_tools(prepared, self.tool_support)
        variables = {**self.special_tokens, **kwargs}
        try:
            return self.template.render(
                messages=[_template_view(m) for m in prepared.messages],
                tools=prepared.tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            raise ValueError(f"chat template rejected the request: {exc}") from None
