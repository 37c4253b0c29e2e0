"""The grammar of `output_constraint`, checked with xgrammar's matcher on text: it accepts exactly the calls each
family's template renders (and its parser reads), with arguments valid against the tool schema, and nothing else."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from engine.model_sources.kimi_tokenizer import write_kimi_k3_tokenizer
from engine.registry import resolve_model
from engine.worker.structured_output import StructuredOutputs, StructuredOutputSpec
from server.parsing import get_output_parser, parse_output
from server.parsing.constraint import ConstraintError, completion_constraint, output_constraint
from server.parsing.formats.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from server.rendering.native.gemma4 import call_text
from server.rendering.native.kimi import render_calls as kimi_section
from server.rendering.native.kimi_k3 import render_calls as kimi_k3_calls
from server.rendering.native.minimax import render_calls

from tests.parsing.fixtures import NO_ARGS, TOOLS, WEATHER

NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"], "additionalProperties": False,
}}}


@pytest.fixture(scope="module")
def grammars() -> StructuredOutputs:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("qwen3-tiny")))
    return StructuredOutputs(tokenizer, 151936, [151645, 151643], "cpu")


def accepts(grammars: StructuredOutputs, spec: StructuredOutputSpec, text: str) -> bool:
    """The grammar accepts `text` as a whole output (what follows may only be the end of the turn)."""
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


def qwen_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def coder_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def v3_calls(*calls: tuple[str, str]) -> str:
    return CALLS_BEGIN + "\n".join(f"{CALL_BEGIN}function{SEP}{n}\n```json\n{a}\n```{CALL_END}" for n, a in calls) + \
        CALLS_END


def v31_calls(*calls: tuple[str, str]) -> str:
    return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{n}{SEP}{a}{CALL_END}" for n, a in calls) + CALLS_END


def dsml_calls(block: str, *invokes: tuple[str, dict]) -> str:
    d = "｜DSML｜"
    body = "\n".join(f'<{d}invoke name="{n}">\n' + "\n".join(
        f'<{d}parameter name="{k}" string="true">{v}</{d}parameter>' for k, v in p.items()) + f"\n</{d}invoke>"
        for n, p in invokes)
    return f"\n\n<{d}{block}>\n{body}\n</{d}{block}>"


def glm_call(name: str, **args: str) -> str:
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                          for k, v in args.items()) + "</tool_call>"


def minimax_calls(*invokes: tuple[str, dict]) -> str:
    return render_calls([{"function": {"name": n, "arguments": a}} for n, a in invokes])


def kimi_calls(*calls: tuple[str, str]) -> str:
    return kimi_section([{"id": i, "function": {"name": "", "arguments": a}} for i, a in calls])


def gemma_call(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def gemma4_call(name: str, arguments: dict) -> str:
    return call_text({"name": name, "arguments": arguments})


PARIS = '{"city": "Paris"}'
# family -> (one call to get_weather, two calls: get_weather then now), in the bytes the template renders
CALLS = {
    "qwen2.5": (qwen_call("get_weather", PARIS), qwen_call("get_weather", PARIS) + "\n" + qwen_call("now", "{}")),
    "qwen3-coder": (coder_call("get_weather", city="Paris"),
                    coder_call("get_weather", city="Paris") + "\n" + coder_call("now")),
    "qwen3.6": (coder_call("get_weather", city="Paris"),
                coder_call("get_weather", city="Paris") + "\n" + coder_call("now")),
    "deepseek-v3-0324": (v3_calls(("get_weather", PARIS)), v3_calls(("get_weather", PARIS), ("now", "{}"))),
    "deepseek-v3.2": (dsml_calls("function_calls", ("get_weather", {"city": "Paris"})),
                      dsml_calls("function_calls", ("get_weather", {"city": "Paris"}), ("now", {}))),
    "deepseek-v4": (dsml_calls("tool_calls", ("get_weather", {"city": "Paris"})),
                    dsml_calls("tool_calls", ("get_weather", {"city": "Paris"}), ("now", {}))),
    "deepseek-v3.1": (v31_calls(("get_weather", PARIS)), v31_calls(("get_weather", PARIS), ("now", "{}"))),
    "glm-4.7": (glm_call("get_weather", city="Paris"), glm_call("get_weather", city="Paris") + glm_call("now")),
    "gemma3": (gemma_call("get_weather", PARIS), gemma_call("get_weather", PARIS) + "\n" + gemma_call("now", "{}")),
    "gemma4": (gemma4_call("get_weather", {"city": "Paris"}),
               gemma4_call("get_weather", {"city": "Paris"}) + gemma4_call("now", {})),
}


def constraint(family: str, tool_choice, *, tools=TOOLS, parallel=True, response_format=None, reasoning=False,
               structured_outputs=None):
    return output_constraint(family, tools, tool_choice, parallel, response_format, reasoning=reasoning,
                             structured_outputs=structured_outputs)


@pytest.mark.parametrize("family", list(CALLS))
@pytest.mark.slow_cases("qwen2.5", "qwen3-coder", "qwen3.6", "glm-4.7", "gemma3", "gemma4")
def test_required_and_named_accept_the_templates_calls_and_nothing_else(grammars, family):
    one, two = CALLS[family]
    required, named = constraint(family, "required"), constraint(family, NAMED)
    assert accepts(grammars, required, one) and accepts(grammars, required, two)
    assert accepts(grammars, named, one) and not accepts(grammars, named, two)  # a named tool is called once
    assert not accepts(grammars, constraint(family, "required", parallel=False), two)
    for wrong in ("", "Sure.", "Sure. " + one, one.replace("get_weather", "get_wether")):
        assert not accepts(grammars, required, wrong), wrong
    # What the grammar lets through is what the parser reads as calls.
    parsed = parse_output(family, two, TOOLS, "required", reasoning=False, id_prefix="g")
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"city": "Paris"}, {}]


@pytest.mark.slow  # ~18 s of grammar compiles
def test_minimax_calls_come_after_its_thinking(grammars):
    """MiniMax-M2 always thinks (its generation prompt opens `<think>`): required / named calls, in the template's
    block, follow the `</think>`, as its template renders them; under auto every opened block is valid."""
    thought = "Need the weather.\n</think>\n\n"
    one = minimax_calls(("get_weather", {"city": "Paris"}))
    two = minimax_calls(("get_weather", {"city": "Paris"}), ("now", {}))
    required, named = constraint("minimax-m2", "required"), constraint("minimax-m2", NAMED)
    assert accepts(grammars, required, thought + one) and accepts(grammars, required, thought + two)
    assert accepts(grammars, named, thought + one) and not accepts(grammars, named, thought + two)
    assert not accepts(grammars, constraint("minimax-m2", "required", parallel=False), thought + two)
    for wrong in ("", one, thought + "Sure.", thought + "Sure. " + one, thought + one.replace("get_weather", "get_")):
        assert not accepts(grammars, required, wrong), wrong
    parsed = parse_output("minimax-m2", thought + two, TOOLS, "required", reasoning=True, id_prefix="g")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    auto = constraint("minimax-m2", "auto")
    assert accepts(grammars, auto, thought + "Just text.") and accepts(grammars, auto, thought + "Let me check." + two)
    assert not accepts(grammars, auto, thought + "Let me check." + one.replace("get_weather", "get_wether"))


@pytest.mark.slow  # the Kimi stand-in tokenizer and grammar compiles over its vocabulary
def test_kimi_calls_follow_its_thinking_in_its_marker_tokens():
    """Kimi's template writes <think>...</think> in every assistant turn, so the grammar has the model write it before
    required / named calls in its section; every marker is its one token (spelled in pieces it is refused), and each
    call's header functions.NAME:IDX takes the index the model writes, which becomes the call's id. Under auto the
    model writes freely."""
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("kimi-linear-tiny")))
    grammars = StructuredOutputs(tokenizer, 163840, [tokenizer.convert_tokens_to_ids("<|im_end|>")], "cpu")

    def accepts_tokens(spec: StructuredOutputSpec, text: str, pieces: bool = False) -> bool:
        ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False, split_special_tokens=pieces)
        matcher = xgr.GrammarMatcher(grammars.compile(spec))
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()

    thought = "<think>Need the weather.</think>"
    one = kimi_calls(("functions.get_weather:0", PARIS))
    two = kimi_calls(("functions.get_weather:0", PARIS), ("functions.now:1", "{}"))
    required, named = constraint("kimi-k2", "required"), constraint("kimi-k2", NAMED)
    assert accepts_tokens(required, thought + one) and accepts_tokens(required, thought + two)
    assert accepts_tokens(named, thought + one) and not accepts_tokens(named, thought + two)
    assert not accepts_tokens(constraint("kimi-k2", "required", parallel=False), thought + two)
    for wrong in ("", one, thought + "Sure.", thought + one.replace("get_weather:0", "get_weather:x"),
                  thought + one.replace("functions.get_weather", "get_weather")):
        assert not accepts_tokens(required, wrong), wrong
    assert "<|tool_call_begin|>" in tokenizer.convert_ids_to_tokens(tokenizer.encode(one))
    assert not accepts_tokens(required, thought + one, pieces=True)
    parsed = parse_output("kimi-k2", thought + two, TOOLS, "required", reasoning=True, id_prefix="g")
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}), ("functions.now:1", "now", {})]
    assert constraint("kimi-k2", "auto") is None


@pytest.mark.slow  # the Kimi-K3 stand-in tokenizer and grammar compiles over its vocabulary
def test_kimi_k3_calls_follow_its_think_and_response_channels(tmp_path):
    """Kimi-K3's generation prompt opens the think channel: required / named calls come after its close and an empty
    response channel, in the tools channel, each argument tagged with its type, then the message's close, all as the
    template renders them; the index is the model's."""
    write_kimi_k3_tokenizer(tmp_path, "kimi-k3")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    end = tokenizer.convert_tokens_to_ids("<|end_of_msg|>")
    grammars = StructuredOutputs(tokenizer, len(tokenizer), [end], "cpu")

    def accepts_tokens(spec: StructuredOutputSpec, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammars.compile(spec))
        ids = tokenizer.encode(text, add_special_tokens=False) + [end]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()

    def turn(*calls: tuple[str, dict], index: int = 1) -> str:
        rendered = kimi_k3_calls([{"function": {"name": n, "arguments": a}} for n, a in calls])
        return "<|open|>response<|sep|><|close|>response<|sep|>" + rendered.replace(
            'index="1"', f'index="{index}"') + "<|close|>message<|sep|>"

    typed = {"type": "function", "function": {"name": "forecast", "parameters": FORECAST["function"]["parameters"]}}
    tools = [*TOOLS, typed]
    thought = "Need the weather.<|close|>think<|sep|>"
    one, two = turn(("get_weather", {"city": "Paris"})), turn(("get_weather", {"city": "Paris"}), ("now", {}))
    required = constraint("kimi-k3", "required", tools=tools, reasoning=True)
    named = constraint("kimi-k3", NAMED, tools=tools, reasoning=True)
    assert accepts_tokens(required, thought + one) and accepts_tokens(required, thought + two)
    assert accepts_tokens(required, thought + turn(("forecast", {"city": "Oslo", "days": 3}), index=7))
    assert accepts_tokens(named, thought + one) and not accepts_tokens(named, thought + two)
    assert not accepts_tokens(constraint("kimi-k3", "required", tools=tools, parallel=False, reasoning=True),
                              thought + two)
    for wrong in ("", one, thought + "<|open|>response<|sep|>Sure.<|close|>response<|sep|>", thought + "\n" + one,
                  thought + one.replace('index="1"', 'index="x"'),
                  thought + turn(("forecast", {"city": "Oslo", "days": 9})),
                  thought + turn(("forecast", {"city": "Oslo", "days": "3"}))):
        assert not accepts_tokens(required, wrong), wrong
    parsed = parse_output("kimi-k3", thought + two, tools, "required", reasoning=True, id_prefix="g")
    assert parsed.reasoning_content == "Need the weather." and not parsed.content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    auto = constraint("kimi-k3", "auto", tools=tools, reasoning=True)
    assert accepts_tokens(auto, thought + "<|open|>response<|sep|>Just text.<|close|>response<|sep|>"
                                          "<|close|>message<|sep|>")


@pytest.mark.parametrize("family", ["qwen3", "qwen3-coder", "deepseek-v3.1"])
def test_arguments_follow_the_schema(grammars, family):
    spec = constraint(family, "required", tools=[FORECAST])

    def call(**arguments) -> str:
        if family == "qwen3-coder":
            raw = {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}
            return coder_call("forecast", **raw)
        text = json.dumps(arguments)
        return qwen_call("forecast", text) if family == "qwen3" else v31_calls(("forecast", text))

    assert accepts(grammars, spec, call(city="Oslo", days=3))
    assert accepts(grammars, spec, call(city="Oslo", days=7, unit="f"))
    for bad in (dict(city="Oslo"), dict(city="Oslo", days=8), dict(city="Oslo", days=0), dict(city="Oslo", days=2.5),
                dict(city="Oslo", days=3, unit="k"), dict(city="Oslo", days=3, extra=1), dict(city="x" * 21, days=1)):
        assert not accepts(grammars, spec, call(**bad)), bad


def test_gemma4_arguments_follow_the_schema_in_its_notation(grammars):
    """Gemma 4's arguments are not JSON: keys bare and sorted as the template writes them, strings between <|"|>
    quotes (which may hold the call's closing tag, never the quote), numbers bare."""
    spec = constraint("gemma4", "required", tools=[FORECAST])
    assert accepts(grammars, spec, gemma4_call("forecast", {"city": "Oslo", "days": 3}))
    assert accepts(grammars, spec, gemma4_call("forecast", {"city": "a}<tool_call|>,<|b", "days": 7, "unit": "f"}))
    for bad in (dict(city="Oslo"), dict(city="Oslo", days="3"), dict(city="Oslo", days=2.5),
                dict(city="Oslo", days=3, unit="k"), dict(city="Oslo", days=3, extra=1)):
        assert not accepts(grammars, spec, gemma4_call("forecast", bad)), bad
    unsorted = '<|tool_call>call:forecast{days:3,city:<|"|>Oslo<|"|>}<tool_call|>'
    json_arguments = '<|tool_call>call:forecast{"city": "Oslo", "days": 3}<tool_call|>'
    assert not accepts(grammars, spec, unsorted) and not accepts(grammars, spec, json_arguments)
    nested = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
        "edits": {"type": "array", "items": {"type": "object", "properties": {"old": {"type": "string"},
                                                                               "new": {"type": "string"}}}},
        "meta": {}}, "required": ["edits"]}}}
    call = gemma4_call("edit", {"edits": [{"new": "b", "old": "a"}, {"old": "<|\"|"}], "meta": {"k": [1, None]}})
    assert accepts(grammars, constraint("gemma4", "required", tools=[nested]), call)
    parsed = parse_output("gemma4", call, [nested], "required", reasoning=False, id_prefix="g")
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {
        "edits": [{"new": "b", "old": "a"}, {"old": '<|"|'}], "meta": {"k": [1, None]}}


def test_gemma4_thinks_in_its_channel_before_the_named_call(grammars):
    spec, call = constraint("gemma4", NAMED, reasoning=True), CALLS["gemma4"][0]
    assert accepts(grammars, spec, "<|channel>thought\nParis, then.<channel|>" + call)
    assert accepts(grammars, spec, call)  # the model may answer without a thought
    assert not accepts(grammars, spec, "<think>\nParis.\n</think>\n\n" + call)


@pytest.mark.parametrize("family", ["qwen3", "qwen3-coder", "deepseek-v3-0324", "deepseek-v3.1"])
def test_call_markup_inside_an_argument_string_is_text(grammars, family):
    """Code that mentions a call marker (an agent editing a parser) is a valid argument; the parser reads it."""
    value = f"a</tool_call>{CALL_END}{CALLS_END}b" if family != "qwen3-coder" else f"a</tool_call>{CALL_END}b"
    arguments = json.dumps({"city": value}, ensure_ascii=False)
    text = {
        "qwen3": qwen_call("get_weather", arguments), "qwen3-coder": coder_call("get_weather", city=value),
        "deepseek-v3-0324": v3_calls(("get_weather", arguments)),
        "deepseek-v3.1": v31_calls(("get_weather", arguments)),
    }[family]
    assert accepts(grammars, constraint(family, "required", tools=[WEATHER]), text)
    for streaming in (True, False):
        parser = get_output_parser(family, [WEATHER], "required", reasoning=False, id_prefix="g", streaming=streaming)
        parser.feed(text)
        parser.finish()
        [call] = parser.result().tool_calls
        assert json.loads(call["function"]["arguments"]) == {"city": value}
    if family == "qwen3-coder":  # a raw-text value cannot hold the tags that end it: the grammar keeps them out
        bad = coder_call("get_weather", city="a</parameter>b")
        assert not accepts(grammars, constraint(family, "required", tools=[WEATHER]), bad)


@pytest.mark.parametrize("family", list(CALLS))
def test_auto_is_free_text_in_which_every_opened_call_is_valid(grammars, family):
    one, two = CALLS[family]
    auto = constraint(family, "auto")
    assert accepts(grammars, auto, "Just text, no call.")
    assert accepts(grammars, auto, "Let me check." + ("\n" if family.startswith("qwen") else "") + two)
    broken = one.replace("get_weather", "get_wether")
    assert not accepts(grammars, auto, "Let me check." + broken)
    assert constraint(family, "none") is None and constraint(family, "auto", tools=None) is None


def test_thinking_stays_free_before_the_constrained_part(grammars):
    qwen = constraint("qwen3", NAMED, reasoning=True)
    thought = "<think>\nMaybe <tool_call> {not json, and no rules here\n</think>\n\n"
    assert accepts(grammars, qwen, thought + CALLS["qwen2.5"][0])
    assert accepts(grammars, qwen, CALLS["qwen2.5"][0])  # thinking is optional for Qwen3
    assert not accepts(grammars, qwen, thought + "I will not call it.")
    # DeepSeek-V3.1 thinking: the generation prompt opened <think>, so the output starts inside it.
    v31 = constraint("deepseek-v3.1", "required", reasoning=True)
    assert accepts(grammars, v31, "Some reasoning.</think>" + CALLS["deepseek-v3.1"][0])
    assert not accepts(grammars, v31, CALLS["deepseek-v3.1"][0])
    # Qwen3.6 too: its generation prompt opens `<think>\n`.
    q36 = constraint("qwen3.6", "required", reasoning=True)
    assert accepts(grammars, q36, "Call it.\n</think>\n\n" + CALLS["qwen3.6"][0])
    assert not accepts(grammars, q36, CALLS["qwen3.6"][0])
    message = parse_output("qwen3", thought + CALLS["qwen2.5"][0], TOOLS, NAMED, reasoning=True, id_prefix="g")
    assert message.reasoning_content.startswith("Maybe <tool_call>") and len(message.tool_calls) == 1


@pytest.mark.slow
def test_response_format_json_schema_and_json_object(grammars):
    schema = FORECAST["function"]["parameters"]
    response_format = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}}
    spec = constraint("qwen3", None, tools=None, response_format=response_format, reasoning=True)
    assert accepts(grammars, spec, '<think>\nhm\n</think>\n\n{"city": "Rome", "days": 2}')
    assert accepts(grammars, spec, '{"city": "Rome", "days": 2}')
    assert not accepts(grammars, spec, '{"city": "Rome"}') and not accepts(grammars, spec, "Rome")
    # A raw control character is not JSON (xgrammar 0.2.8 lets one into a length-bounded string unless rewritten).
    assert not accepts(grammars, spec, '{"city": "Ro\tme", "days": 2}')
    any_object = constraint("qwen2.5", None, tools=None, response_format={"type": "json_object"})
    assert accepts(grammars, any_object, '{"anything": [1, {"x": null}]}') and not accepts(grammars, any_object, "[1]")
    # With tools under auto, the answer is either that JSON or calls.
    both = constraint("qwen2.5", "auto", response_format=response_format)
    assert accepts(grammars, both, '{"city": "Rome", "days": 2}') and accepts(grammars, both, CALLS["qwen2.5"][1])
    assert not accepts(grammars, both, "Plain text.")
    text = completion_constraint(response_format)
    assert accepts(grammars, text, '{"city": "Rome", "days": 2, "unit": "c"}')
    assert completion_constraint(None) is None and completion_constraint({"type": "text"}) is None


@pytest.mark.parametrize(
    "kwargs,param,message",
    [
        (dict(response_format={"type": "yaml"}), "response_format", "must be 'text', 'json_object' or 'json_schema'"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema", "needs json_schema.schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
            "a": {"not": {"type": "string"}}}}}}), "response_format.json_schema.schema", "properties.a: 'not'"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}}),
         "response_format.json_schema.schema", "the schema cannot be enforced: "),
        (dict(tool_choice="required", tools=[WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {
            "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]),
         "tools[1].function.parameters", "properties.xs: 'uniqueItems'"),
        (dict(tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_part(kwargs, param, message):
    """kvserve's own words (the field, and what cannot be enforced); a library's reason may follow them, but its
    wording is the library's to change (xgrammar 0.2.9 reworded its missing-$ref message), so it is not asserted."""
    args = dict(tool_choice=None, tools=TOOLS) | kwargs
    with pytest.raises(ConstraintError) as err:
        constraint("qwen3", args.pop("tool_choice"), **args)
    assert err.value.param == param and message in str(err.value), str(err.value)


def test_a_tool_without_parameters_takes_an_empty_object(grammars):
    spec = constraint("qwen2.5", "required", tools=[NO_ARGS, {"type": "function", "function": {"name": "ping"}}])
    assert accepts(grammars, spec, qwen_call("ping", "{}")) and accepts(grammars, spec, qwen_call("now", "{}"))
    assert not accepts(grammars, spec, qwen_call("now", '{"x": 1}'))


def test_structured_outputs_extension(grammars):
    choice = constraint("qwen3", "auto", structured_outputs={"choice": ["yes", 'say "no"']}, reasoning=True)
    assert accepts(grammars, choice, 'say "no"') and not accepts(grammars, choice, "maybe")
    regex = completion_constraint(None, {"regex": r"<think>\n[a-z]+\n</think>\n\nok"})
    assert accepts(grammars, regex, "<think>\nhm\n</think>\n\nok")
    json_spec = completion_constraint(None, {"json": FORECAST["function"]["parameters"]})
    assert accepts(grammars, json_spec, '{"city": "Rome", "days": 2}')
    for bad, message in (({"regex": "a", "choice": ["b"]}, "exactly one of"), ({"choice": []}, "non-empty strings")):
        with pytest.raises(ConstraintError, match=message):
            completion_constraint(None, bad)
    with pytest.raises(ConstraintError, match="send only one of them") as err:
        constraint("qwen3", "required", structured_outputs={"regex": "a"})
    assert err.value.param == "structured_outputs"


def test_under_auto_an_unenforceable_tool_schema_is_held_to_an_object(grammars):
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    auto = constraint("qwen2.5", "auto", tools=[WEATHER, odd])
    assert accepts(grammars, auto, qwen_call("odd", '{"a": "anything"}'))
    assert not accepts(grammars, auto, qwen_call("odd", '"not an object"'))
    assert not accepts(grammars, auto, qwen_call("get_weather", '{"city": 1}'))  # the others keep their schema
    with pytest.raises(ConstraintError, match="'not' is not supported"):
        constraint("qwen2.5", "required", tools=[WEATHER, odd])
