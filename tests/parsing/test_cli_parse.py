import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli.chat import add_parse_command
from tests.parsing.fixtures import TOOLS

ROOT = Path(__file__).resolve().parents[2]


def kvserve_parse(stdin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "parse", *args],
        input=stdin.encode("utf-8"),
        capture_output=True,
        cwd=ROOT,
        timeout=120,
    )


def parse_in_process(stdin: str, *args: str, monkeypatch, capsysbinary) -> tuple[int, dict | None, str]:
    """The same command without a new interpreter (the subprocess test above covers the wiring)."""
    parser = argparse.ArgumentParser()
    add_parse_command(parser.add_subparsers())
    parsed = parser.parse_args(["parse", *args])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8")), encoding="utf-8"))
    code = parsed.func(parsed)
    out, err = capsysbinary.readouterr()
    return code, json.loads(out) if out else None, err.decode()


@pytest.mark.slow
def test_parse_prints_the_assistant_message(tmp_path):
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps({"tools": TOOLS}), encoding="utf-8")
    raw = (
        "<think>\nWeather needed.\n</think>\n\nChecking Zürich.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>'
    )
    done = kvserve_parse(raw, "--template", "qwen3", "--tools", str(tools_file), "--id-prefix", "x")
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout.decode("utf-8")) == {
        "role": "assistant",
        "content": "Checking Zürich.",
        "reasoning_content": "Weather needed.",
        "tool_calls": [
            {"id": "call_x0000", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
        ],
    }


def test_parse_thinking_flag_and_family_default(monkeypatch, capsysbinary):
    raw = "Reasoning</think>Answer<｜end▁of▁sentence｜>"
    run = lambda *args: parse_in_process(raw, *args, monkeypatch=monkeypatch, capsysbinary=capsysbinary)  # noqa: E731
    _, default, _ = run("--template", "deepseek-v3.1")
    assert default["content"] == "Reasoning</think>Answer" and default["reasoning_content"] is None
    _, thinking, _ = run("--template", "deepseek-v3.1", "--thinking")
    assert thinking["content"] == "Answer" and thinking["reasoning_content"] == "Reasoning"
    _, qwen_default, _ = run("--template", "qwen3")  # Qwen3 thinks unless told not to
    assert qwen_default["content"] == raw.removesuffix("<｜end▁of▁sentence｜>")


def test_parse_named_call_and_bad_tool_choice(tmp_path, monkeypatch, capsysbinary):
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS), encoding="utf-8")
    run = lambda *args: parse_in_process(  # noqa: E731
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "--template", "qwen2.5",
        "--tools", str(tools_file), "--tool-choice", *args, monkeypatch=monkeypatch, capsysbinary=capsysbinary,
    )
    code, message, _ = run(json.dumps({"type": "function", "function": {"name": "get_weather"}}))
    assert code == 0 and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    code, message, err = run(json.dumps({"type": "function", "function": {"name": "nope"}}))
    assert code == 2 and message is None and "'nope', which is not in tools" in err


# The parser hardening cases agent users hit in other servers, as `kvserve parse` sees them.
CUT_OFF = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'


@pytest.fixture
def tools_file(tmp_path) -> str:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS), encoding="utf-8")
    return str(path)


def test_a_call_cut_off_by_max_tokens_is_content_unless_streamed(tools_file, monkeypatch, capsysbinary):
    run = lambda *args: parse_in_process(CUT_OFF, "--template", "qwen3", "--tools", tools_file, *args,  # noqa: E731
                                         monkeypatch=monkeypatch, capsysbinary=capsysbinary)[1]
    message = run()
    assert message["content"] == CUT_OFF and message["tool_calls"] == []
    streamed = run("--stream")  # the call streamed already: its arguments end as valid JSON
    assert [json.loads(c["function"]["arguments"]) for c in streamed["tool_calls"]] == [{"city": "Par"}]
    assert streamed["content"] is None


@pytest.mark.parametrize(
    "raw,content,reasoning,calls",
    [
        # a call written while thinking is reasoning, not a call
        ('<think>\nI could <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n</think>\n\nNo need.',
         "No need.", 'I could <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', []),
        # a literal tag in prose stays prose, and the real call after it is still found
        ('Wrap calls in `<tool_call>` tags.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
         "Wrap calls in `<tool_call>` tags.", None, ["now"]),
        # a call shown in a code block is code
        ('Example:\n```\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n```',
         'Example:\n```\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n```', None, []),
    ],
)
def test_markup_that_is_not_a_call(raw, content, reasoning, calls, tools_file, monkeypatch, capsysbinary):
    for extra in ([], ["--stream"]):
        code, message, _ = parse_in_process(raw, "--template", "qwen3", "--tools", tools_file, *extra,
                                            monkeypatch=monkeypatch, capsysbinary=capsysbinary)
        assert code == 0
        assert (message["content"], message["reasoning_content"]) == (content, reasoning)
        assert [c["function"]["name"] for c in message["tool_calls"]] == calls


def test_deepseek_v31_empty_call_block_is_no_call(monkeypatch, capsysbinary):
    raw = "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    _, message, _ = parse_in_process(raw, "--template", "deepseek-v3.1", monkeypatch=monkeypatch,
                                     capsysbinary=capsysbinary)
    assert message["tool_calls"] == [] and message["content"] == "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"
