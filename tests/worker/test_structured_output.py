"""Grammar-constrained decoding in the engine, on qwen3-tiny (random weights, the real Qwen3 tokenizer): a random
model never writes valid JSON by chance, so only the grammar can make every output valid."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.worker.structured_output import StructuredOutputSpec
from tests.hf_oracle import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
JSON = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))


def constrained(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_output=JSON, **kwargs)


@pytest.mark.slow
def test_every_output_validates_at_temperature_1(qwen3_llm: LLM):
    prompts = random_prompts(50_000, [5, 12, 30, 7] * 2, seed=3)
    outs = qwen3_llm.generate(prompts, [constrained(seed) for seed in range(8)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in outs}) == 8  # varied, context-dependent output, not one forced string
    assert qwen3_llm.engine.structured_outputs.num_active == 0  # every matcher is released


@pytest.mark.slow
def test_n_siblings_and_ignore_eos_each_follow_the_grammar(qwen3_llm: LLM):
    [out] = qwen3_llm.generate([list(range(200, 220))], constrained(7, n=3, ignore_eos=True, logprobs=3))
    assert len(out.outputs) == 3
    for completion in out.outputs:
        # ignore_eos cannot run past the end of the grammar: the output ends where the JSON does.
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        for entry in completion.logprobs:  # tokens the grammar ruled out are no alternatives (nor -inf in JSON)
            assert all(logprob > float("-inf") for _, logprob in entry.top)


@pytest.mark.slow
def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(qwen3_llm: LLM):
    prompts = random_prompts(50_000, [9, 14, 21], seed=5)
    free = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    free += [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    alone = [o.token_ids for o in qwen3_llm.generate(prompts, free)]
    mixed = qwen3_llm.generate(prompts * 2, free + [constrained(s) for s in range(3)])
    assert [o.token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.slow
def test_preempted_constrained_requests_resume_their_grammar():
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    prompts = random_prompts(50_000, [20, 30, 25], seed=8)
    outs = llm.generate(prompts, [constrained(seed) for seed in range(3)])
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    "spec,pattern",
    [
        (StructuredOutputSpec("regex", r"(yes|no), [0-9]{2}"), r"(yes|no), [0-9]{2}"),
        (StructuredOutputSpec("ebnf", 'root ::= "(" word ("," word){0,3} ")"\nword ::= [a-z]{1,6}'),
         r"\([a-z]{1,6}(,[a-z]{1,6}){0,3}\)"),
    ],
)
@pytest.mark.slow
def test_regex_and_ebnf(qwen3_llm: LLM, spec, pattern):
    params = [SamplingParams(max_tokens=64, seed=s, structured_output=spec) for s in range(4)]
    outs = qwen3_llm.generate([[300, 301, 302]] * 4, params)
    assert all(out.finish_reason == "stop" and re.fullmatch(pattern, out.text) for out in outs), [o.text for o in outs]
    assert len({out.text for out in outs}) > 1


@pytest.mark.slow
def test_a_grammar_compiled_elsewhere_is_read_not_compiled_again(qwen3_llm: LLM, monkeypatch):
    """A server beside a core process compiles a request's grammar in its own workers and sends it with the request
    as JSON: the core reads it (milliseconds) instead of compiling the schema a second time, and it constrains."""
    from engine.worker import structured_output

    engine = qwen3_llm.engine
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA | {"title": "sent along"}))  # compiled nowhere yet
    server_side = structured_output.StructuredOutputs(engine.tokenizer, engine.model_cfg.vocab_size,
                                                      engine.eos_token_ids, "cpu")
    assert server_side.serialized(spec) is None
    server_side.compile_isolated(spec, timeout_s=120)
    sent = server_side.serialized(spec)
    server_side.close()

    def no_compile(*args):
        raise AssertionError("compiled a grammar it was sent")

    monkeypatch.setattr(structured_output, "compile_spec", no_compile)
    engine.structured_outputs.adopt(spec, sent)
    outs = qwen3_llm.generate([[5, 6, 7]] * 3, [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_output=spec) for seed in range(3)])
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_grammar_that_cannot_compile_is_refused_before_it_runs(qwen3_llm: LLM):
    bad = StructuredOutputSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "strange"}}}))
    with pytest.raises(ValueError, match='json schema cannot be enforced: Unsupported type "strange"'):
        qwen3_llm.generate([[1, 2, 3]], SamplingParams(structured_output=bad))
    assert not qwen3_llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="structured output kind"):
        StructuredOutputSpec("yaml", "a: 1")


def test_strings_are_valid_utf8_and_json(qwen3_llm: LLM):
    """xgrammar 0.2.8 lets a string hold the bytes of a UTF-16 surrogate (ED A0-BF ..), which is no UTF-8, and a raw
    tab; the schema rewrite (engine/json_schema_support.py) keeps both out, byte by byte, token by token."""
    import xgrammar as xgr

    from server.pipeline.logprobs import _byte_level_alphabet

    grammar = qwen3_llm.engine.structured_outputs.compile(StructuredOutputSpec("json_schema", '{"type": "string"}'))
    char_of = {byte: char for char, byte in _byte_level_alphabet().items()}
    vocab = qwen3_llm.tokenizer.get_vocab()

    def accepted(data: bytes) -> list[bool]:  # one single-byte token per byte, between quotes
        matcher = xgr.GrammarMatcher(grammar)
        return [matcher.accept_token(vocab[char_of[b]]) for b in b'"' + data + b'"']

    assert all(accepted("륤 😀 ok".encode()))
    assert accepted(b"\xed\xbd\x94") == [True, True, False, True, False]  # a surrogate: refused at its 2nd byte
    assert accepted(b"\t") == [True, False, True]


BOUNDED = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},  # the bound goes into the regex
    "tag": {"type": "string", "pattern": "[A-Z][a-z]*", "minLength": 3, "maxLength": 4},
    "note": {"type": "string", "minLength": 2, "maxLength": 6},  # kvserve's own rewrite: pattern, no warning
}, "required": ["code", "tag", "note"], "additionalProperties": False}


@pytest.mark.slow
def test_pattern_with_length_bounds_holds_both_without_warnings(qwen3_llm: LLM, capfd):
    spec = StructuredOutputSpec("json_schema", json.dumps(BOUNDED))
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_output=spec) for seed in range(8)]
    outs = qwen3_llm.generate(random_prompts(50_000, [9] * 8, seed=8), params)
    for out in outs:
        value = json.loads(out.text)
        jsonschema.validate(value, BOUNDED)  # maxLength included: xgrammar alone drops it beside a pattern
        assert re.fullmatch("[a-z]{1,5}", value["code"]) and re.fullmatch("[A-Z][a-z]{2,3}", value["tag"])
    assert "not supported" not in capfd.readouterr().err  # xgrammar's "ignoring minLength/maxLength" warning


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "^(ab)+$", "maxLength": 4}, "single characters"),
    ({"type": "string", "pattern": "^a+b+$", "maxLength": 4}, "more than one run"),
    ({"type": "string", "pattern": "^abc$", "maxLength": 2}, "only strings of length 3"),
    ({"type": "string", "format": "email", "maxLength": 20}, "'format' combined"),
])
def test_length_bounds_that_cannot_be_composed_are_refused(schema, message):
    from engine.json_schema_support import check_json_schema

    with pytest.raises(ValueError, match=message):
        check_json_schema({"type": "object", "properties": {"s": schema}})
