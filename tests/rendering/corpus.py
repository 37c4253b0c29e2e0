"""The golden corpus: OpenAI chat requests every renderer is checked on, byte for byte, against the official templates.

Each case is rendered for every family; template kwargs (``enable_thinking``, ``thinking``) are passed to all of them
(templates ignore kwargs they do not know, as transformers does). ``make_goldens.py`` renders the cases with the
official templates; ``test_goldens.py`` compares the native renderers with those files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    messages: list[Any]
    tools: list[dict] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True


def system(text: Any) -> dict:
    return {"role": "system", "content": text}


def user(text: Any, **extra: Any) -> dict:
    return {"role": "user", "content": text, **extra}


def assistant(content: Any = None, calls: list[dict] | None = None, **extra: Any) -> dict:
    message = {"role": "assistant", "content": content, **extra}
    if calls is not None:
        message["tool_calls"] = calls
    return message


def call(name: str, arguments: Any, call_id: str = "call_0") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(content: Any, call_id: str = "call_0") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def fn(name: str, description: str | None, parameters: dict | None, **extra: Any) -> dict:
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    function.update(extra)
    return {"type": "function", "function": function}


WEATHER = fn(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
        },
        "required": ["city"],
    },
)
SEARCH = fn(
    "search_code",
    "  Search the repository.\nReturns matching lines.  ",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "A regular expression"},
            "filters": {
                "type": "object",
                "description": "Where to look",
                "properties": {
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "language": {"type": "string", "enum": ["python", "rust", "c++"]},
                    "range": {
                        "type": "object",
                        "properties": {"start": {"type": "integer"}, "end": {"type": "integer"}},
                    },
                },
            },
            "max_results": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
            "case_sensitive": {"type": ["boolean", "null"], "default": False},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
    strict=True,
)
TRANSLATE = fn(
    "traduire",
    "Traduit un texte — 日本語, Ελληνικά, emoji ✓ 🚀 <b>&'\"",
    {
        "type": "object",
        "properties": {
            "texte": {"type": "string", "description": "Le texte à traduire"},
            "langue": {"type": "string", "enum": ["français", "日本語", "ελληνικά"]},
        },
        "required": ["texte", "langue"],
    },
)
NOW = fn("get_time", None, None)
BARE = fn("list_files", "List files.", {"type": "object", "properties": {}})

TOOLS = [WEATHER]
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
ROME_ARGS = '{"city": "Rome"}'
ALL_TYPES = {"query": "déjà \"vu\"\n\\d+", "max_results": 5, "case_sensitive": None,
             "filters": {"paths": ["src/", "tests/"], "range": {"start": 1, "end": 2.5}, "recursive": True}}


def _weather_loop(first_content: Any = None, arguments: Any = WEATHER_ARGS) -> list[dict]:
    return [user("What's the weather in Paris?"), assistant(first_content, [call("get_weather", arguments)]),
            tool('{"temp": 18, "sky": "cloudy"}')]


CASES: list[Case] = [
    # --- plain chat ---------------------------------------------------------------------------------------------
    Case("user_only", [user("Hello!")]),
    Case("system_user", [system("You are a terse assistant."), user("Hi")]),
    Case("multi_turn", [user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke.")]),
    Case("multi_turn_system", [system("Be brief."), user("2+2?"), assistant("4"), user("3+3?"),
                               assistant("6"), user("and 4+4?")]),
    Case("mid_conversation_system", [system("Be brief."), user("Hi"), assistant("Hello."),
                                     system("From now on answer in French."), user("How are you?")]),
    Case("mid_system_no_first_system", [user("Hi"), assistant("Hello."), system("Switch to English only."),
                                        user("Ça va ?")]),
    Case("two_systems_at_top", [system("Rule one."), system("Rule two."), user("Go")]),
    Case("non_ascii", [system("Tu es un assistant français. 你好！"), user("Привет 👋 مرحبا — naïve café ßẞ"),
                       assistant("こんにちは 🌸"), user("¿Qué tal? Ω≈ç√∫")]),
    Case("empty_user_content", [user("")]),
    Case("null_user_content", [user(None)]),
    Case("text_parts_user", [user([{"type": "text", "text": "First part."}, {"type": "text", "text": "Second 部分."}])]),
    Case("text_parts_system", [system([{"type": "text", "text": "You are helpful."}]), user("Hi")]),
    Case("text_parts_assistant", [user("Hi"), assistant([{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]),
                                  user("Bye")]),
    Case("assistant_null_content", [user("Say nothing."), assistant(None), user("Now say something.")]),
    Case("assistant_empty_content", [user("Say nothing."), assistant(""), user("Now say something.")]),
    Case("no_generation_prompt", [user("Hi"), assistant("Hello!")], add_generation_prompt=False),
    Case("final_assistant_prefill", [system("S"), user("Write a haiku."), assistant("Autumn moonlight—")],
         add_generation_prompt=False),
    Case("generation_prompt_after_assistant", [user("Hi"), assistant("Hello!")]),
    Case("whitespace_edges", [system("\n  padded system  \n"), user("\n\nleading newlines"),
                              assistant("\n\nanswer with newlines\n\n"), user("trailing\n\n")]),
    Case("template_syntax_in_content", [user("Render {{ messages }} and {% if x %}y{% endif %} literally"),
                                        assistant("Sure: {{ '{{' }} {#comment#}"), user("<|im_end|> and <｜User｜> text")]),
    Case("developer_role", [{"role": "developer", "content": "Developer rules."}, user("Hi")]),
    Case("long_conversation", [system("Count.")] + [m for i in range(1, 6) for m in (user(f"n={i}"), assistant(str(i * i)))]
         + [user("n=6")]),
    Case("user_text_looks_like_tool_response", [user("<tool_response>\nfake\n</tool_response>"), assistant("ok"),
                                                user("Real question")]),
    # --- tools in the prompt --------------------------------------------------------------------------------------
    Case("tools_no_system", [user("Weather in Paris?")], tools=TOOLS),
    Case("tools_with_system", [system("You are a weather bot."), user("Weather in Paris?")], tools=TOOLS),
    Case("tools_nested_schema", [system("You search code."), user("Find TODOs in src")], tools=[SEARCH]),
    Case("tools_enum_unicode", [user("Traduis « bonjour » en japonais")], tools=[TRANSLATE, WEATHER]),
    Case("tools_minimal_definitions", [user("What time is it?")], tools=[NOW, BARE]),
    Case("tools_empty_list", [user("Hi")], tools=[]),
    Case("tools_with_mid_system", [system("Top."), user("Hi"), assistant("Hello"), system("Later rule."),
                                   user("Weather?")], tools=TOOLS),
    Case("tools_system_text_parts", [system([{"type": "text", "text": "Part A"}, {"type": "text", "text": "Part B"}]),
                                     user("Weather?")], tools=TOOLS),
    # --- tool calls and results -------------------------------------------------------------------------------------
    Case("single_call_string_args", _weather_loop(), tools=TOOLS),
    Case("single_call_object_args", _weather_loop(arguments={"city": "Paris", "unit": "celsius"}), tools=TOOLS),
    Case("single_call_with_text", _weather_loop("Let me check the weather."), tools=TOOLS),
    Case("single_call_empty_content", _weather_loop(""), tools=TOOLS),
    Case("single_call_pending", [user("Weather in Paris?"), assistant(None, [call("get_weather", WEATHER_ARGS)])],
         tools=TOOLS, add_generation_prompt=False),
    Case("single_call_answered", _weather_loop() + [assistant("It is 18 °C and cloudy in Paris.")], tools=TOOLS),
    Case("single_call_answered_then_user", _weather_loop() + [assistant("18 °C, cloudy."), user("And tomorrow?")],
         tools=TOOLS),
    Case("parallel_calls", [user("Weather in Paris and Rome?"),
                            assistant(None, [call("get_weather", WEATHER_ARGS, "a"), call("get_weather", ROME_ARGS, "b")]),
                            tool("18C", "a"), tool("20C", "b")], tools=TOOLS),
    Case("parallel_calls_three_with_text", [system("Use tools."), user("Paris, Rome, Tōkyō?"),
                                            assistant("Checking all three.", [call("get_weather", WEATHER_ARGS, "a"),
                                                                              call("get_weather", ROME_ARGS, "b"),
                                                                              call("get_weather", '{"city": "東京"}', "c")]),
                                            tool("18C", "a"), tool("20C", "b"), tool("25C ☀", "c"),
                                            assistant("Paris 18, Rome 20, Tokyo 25.")], tools=TOOLS),
    Case("parallel_calls_object_args", [user("Paris and Rome?"),
                                        assistant("", [call("get_weather", {"city": "Paris"}, "a"),
                                                       call("get_weather", {"city": "Rome"}, "b")]),
                                        tool("18C", "a"), tool("20C", "b")], tools=TOOLS),
    Case("two_tool_rounds", _weather_loop() + [assistant(None, [call("get_weather", ROME_ARGS, "call_1")]),
                                               tool("20C", "call_1"), assistant("Paris 18, Rome 20.")], tools=TOOLS),
    Case("tool_loop_then_new_user", _weather_loop() + [assistant("18 °C."), user("Now Rome?"),
                                                       assistant(None, [call("get_weather", ROME_ARGS, "call_1")]),
                                                       tool("20C", "call_1")], tools=TOOLS),
    Case("call_after_tool_result_with_text", _weather_loop("Checking Paris.") + [
        assistant("Now Rome.", [call("get_weather", ROME_ARGS, "call_1")]), tool("20C", "call_1")], tools=TOOLS),
    Case("args_unicode_and_escapes", [user("Search"), assistant(None, [call(
        "search_code", '{"query": "naïve \\"quoted\\"\\n\\\\d+ 日本"}')]), tool("no matches")], tools=[SEARCH]),
    Case("args_all_json_types_object", [user("Search"), assistant(None, [call("search_code", ALL_TYPES)]),
                                        tool("3 matches")], tools=[SEARCH]),
    Case("args_all_json_types_string", [user("Search"), assistant(None, [call("search_code", '{"query": "x", "max_results": 5, '
                                        '"case_sensitive": true, "filters": {"paths": ["a"], "range": {"end": 1.0}}}')]),
                                        tool("ok")], tools=[SEARCH]),
    Case("args_compact_json_string", [user("Weather?"), assistant(None, [call("get_weather", '{"city":"Paris"}')]),
                                      tool("18C")], tools=TOOLS),
    Case("args_empty_object", [user("Time?"), assistant(None, [call("get_time", "{}")]), tool("12:00")], tools=[NOW]),
    Case("args_empty_string", [user("Time?"), assistant(None, [call("get_time", "")]), tool("12:00")], tools=[NOW]),
    Case("args_non_object_json", [user("Time?"), assistant(None, [call("get_time", "[1, 2]")]), tool("12:00")],
         tools=[NOW]),
    Case("args_invalid_json", [user("Time?"), assistant(None, [call("get_time", "{not json")]), tool("12:00")],
         tools=[NOW]),
    Case("tool_calls_empty_list", [user("Hi"), assistant("Hello!", []), user("Bye")]),
    Case("tool_calls_null", [user("Hi"), assistant("Hello!", tool_calls=None), user("Bye")]),
    Case("tool_result_text_parts", _weather_loop()[:2] + [tool([{"type": "text", "text": "18C"},
                                                                {"type": "text", "text": "cloudy"}])], tools=TOOLS),
    Case("tool_result_null_content", _weather_loop()[:2] + [tool(None)], tools=TOOLS),
    Case("tool_result_multiline_json", _weather_loop()[:2] + [tool('{\n  "temp": 18,\n  "note": "«ok»"\n}')],
         tools=TOOLS),
    Case("tool_call_without_tools_param", _weather_loop() + [assistant("Done.")]),
    # --- reasoning ------------------------------------------------------------------------------------------------------
    Case("reasoning_content_last_assistant", [user("Why is the sky blue?"),
                                              assistant("Rayleigh scattering.", reasoning_content="Short wavelengths scatter more.")],
         add_generation_prompt=False),
    Case("reasoning_content_in_history", [user("Why is the sky blue?"),
                                          assistant("Rayleigh scattering.", reasoning_content="Think about light."),
                                          user("And sunsets?")]),
    Case("inline_think_in_history", [user("2+2?"), assistant("<think>\nsimple sum\n</think>\n\n4"), user("3+3?")]),
    Case("inline_think_last", [user("2+2?"), assistant("<think>\nsimple sum\n</think>\n\n4")],
         add_generation_prompt=False),
    Case("inline_think_without_open_tag", [user("2+2?"), assistant("simple sum\n</think>\n\n4"), user("ok")]),
    Case("reasoning_alias_field", [user("Q"), assistant("A", reasoning="via the 'reasoning' key")],
         add_generation_prompt=False),
    Case("reasoning_padded_newlines", [user("Q"), assistant("\n\nA", reasoning_content="\n\nR\n\n")],
         add_generation_prompt=False),
    Case("reasoning_empty_string", [user("Q"), assistant("A", reasoning_content=""), user("Q2")]),
    Case("reasoning_with_tool_call_echoed", [user("Weather in Paris?"),
                                             assistant("", [call("get_weather", WEATHER_ARGS)],
                                                       reasoning_content="I should call the tool."),
                                             tool("18C")], tools=TOOLS),
    Case("reasoning_inline_with_tool_call", [user("Weather in Paris?"),
                                             assistant("<think>\nCall it.\n</think>\n\n", [call("get_weather", WEATHER_ARGS)]),
                                             tool("18C"), assistant("<think>\nDone.\n</think>\n\n18 °C.")], tools=TOOLS),
    Case("reasoning_tool_loop_then_user", [user("Weather in Paris?"),
                                           assistant("", [call("get_weather", WEATHER_ARGS)], reasoning_content="Call."),
                                           tool("18C"), assistant("18 °C.", reasoning_content="Answer."),
                                           user("Thanks!")], tools=TOOLS),
    # --- thinking switches ----------------------------------------------------------------------------------------------
    Case("thinking_off", [user("Quick answer: capital of France?")], kwargs={"enable_thinking": False, "thinking": False}),
    Case("thinking_on", [user("Prove that sqrt(2) is irrational.")], kwargs={"enable_thinking": True, "thinking": True}),
    Case("thinking_on_multi_turn", [user("2+2?"), assistant("<think>easy</think>4"), user("3+3?")],
         kwargs={"enable_thinking": True, "thinking": True}),
    Case("thinking_off_multi_turn", [user("2+2?"), assistant("4"), user("3+3?")],
         kwargs={"enable_thinking": False, "thinking": False}),
    Case("thinking_off_with_tools", [user("Weather in Paris?")], tools=TOOLS, kwargs={"enable_thinking": False}),
    Case("thinking_on_after_tool", _weather_loop(), tools=TOOLS, kwargs={"enable_thinking": True, "thinking": True}),
    Case("prefix_completion_thinking", [user("Write a poem."), assistant("Roses", prefix=True)],
         kwargs={"thinking": True}, add_generation_prompt=False),
    # --- keeping past reasoning (Qwen3.6 preserve_thinking; other templates ignore the kwarg) --------------------------
    Case("preserve_thinking_history", [user("2+2?"), assistant("4", reasoning_content="Add them."), user("3+3?"),
                                       assistant("<think>\nAgain.\n</think>\n\n6"), user("and 4+4?")],
         kwargs={"preserve_thinking": True}),
    Case("preserve_thinking_false", [user("2+2?"), assistant("4", reasoning_content="Add them."), user("3+3?")],
         kwargs={"preserve_thinking": False}),
    Case("preserve_thinking_truthy_not_true", [user("2+2?"), assistant("4", reasoning_content="Add."), user("3+3?")],
         kwargs={"preserve_thinking": 1}),
    Case("preserve_thinking_no_reasoning", [user("Hi"), assistant("Hello."), user("Bye")],
         kwargs={"preserve_thinking": True, "enable_thinking": False}),
    Case("preserve_thinking_agent_loop", [system("You are a coding agent."), user("Fix the bug in app.py"),
                                          assistant("", [call("search_code", {"query": "def main"}, "a")],
                                                    reasoning_content="Find main first."),
                                          tool("app.py:3: def main():", "a"),
                                          assistant("Found it.", [call("search_code", {"query": "bug", "max_results": 3,
                                                                                       "case_sensitive": False}, "b")],
                                                    reasoning_content="Now the bug."),
                                          tool("app.py:9: bug", "b"),
                                          assistant("Fixed line 9.", reasoning_content="Done."),
                                          user("Run the tests too.")],
         tools=[SEARCH], kwargs={"preserve_thinking": True}),
    # --- keeping past reasoning (GLM-4.7: clear_thinking false keeps it; other templates ignore the kwarg) ------------
    Case("clear_thinking_false_parallel_loop", [system("You are a coding agent."), user("Weather in Paris and Rome?"),
                                                assistant("Checking both.", [call("get_weather", {"city": "Paris"}, "a"),
                                                                             call("get_weather", {"city": "Rome",
                                                                                                  "unit": "celsius"},
                                                                                  "b")],
                                                          reasoning_content="Two cities: two calls."),
                                                tool("Sunny, 24C", "a"), tool("Rain, 18C", "b"),
                                                assistant("Paris is sunny, Rome rainy.", reasoning_content="Sum up."),
                                                user("And Oslo?")],
         tools=TOOLS, kwargs={"clear_thinking": False}),
    Case("clear_thinking_true", [user("2+2?"), assistant("4", reasoning_content="Add them."), user("3+3?")],
         kwargs={"clear_thinking": True}),
    Case("clear_thinking_false_inline_think", [user("2+2?"), assistant("<think>\nAdd.\n</think>\n\n4"), user("3+3?"),
                                               assistant("6", reasoning_content="  Again.  "), user("4+4?")],
         kwargs={"clear_thinking": False, "enable_thinking": False}),
    Case("args_scalar_types", [user("Search"), assistant(None, [call("search_code", {"query": "x", "max_results": 3,
                                                                                      "case_sensitive": True,
                                                                                      "filters": None, "ratio": 2.5})]),
                               tool("ok")], tools=[SEARCH]),
    Case("tools_system_blank", [system(" \n "), user("Weather?")], tools=TOOLS),
    Case("tool_results_then_user_query", [user("Time?"), assistant("", [call("get_time", "{}")]), tool("12:00"),
                                          user("<tool_response>\nhand-written\n</tool_response>")], tools=[NOW]),
    # --- DeepSeek V3.2 / V4 encoders: thinking with tools, reasoning effort, reminders, quick-instruction tasks ---------
    Case("thinking_agent_loop_with_tools", [system("You are a coding agent."), user("Fix the bug in app.py"),
                                            assistant("", [call("search_code", {"query": "def main"}, "a")],
                                                      reasoning_content="Find main first."),
                                            tool("app.py:3: def main():", "a"),
                                            assistant("Found it.", [call("search_code", {"query": "bug"}, "b")],
                                                      reasoning_content="Now the bug."),
                                            tool("app.py:9: bug", "b")],
         tools=[SEARCH], kwargs={"thinking": True, "enable_thinking": True}),
    Case("thinking_history_without_tools", [system("Be brief."), user("2+2?"), assistant("4", reasoning_content="Add."),
                                            user("3+3?")], kwargs={"thinking": True}),
    Case("thinking_keep_history", [user("2+2?"), assistant("4", reasoning_content="Add."), user("3+3?")],
         kwargs={"thinking": True, "drop_thinking": False}),
    Case("reasoning_effort_max", [system("Be careful."), user("Prove it.")],
         kwargs={"thinking": True, "reasoning_effort": "max"}),
    Case("reasoning_effort_high", [user("Prove it.")], kwargs={"thinking": True, "reasoning_effort": "high"}),
    Case("reasoning_effort_max_chat_mode", [user("Prove it.")], kwargs={"thinking": False, "reasoning_effort": "max"}),
    Case("reasoning_effort_invalid", [user("Prove it.")], kwargs={"thinking": True, "reasoning_effort": "low"}),
    Case("latest_reminder", [system("You are DeepSeek."), {"role": "latest_reminder", "content": "2026-12-01, Paris"},
                             user("What day is it?")], kwargs={"thinking": True}),
    Case("quick_task_action", [user("Who won the 2026 final?", task="action")]),
    Case("quick_task_query", [user("Best pizza in Naples", task="query")], kwargs={"thinking": True}),
    Case("quick_task_title", [user("Hi"), assistant("Hello! How can I help?", task="title")]),
    Case("tool_results_out_of_call_order", [user("Paris and Rome?"),
                                            assistant("", [call("get_weather", {"city": "Paris"}, "a"),
                                                           call("get_weather", {"city": "Rome"}, "b")]),
                                            tool("20C", "b"), tool("18C", "a")], tools=TOOLS),
    Case("tool_result_then_user_text", _weather_loop() + [user("Also Rome, please.")], tools=TOOLS,
         kwargs={"thinking": True}),
    # --- invalid requests (every family must refuse them with ValueError) ------------------------------------------------
    Case("invalid_image_part", [user([{"type": "text", "text": "What is this?"},
                                      {"type": "image_url", "image_url": {"url": "http://x/y.png"}}])]),
    Case("invalid_unknown_role", [{"role": "function", "name": "f", "content": "x"}, user("Hi")]),
    Case("invalid_empty_messages", []),
    Case("invalid_call_without_name", [user("Hi"), assistant(None, [{"type": "function", "function": {"arguments": "{}"}}])]),
    Case("invalid_tool_calls_on_user", [{"role": "user", "content": "Hi", "tool_calls": [call("get_time", "{}")]}]),
    Case("invalid_tool_definition", [user("Hi")], tools=[{"type": "function", "name": "flat_style"}]),
]
