import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

from server.cli_chat import add_parse_command
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


def test_parse_forced_call_and_bad_tool_choice(tmp_path, monkeypatch, capsysbinary):
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS), encoding="utf-8")
    run = lambda *args: parse_in_process(  # noqa: E731
        '{"city": "Oslo"}}\n</tool_call>', "--template", "qwen2.5", "--tools", str(tools_file), "--tool-choice",
        *args, monkeypatch=monkeypatch, capsysbinary=capsysbinary,
    )
    code, message, _ = run(json.dumps({"type": "function", "function": {"name": "get_weather"}}))
    assert code == 0 and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    code, message, err = run(json.dumps({"type": "function", "function": {"name": "nope"}}))
    assert code == 2 and message is None and "'nope', which is not in tools" in err
