"""The operator's bounds on one request, checked before any expensive work (rendering, tokenizing, compiling a
grammar), so that no single request can hold the server's shared resources for long: a 413 or a 400 naming the
field and the limit instead. Every bound is a `kvserve serve` flag (docs/SERVER.md, "Limits").

- the body: its size (checked before it is read) and its JSON nesting depth;
- `messages`: how many;
- every JSON schema a request brings (`response_format`, each tool's parameters, `structured_outputs.json`): its
  size in bytes and its nesting depth; all of a request's `enum` / `structured_outputs.choice` values together;
- `structured_outputs.regex` / `.grammar` (EBNF): their size in bytes;
- grammar compilation: time limits, one for a request waiting on its grammar and one for an optional grammar
  compiling in the background (engine/worker/grammar_compile.py enforces them in a worker process);
- sampling: sequences (prompts x n), stop strings (count and bytes), stop token ids, and the prompt tokens a reply
  echoes or scores (`check_sampling`, `check_scored`).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.api.protocol import APIError

if TYPE_CHECKING:
    from server.pipeline.turn import Sampling

# A JSON escape of a UTF-16 surrogate: only then can a parsed body hold a lone one (raw UTF-8 never decodes to one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _flag(name: str, help_text: str) -> dict[str, str]:
    return {"flag": name, "help": help_text}


@dataclass(frozen=True)
class RequestLimits:
    """Each field's ``metadata`` names its `kvserve serve` flag (server/cli/serve.py builds them from it)."""

    body_bytes: int = field(default=8 * 1024 * 1024, metadata=_flag(
        "--max-request-bytes", "larger request bodies get 413"))
    json_depth: int = field(default=128, metadata=_flag(
        "--max-json-depth", "deepest nesting of arrays and objects in a request body"))
    messages: int = field(default=10_000, metadata=_flag("--max-messages", "most messages in one request"))
    schema_bytes: int = field(default=128 * 1024, metadata=_flag(
        "--max-schema-bytes", "largest JSON schema (response_format, a tool's parameters), as compact JSON"))
    schema_depth: int = field(default=64, metadata=_flag(
        "--max-schema-depth", "deepest nesting of arrays and objects in one JSON schema"))
    enum_values: int = field(default=2_000, metadata=_flag(
        "--max-enum-values", "most enum values (all schemas) plus structured_outputs.choice entries of one request"))
    grammar_bytes: int = field(default=64 * 1024, metadata=_flag(
        "--max-grammar-bytes", "largest structured_outputs regex or EBNF grammar"))
    compile_timeout_s: float = field(default=30.0, metadata=_flag(
        "--grammar-compile-timeout", "seconds a request waits for its grammar (response_format, tool_choice required "
        "or named) to compile in a worker process before it gets a 400"))
    sequences: int = field(default=64, metadata=_flag(
        "--max-sequences", "most sequences one request runs: its prompts times n"))
    stop_strings: int = field(default=64, metadata=_flag(
        "--max-stop-strings", "most stop strings (stop, stop_sequences) of one request"))
    stop_bytes: int = field(default=16 * 1024, metadata=_flag(
        "--max-stop-bytes", "most bytes of one request's stop strings together"))
    stop_token_ids: int = field(default=256, metadata=_flag(
        "--max-stop-token-ids", "most stop_token_ids of one request"))
    images: int = field(default=16, metadata=_flag(
        "--max-images", "most images in one request (a vision-language model's; docs/IMAGES.md)"))
    scored_tokens: int = field(default=262_144, metadata=_flag(
        "--max-scored-tokens", "most prompt-token entries a reply may carry: each echoed prompt token (echo) or scored "
        "one (echo with logprobs, prompt_logprobs) counts 1 + its alternatives, once per choice that carries it"))
    background_compile_timeout_s: float = field(default=300.0, metadata=_flag(
        "--grammar-background-compile-timeout", "seconds an optional grammar (the tool calls of tool_choice auto) may "
        "compile in the background; its request never waits: it runs unconstrained until the grammar is cached"))

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"request limit {name} must be positive, got {value}")


def _too_big(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="limit_exceeded")


def depth(value: Any) -> int:
    """Nesting depth of arrays and objects (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def check_body(raw: bytes, body: Any, limits: RequestLimits) -> None:
    """A parsed body's depth, and that its strings are valid Unicode (a lone surrogate `\\ud800` parses, but no
    tokenizer can encode it)."""
    if depth(body) > limits.json_depth:
        raise _too_big(f"the request body nests arrays and objects deeper than {limits.json_depth} levels")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "a string in the request holds a lone UTF-16 surrogate (such as \\ud800), which is "
                           "not valid Unicode", code="invalid_encoding") from None


def _enum_count(schema: Any) -> int:
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                count += len(node["enum"])
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return count


def _schemas(tools: list | None, response_format: Any, structured_outputs: Any) -> Iterator[tuple[str, Any]]:
    """(param, schema) for every JSON schema of a chat or completion request, in any of the shapes clients send."""
    for i, tool in enumerate(tools or []):
        if isinstance(tool, dict):
            function = tool.get("function")
            if isinstance(function, dict) and "parameters" in function:
                yield f"tools[{i}].function.parameters", function["parameters"]
            for key in ("parameters", "input_schema"):
                if key in tool:
                    yield f"tools[{i}].{key}", tool[key]
    if isinstance(response_format, dict):
        spec = response_format.get("json_schema")
        if isinstance(spec, dict) and "schema" in spec:
            yield "response_format.json_schema.schema", spec["schema"]
        if "schema" in response_format:
            yield "response_format.schema", response_format["schema"]
    if isinstance(structured_outputs, dict) and "json" in structured_outputs:
        yield "structured_outputs.json", structured_outputs["json"]


def check_request(limits: RequestLimits, *, messages: Iterable | None = None, tools: list | None = None,
                  response_format: Any = None, structured_outputs: Any = None) -> None:
    """A chat-shaped or completion request's messages, schemas, enums and grammars against the limits (400)."""
    if messages is not None and len(messages) > limits.messages:  # type: ignore[arg-type]
        raise _too_big(f"the request has {len(messages)} messages; this server takes at most "  # type: ignore
                       f"{limits.messages}", "messages")
    enums = 0
    for param, schema in _schemas(tools, response_format, structured_outputs):
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > limits.schema_bytes:
            raise _too_big(f"'{param}' is {size} bytes of JSON schema; this server takes at most "
                           f"{limits.schema_bytes}", param)
        if depth(schema) > limits.schema_depth:
            raise _too_big(f"'{param}' nests deeper than {limits.schema_depth} levels", param)
        enums += _enum_count(schema)
    if isinstance(structured_outputs, dict):
        choice = structured_outputs.get("choice")
        enums += len(choice) if isinstance(choice, list) else 0
        for key in ("regex", "grammar"):
            text = structured_outputs.get(key)
            if isinstance(text, str) and len(text.encode()) > limits.grammar_bytes:
                raise _too_big(f"'structured_outputs.{key}' is {len(text.encode())} bytes; this server takes at "
                               f"most {limits.grammar_bytes}", f"structured_outputs.{key}")
    if enums > limits.enum_values:
        raise _too_big(f"the request's schemas and choices list {enums} enum values together; this server takes at "
                       f"most {limits.enum_values}")


def check_sampling(limits: RequestLimits, sampling: Sampling, num_prompts: int = 1) -> None:
    """Sequences (``num_prompts`` x n), stop strings and stop token ids against the limits (400), before any work."""
    sequences = num_prompts * sampling.n
    if sequences > limits.sequences:
        raise _too_big(f"the request asks for {sequences} sequences ({num_prompts} prompt(s) x n={sampling.n}); this "
                       f"server runs at most {limits.sequences} for one request (--max-sequences)",
                       "n" if num_prompts == 1 else "prompt")
    if len(sampling.stop) > limits.stop_strings:
        raise _too_big(f"the request has {len(sampling.stop)} stop strings; this server takes at most "
                       f"{limits.stop_strings} (--max-stop-strings)", "stop")
    stop_bytes = sum(len(s.encode("utf-8", "surrogatepass")) for s in sampling.stop)
    if stop_bytes > limits.stop_bytes:
        raise _too_big(f"the request's stop strings are {stop_bytes} bytes together; this server takes at most "
                       f"{limits.stop_bytes} (--max-stop-bytes)", "stop")
    if len(sampling.stop_token_ids) > limits.stop_token_ids:
        raise _too_big(f"the request has {len(sampling.stop_token_ids)} stop_token_ids; this server takes at most "
                       f"{limits.stop_token_ids} (--max-stop-token-ids)", "stop_token_ids")


def check_scored(limits: RequestLimits, prompt_lengths: Iterable[int], n: int, *, echo: bool = False,
                 echo_logprobs: int | None = None, prompt_logprobs: int | None = None) -> None:
    """The prompt-token entries a reply will carry (echoed tokens and their logprobs once per choice, vLLM's
    `prompt_logprobs` once per prompt, each with its alternatives) against `--max-scored-tokens` (400)."""
    per_token = (n * (1 + (echo_logprobs or 0)) if echo else 0) + (1 + prompt_logprobs if prompt_logprobs is not None
                                                                   else 0)
    entries = per_token * sum(prompt_lengths)
    if entries > limits.scored_tokens:
        param = "prompt_logprobs" if prompt_logprobs is not None else "echo"
        raise _too_big(f"the reply would carry {entries} prompt-token entries (echo, logprobs and prompt_logprobs "
                       f"over every prompt token and choice); this server returns at most {limits.scored_tokens} "
                       f"(--max-scored-tokens)", param)
