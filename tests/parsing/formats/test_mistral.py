"""Devstral's output (server/parsing/formats/mistral.py): `[TOOL_CALLS]NAME[ARGS]{…}` calls back to back, v11's
`[CALL_ID]`, the older `[TOOL_CALLS][{…}]` list of one call, `</s>` ending the reply; the same message under every
split of the text, deltas that rebuild it, calls the renderer writes read back, and tool_choice's grammar."""
import json

import pytest

from server.parsing import get_output_parser, output_constraint
from server.parsing.formats.mistral import TOKEN_IDS
from server.rendering import get_renderer
from server.rendering.native.devstral import call_text

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked


def parser(tools=TOOLS, **kwargs):
    return lambda: get_output_parser("devstral", tools, reasoning=False, id_prefix="d", **kwargs)  # noqa: E731


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_text_then_parallel_calls_and_the_end_of_turn():
    text = ("Checking both." + call_text("get_weather", '{"city": "Paris"}')
            + call_text("get_weather", '{"city": "東京", "unit": "c"}') + "</s>[INST]ignored")
    message = parse_checked(parser(), text)
    assert message.content == "Checking both."
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京", "unit": "c"})]
    assert message.tool_calls[1]["function"]["arguments"] == '{"city": "東京", "unit": "c"}'  # the model's bytes


def test_call_id_and_the_older_list_form():
    assert calls_of(parse_checked(parser(), '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}')) == [
        ("get_weather", {"city": "Oslo"})]
    old = parse_checked(parser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]</s>')
    assert calls_of(old) == [("get_weather", {"city": "Rome"})] and old.content is None


def test_the_older_list_form_with_several_calls():
    listed = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}},'
              ' {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]</s>')
    for streaming in (True, False):
        message = parse_checked(parser(streaming=streaming), listed)
        assert calls_of(message) == [("get_weather", {"city": "Rome"}), ("now", {}), ("get_weather", {"city": "Oslo"})]
        assert message.content is None
    # One element that is not a call: the list is text, as the model wrote it.
    broken = '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"arguments": {}}]'
    assert parse_checked(parser(), broken).content == broken
    # parallel tool calls off: the output ends after the first call
    [first] = parse_checked(parser(max_calls=1), listed).tool_calls
    assert first["function"]["name"] == "get_weather"


def test_markup_in_strings_and_prose_is_not_a_call():
    code = 'print("[TOOL_CALLS]x[ARGS]{}")'
    message = parse_checked(parser(), call_text("get_weather", json.dumps({"city": code})))
    assert calls_of(message) == [("get_weather", {"city": code})]
    prose = parse_checked(parser(), "Write [TOOL_CALLS] then a name. " + call_text("get_weather", "{}"))
    assert prose.content == "Write [TOOL_CALLS] then a name. " and calls_of(prose) == [("get_weather", {})]


def test_arguments_stream_and_a_cut_call_is_closed():
    text = call_text("get_weather", '{"city": "Paris", "unit": "c"}')
    fragments = argument_fragments(parser(), text)
    assert len(fragments) == 1 and "".join(fragments[0]) == '{"city": "Paris", "unit": "c"}' and len(fragments[0]) > 3
    cut = parse_checked(parser(), call_text("get_weather", '{"city": "Pa'))
    assert calls_of(cut) == [("get_weather", {"city": "Pa"})]


def test_without_tools_everything_is_content():
    text = call_text("get_weather", '{"city": "Paris"}')
    assert parse_checked(parser(tools=None), text).content == text


def test_what_the_renderer_writes_reads_back():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "On it.", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Nice"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]}]
    rendered = get_renderer("devstral").render(messages, TOOLS, add_generation_prompt=False)
    reply = rendered[rendered.index("[/INST]") + len("[/INST]"):]
    message = parse_checked(parser(), reply)
    assert message.content == "On it."
    assert calls_of(message) == [("get_weather", {"city": "Nice"}), ("get_weather", {"city": "Lyon"})]


def test_the_grammar_of_a_required_call_writes_the_control_tokens():
    """tool_choice required / named: [TOOL_CALLS] (9) NAME [ARGS] (32) then arguments of the tool's schema; auto has
    no grammar (a call opens with a control token no text trigger sees)."""
    named = json.loads(output_constraint("devstral", TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                                         None, None, reasoning=False).value)["format"]
    assert [e.get("token", e.get("value")) for e in named["elements"] if e["type"] != "json_schema"] == [
        TOKEN_IDS["[TOOL_CALLS]"], "get_weather", TOKEN_IDS["[ARGS]"]] == [9, "get_weather", 32]
    assert named["elements"][-1]["json_schema"]["required"] == TOOLS[0]["function"]["parameters"]["required"]
    assert output_constraint("devstral", TOOLS, "auto", None, None, reasoning=False) is None


@pytest.mark.slow  # a grammar over tekken's 131k tokens
def test_required_parallel_calls_are_written_back_to_back_as_tokens():
    """tool_choice required with parallel calls: one or more `[TOOL_CALLS]NAME[ARGS]{…}` calls, the markers as
    their control tokens; parallel calls off or a named tool: exactly one."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from engine.registry import resolve_model
    from engine.worker.structured_output import StructuredOutputs

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("devstral-small-tiny")))
    grammar = StructuredOutputs(tokenizer, 131072, [tokenizer.eos_token_id], "cpu").compile(
        output_constraint("devstral", TOOLS, "required", True, None, reasoning=False))

    def accepts(*calls: tuple[str, str]) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        ids = [i for name, args in calls for i in [TOKEN_IDS["[TOOL_CALLS]"], *encode(name), TOKEN_IDS["[ARGS]"],
                                                   *encode(args)]]
        return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(tokenizer.eos_token_id)

    paris, now = ("get_weather", '{"city": "Paris"}'), ("now", "{}")
    assert accepts(paris) and accepts(paris, now, paris) and not accepts() and not accepts(("get_wether", "{}"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    for one in (output_constraint("devstral", TOOLS, "required", False, None, reasoning=False),
                output_constraint("devstral", TOOLS, named, True, None, reasoning=False)):
        assert '"plus"' not in one.value  # exactly one call
    # what the grammar lets through is what the parser reads as calls
    message = parse_checked(parser(), call_text(*paris) + call_text(*now) + "</s>")
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("now", {})]
