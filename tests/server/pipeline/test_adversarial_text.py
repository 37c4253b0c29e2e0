"""No normalisation, renderer or parser runs in more than linear time over request or output text (issue 41, item 1):
each runs on adversarial inputs of about 1 MB within a loose bound. A quadratic pass (a backtracking regex, `+=` on
a growing attribute) takes tens of seconds to minutes on these; the linear passes take well under a second."""
from __future__ import annotations

import time

import pytest

from server.cache.normalize import BILLING_HEADER, normalize_for_cache, strip_billing_nonce
from server.parsing.registry import FAMILIES as PARSING_FAMILIES
from server.parsing.registry import parse_output
from server.rendering import FAMILIES as RENDERING_FAMILIES
from server.rendering import get_renderer

MB = 1_000_000
BOUND_S = 2.0  # normalisation and rendering: linear passes take milliseconds
PARSE_BOUND_S = 8.0  # an output parser handles ~10 µs a piece; 2 MB of 7-byte tags is 285,000 pieces
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}}}}}]

NONCE_INPUTS = {
    "header then blanks": BILLING_HEADER + " " * MB,
    "header then tabs and a late key": BILLING_HEADER + "\t " * (MB // 2) + "cch=1;",
    "header then keys glued to words": BILLING_HEADER + "xcch=" * (MB // 5),
    "many header lines of blanks": (BILLING_HEADER + " " * 1000 + "\n") * (MB // 1030),
}

OUTPUT_INPUTS = {
    "blanks": " " * MB,
    "open call then blanks": "<tool_call>" + " " * MB,
    "open braces": '<tool_call>{"name": "f", "arguments": ' + "{" * MB,
    "backslashes in a name": '<tool_call>{"name": "' + "\\" * MB,
    "function tag then blanks": "<tool_call>\n<function=" + " " * MB,
    "many function closes": "<tool_call>\n<function=f>\n<parameter=a>\n" + "</function>x" * (MB // 12),
    "json fences": "```json\n" * (MB // 8),
    "think tags": "<think>" * (2 * MB // 7),  # 2 MB: the quadratic pass took 20 s on these, the linear 2-4 s
    "call tags": "<tool_call>" * (2 * MB // 11),
    "less-than signs": "<" * MB,
}


def _timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


@pytest.mark.parametrize("name", NONCE_INPUTS)
def test_the_billing_nonce_is_stripped_in_linear_time(name: str) -> None:
    # The old regex took 8.9 s on a header and 20,000 blanks (minutes on 1 MB)
    assert _timed(strip_billing_nonce, NONCE_INPUTS[name]) < BOUND_S


def test_the_billing_nonce_is_stripped_as_before() -> None:
    header = f"{BILLING_HEADER} cc_version=1.0; cch=abc123; cc_entrypoint=cli;"
    assert strip_billing_nonce(header) == f"{BILLING_HEADER} cc_version=1.0; cc_entrypoint=cli;"
    assert strip_billing_nonce(f"{BILLING_HEADER}cch=1") == BILLING_HEADER
    assert strip_billing_nonce(f"{BILLING_HEADER} xcch=1; cch=2;") == f"{BILLING_HEADER} xcch=1;"
    assert strip_billing_nonce(f"a\n{BILLING_HEADER} cch=1;\n{BILLING_HEADER}\tcch=2;x\ncch=3;") == \
        f"a\n{BILLING_HEADER}\n{BILLING_HEADER}x\ncch=3;"
    assert strip_billing_nonce(f" {BILLING_HEADER} cch=1;") == f" {BILLING_HEADER} cch=1;"  # not a line start


@pytest.mark.parametrize("family", sorted(RENDERING_FAMILIES))
def test_normalising_and_rendering_a_megabyte_is_linear(family: str) -> None:
    renderer = get_renderer(family)
    messages = [
        {"role": "system", "content": NONCE_INPUTS["header then blanks"]},
        {"role": "user", "content": "<think>" * (MB // 7)},
        {"role": "assistant", "content": "</think>" * (MB // 8)},
        {"role": "system", "content": [{"type": "text", "text": NONCE_INPUTS["many header lines of blanks"]}]},
        {"role": "user", "content": "<tool_call>" * (MB // 11)},
    ]
    started = time.perf_counter()
    renderer.render(normalize_for_cache(messages, renderer), None, True)
    assert time.perf_counter() - started < BOUND_S


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(PARSING_FAMILIES))
@pytest.mark.slow
def test_every_output_parser_takes_a_megabyte_in_linear_time(family: str) -> None:
    # Before: 142,857 <think> tags (1 MB) took 5.1-5.5 s and 90,909 <tool_call> tags 3.2-3.6 s, growing
    # quadratically (each piece copied the item's whole text: 2.9 s at 100,000 tags, 1.0 s at 50,000); now 1-2 s a
    # megabyte on a loaded two-core machine, growing linearly.
    for name, text in OUTPUT_INPUTS.items():
        elapsed = _timed(parse_output, family, text, TOOLS, reasoning=True, id_prefix="x")
        assert elapsed < PARSE_BOUND_S, f"{family}, {name}: {elapsed:.1f} s"
