"""The parser's messages keep the prefix cache warm: for the families whose templates allow it (NOTES.md §3),
prompt N + the model's raw output is a byte prefix of prompt N+1 rendered from the message the parser returned."""
import pytest

from server.parsing import parse_output
from server.parsing.formats.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from server.rendering import get_renderer, serving_template_kwargs

from tests.parsing.fixtures import WEATHER

QUESTION = {"role": "user", "content": "Weather in Paris?"}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_r0000", "content": "18C"}
FOLLOW_UP = {"role": "user", "content": "Thanks!"}
QWEN_JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
DS_EOS = "<｜end▁of▁sentence｜>"

# (family, template kwargs / thinking, raw output after prompt N, next message)
CASES = [
    ("qwen2.5", False, "Let me check.\n" + QWEN_JSON_CALL, TOOL_RESULT),
    ("qwen2.5", False, "It is 18C.<|im_end|>", FOLLOW_UP),
    ("qwen3", True, "<think>\nNeed a call.\n</think>\n\nLet me check.\n" + QWEN_JSON_CALL, TOOL_RESULT),
    ("qwen3-coder", False, "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call><|im_end|>", TOOL_RESULT),
    ("qwen3-coder", False, "It is 18C.<|im_end|>", FOLLOW_UP),
    # Qwen3.6 with kvserve's serving default preserve_thinking: even a new user query keeps the reasoning.
    ("qwen3.6", True, "Need a call.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>", TOOL_RESULT),
    ("qwen3.6", True, "Easy.\n</think>\n\nIt is 18C.<|im_end|>", FOLLOW_UP),
    ("deepseek-v3-0324", False, f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
     f'{{"city": "Paris"}}\n```{CALL_END}{CALLS_END}{DS_EOS}', TOOL_RESULT),
    ("deepseek-v3-0324", False, "It is 18C." + DS_EOS, FOLLOW_UP),
    ("deepseek-v3.1", False, f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Paris"}}{CALL_END}{CALLS_END}{DS_EOS}',
     TOOL_RESULT),
    ("deepseek-v3.1", False, "It is 18C." + DS_EOS, FOLLOW_UP),
    # GLM-4.7 with kvserve's serving default clear_thinking: false; the model ends its turn with the next role token.
    ("glm-4.7", True, "Need a call.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key>"
     "<arg_value>Paris</arg_value></tool_call><|observation|>", TOOL_RESULT),
    ("glm-4.7", True, "Easy.</think>It is 18C.<|user|>", FOLLOW_UP),
    # MiniMax-M2 keeps the reasoning of the turns after the last user message (a tool loop), as its template does.
    ("minimax-m2", True, 'Need a call.\n</think>\n\nLet me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
     '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[', TOOL_RESULT),
    # Kimi: the call's id is the model's header, which the template writes back; a tool loop keeps the reasoning, a
    # final answer drops it (so only an empty <think></think> survives a new query byte for byte).
    ("kimi-k2", True, "<think>Need a call.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>"
     'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
     "<|tool_calls_section_end|><|im_end|>", TOOL_RESULT),
    ("kimi-k2", True, "<think></think>It is 18C.<|im_end|>", FOLLOW_UP),
    # Gemma 3: a call written as its function-calling prompt asks (the arguments kept as the model wrote them).
    ("gemma3", False, 'Let me check.\n{"name": "get_weather", "parameters": {"city":"Paris"}}<end_of_turn>\n',
     TOOL_RESULT),
    ("gemma3", False, "It is 18C.<end_of_turn>\n", FOLLOW_UP),
]


@pytest.mark.parametrize("family,thinking,raw,next_message", CASES)
def test_parsed_message_re_renders_the_raw_output(family, thinking, raw, next_message):
    renderer = get_renderer(family)
    kwargs = {"enable_thinking": thinking} if family.startswith(("qwen3", "glm")) else {"thinking": thinking}
    kwargs.update(serving_template_kwargs(renderer))  # Qwen3.6 preserve_thinking, GLM clear_thinking: false
    prompt = renderer.render([QUESTION], [WEATHER], True, **kwargs)
    parsed = parse_output(family, raw, [WEATHER], reasoning=thinking, id_prefix="r")
    message = {k: v for k, v in parsed.to_message().items() if v is not None and v != []}
    message.setdefault("content", "")
    following = renderer.render([QUESTION, message, next_message], [WEATHER], True, **kwargs)
    assert following.startswith(prompt + raw), (prompt + raw, following)
