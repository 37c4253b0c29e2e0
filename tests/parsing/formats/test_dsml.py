"""DSML tool calls (DeepSeek-V3.2 `function_calls`, V4 `tool_calls`), parsed split-invariantly: every split of the
output, down to one character at a time, gives the same message, and the streamed deltas rebuild it."""
import json

import pytest

from server.parsing import get_output_parser
from server.rendering import get_renderer

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
BLOCKS = {"deepseek-v3.2": "function_calls", "deepseek-v4": "tool_calls"}
FAMILIES = sorted(BLOCKS)


def invoke(name: str, **params) -> str:
    body = "\n".join(f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                     f'{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>' for k, v in params.items())
    return f'<{D}invoke name="{name}">\n{body}\n</{D}invoke>'


def calls(family: str, *invokes: str) -> str:
    block = BLOCKS[family]
    return f"\n\n<{D}{block}>\n" + "\n".join(invokes) + f"\n</{D}{block}>"


def parse(family: str, text: str, *, reasoning: bool = False, **kwargs):
    factory = lambda: get_output_parser(family, TOOLS, reasoning=reasoning, id_prefix="d", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def args_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


@pytest.mark.parametrize("family", FAMILIES)
def test_calls_after_text_and_thinking(family):
    text = "The user wants weather.</think>Let me check." + calls(
        family, invoke("get_weather", city="Paris", unit="c"), invoke("typed", count=3, options={"a": [1, None]}))
    message = parse(family, text + EOS, reasoning=True)
    assert message.reasoning_content == "The user wants weather." and message.content == "Let me check."
    assert args_of(message) == [("get_weather", {"city": "Paris", "unit": "c"}),
                                ("typed", {"count": 3, "options": {"a": [1, None]}})]
    assert message.tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'
    assert message.finish_reason_override == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_parsed_message_re_renders_the_raw_output(family):
    """Prompt N + the raw output is a prefix of prompt N+1 rendered from the parsed message (V4 in agent use)."""
    renderer = get_renderer(family)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    raw = "Need the tool.</think>" + calls(family, invoke("get_weather", city="Paris")) + EOS
    prompt = renderer.render(question, TOOLS, thinking=True)
    message = {k: v for k, v in parse(family, raw, reasoning=True).to_message().items() if v not in (None, [])}
    message.setdefault("content", "")
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18C"}
    following = renderer.render([*question, message, result], TOOLS, thinking=True)
    assert following.startswith(prompt + raw)


@pytest.mark.parametrize("family", FAMILIES)
def test_values_string_raw_and_json_typed(family):
    text = calls(family, invoke("typed", text="a </invoke> \"quoted\"\nline", count=7, ratio=0.5, flag=True,
                                nothing=None, items=["x", 1]))
    ((name, arguments),) = args_of(parse(family, text))
    assert arguments == {"text": 'a </invoke> "quoted"\nline', "count": 7, "ratio": 0.5, "flag": True,
                         "nothing": None, "items": ["x", 1]}
    # `string="false"` with text that is not JSON: typed by the schema, else kept as a string
    odd = (f'\n\n<{D}{BLOCKS[family]}>\n<{D}invoke name="typed">\n<{D}parameter name="count" string="false">'
           f' 12 </{D}parameter>\n<{D}parameter name="text" string="false">not json</{D}parameter>\n'
           f'<{D}parameter name="ratio" string="false">NaN</{D}parameter>\n</{D}invoke>\n</{D}{BLOCKS[family]}>')
    ((_, arguments),) = args_of(parse(family, odd))
    assert arguments == {"count": 12, "text": "not json", "ratio": "NaN"}


@pytest.mark.parametrize("family", FAMILIES)
def test_arguments_stream_per_parameter(family):
    factory = lambda: get_output_parser(family, TOOLS, reasoning=False, id_prefix="d")  # noqa: E731
    text = calls(family, invoke("get_weather", city="Paris", unit="c"), invoke("now"))
    assert argument_fragments(factory, text) == [['{"city": "Paris"', ', "unit": "c"', "}"], ["{}"]]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", [
    "Just prose that mentions <｜DSML｜invoke name= in passing.",
    "```\n<｜DSML｜invoke name=\"get_weather\">\n```\nIn a code fence.",
    "\n\n<｜DSML｜tool_calls>\nno invoke here\n</｜DSML｜tool_calls>",
    "<｜DSML｜invoke oops>broken</｜DSML｜invoke> after",
])
def test_malformed_markup_is_content(family, text):
    message = parse(family, text)
    assert message.tool_calls == [] and message.content.strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_cut_off_by_max_tokens(family):
    whole = calls(family, invoke("get_weather", city="Paris", unit="c"))
    text = whole[: whole.index('">c<') + 3]  # inside the unit value
    streamed = parse(family, text, streaming=True)
    assert args_of(streamed) == [("get_weather", {"city": "Paris"})]  # the open parameter is dropped
    assert parse(family, text, streaming=False).tool_calls == []  # not streamed: the cut call stays content


@pytest.mark.parametrize("family", FAMILIES)
def test_text_that_breaks_the_format_ends_the_parameters(family):
    broken = (f'\n\n<{D}{BLOCKS[family]}>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">'
              f'Paris</{D}parameter>\ngarbage <{D}parameter name="unit" string="true">c</{D}parameter>\n</{D}invoke>\n'
              f'</{D}{BLOCKS[family]}>')
    assert args_of(parse(family, broken, streaming=True)) == [("get_weather", {"city": "Paris"})]
